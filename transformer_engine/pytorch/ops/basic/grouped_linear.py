"""``te.ops.GroupedLinear``: ``num_groups`` linear layers applied to consecutive row
blocks of one input, the block sizes given as an extra input (the experts of a
Mixture-of-Experts MLP).

Each block runs te.GroupedLinear's arithmetic: the FP8 linear of te.Linear
(`fp8_linear`) with its own GEMM index ``i``, so group ``i`` owns the delayed-scaling
slots ``[input_i, weight_i]`` (``2 i``, ``2 i + 1``) of ``fp8_meta["scaling_fwd"]``
and ``[grad_output_i]`` of ``fp8_meta["scaling_bwd"]``; the groups share one
``prepare_forward`` (one registration with the autocast session, one recompute stash
per call). The FP8 state is saved as ``_extra_state`` in te.GroupedLinear's layout, so
a te.GroupedLinear's state_dict (whose weights Megatron-LM's fused expert MLP shares
with this operation) loads here and back.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, List, Optional

import torch

from ...module.base import TransformerEngineBaseModule
from ...module.devices import default_device
from ...module.fp8_linear import fp8_linear
from ...module.grouped_params import (grouped_slices, per_gemm_init, remap_state_dict,
                                      single_param_flags)
from ...module.main_grad import check_main_grad
from ...module.params import ParamInit, constant_init
from ...utils import check_bool, check_params_dtype, check_positive_int
from ..op import BasicOperation

__all__ = ["GroupedLinear", "OUTPUT_BUFFER_KEY", "GRAD_INPUT_BUFFER_KEY"]

_API = "te.ops.GroupedLinear"

# TE's keys for caller-provided output / grad-input buffers in an operation's kwargs
# (Megatron-LM imports them); such buffers are refused here (see `native_forward`)
OUTPUT_BUFFER_KEY = "output"
GRAD_INPUT_BUFFER_KEY = "grad_input"


def _kaiming_uniform(weight: torch.Tensor) -> None:
    """TE's initialization of each group's weight (that of ``torch.nn.Linear``)."""
    torch.nn.init.kaiming_uniform_(weight, a=math.sqrt(5))


def split_sizes_list(split_sizes, num_groups: int, rows: int, api: str = _API) -> List[int]:
    """``split_sizes`` (an integer tensor of ``num_groups`` counts, or a list of ints) as
    a list of non-negative ints adding up to ``rows``. Reading a CUDA tensor syncs."""
    if torch.is_tensor(split_sizes):
        if split_sizes.is_floating_point() or split_sizes.is_complex() \
                or split_sizes.dtype == torch.bool or split_sizes.numel() != num_groups:
            raise ValueError(f"{api}: split_sizes must hold num_groups={num_groups} integer "
                             f"counts, got a {split_sizes.dtype} tensor of shape "
                             f"{tuple(split_sizes.shape)}")
        split_sizes = split_sizes.reshape(-1).tolist()
    if not isinstance(split_sizes, (list, tuple)) or len(split_sizes) != num_groups or any(
            isinstance(m, bool) or not isinstance(m, int) or m < 0 for m in split_sizes):
        raise ValueError(f"{api}: split_sizes must be an integer tensor (or list) of "
                         f"num_groups={num_groups} non-negative counts, got {split_sizes!r}")
    if sum(split_sizes) != rows:
        raise ValueError(f"{api}: split_sizes must add up to the input's rows ({rows}), "
                         f"got {list(split_sizes)} (sum {sum(split_sizes)})")
    return list(split_sizes)


class GroupedLinear(BasicOperation, TransformerEngineBaseModule):
    """``y_i = x_i W_i^T + b_i`` for the row blocks ``x_i`` of the input (all leading
    dimensions flattened) whose sizes are the extra input ``split_sizes``; FP8 GEMMs
    inside an enabled ``te.autocast``, for every recipe te.GroupedLinear takes. TE's
    signature. Called as ``op(x, split_sizes)`` (``op(x, split_sizes, scales)`` with
    ``scale_bias``), or in a `te.ops.Sequential` whose call passes them as extra inputs.

    Parameters
    ----------
    num_groups, in_features, out_features : int
        Parameters ``weight0`` .. ``weight{num_groups-1}`` ``[out_features,
        in_features]`` (initialized as ``torch.nn.Linear``'s), then, with ``bias``,
        ``bias0`` .. (zeros): TE's state_dict keys and order.
    bias : bool, default True
    device : torch.device, optional
        CUDA if available, else CPU; ``"meta"`` defers initialization to the first
        forward (or ``reset_parameters()``), unless real parameters are set first.
    dtype : torch.dtype, optional
        The parameters' dtype (``torch.get_default_dtype()`` when None).
    rng_state_tracker_function : callable, optional
        Each weight is initialized under its tracker's ``fork()``.
    accumulate_into_main_grad : bool, default False
        Each weight gradient goes into ``weight{i}.main_grad`` in float32 (Megatron-LM).
    single_grouped_weight, single_grouped_bias : bool, default False
        One ``weight`` ``[num_groups, out, in]`` (``bias`` ``[num_groups, out]``)
        parameter instead of the per-group ones, gated by the environment variable
        ``NVTE_GROUPED_LINEAR_SINGLE_PARAM`` as in te.GroupedLinear (NOTE [Single
        grouped parameters] in module/grouped_params.py).
    delay_wgrad_compute : bool, default False
        The backward leaves the weight gradients to ``backward_dw()`` (NOTE [Delayed
        wgrad] in module/delayed_wgrad.py).
    scale_bias : bool, default False
        With ``bias``: a second extra input ``scales`` (one per row) and ``y_i = x_i
        W_i^T + b_i * scales_i`` (the router probabilities of an expert MLP).
    """

    FP8_SLOTS_ROLE_MAJOR = True         # te.GroupedLinear's extra-state payload
    num_extra_inputs = 1

    def __init__(self, num_groups: int, in_features: int, out_features: int, *,
                 bias: bool = True, device=None, dtype: Optional[torch.dtype] = None,
                 rng_state_tracker_function: Optional[Callable] = None,
                 accumulate_into_main_grad: bool = False, single_grouped_weight: bool = False,
                 single_grouped_bias: bool = False, delay_wgrad_compute: bool = False,
                 scale_bias: bool = False):
        num_groups = check_positive_int(_API, "num_groups", num_groups)
        super().__init__(num_gemms=num_groups)
        self.num_groups = num_groups
        self.in_features = check_positive_int(_API, "in_features", in_features)
        self.out_features = check_positive_int(_API, "out_features", out_features)
        self.use_bias = check_bool(_API, "bias", bias)
        self._scale_bias = check_bool(_API, "scale_bias", scale_bias) and self.use_bias
        if self._scale_bias:
            self.num_extra_inputs = 2
        self._accumulate_into_main_grad = check_bool(_API, "accumulate_into_main_grad",
                                                     accumulate_into_main_grad)
        self._init_delay_wgrad(_API, delay_wgrad_compute)
        self.single_grouped_weight, self.single_grouped_bias = single_param_flags(
            _API, check_bool(_API, "single_grouped_weight", single_grouped_weight),
            check_bool(_API, "single_grouped_bias", single_grouped_bias))
        if self.single_grouped_weight and self._builds_fp8_weights():
            raise NotImplementedError(
                f"{_API}: single_grouped_weight=True with FP8 primary weights "
                "(te.quantized_model_init) is not implemented by this pure-PyTorch Transformer "
                "Engine; build it with single_grouped_weight=False or outside "
                "quantized_model_init")
        if rng_state_tracker_function is not None and not callable(rng_state_tracker_function):
            raise TypeError(f"{_API}: rng_state_tracker_function must be callable or None, "
                            f"got {type(rng_state_tracker_function).__name__}")
        self._rng_state_tracker_function = rng_state_tracker_function
        dtype = check_params_dtype(_API, dtype)
        device = default_device(device)
        shape = (out_features, in_features)
        # TE's order: every weight, then every bias
        if self.single_grouped_weight:
            self.register_initialized(
                "weight", torch.empty(num_groups, *shape, dtype=dtype, device=device),
                ParamInit(per_gemm_init(_kaiming_uniform), rng_state_tracker_function))
        for i in range(num_groups):
            if self.single_grouped_weight:
                self.register_parameter(f"weight{i}", None)
            else:
                self.register_initialized(
                    f"weight{i}", torch.empty(shape, dtype=dtype, device=device),
                    ParamInit(_kaiming_uniform, rng_state_tracker_function,
                              fp8_weight_index=self.FWD_TENSORS_PER_GEMM * i + 1))
        if self.use_bias and self.single_grouped_bias:
            self.register_initialized(
                "bias", torch.empty(num_groups, out_features, dtype=dtype, device=device),
                ParamInit(constant_init(0.0)))
        for i in range(num_groups):
            if self.use_bias and not self.single_grouped_bias:
                self.register_initialized(
                    f"bias{i}", torch.empty(out_features, dtype=dtype, device=device),
                    ParamInit(constant_init(0.0)))
            else:
                self.register_parameter(f"bias{i}", None)
        self.reset_parameters(defer_init=device.type == "meta")

    @property
    def has_bias(self) -> bool:
        """Whether a bias is added (TE's attribute)."""
        return self.use_bias

    def num_quantizers(self, mode: str) -> int:
        """Per group two forward FP8 tensors (input, weight) and one backward
        (grad_output)."""
        super().num_quantizers(mode)
        return (2 if mode == "forward" else 1) * self.num_groups

    def pre_first_fuser_forward(self) -> None:
        """Materialize parameters still on ``meta`` and check that the groups' weights
        agree in dtype and device (each may have been replaced after construction)."""
        if any(p.is_meta for p in self.parameters()):
            self.reset_parameters()
        params = [(name, p) for name, p in self.named_parameters(recurse=False)
                  if p is not None]
        for name, p in params[1:]:
            if p.dtype != params[0][1].dtype or p.device != params[0][1].device:
                raise RuntimeError(f"{_API}: every parameter must have one dtype and device; "
                                   f"{params[0][0]} is {params[0][1].dtype} on "
                                   f"{params[0][1].device}, {name} is {p.dtype} on {p.device}")

    def _gemm_weights(self) -> List[torch.Tensor]:
        if not self.single_grouped_weight:
            return [getattr(self, f"weight{i}") for i in range(self.num_groups)]
        if self._accumulate_into_main_grad:
            check_main_grad(_API, self.weight)
        return grouped_slices(self.weight, fused_main_grad=self._accumulate_into_main_grad,
                              deliver_delayed=self.need_backward_dw())

    def _gemm_biases(self) -> List[Optional[torch.Tensor]]:
        if self.use_bias and self.single_grouped_bias:
            return grouped_slices(self.bias)
        return [getattr(self, f"bias{i}") for i in range(self.num_groups)]

    def native_forward(self, x, extra_inputs, kwargs):
        api = self.named_api(_API)
        unknown = sorted(set(kwargs[0]) - {OUTPUT_BUFFER_KEY, GRAD_INPUT_BUFFER_KEY})
        if unknown:
            raise TypeError(f"{api}: unexpected keyword arguments {unknown}")
        if kwargs[0]:
            raise NotImplementedError(f"{api}: caller-provided buffers ({sorted(kwargs[0])}) "
                                      "are not implemented; the outputs are new tensors")
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"{api}: the input's last dimension must be in_features="
                             f"{self.in_features}, got input of shape {tuple(x.shape)}")
        x = x.contiguous()      # NOTE [Contiguous module inputs] in module/base.py
        x2d = x.reshape(-1, self.in_features)
        splits = split_sizes_list(extra_inputs[0][0], self.num_groups, x2d.shape[0], api)
        weights, biases = self._gemm_weights(), self._gemm_biases()
        gemm_biases = [None] * self.num_groups if self._scale_bias else biases
        with self.prepare_forward(x) as plan:
            # an empty block has nothing to cast or scale: its (empty) output comes from
            # the high-precision path, as in te.GroupedLinear
            empty_plan = dataclasses.replace(plan, fp8=False, record_amax=False)
            outs = [fp8_linear(api, x_i, w_i, b_i, plan if m else empty_plan, self.fp8_meta,
                               gemm=i, fuse_wgrad_accumulation=self._accumulate_into_main_grad,
                               input_name=f"input rows of group {i} (split_sizes[{i}]={m})",
                               weight_name=f"weight{i}", wgrad_store=self._forward_wgrad_store())
                    for i, (x_i, w_i, b_i, m) in enumerate(zip(torch.split(x2d, splits),
                                                               weights, gemm_biases, splits))]
        if self._scale_bias:
            outs = self._add_scaled_biases(api, outs, biases, extra_inputs[0][1], splits)
        out = torch.cat(outs, dim=0).view(*x.shape[:-1], self.out_features)
        return out, [()]

    def _add_scaled_biases(self, api, outs, biases, scales, splits):
        """``y_i + b_i * scales_i`` per group (in ``y_i``'s dtype)."""
        rows = sum(splits)
        if not torch.is_tensor(scales) or not scales.is_floating_point() \
                or scales.numel() != rows:
            raise ValueError(f"{api}: with scale_bias=True the second extra input must be a "
                             f"floating-point tensor of one scale per row ({rows}), got "
                             f"{getattr(scales, 'shape', type(scales).__name__)}")
        parts = torch.split(scales.reshape(-1, 1), splits)
        return [(y + b * s).to(y.dtype) for y, b, s in zip(outs, biases, parts)]

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """Either layout loads: per-group ``weight{i}`` / ``bias{i}`` or the single
        grouped ``weight`` / ``bias``."""
        remap_state_dict(state_dict, prefix, "weight", self.num_groups,
                         self.single_grouped_weight)
        if self.use_bias:
            remap_state_dict(state_dict, prefix, "bias", self.num_groups,
                             self.single_grouped_bias)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return (f"num_groups={self.num_groups}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.use_bias}")
