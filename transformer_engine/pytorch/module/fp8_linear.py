"""The FP8 linear: ``x W^T + b`` as one autograd Function with FP8 forward, dgrad and
wgrad GEMMs (`fp8_linear`), the path of te.Linear that LayerNormLinear, LayerNormMLP
and GroupedLinear reuse.

The GEMM names (forward, dgrad, wgrad) are those of NOTE [GEMM vocabulary] in
`quantize.py`; which scale each cast uses is decided by `ForwardPlan` (forward_plan.py).

NOTE [Saving the original input]
    With ``save_original_input=True`` (TE's te.Linear argument) an FP8 forward keeps
    the high-precision input for backward instead of its transposed FP8 copy (a saving
    when another module keeps that input alive anyway), and the backward casts it
    again for the wgrad GEMM with the cast the forward would have made: current
    scaling from its own amax, block scaling in its blocks. That cast depends only on
    the input's values, so outputs and gradients are those of the default path, bit
    for bit. DelayedScaling is refused (its cast needs the forward's scale and records
    an amax), as in TE; without FP8 or with a backward override the flag changes
    nothing.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .. import block_scaling, mx_scaling, nvfp4_scaling, quantize, torch_compile
from ..amax_update import request_backward_update
from ..fp8_shapes import Float8Data
from ..tensor import QuantizedTensor
from ..utils import check_input_dtype
from .backward_override import backward_override, operands_to_save, override_grads
from .base import TransformerEngineBaseModule
from .delayed_wgrad import accumulate_grad, deferred_linear
from .devices import activation_dtype, no_autocast
from .forward_plan import ForwardPlan
from .fp8_operands import (block_cast_for_role, cast_operand, fp8_weight,
                           forward_operands)
from .main_grad import (accumulate_into_main_grad, check_main_grad, linear_into_main_grad,
                        main_grad_placeholder)

__all__ = ["fp8_linear"]

_ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _gemm(a, b, out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None,
          fast_accum: bool = False) -> torch.Tensor:
    """``a @ b^T`` (NOTE [GEMM vocabulary]) for per-tensor or block-scaled operands."""
    if isinstance(a, block_scaling.BlockScaledData):
        return block_scaling.block_gemm(a, b, out_dtype, bias)
    if isinstance(a, (mx_scaling.MXFP8Data, nvfp4_scaling.NVFP4Data)):
        return mx_scaling.mx_gemm(a, b, out_dtype, bias)
    return quantize.fp8_gemm_unchecked(a, b, out_dtype, bias=bias, use_fast_accum=fast_accum)


def _fast_accum(recipe, gemm_field: str, default: bool) -> bool:
    """``use_fast_accum`` of ``torch._scaled_mm`` for a GEMM: ``not use_split_accumulator``
    of the recipe's `MMParams` for it (``fp8_gemm_fprop`` ...), ``default`` for a recipe
    without them (delayed scaling: fast for the forward only, TE's defaults)."""
    mm = getattr(recipe, gemm_field, None)
    return default if mm is None else not mm.use_split_accumulator


def _saved(q):
    """The tensors of an FP8 operand to save for backward, and what `_restored` needs
    to rebuild the operand from them (the class alone for plain `Float8Data`)."""
    if q is None:
        return (None, None), None
    if type(q) is Float8Data:
        return (q.data, q.scale_inv), Float8Data
    return (q.data, q.scale_inv), q._replace(data=None, scale_inv=None)


def _restored(kind, data, scale_inv):
    if kind is Float8Data:
        return Float8Data(data, scale_inv)
    return kind._replace(data=data, scale_inv=scale_inv)


class _LinearCall:
    """The non-tensor arguments of one `_FP8LinearFunction` call, as one argument
    (autograd's ``apply`` inspects every argument: fewer is cheaper on the host)."""

    __slots__ = ("plan", "fp8_meta", "gemm", "out_dtype", "fuse_wgrad", "input_fp8",
                 "grad_handoff", "weight_ops", "save_original", "wgrad_store")

    def __init__(self, plan: ForwardPlan, fp8_meta: dict, gemm: int, out_dtype: torch.dtype,
                 fuse_wgrad: bool, input_fp8=None, grad_handoff=None, weight_ops=None):
        self.plan, self.fp8_meta, self.gemm = plan, fp8_meta, gemm
        self.out_dtype, self.fuse_wgrad = out_dtype, fuse_wgrad
        self.input_fp8, self.grad_handoff = input_fp8, grad_handoff
        # the FP8 weight made before the call, while dynamo traces (NOTE [torch.compile])
        self.weight_ops = weight_ops
        # set by fp8_linear: NOTE [Saving the original input], NOTE [Delayed wgrad]
        self.save_original, self.wgrad_store = False, None


class _OriginalInput:
    """The ``x_t_kind`` of a call that saved its high-precision input (NOTE [Saving the
    original input])."""


class _FP8LinearFunction(torch.autograd.Function):
    """``y = x W^T + b`` with FP8 forward, dgrad and wgrad GEMMs.

    The forward casts also produce the transposed FP8 copies the backward GEMMs take
    (``W^T`` for dgrad, ``x^T`` for wgrad; on CUDA in the cast's own pass, NOTE [Fused
    casts]) and save only those: FP8 copies, not the high-precision tensors, and
    nothing to transpose in backward. With ``call.input_fp8`` the input's FP8 copies
    come from its producer and ``x`` is only the autograd edge; with
    ``call.grad_handoff`` the output gradient's FP8 copies and the bias gradient come
    from the next layer's backward (NOTE [Fused producers] in fused_producers.py).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                call: "_LinearCall"):
        plan, fp8_meta, gemm = call.plan, call.fp8_meta, call.gemm
        fmt = plan.recipe.fp8_format.value
        state = plan.fwd_state
        i = TransformerEngineBaseModule.FWD_TENSORS_PER_GEMM * gemm
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        override = backward_override(plan.recipe)
        fp8_backward = override is None
        save_x = (call.save_original and fp8_backward and need_wgrad
                  and call.input_fp8 is None)
        with no_autocast(x.device.type):
            if call.input_fp8 is not None:      # fused producers: FP8 backward only
                x_fp8, x_t = call.input_fp8
                if need_wgrad and x_t is None:
                    x_t = quantize.transpose_fp8(x_fp8)
                w_fp8, w_t = fp8_weight(weight, plan, fp8_meta, state, i + 1, gemm,
                                        fmt.dtype_fwd, need_dgrad)
            elif call.weight_ops is not None:   # (made outside, while dynamo traces)
                x_fp8, x_t = cast_operand(x, plan, state, i, fmt.dtype_fwd, plan.record_amax,
                                          "fwd_inp",
                                          transpose=need_wgrad and fp8_backward and not save_x)
                w_fp8, w_t = call.weight_ops
            else:
                (x_fp8, x_t), (w_fp8, w_t) = forward_operands(x, weight, plan, fp8_meta, state,
                                                              i, gemm, fmt.dtype_fwd,
                                                              need_wgrad and fp8_backward
                                                              and not save_x,
                                                              need_dgrad and fp8_backward)
            y = _gemm(x_fp8, w_fp8, call.out_dtype, bias,
                      _fast_accum(plan.recipe, "fp8_gemm_fprop", True))
        ctx.override = override
        if save_x:
            (x_t_data, x_t_scale_inv), ctx.x_t_kind = (x, None), _OriginalInput
            (w_t_data, w_t_scale_inv), ctx.w_t_kind = _saved(w_t)
            ctx.save_for_backward(x_t_data, x_t_scale_inv, w_t_data, w_t_scale_inv)
        elif fp8_backward:
            (x_t_data, x_t_scale_inv), ctx.x_t_kind = _saved(x_t)
            (w_t_data, w_t_scale_inv), ctx.w_t_kind = _saved(w_t)
            ctx.save_for_backward(x_t_data, x_t_scale_inv, w_t_data, w_t_scale_inv)
        else:       # NOTE [Backward override] in backward_override.py
            x_kept, w_kept = operands_to_save(override, x, weight, x_fp8, w_fp8, need_dgrad,
                                              need_wgrad)
            ctx.save_for_backward(*_saved_any(x_kept, "x_kind", ctx),
                                  *_saved_any(w_kept, "w_kind", ctx))
        ctx.plan, ctx.fp8_meta, ctx.gemm = plan, fp8_meta, gemm
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        ctx.main_grad_weight = weight if call.fuse_wgrad else None
        ctx.wgrad_store = call.wgrad_store
        if call.wgrad_store is not None:
            ctx.weight = weight     # (the parameter the delayed wgrad is delivered to)
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.grad_handoff = call.grad_handoff
        if call.grad_handoff is not None:
            call.grad_handoff.needs = (need_dgrad, need_wgrad,
                                       ctx.bias_dtype if ctx.needs_input_grad[2] else None)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        if ctx.override is not None:
            return _override_backward(ctx, dy)
        x_t_data, x_t_scale_inv, w_t_data, w_t_scale_inv = ctx.saved_tensors
        plan: ForwardPlan = ctx.plan
        fmt = plan.recipe.fp8_format.value
        i = TransformerEngineBaseModule.BWD_TENSORS_PER_GEMM * ctx.gemm
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        handoff, handed = ctx.grad_handoff, None
        if handoff is not None and handoff.grad is not None:
            handed, handoff.grad = handoff.grad, None
        with no_autocast(dy.device.type):
            if handed is not None:      # dy is the unwritten edge; its FP8 copies are here
                dy_fp8, dy_t, handed_dbias = handed
            else:
                dy = dy.contiguous()
                # NOTE [Backward inside a checkpointed function] in recompute.py
                state, record = plan.backward_state(
                    ctx.fp8_meta["scaling_bwd"] if plan.delayed else None, i)
                # The amax of dy is recorded even when only dbias is needed.
                dy_fp8, dy_t = cast_operand(dy, plan, state, i, fmt.dtype_bwd, record,
                                            "bwd_grad", data=need_dgrad or not need_wgrad,
                                            transpose=need_wgrad, count=record)
            dgrad = wgrad = dbias = None
            if need_dgrad:
                w_t = _restored(ctx.w_t_kind, w_t_data, w_t_scale_inv)
                dgrad = _gemm(dy_fp8, w_t, ctx.x_dtype,
                              fast_accum=_fast_accum(plan.recipe, "fp8_gemm_dgrad", False))
            if need_wgrad:
                x_t = (_requantized_input(x_t_data, plan, fmt.dtype_fwd)
                       if ctx.x_t_kind is _OriginalInput
                       else _restored(ctx.x_t_kind, x_t_data, x_t_scale_inv))
                fast = _fast_accum(plan.recipe, "fp8_gemm_wgrad", False)
                main_grad_weight, w_dtype = ctx.main_grad_weight, ctx.w_dtype

                def wgrad_gemm():
                    if main_grad_weight is None:
                        return _gemm(dy_t, x_t, w_dtype, fast_accum=fast)
                    # NOTE [Fused wgrad accumulation] in main_grad.py
                    return accumulate_into_main_grad(
                        main_grad_weight, _gemm(dy_t, x_t, torch.float32, fast_accum=fast))
                wgrad = _wgrad_now_or_later(ctx, wgrad_gemm)
            if handed is None:
                dbias = _dbias(ctx, dy)
            elif ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
                dbias = handed_dbias
        if plan.session is not None:
            if not plan.replaying():
                request_backward_update(plan.session)
        elif plan.bwd_update_gemm == ctx.gemm:      # NOTE [torch.compile]
            torch_compile.backward_update(ctx.fp8_meta, plan.recipe, plan.group)
        return dgrad, wgrad, dbias, None


def _wgrad_now_or_later(ctx, wgrad_gemm):
    """The weight gradient autograd gets: ``wgrad_gemm()`` run now, or, for a module
    that delays it, stored for ``backward_dw()`` and the placeholder the undelayed
    backward would give (NOTE [Delayed wgrad] in delayed_wgrad.py)."""
    store = ctx.wgrad_store
    if store is None:
        return wgrad_gemm()
    weight, fused = ctx.weight, ctx.main_grad_weight is not None
    if fused:
        store.put(wgrad_gemm)
        return main_grad_placeholder(weight)
    store.put(lambda: accumulate_grad(weight, wgrad_gemm()))
    return None


def _requantized_input(x: torch.Tensor, plan: ForwardPlan, dtype: torch.dtype):
    """The wgrad operand ``x_fp8^T`` cast again from the saved high-precision input
    (NOTE [Saving the original input]): the cast the forward would have made, no amax
    or non-finite count recorded a second time."""
    if plan.blockwise:
        return block_cast_for_role(plan.recipe, "fwd_inp", x, dtype, False, True,
                                   count_non_finite=False)[1]
    q = plan.recipe.fp8_quant_fwd_inp
    return quantize.current_scaling_cast(x, dtype, q.power_2_scale, q.amax_epsilon, None,
                                         data=False, transpose=True)[1]


def bias_grad(dy: torch.Tensor, bias_dtype: torch.dtype) -> torch.Tensor:
    """The bias gradient of a 2-D ``dy``: float32 accumulation (torch's for 16-bit sums
    too), rounded once to ``bias_dtype``."""
    return (dy.sum(0) if dy.dtype == bias_dtype
            else dy.sum(0, dtype=torch.float32).to(bias_dtype))


def _dbias(ctx, dy: torch.Tensor) -> Optional[torch.Tensor]:
    if ctx.bias_dtype is None or not ctx.needs_input_grad[2]:
        return None
    return bias_grad(dy, ctx.bias_dtype)


def _saved_any(operand, kind_name: str, ctx):
    """Two saved-tensor slots for an operand kept by a backward override: a plain
    tensor (and None), or an FP8 operand's data and ``scale_inv`` (`_saved`)."""
    if isinstance(operand, torch.Tensor):
        setattr(ctx, kind_name, torch.Tensor)
        return operand, None
    pair, kind = _saved(operand)
    setattr(ctx, kind_name, kind)
    return pair


def _restored_any(kind, first, second):
    if kind is torch.Tensor or kind is None:
        return first
    return _restored(kind, first, second)


def _override_backward(ctx, dy: torch.Tensor):
    """NOTE [Backward override] in backward_override.py: no FP8 in the backward."""
    x_a, x_b, w_a, w_b = ctx.saved_tensors
    with no_autocast(dy.device.type):
        dy = dy.contiguous()
        x_operand = _restored_any(ctx.x_kind, x_a, x_b)
        delayed = ctx.wgrad_store is not None and x_operand is not None
        dgrad, wgrad = override_grads(dy, None if delayed else x_operand,
                                      _restored_any(ctx.w_kind, w_a, w_b), ctx.x_dtype,
                                      ctx.w_dtype, ctx.main_grad_weight)
        if delayed:
            wgrad = _wgrad_now_or_later(ctx, lambda: override_grads(
                dy, x_operand, None, ctx.x_dtype, ctx.w_dtype, ctx.main_grad_weight)[1])
        dbias = _dbias(ctx, dy)
    return dgrad, wgrad, dbias, None


def fp8_linear(api: str, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
               plan: ForwardPlan, fp8_meta: dict, gemm: int = 0,
               fuse_wgrad_accumulation: bool = False, input_name: str = "input",
               weight_name: str = "weight", input_fp8=None, grad_handoff=None,
               save_original_input: bool = False, wgrad_store=None) -> torch.Tensor:
    """``x W^T + b`` for ``x: [..., K]``, ``W: [N, K]``: in FP8 when ``plan.fp8``, else an
    ordinary linear (recording amaxes when calibrating). ``gemm`` picks this GEMM's
    slots in the module's scaling state. ``fuse_wgrad_accumulation``: the wgrad goes
    into ``weight.main_grad`` (NOTE [Fused wgrad accumulation] in main_grad.py).
    ``input_name`` / ``weight_name`` name the tensors in a shape error (NOTE [FP8
    shapes] in fp8_shapes.py). ``input_fp8`` / ``grad_handoff``: the input's FP8 copies
    made by its producer, the output gradient's made by the next layer's backward
    (FP8 only; NOTE [Fused producers] in fused_producers.py). ``save_original_input``:
    NOTE [Saving the original input]. ``wgrad_store``: the module's `WeightGradStore`
    when it delays its wgrad (NOTE [Delayed wgrad] in delayed_wgrad.py)."""
    in_features, out_features = weight.shape[1], weight.shape[0]
    if x.dim() == 0 or x.shape[-1] != in_features:
        raise ValueError(f"{api}: the input's last dimension must be in_features={in_features}, "
                         f"got input of shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"{api}: input must be a floating-point tensor, got dtype {x.dtype}")
    check_input_dtype(api, x, weight, plan.fp8)
    if fuse_wgrad_accumulation:
        check_main_grad(api, weight)
    if wgrad_store is not None and not (torch.is_grad_enabled() and weight.requires_grad):
        wgrad_store = None                      # no wgrad to delay
    if not plan.fp8:
        param = weight
        if isinstance(weight, QuantizedTensor) and not fuse_wgrad_accumulation:
            weight = weight.dequantize()        # (the main-grad path reads the weight itself)
        if plan.record_amax:
            state = plan.fwd_state
            i = TransformerEngineBaseModule.FWD_TENSORS_PER_GEMM * gemm
            state.record_amax(i, quantize.amax(x))
            state.record_amax(i + 1, quantize.amax(weight))
        if fuse_wgrad_accumulation:
            return linear_into_main_grad(x, weight, bias, wgrad_store)
        if wgrad_store is not None:             # NOTE [Delayed wgrad] in delayed_wgrad.py
            return deferred_linear(x, param, bias, weight, wgrad_store, activation_dtype(x))
        return F.linear(x, weight, bias)
    out_dtype = activation_dtype(x)
    if out_dtype not in _ACT_DTYPES:
        raise TypeError(f"{api}: FP8 GEMMs produce float32, bfloat16 or float16; got an input "
                        f"of dtype {x.dtype} (use one of {_ACT_DTYPES} or torch.autocast)")
    x2d = x if x.dim() == 2 else x.reshape(-1, in_features)
    # the block-scaling emulation takes any shape (NOTE [Block scaling layout])
    if (x2d.shape[0] % quantize.FP8_HEIGHT_MULTIPLE or in_features % quantize.FP8_WIDTH_MULTIPLE
            or out_features % quantize.FP8_HEIGHT_MULTIPLE) \
            and not plan.blockwise:
        quantize.check_fp8_matrix(api, input_name, x.shape)
        quantize.check_fp8_matrix(api, weight_name, weight.shape)
    if save_original_input and plan.delayed and torch.is_grad_enabled() \
            and weight.requires_grad and backward_override(plan.recipe) is None:
        raise ValueError(f"{api}: save_original_input=True does not work with the "
                         "DelayedScaling recipe (the wgrad's input cast needs the forward's "
                         "scale); use Float8CurrentScaling or Float8BlockScaling, or "
                         "save_original_input=False")
    call = (_LinearCall(plan, fp8_meta, gemm, out_dtype, fuse_wgrad_accumulation, input_fp8,
                        grad_handoff)
            if not plan.traced else _traced_call(plan, fp8_meta, gemm, out_dtype,
                                                 fuse_wgrad_accumulation, x2d, weight))
    call.save_original, call.wgrad_store = save_original_input, wgrad_store
    y = _FP8LinearFunction.apply(x2d, weight, bias, call)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], out_features)


def _traced_call(plan: ForwardPlan, fp8_meta: dict, gemm: int, out_dtype: torch.dtype,
                 fuse_wgrad: bool, x2d: torch.Tensor, weight: torch.Tensor) -> _LinearCall:
    """The call's arguments while dynamo traces (NOTE [torch.compile]): the backward
    state in a dict of its own (the function's arguments are guarded on: not the
    module's whole ``fp8_meta``), and a cached or FP8 primary weight taken here,
    outside the function, whose graph may not write the module's cache."""
    meta = {"scaling_bwd": fp8_meta["scaling_bwd"]} if plan.delayed else {}
    weight_ops = None
    if plan.is_first_microbatch is not None or isinstance(weight, QuantizedTensor):
        dtype = plan.recipe.fp8_format.value.dtype_fwd
        need_dgrad = (torch.is_grad_enabled() and x2d.requires_grad
                      and backward_override(plan.recipe) is None)
        index = TransformerEngineBaseModule.FWD_TENSORS_PER_GEMM * gemm + 1
        with no_autocast(x2d.device.type):
            weight_ops = fp8_weight(weight, plan, fp8_meta, plan.fwd_state, index, gemm, dtype,
                                    need_dgrad)
    return _LinearCall(plan, meta, gemm, out_dtype, fuse_wgrad, weight_ops=weight_ops)
