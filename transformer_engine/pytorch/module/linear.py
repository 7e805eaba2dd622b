"""te.Linear, and the FP8 linear autograd function that the other modules reuse.

The GEMM names (forward, dgrad, wgrad) are those of NOTE [GEMM vocabulary] in
`quantize.py`; which scale each cast uses is decided by `ForwardPlan` (base.py).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .. import quantize
from ..amax_update import count_non_finite, request_backward_update
from ..tensor_parallel import TensorParallelConfig
from ..utils import check_input_dtype, check_params_dtype
from .base import (ForwardPlan, TransformerEngineBaseModule, activation_dtype, default_device,
                   no_autocast)

__all__ = ["Linear", "fp8_linear", "init_weight_"]

_ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def init_weight_(weight: torch.Tensor) -> None:
    """TE's default weight init: normal with std 0.023."""
    with torch.no_grad():
        weight.normal_(0.0, 0.023)


def _cast(x: torch.Tensor, plan: ForwardPlan, state, index: int, dtype: torch.dtype,
          record: bool, data: bool = True, transpose: bool = False):
    """Cast a 2-D ``x`` with the delayed scale ``state.scale[index]`` (folding its amax
    into the live history slot when ``record``) or, for current scaling, with its own
    amax. Returns ``(x_fp8, x_fp8^T)`` as asked for (`quantize.cast_transpose_to_fp8`:
    one pass over ``x`` on CUDA)."""
    if plan.delayed:
        return quantize.cast_transpose_unchecked(x, state.scale, dtype, index,
                                        state.amax_history if record else None, data, transpose)
    amax_value = quantize.amax(x)
    count_non_finite(amax_value)
    scale = quantize.current_scale(amax_value, dtype)
    return quantize.cast_transpose_unchecked(x, scale, dtype, 0, None, data, transpose)


class _FP8LinearFunction(torch.autograd.Function):
    """``y = x W^T + b`` with FP8 forward, dgrad and wgrad GEMMs.

    The forward casts also produce the transposed FP8 copies the backward GEMMs take
    (``W^T`` for dgrad, ``x^T`` for wgrad; on CUDA in the cast's own pass, NOTE [Fused
    casts]) and save only those: FP8 copies, not the high-precision tensors, and
    nothing to transpose in backward.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                plan: ForwardPlan, fp8_meta: dict, gemm: int, out_dtype: torch.dtype):
        fmt = plan.recipe.fp8_format.value
        state = fp8_meta["scaling_fwd"] if plan.delayed else None
        i = TransformerEngineBaseModule.FWD_TENSORS_PER_GEMM * gemm
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        with no_autocast(x.device.type):
            x_fp8, x_t = _cast(x, plan, state, i, fmt.dtype_fwd, plan.record_amax,
                               transpose=need_wgrad)
            w_fp8, w_t = _cast(weight, plan, state, i + 1, fmt.dtype_fwd, plan.record_amax,
                               transpose=need_dgrad)
            y = quantize.fp8_gemm_unchecked(x_fp8, w_fp8, out_dtype, bias=bias,
                                            use_fast_accum=True)
        ctx.save_for_backward(x_t.data if x_t is not None else None, x_fp8.scale_inv,
                              w_t.data if w_t is not None else None, w_fp8.scale_inv)
        ctx.plan, ctx.fp8_meta, ctx.gemm = plan, fp8_meta, gemm
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x_t_data, x_scale_inv, w_t_data, w_scale_inv = ctx.saved_tensors
        plan: ForwardPlan = ctx.plan
        fmt = plan.recipe.fp8_format.value
        state = ctx.fp8_meta["scaling_bwd"] if plan.delayed else None
        i = TransformerEngineBaseModule.BWD_TENSORS_PER_GEMM * ctx.gemm
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        with no_autocast(dy.device.type):
            dy = dy.contiguous()
            # The amax of dy is recorded even when only dbias is needed.
            dy_fp8, dy_t = _cast(dy, plan, state, i, fmt.dtype_bwd, record=True,
                                 data=need_dgrad or not need_wgrad, transpose=need_wgrad)
            dgrad = wgrad = dbias = None
            if need_dgrad:
                w_t = quantize.Float8Data(w_t_data, w_scale_inv)
                dgrad = quantize.fp8_gemm_unchecked(dy_fp8, w_t, ctx.x_dtype)
            if need_wgrad:
                x_t = quantize.Float8Data(x_t_data, x_scale_inv)
                wgrad = quantize.fp8_gemm_unchecked(dy_t, x_t, ctx.w_dtype)
            if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
                # float32 accumulation without a float32 copy of dy
                dbias = dy.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        if plan.session is not None:
            request_backward_update(plan.session)
        return dgrad, wgrad, dbias, None, None, None, None


def fp8_linear(api: str, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
               plan: ForwardPlan, fp8_meta: dict, gemm: int = 0) -> torch.Tensor:
    """``x W^T + b`` for ``x: [..., K]``, ``W: [N, K]``: in FP8 when ``plan.fp8``, else an
    ordinary linear (recording amaxes when calibrating). ``gemm`` picks this GEMM's
    slots in the module's scaling state."""
    in_features, out_features = weight.shape[1], weight.shape[0]
    if x.dim() == 0 or x.shape[-1] != in_features:
        raise ValueError(f"{api}: the input's last dimension must be in_features={in_features}, "
                         f"got input of shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"{api}: input must be a floating-point tensor, got dtype {x.dtype}")
    check_input_dtype(api, x, weight, plan.fp8)
    if not plan.fp8:
        if plan.record_amax:
            state = fp8_meta["scaling_fwd"]
            i = TransformerEngineBaseModule.FWD_TENSORS_PER_GEMM * gemm
            state.record_amax(i, quantize.amax(x))
            state.record_amax(i + 1, quantize.amax(weight))
        return F.linear(x, weight, bias)
    out_dtype = activation_dtype(x)
    if out_dtype not in _ACT_DTYPES:
        raise TypeError(f"{api}: FP8 GEMMs produce float32, bfloat16 or float16; got an input "
                        f"of dtype {x.dtype} (use one of {_ACT_DTYPES} or torch.autocast)")
    x2d = x if x.dim() == 2 else x.reshape(-1, in_features)
    if x2d.shape[0] % 16 or in_features % 16 or out_features % 16:
        quantize.check_gemm_shape(api, x2d.shape[0], in_features, out_features,
                                  f"input of shape {tuple(x.shape)}")
    y = _FP8LinearFunction.apply(x2d, weight, bias, plan, fp8_meta, gemm, out_dtype)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], out_features)


class Linear(TransformerEngineBaseModule):
    """``y = x W^T + b``, in FP8 inside an enabled ``te.autocast``.

    Parameters
    ----------
    in_features, out_features : int
    bias : bool, default True
    params_dtype : torch.dtype, optional
        float32 or bfloat16; ``torch.get_default_dtype()`` when None.
    device : torch.device, optional
        CUDA if available, else CPU, when None.
    return_bias : bool, default False
        Return ``(x W^T, b)`` instead of adding the bias, so it can be fused later.
    sequence_parallel : bool, default False
        With ``parallel_mode``: activations outside the layer pair are split along
        dim 0 (column all-gathers its input, row reduce-scatters its output).
    tp_group : torch.distributed.ProcessGroup, optional
        The tensor-parallel group; its size is the TP size.
    tp_size : int, default 1
        The TP size when the group is formed later: call
        ``set_tensor_parallel_group(group)`` before the first forward.
    parallel_mode : None | "column" | "row", default None
        "column": ``weight`` and ``bias`` hold ``out_features / tp`` rows and the
        output is this rank's slice of the features (not gathered). "row": ``weight``
        holds ``in_features / tp`` columns, the input is this rank's slice of the
        features, the output is summed over the group and the full bias added after.
        None: no communication. See NOTE [Tensor-parallel layouts] in
        ``tensor_parallel.py``; in FP8 the autocast's ``amax_reduction_group`` must
        span the TP group.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 params_dtype: Optional[torch.dtype] = None, device=None,
                 return_bias: bool = False, *, sequence_parallel: bool = False,
                 tp_group=None, tp_size: int = 1, parallel_mode: Optional[str] = None):
        super().__init__(num_gemms=1)
        api = "te.Linear"
        for name, v in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"te.Linear: {name} must be a positive int, got {v!r}")
        dtype = check_params_dtype(api, params_dtype)
        device = default_device(device)
        self.tp = TensorParallelConfig(api, parallel_mode, tp_group, tp_size, sequence_parallel)
        self.in_features, self.out_features = in_features, out_features
        local_in, local_out = in_features, out_features
        if parallel_mode == "column":
            local_out = self.tp.local_features("out_features", out_features)
        elif parallel_mode == "row":
            local_in = self.tp.local_features("in_features", in_features)
        self.use_bias, self.return_bias = bias, return_bias
        self.weight = torch.nn.Parameter(torch.empty(local_out, local_in, dtype=dtype,
                                                     device=device))
        init_weight_(self.weight)
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(local_out, dtype=dtype, device=device))
        else:
            self.register_parameter("bias", None)
        self.tp.mark_params(self.weight, self.bias)

    # TE's attribute names for the TP settings.
    parallel_mode = property(lambda self: self.tp.parallel_mode)
    sequence_parallel = property(lambda self: self.tp.sequence_parallel)
    tp_group = property(lambda self: self.tp.tp_group)
    tp_size = property(lambda self: self.tp.tp_size)

    def set_tensor_parallel_group(self, tp_group) -> None:
        """Attach the tensor-parallel group (for a module built with ``tp_size``)."""
        self.tp.set_group(tp_group)

    def forward(self, inp: torch.Tensor):
        if not torch.is_tensor(inp):
            raise TypeError(f"te.Linear: input must be a tensor, got {type(inp).__name__}")
        with self.prepare_forward(inp) as plan:
            inp = self.tp.column_input(inp)
            row = self.tp.parallel_mode == "row"
            fused_bias = None if (self.return_bias or row) else self.bias
            out = fp8_linear("te.Linear", inp, self.weight, fused_bias, plan, self.fp8_meta)
            out = self.tp.row_output(out)
        if self.return_bias:
            return out, self.bias
        if row and self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out

    def extra_repr(self) -> str:
        return ", ".join((f"in_features={self.in_features}", f"out_features={self.out_features}",
                          f"bias={self.use_bias}") + self.tp.describe())

