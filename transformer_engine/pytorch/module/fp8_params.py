"""FP8 primary weights: the GEMM weights of modules built under
``te.quantized_model_init(enabled=True)`` (TE's ``fp8_model_init``) are `Float8Tensor`
parameters (per-tensor recipes), `Float8BlockwiseQTensor` ones (Float8BlockScaling),
`MXFP8Tensor` or `NVFP4Tensor` ones (MXFP8BlockScaling, NVFP4BlockScaling).

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

    With Float8BlockScaling the weight is a `Float8BlockwiseQTensor`: blocks of the
    recipe's ``w_block_scaling_dim`` (128x128 by default) scaled by its
    ``fp8_quant_fwd_weight`` settings, each write quantizing the new value into its
    rowwise copy (the forward GEMM's operand) and its columnwise copy (the dgrad's).
    MXFP8BlockScaling and NVFP4BlockScaling weights are `MXFP8Tensor` / `NVFP4Tensor`
    (tensor/mx_tensors.py) the same way: both copies are what the recipe's weight cast
    makes of the written value (1x32 or 32x32 MXFP8 blocks; 1x16 or 16x16 NVFP4 blocks,
    no Hadamard transform, round to nearest), so a forward reads the bits a
    high-precision weight of that value is cast to.

    An FP8 forward takes the weight's FP8 storage as its operand: no cast, no amax.
    The weight serves the autocast of its own recipe class only: a module whose
    weights were made for one recipe, run under another, raises TE's "Recipe mismatch"
    ``RuntimeError`` (`check_weight_recipes`; a weight made for DelayedScaling does
    not run under Float8CurrentScaling either, as in TE). A per-tensor weight's
    transposed copy for the dgrad is made from its FP8 data, the same values, and kept
    in the weight (NOTE [Cached FP8 transpose] in tensor/float8_tensor.py). So
    ``is_first_microbatch`` has nothing to cache, and a recompute under
    ``te.checkpoint`` reads the very FP8 weight its first forward read (nothing can
    write it in between). A forward outside FP8 runs on the dequantized weight. The
    gradient is an ordinary tensor of the weight's nominal dtype (``params_dtype``).
    Split weights (``parameters_split``) are joined dequantized and cast as one
    weight.
"""

from __future__ import annotations

import types
import weakref
from typing import List, Optional, Tuple

import torch

from ...common.recipe import DelayedScaling
from .. import quantize
from ..non_finite import non_finite_counter
from ..fp8_shapes import Float8Data
from ..tensor import (Float8BlockQuantizer, Float8BlockwiseQTensor, MXFP8Quantizer,
                      MXFP8Tensor, NVFP4Quantizer, NVFP4Tensor, QuantizedTensor)
from ..tensor.float8_tensor import CurrentScalingQuantizer, Float8Quantizing, as_matrix

__all__ = ["DelayedWeightQuantizer", "CurrentWeightQuantizer", "weight_quantizer",
           "quantize_weights", "weight_operands", "check_weight_recipes"]


class DelayedWeightQuantizer(Float8Quantizing):
    """Quantizes a module's weight with the module's delayed-scaling scale for forward
    tensor ``index``, folding the amax into the live history row, as the forward cast
    of a high-precision weight does (NOTE [FP8 primary weights])."""

    def __init__(self, module, index: int, fp8_dtype: torch.dtype):
        self._module = weakref.ref(module)
        self.index, self.fp8_dtype = index, fp8_dtype

    def quantize(self, x: torch.Tensor, record_amax: bool = True) -> Float8Data:
        state = self._live_module().fp8_weight_state()
        q, _ = quantize.cast_transpose_unchecked(
            as_matrix(x), state.scale, self.fp8_dtype, self.index,
            state.amax_history if record_amax else None, True, False)
        return Float8Data(q.data.view(x.shape), q.scale_inv)

    def _live_module(self):
        module = self._module()
        if module is None:
            raise RuntimeError("an FP8 primary weight cannot be written after its module is "
                               "gone: its delayed-scaling scale lived in that module")
        return module

    @property
    def scale(self) -> torch.Tensor:
        """TE's attribute: the scale writes use, a one-element view into the module's
        forward scales (slot ``index``)."""
        return self._live_module().fp8_weight_state().cast_views(self.index)[0]

    @property
    def amax(self) -> torch.Tensor:
        """TE's attribute: where writes record their amax, a one-element view of the
        live row of the module's forward amax history (slot ``index``)."""
        return self._live_module().fp8_weight_state().cast_views(self.index)[1].view(1)

    def _get_compatible_recipe(self):
        return DelayedScaling

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
    if recipe.float8_block_scaling():
        return Float8BlockQuantizer.for_weights(recipe)
    if recipe.mxfp8():
        return MXFP8Quantizer.for_weights(recipe)
    if recipe.nvfp4():
        return NVFP4Quantizer.for_weights(recipe)
    q = recipe.fp8_quant_fwd_weight
    return CurrentWeightQuantizer(fp8_dtype, q.power_2_scale, q.amax_epsilon)


def quantize_weights(module, recipe, preserve_init_value: bool,
                     weights: List[Tuple[str, torch.Tensor, int]]) -> None:
    """Make each ``(name, initialized value, FP8 slot)`` of ``weights`` an FP8 primary
    weight of ``module``: a new quantized parameter (`Float8Tensor` or
    `Float8BlockwiseQTensor`, by the recipe) that keeps the old parameter's attributes
    (tensor-parallel marks), or, where it is one already, the value quantized into it
    in place (a reset)."""
    fp8_dtype = recipe.fp8_format.value.dtype_fwd
    for name, value, index in weights:
        old = getattr(module, name)
        quantizer = weight_quantizer(module, recipe, index, fp8_dtype)
        q = quantizer.quantize(value, record_amax=False)
        if isinstance(old, QuantizedTensor):
            old._quantizer = quantizer
            with torch.no_grad():
                old._store(q)
            param = old
        else:
            param = torch.nn.Parameter(quantizer.make_tensor(q, value.dtype),
                                       requires_grad=old.requires_grad)
            for key, attr in old.__dict__.items():
                setattr(param, key, attr)
            setattr(module, name, param)
        if preserve_init_value:
            _keep_init_value(param, value)


def _keep_init_value(param: QuantizedTensor, value: torch.Tensor) -> None:
    """TE's ``get_high_precision_init_val()`` / ``clear_high_precision_init_val()``,
    bound to ``param``, over a CPU copy of its initial high-precision value in
    ``param._high_precision_init_val``. Clearing drops the value, not the accessors
    (``get_high_precision_init_val()`` then returns None), as in TE. The module moves
    them onto the parameter ``module.to`` / ``.half()`` / ``.cuda()`` leave it
    (`TransformerEngineBaseModule._apply`)."""
    param._high_precision_init_val = value.detach().to("cpu", copy=True)
    param.get_high_precision_init_val = types.MethodType(_get_init_value, param)
    param.clear_high_precision_init_val = types.MethodType(_clear_init_value, param)


def _get_init_value(param) -> Optional[torch.Tensor]:
    return param.__dict__.get("_high_precision_init_val")


def _clear_init_value(param) -> None:
    param.__dict__.pop("_high_precision_init_val", None)


def weight_operands(weight: QuantizedTensor, transpose: bool):
    """``(w_fp8, w_fp8^T)`` of an FP8 primary weight for a GEMM: its own storage (NOTE
    [FP8 primary weights]); the recipes match (`check_weight_recipes`)."""
    if isinstance(weight, (Float8BlockwiseQTensor, MXFP8Tensor, NVFP4Tensor)):
        return weight.block_operands(transpose)
    w = weight.fp8_operand()
    if not transpose:
        return w, None
    # cached in the weight (NOTE [Cached FP8 transpose]); made afresh while dynamo traces
    # (no side effect in a trace) or a CUDA graph is captured (its replays then
    # transpose whatever the weight holds, however it was written)
    if (weight.dim() != 2 or torch.compiler.is_compiling()
            or (w.data.is_cuda and torch.cuda.is_current_stream_capturing())):
        return w, quantize.transpose_fp8(w)
    return w, weight.transpose_operand()


def check_weight_recipes(module, recipe) -> None:
    """TE's check that each FP8 primary weight of ``module`` was made for the class of
    ``recipe``, the recipe of the autocast it runs in: else TE's RuntimeError."""
    for name, init in module._init_table().items():
        if init.fp8_weight_index is None:
            continue
        param = module._parameters.get(name)
        if not isinstance(param, QuantizedTensor):
            continue
        compatible = param._get_quantizer()._get_compatible_recipe()
        if compatible is not None and not isinstance(recipe, compatible):
            raise RuntimeError(f"Recipe mismatch for '{name}': tensor supports recipe "
                               f"{compatible.__name__}, but got {type(recipe).__name__}. Please "
                               "check the recipes assigned during quantized_model_init() and "
                               "autocast() calls.")
