"""FP8 primary weights: the GEMM weights of modules built under
``te.quantized_model_init(enabled=True)`` (TE's ``fp8_model_init``) are `Float8Tensor`
parameters.

NOTE [FP8 primary weights]
    Such a module keeps each GEMM weight only in FP8 (the forward format of the
    model-init recipe), with its own ``scale_inv``; biases and norm parameters stay in
    high precision. The weight is drawn in high precision, as it would be otherwise
    (same RNG draws), and quantized at once: with delayed scaling, by the module's
    scale for it (slot ``2 g + 1`` of ``fp8_meta["scaling_fwd"]`` for GEMM ``g``; 1.0 in
    a fresh module, as in TE); with current scaling, by its own amax and the recipe's
    ``fp8_quant_fwd_weight`` settings. Every later write into the weight (the
    optimizer step, ``load_state_dict``, ``copy_``) quantizes the same way, in place
    (NOTE [Quantized tensor semantics] in tensor/float8_tensor.py), and one bit for
    bit (``copy_`` from a Float8Tensor). With delayed scaling a write also folds the
    value's amax into the live history row, so the next update sets the scale the
    following writes use; the initial value does not: clients may construct with an
    init function that leaves the weight uninitialized and write it afterwards
    (Megatron's CPU initialization does, through ``weight.data.copy_``), and the amax
    of memory never used must not set a scale.

    An FP8 forward takes the weight's FP8 data and ``scale_inv`` as its operand: no
    cast, no amax, whatever the autocast's per-tensor recipe (its transposed copy for
    the dgrad is made from the FP8 data, the same values). So ``is_first_microbatch``
    has nothing to cache, and a recompute under ``te.checkpoint`` reads the very FP8
    weight its first forward read (nothing can write it in between). A forward
    outside FP8 runs on the dequantized weight. The gradient is an ordinary tensor of
    the weight's nominal dtype (``params_dtype``). Split weights
    (``parameters_split``) are joined dequantized and cast as one weight. Block
    scaling (``Float8BlockScaling``) would need weights kept in blocks: refused.
"""

from __future__ import annotations

import types
import weakref
from typing import List, Optional, Tuple

import torch

from .. import quantize
from ..amax_update import non_finite_counter
from ..fp8_shapes import Float8Data
from ..tensor.float8_tensor import CurrentScalingQuantizer, Float8Tensor, as_matrix

__all__ = ["DelayedWeightQuantizer", "CurrentWeightQuantizer", "weight_quantizer",
           "quantize_weights", "weight_operands"]


class DelayedWeightQuantizer:
    """Quantizes a module's weight with the module's delayed-scaling scale for forward
    tensor ``index``, folding the amax into the live history row, as the forward cast
    of a high-precision weight does (NOTE [FP8 primary weights])."""

    def __init__(self, module, index: int, fp8_dtype: torch.dtype):
        self._module = weakref.ref(module)
        self.index, self.fp8_dtype = index, fp8_dtype

    def quantize(self, x: torch.Tensor, record_amax: bool = True) -> Float8Data:
        module = self._module()
        if module is None:
            raise RuntimeError("an FP8 primary weight cannot be written after its module is "
                               "gone: its delayed-scaling scale lived in that module")
        state = module.fp8_weight_state()
        q, _ = quantize.cast_transpose_unchecked(
            as_matrix(x), state.scale, self.fp8_dtype, self.index,
            state.amax_history if record_amax else None, True, False)
        return Float8Data(q.data.view(x.shape), q.scale_inv)

    def __deepcopy__(self, memo):
        # a deep copy of the module quantizes with the copy's own state
        module = self._module()
        return DelayedWeightQuantizer(memo.get(id(module), module), self.index, self.fp8_dtype)

    def __getstate__(self):
        raise TypeError("DelayedWeightQuantizer refers to its module's live scaling state and "
                        "is not pickled (Float8Tensor.__reduce_ex__ leaves it out)")


class CurrentWeightQuantizer(CurrentScalingQuantizer):
    """Current scaling for a module's weight, its non-finite amaxes counted as the
    forward casts' are (NOTE [Non-finite amaxes] in amax_update.py)."""

    def non_finite(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        return non_finite_counter(x.device)


def weight_quantizer(module, recipe, index: int, fp8_dtype: torch.dtype):
    """The quantizer of an FP8 primary weight of ``module`` (forward tensor ``index``)."""
    if recipe.delayed():
        return DelayedWeightQuantizer(module, index, fp8_dtype)
    q = recipe.fp8_quant_fwd_weight
    return CurrentWeightQuantizer(fp8_dtype, q.power_2_scale, q.amax_epsilon)


def quantize_weights(module, recipe, preserve_init_value: bool,
                     weights: List[Tuple[str, torch.Tensor, int]]) -> None:
    """Make each ``(name, initialized value, FP8 slot)`` of ``weights`` an FP8 primary
    weight of ``module``: a new `Float8Tensor` parameter that keeps the old
    parameter's attributes (tensor-parallel marks), or, where it is one already, the
    value quantized into it in place (a reset)."""
    fp8_dtype = recipe.fp8_format.value.dtype_fwd
    for name, value, index in weights:
        old = getattr(module, name)
        quantizer = weight_quantizer(module, recipe, index, fp8_dtype)
        q = quantizer.quantize(value, record_amax=False)
        if isinstance(old, Float8Tensor):
            old._quantizer = quantizer
            old._data.copy_(q.data)
            old._scale_inv.copy_(q.scale_inv)
            param = old
        else:
            param = torch.nn.Parameter(Float8Tensor(q.data, q.scale_inv, value.dtype, quantizer),
                                       requires_grad=old.requires_grad)
            for key, attr in old.__dict__.items():
                setattr(param, key, attr)
            setattr(module, name, param)
        if preserve_init_value:
            _keep_init_value(param, value)


def _keep_init_value(param: Float8Tensor, value: torch.Tensor) -> None:
    """TE's ``get_high_precision_init_val()`` / ``clear_high_precision_init_val()``,
    bound to ``param``, over a CPU copy of its initial high-precision value."""
    param._high_precision_init_val = value.detach().to("cpu", copy=True)
    param.get_high_precision_init_val = types.MethodType(_get_init_value, param)
    param.clear_high_precision_init_val = types.MethodType(_clear_init_value, param)


def _get_init_value(param) -> torch.Tensor:
    return param._high_precision_init_val


def _clear_init_value(param) -> None:
    for key in ("_high_precision_init_val", "get_high_precision_init_val",
                "clear_high_precision_init_val"):
        param.__dict__.pop(key, None)


def weight_operands(api: str, weight: Float8Tensor, recipe, transpose: bool):
    """``(w_fp8, w_fp8^T)`` of an FP8 primary weight for a GEMM: its own data and
    ``scale_inv`` (NOTE [FP8 primary weights])."""
    if recipe.float8_block_scaling():
        raise NotImplementedError(
            f"{api}: an FP8 primary weight (te.quantized_model_init) has one per-tensor scale "
            "and cannot run in a Float8BlockScaling autocast; build the module without "
            "quantized_model_init or use a per-tensor recipe")
    w = weight.fp8_operand()
    return w, (quantize.transpose_fp8(w) if transpose else None)
