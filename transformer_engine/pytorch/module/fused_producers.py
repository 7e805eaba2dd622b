"""The producers of an FP8 GEMM's operands that write the FP8 copy themselves: the
normalization in front of LayerNormLinear's and LayerNormMLP's first GEMM, the
activation in front of FC2, and the activation's gradient in front of FC1's backward.

NOTE [Fused producers]
    Unfused, a normalization (or activation) writes its high-precision output, and the
    GEMM's cast reads it back to write the FP8 copy and the amax. Fused (CUDA, the
    kernels of ``kernels/norm_cast.py``, ``act_cast.py`` and ``dact_cast.py``), the
    producer's kernel writes the FP8 copy, its transposed copy (the wgrad operand), the
    amax into the live history slot, or with current scaling takes its two launches,
    and writes the high-precision output only when someone reads it (the
    normalization output a module returns). The GEMM takes the FP8 copies as they
    are (`fp8_linear`'s ``input_fp8``), and the autograd edge between the two carries a
    tensor of the right shape whose values are never read (`unwritten`).

    Backward, the activation's autograd function computes FC1's output gradient in
    FP8 (and FC1's bias gradient) and hands it to FC1's backward through a
    `GradHandoff` both share; the gradient autograd passes between them is again
    `unwritten`. FC1's backward, which runs next, takes the handed-off gradient
    instead of casting its own.

    The bits: the FP8 copies and amaxes are those of casting the producer's output
    (NOTE [FP8 cast formula] in kernels/common.py); the activations and their
    gradients are torch's bit for bit (NOTE [Same arithmetic] in
    kernels/activations.py); the normalization and FC1's bias gradient are within
    the bounds kernels/norm_cast.py and kernels/dact_cast.py state (the reduction
    order differs from torch's). A recompute reruns the same kernels with the
    stashed scales, so checkpointed and plain runs give the same bits as before.

    When: an FP8 forward under delayed or current scaling with an FP8 backward (no
    ``backward_override``, NOTE [Backward override]: that backward reads the
    high-precision input), on CUDA, with
    ``KernelConfig.fused`` and ``.fused_producers`` on, outside ``torch.compile``
    tracing (the kernels are registered as custom ops for that path: kernels/ops.py),
    and only where the GEMM takes the tensor as it is: no sequence-parallel gather in
    between, shapes the FP8 GEMM accepts (otherwise the unfused path raises its
    error). LayerNormMLP with ``checkpoint=True`` keeps its normalization unfused (the
    normalization output is the checkpointed function's input).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from ..non_finite import non_finite_counter
from ..fp8_shapes import FP8_HEIGHT_MULTIPLE, FP8_WIDTH_MULTIPLE, Float8Data
from ..kernel_config import SuspectCompile, get_kernel_config, load_kernels
from ..quantize import fused_or_none
from .activations import activate
from .backward_override import backward_override
from .forward_plan import ForwardPlan
from .fp8_linear import bias_grad
from .fp8_operands import cast_operand

__all__ = ["fused_producers_on", "NormCast", "ActCast", "GradHandoff", "unwritten",
           "norm_cast_input", "act_cast_input"]

_HP = (torch.float32, torch.bfloat16, torch.float16)
_NATIVE_16BIT = (torch.bfloat16, torch.float16)
_kernels = None     # the kernels package's modules once loaded; False without Triton


def _load():
    global _kernels
    if _kernels is None:
        _kernels = load_kernels("norm_cast", "act_cast", "dact_cast")
    return _kernels or None


def fused_producers_on(plan: ForwardPlan, x: torch.Tensor) -> bool:
    """Whether a producer of an FP8 GEMM operand ``x`` under ``plan`` takes its fused
    kernel (NOTE [Fused producers]): not the GEMM shapes, which the caller checks."""
    if not (plan.fp8 and (plan.delayed or plan.recipe.float8_current_scaling())
            and backward_override(plan.recipe) is None):
        return False
    config = get_kernel_config()
    return ((x.is_cuda or config.interpret) and config.fused and config.fused_producers
            and x.dtype in _HP and x.numel() > 0 and not torch.compiler.is_compiling()
            and _load() is not None)


def gemm_shapes_ok(rows: int, *widths: int) -> bool:
    """The FP8 GEMM shape rule (NOTE [FP8 shapes]) for ``rows`` and feature widths."""
    return rows % FP8_HEIGHT_MULTIPLE == 0 and all(w % FP8_WIDTH_MULTIPLE == 0 for w in widths)


_UNWRITTEN: Dict[tuple, torch.Tensor] = {}


def unwritten(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of ``shape`` whose values nobody reads: one element, expanded (the
    autograd edge between a fused producer and its GEMM: NOTE [Fused producers])."""
    key = (dtype, device)
    one = _UNWRITTEN.get(key)
    if one is None:
        one = _UNWRITTEN[key] = torch.zeros((), dtype=dtype, device=device)
    return one.expand(shape)


def _scaling(plan: ForwardPlan, state, index: int, role: str, record: bool, device) -> dict:
    """The scaling arguments of a fused kernel: delayed (``scale``, ``index`` and, when
    recording, the history) or current (the role's `QParams`, the non-finite counter)."""
    if plan.delayed:
        return {"scale": state.scale, "index": index,
                "amax_history": state.amax_history if record else None}
    q = getattr(plan.recipe, "fp8_quant_" + role)
    # non-finite amaxes count once: not in a recompute's forward (its phase 1 counted),
    # nor in a backward a recompute replays (NOTE [Non-finite amaxes])
    counted = record if role == "bwd_grad" else not plan.recomputing
    return {"power_2_scale": q.power_2_scale, "amax_epsilon": q.amax_epsilon,
            "non_finite": non_finite_counter(device) if counted else None}


def _fp8_pair(q, q_t, scale_inv) -> Tuple[Optional[Float8Data], Optional[Float8Data]]:
    return (None if q is None else Float8Data(q, scale_inv),
            None if q_t is None else Float8Data(q_t, scale_inv))


# ---- normalization -> FP8 GEMM input ----------------------------------------------
class _NormCall:
    """The non-tensor arguments of one `NormCast` call; ``fp8`` receives ``(x_fp8,
    x_fp8^T or None)``."""

    __slots__ = ("normalization", "eps", "zero_centered_gamma", "out_dtype", "dtype",
                 "scaling", "write_y", "transpose", "fp8")

    def __init__(self, normalization, eps, zero_centered_gamma, out_dtype, dtype, scaling,
                 write_y, transpose):
        self.normalization, self.eps, self.zero_centered_gamma = (normalization, eps,
                                                                  zero_centered_gamma)
        self.out_dtype, self.dtype, self.scaling = out_dtype, dtype, scaling
        self.write_y, self.transpose, self.fp8 = write_y, transpose, None


class NormCast(torch.autograd.Function):
    """The normalization of `layernorm.normalize` whose kernel also writes the FP8
    copy of its output (NOTE [Fused producers]); returns the output (`unwritten`
    unless ``call.write_y``). Backward: torch's normalization backward at this
    forward's statistics, in the dtypes `normalize`'s autograd uses."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                call: _NormCall):
        norm_cast = _kernels[0]
        n = weight.numel()
        x2d = x.reshape(-1, n)
        if x2d.stride(1) != 1:
            x2d = x2d.contiguous()
        y, q, q_t, scale_inv, stats = norm_cast.norm_cast(
            x2d, weight, bias, call.normalization, call.eps, call.zero_centered_gamma,
            call.out_dtype, call.dtype, write_y=call.write_y, data=True,
            transpose=call.transpose, **call.scaling)
        call.fp8 = _fp8_pair(q, q_t, scale_inv)
        mean = stats[0] if call.normalization == "LayerNorm" else None
        ctx.save_for_backward(x, weight, bias, mean, stats[-1])
        ctx.normalization, ctx.zero_centered_gamma = call.normalization, call.zero_centered_gamma
        ctx.out_dtype = call.out_dtype
        if y is None:
            return unwritten(x.shape, call.out_dtype, x.device)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        n = weight.numel()
        x2d = x.reshape(-1, n)
        dy2d = dy.reshape(-1, n)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        layer_norm = ctx.normalization == "LayerNorm"
        native = (layer_norm and not ctx.zero_centered_gamma and x.is_cuda
                  and x.dtype in _NATIVE_16BIT and x.dtype == ctx.out_dtype == weight.dtype
                  and (bias is None or bias.dtype == x.dtype))
        if native:          # as F.layer_norm's own backward in normalize
            dx, dw, db = torch.ops.aten.native_layer_norm_backward(
                dy2d, x2d, [n], mean, rstd, weight, bias, [need_x, need_w, need_b])
        else:               # normalize's float32 path
            x32, dy32 = x2d.to(torch.float32), dy2d.to(torch.float32)
            gamma = weight.to(torch.float32)
            if ctx.zero_centered_gamma:
                gamma = gamma + 1.0
            if layer_norm:
                beta = bias.to(torch.float32) if bias is not None else None
                dx, dw, db = torch.ops.aten.native_layer_norm_backward(
                    dy32, x32, [n], mean, rstd, gamma, beta, [need_x, need_w, need_b])
            else:
                dx, dw = _rms_norm_backward(dy32, x32, rstd, gamma, need_x, need_w)
                db = None
            dx = dx.to(x.dtype) if dx is not None else None
            dw = dw.to(weight.dtype) if dw is not None else None
            db = db.to(bias.dtype) if db is not None else None
        return (dx.view(x.shape) if dx is not None else None, dw,
                db if bias is not None else None, None)


def _rms_norm_backward(dy, x, rstd, gamma, need_x: bool, need_w: bool):
    """float32 RMSNorm backward at the forward's ``rstd`` [M, 1]: torch's fused kernel
    on CUDA, its formula in torch ops elsewhere (the interpreter tests)."""
    if x.is_cuda:
        return torch.ops.aten._fused_rms_norm_backward(dy, x, [x.shape[1]], rstd, gamma,
                                                       [need_x, need_w])
    xhat = x * rstd
    g = dy * gamma
    dx = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True)) if need_x else None
    dw = (dy * xhat).sum(0) if need_w else None
    return dx, dw


def norm_cast_input(plan: ForwardPlan, fp8_meta: dict, x: torch.Tensor, weight: torch.Tensor,
                    bias: Optional[torch.Tensor], normalization: str, eps: float,
                    zero_centered_gamma: bool, out_dtype: torch.dtype, write_y: bool,
                    transpose: bool, index: int = 0):
    """``(ln_out, (x_fp8, x_fp8^T or None))``: the normalization of ``x`` and its FP8
    copy as the GEMM whose input is forward slot ``index`` takes it (NOTE [Fused
    producers]). ``ln_out`` is `unwritten` unless ``write_y``. ``(None, None)`` where
    the kernel's specialization was refused (NOTE [Suspect compiles] in
    kernels/launch.py): the caller then takes the unfused path."""
    state = fp8_meta["scaling_fwd"] if plan.delayed else None
    call = _NormCall(normalization, eps, zero_centered_gamma, out_dtype,
                     plan.recipe.fp8_format.value.dtype_fwd,
                     _scaling(plan, state, index, "fwd_inp", plan.record_amax, x.device),
                     write_y, transpose)
    try:
        ln_out = NormCast.apply(x, weight, bias, call)
    except SuspectCompile:      # refused before it wrote anything: the caller normalizes
        return None, None
    return ln_out, call.fp8


# ---- activation -> FC2's FP8 input; its gradient -> FC1's FP8 output gradient --------
class GradHandoff:
    """What FC1's backward needs from the activation's fused backward (NOTE [Fused
    producers]): FC1's forward sets ``needs`` (dgrad, wgrad, its bias dtype if the
    bias gradient is needed); the activation's backward sets ``grad`` (``dy_fp8``,
    ``dy_fp8^T``, the bias gradient), which FC1's backward takes (and clears)."""

    __slots__ = ("needs", "grad")

    def __init__(self):
        self.needs: Optional[tuple] = None
        self.grad: Optional[tuple] = None


class _ActCall:
    """The non-tensor arguments of one `ActCast` call; ``fp8`` receives FC2's
    ``(input_fp8, input_fp8^T or None)``."""

    __slots__ = ("activation", "dtype", "scaling", "transpose", "handoff", "plan",
                 "fp8_meta", "bwd_fp8_meta", "fwd_index", "bwd_index", "fp8")

    def __init__(self, activation, dtype, scaling, transpose, handoff, plan, fp8_meta,
                 bwd_fp8_meta, fwd_index, bwd_index):
        self.activation, self.dtype, self.scaling = activation, dtype, scaling
        self.transpose, self.handoff, self.plan = transpose, handoff, plan
        self.fp8_meta, self.bwd_fp8_meta = fp8_meta, bwd_fp8_meta
        self.fwd_index, self.bwd_index, self.fp8 = fwd_index, bwd_index, None


class ActCast(torch.autograd.Function):
    """``activate(fc1_out, activation)`` writing FC2's FP8 input (NOTE [Fused
    producers]); returns `unwritten` of the activation's shape. Backward: FC1's FP8
    output gradient, through ``call.handoff``."""

    @staticmethod
    def forward(ctx, fc1_out: torch.Tensor, call: _ActCall):
        act_cast = _kernels[1]
        width = fc1_out.shape[-1]
        x2d = fc1_out.reshape(-1, width)
        if not x2d.is_contiguous():
            x2d = x2d.contiguous()
        out = fused_or_none(act_cast.act_cast, x2d, call.activation, call.dtype,
                            transpose=call.transpose, **call.scaling)
        if out is None:         # NOTE [Suspect compiles]: the unfused path's casts
            plan = call.plan
            state = call.fp8_meta["scaling_fwd"] if plan.delayed else None
            call.fp8 = cast_operand(activate(x2d, call.activation), plan, state,
                                    call.fwd_index, call.dtype, plan.record_amax, "fwd_inp",
                                    True, call.transpose)
        else:
            call.fp8 = _fp8_pair(*out[1:])
        ctx.save_for_backward(x2d)
        ctx.call = call
        ctx.shape = fc1_out.shape
        out_shape = (*fc1_out.shape[:-1], call.fp8[0].data.shape[1])
        return unwritten(out_shape, fc1_out.dtype, fc1_out.device)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (x2d,) = ctx.saved_tensors
        call: _ActCall = ctx.call
        plan = call.plan
        dy2d = dy.reshape(-1, dy.shape[-1])
        if dy2d.stride(1) != 1:
            dy2d = dy2d.contiguous()
        need_dgrad, need_wgrad, bias_dtype = call.handoff.needs
        # NOTE [Backward inside a checkpointed function] in recompute.py
        state, record = plan.backward_state(
            call.bwd_fp8_meta["scaling_bwd"] if plan.delayed else None, call.bwd_index)
        dtype, data = plan.recipe.fp8_format.value.dtype_bwd, need_dgrad or not need_wgrad
        out = fused_or_none(
            _kernels[2].dact_cast, x2d, dy2d, call.activation, dtype, data=data,
            transpose=need_wgrad, dbias_dtype=bias_dtype,
            **_scaling(plan, state, call.bwd_index, "bwd_grad", record, x2d.device))
        if out is None:         # NOTE [Suspect compiles]: the unfused path's backward
            with torch.enable_grad():
                x = x2d.detach().requires_grad_()
                (grad,) = torch.autograd.grad(activate(x, call.activation), x, dy2d)
            dbias = None if bias_dtype is None else bias_grad(grad, bias_dtype)
            call.handoff.grad = (*cast_operand(grad, plan, state, call.bwd_index, dtype, record,
                                               "bwd_grad", data, need_wgrad, count=record),
                                 dbias)
        else:
            call.handoff.grad = (*_fp8_pair(*out[:3]), out[3])
        return unwritten(ctx.shape, x2d.dtype, x2d.device), None


def act_cast_input(plan: ForwardPlan, fp8_meta: dict, fc1_out: torch.Tensor, activation: str,
                   transpose: bool, handoff: GradHandoff, fwd_index: int, bwd_index: int,
                   bwd_fp8_meta: Optional[dict] = None):
    """``(act_out, (fc2_input_fp8, its transpose or None))``: the activation of FC1's
    output written as FC2's FP8 input (forward slot ``fwd_index``); its backward hands
    FC1's output gradient (backward slot ``bwd_index`` of ``bwd_fp8_meta``, which is
    ``fp8_meta`` unless FC1's state is another module's) to FC1 through ``handoff``."""
    state = fp8_meta["scaling_fwd"] if plan.delayed else None
    call = _ActCall(activation, plan.recipe.fp8_format.value.dtype_fwd,
                    _scaling(plan, state, fwd_index, "fwd_inp", plan.record_amax,
                             fc1_out.device),
                    transpose, handoff, plan, fp8_meta,
                    fp8_meta if bwd_fp8_meta is None else bwd_fp8_meta, fwd_index, bwd_index)
    act_out = ActCast.apply(fc1_out, call)
    fp8, call.fp8 = call.fp8, None      # the backward keeps `call`, not FC2's FP8 input
    return act_out, fp8
