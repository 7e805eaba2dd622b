"""te.Linear, and the FP8 linear autograd function that the other modules reuse.

The GEMM names (forward, dgrad, wgrad) are those of NOTE [GEMM vocabulary] in
`quantize.py`; which scale each cast uses is decided by `ForwardPlan` (base.py).

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

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .. import block_scaling, quantize, torch_compile
from ..amax_update import request_backward_update
from ..fp8_shapes import Float8Data
from ..tensor import QuantizedTensor
from ..tensor_parallel import TensorParallelConfig
from ..utils import (check_bool, check_input_dtype, check_params_dtype, check_positive_int,
                     reject_unsupported)
from .backward_override import backward_override, operands_to_save, override_grads
from .base import TransformerEngineBaseModule
from .devices import activation_dtype, default_device, no_autocast
from .fp8_operands import cast_operand, fp8_weight, forward_operands
from .forward_plan import ForwardPlan
from .delayed_wgrad import accumulate_grad, deferred_linear
from .main_grad import (accumulate_into_main_grad, check_main_grad, linear_into_main_grad,
                        main_grad_placeholder)
from .params import (ParamInit, joined_parameter, normal_init, register_linear_params,
                     split_parameters)

__all__ = ["Linear", "fp8_linear", "check_init_args", "local_parts"]

_ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _gemm(a, b, out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None,
          fast_accum: bool = False) -> torch.Tensor:
    """``a @ b^T`` (NOTE [GEMM vocabulary]) for per-tensor or block-scaled operands."""
    if isinstance(a, block_scaling.BlockScaledData):
        return block_scaling.block_gemm(a, b, out_dtype, bias)
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
        state = ctx.fp8_meta["scaling_bwd"] if plan.delayed else None
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
                # The amax of dy is recorded even when only dbias is needed.
                dy_fp8, dy_t = cast_operand(dy, plan, state, i, fmt.dtype_bwd, True, "bwd_grad",
                                            data=need_dgrad or not need_wgrad,
                                            transpose=need_wgrad)
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
    if plan.recipe.float8_block_scaling():
        return block_scaling.cast_for_role(plan.recipe, "fwd_inp", x, dtype, False, True,
                                           count_non_finite=False)[1]
    q = plan.recipe.fp8_quant_fwd_inp
    return quantize.current_scaling_cast(x, dtype, q.power_2_scale, q.amax_epsilon, None,
                                         data=False, transpose=True)[1]


def _dbias(ctx, dy: torch.Tensor) -> Optional[torch.Tensor]:
    """The bias gradient: float32 accumulation (torch's for 16-bit sums too), rounded once."""
    if ctx.bias_dtype is None or not ctx.needs_input_grad[2]:
        return None
    return (dy.sum(0) if dy.dtype == ctx.bias_dtype
            else dy.sum(0, dtype=torch.float32).to(ctx.bias_dtype))


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
            and not plan.recipe.float8_block_scaling():
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



def check_init_args(api: str, init_method, get_rng_state_tracker, rng_tracker_name) -> None:
    """The initializer arguments TE modules share."""
    if init_method is not None and not callable(init_method):
        raise TypeError(f"{api}: init_method must be a callable init_method(weight) or None, "
                        f"got {type(init_method).__name__}")
    if get_rng_state_tracker is not None and not callable(get_rng_state_tracker):
        raise TypeError(f"{api}: get_rng_state_tracker must be a callable returning a "
                        f"CudaRNGStatesTracker, got {type(get_rng_state_tracker).__name__}")
    if rng_tracker_name is not None and not isinstance(rng_tracker_name, str):
        raise TypeError(f"{api}: rng_tracker_name must be a str or None, got {rng_tracker_name!r}")


def local_parts(tp: TensorParallelConfig, parts):
    """``split_parameters`` parts with their rows split over a column-parallel group."""
    if tp.parallel_mode != "column" or tp.size == 1:
        return parts
    return [(prefix, tp.local_features(f"the rows of {prefix}weight" if prefix else
                                       "out_features", rows)) for prefix, rows in parts]


class Linear(TransformerEngineBaseModule):
    """``y = x W^T + b``, in FP8 inside an enabled ``te.autocast``. TE's signature.

    Parameters
    ----------
    in_features, out_features : int
    sequence_parallel : bool, default False
        With ``parallel_mode``: activations outside the layer pair are split along
        dim 0 (column all-gathers its input, row reduce-scatters its output).
    fuse_wgrad_accumulation : bool, default False
        Add the weight gradient into ``weight.main_grad`` in float32 instead of
        ``weight.grad`` (NOTE [Fused wgrad accumulation] in main_grad.py).
    tp_group : torch.distributed.ProcessGroup, optional
        The tensor-parallel group; its size is the TP size.
    tp_size : int, default 1
        The TP size when the group is formed later: call
        ``set_tensor_parallel_group(group)`` before the first forward.
    get_rng_state_tracker : callable, optional
        Returns a `CudaRNGStatesTracker`; the weights are initialized under its
        ``fork(rng_tracker_name)`` (``fork()`` when the name is None).
    rng_tracker_name : str, optional
    init_method : callable, optional
        ``init_method(weight)``; normal(0, 0.023) when None. Biases start at 0.
    bias : bool, default True
    return_bias : bool, default False
        Return ``(x W^T, b)`` instead of adding the bias, so it can be fused later.
    params_dtype : torch.dtype, optional
        float32, bfloat16 or float16; ``torch.get_default_dtype()`` when None.
    parallel_mode : None | "column" | "row", default None
        "column": the weight and bias hold ``out_features / tp`` rows and the output
        is this rank's slice of the features (not gathered). "row": the weight holds
        ``in_features / tp`` columns, the input is this rank's slice of the
        features, the output is summed over the group and the full bias added
        after. See NOTE [Tensor-parallel layouts] in ``tensor_parallel.py``; in FP8
        the autocast's ``amax_reduction_group`` must span the TP group.
    parameters_split : tuple of str or dict of str -> int, optional
        Expose the weight (and bias) as several parameters split along dim 0, named
        ``<name>_weight`` / ``<name>_bias`` (all weights registered before all
        biases, as TE does); the forward uses their concatenation.
    device : torch.device, optional
        CUDA if available, else CPU, when None. ``"meta"`` defers initialization to
        ``reset_parameters()`` (NOTE [Parameter initialization] in params.py).
    name : str, optional
        TE's module name (for messages).
    save_original_input : bool, default False
        Save the high-precision input for backward instead of its FP8 copy, and cast it
        again there for the wgrad GEMM (NOTE [Saving the original input]); not with
        DelayedScaling (``ValueError``). An attribute, which may be set later.
    delay_wgrad_compute : bool, default False
        The backward computes the input and bias gradients only; ``backward_dw()``
        computes the weight gradient later (NOTE [Delayed wgrad] in
        delayed_wgrad.py). Not with ``parameters_split``.
    ub_overlap_ag, ub_overlap_rs, ub_overlap_rs_dgrad, ub_bulk_dgrad, ub_bulk_wgrad,
    symmetric_ar_type
        Not implemented: anything but the default raises ``NotImplementedError``.
        ``ub_name`` is accepted (it only names a Userbuffers buffer).
    """

    def __init__(self, in_features: int, out_features: int, sequence_parallel: bool = False,
                 fuse_wgrad_accumulation: bool = False, tp_group=None, tp_size: int = 1,
                 get_rng_state_tracker: Optional[Callable] = None,
                 rng_tracker_name: Optional[str] = None, init_method: Optional[Callable] = None,
                 bias: bool = True, return_bias: bool = False,
                 params_dtype: Optional[torch.dtype] = None, parallel_mode: Optional[str] = None,
                 parameters_split=None, device=None, ub_overlap_ag: bool = False,
                 ub_overlap_rs: bool = False, ub_overlap_rs_dgrad: bool = False,
                 ub_bulk_dgrad: bool = False, ub_bulk_wgrad: bool = False,
                 ub_name: Optional[str] = None, delay_wgrad_compute: bool = False,
                 symmetric_ar_type: Optional[str] = None, save_original_input: bool = False,
                 name: Optional[str] = None):
        super().__init__(num_gemms=1, name=name)
        api = "te.Linear"
        reject_unsupported(api, ub_overlap_ag=(ub_overlap_ag, False),
                        ub_overlap_rs=(ub_overlap_rs, False),
                        ub_overlap_rs_dgrad=(ub_overlap_rs_dgrad, False),
                        ub_bulk_dgrad=(ub_bulk_dgrad, False), ub_bulk_wgrad=(ub_bulk_wgrad, False),
                        symmetric_ar_type=(symmetric_ar_type, None))
        # an attribute, as in TE: Megatron-LM sets it after construction
        self.save_original_input = check_bool(api, "save_original_input", save_original_input)
        self.in_features = check_positive_int(api, "in_features", in_features)
        self.out_features = check_positive_int(api, "out_features", out_features)
        self.use_bias = check_bool(api, "bias", bias)
        self.return_bias = check_bool(api, "return_bias", return_bias)
        self.fuse_wgrad_accumulation = check_bool(api, "fuse_wgrad_accumulation",
                                                  fuse_wgrad_accumulation)
        check_init_args(api, init_method, get_rng_state_tracker, rng_tracker_name)
        dtype = check_params_dtype(api, params_dtype)
        device = default_device(device)
        self.tp = TensorParallelConfig(api, parallel_mode, tp_group, tp_size, sequence_parallel)
        parts = split_parameters(api, parameters_split, out_features)
        if parameters_split is not None and self.fuse_wgrad_accumulation:
            raise NotImplementedError(f"{api}: fuse_wgrad_accumulation=True with parameters_split "
                                      "is not implemented (one weight.main_grad per module); "
                                      "use one weight")
        self._init_delay_wgrad(api, delay_wgrad_compute, parameters_split is not None)
        local_in = (self.tp.local_features("in_features", in_features)
                    if parallel_mode == "row" else in_features)
        self.get_rng_state_tracker, self.rng_tracker_name = get_rng_state_tracker, rng_tracker_name
        self.ub_name, self.symmetric_ar_type = ub_name, symmetric_ar_type
        weight_init = ParamInit(init_method or normal_init, get_rng_state_tracker, rng_tracker_name)
        self.weight_names, self.bias_names = register_linear_params(
            self, local_parts(self.tp, parts), local_in, self.use_bias, dtype, device, weight_init)
        for w, b in zip(self.weight_names, self.bias_names):
            self.tp.mark_params(getattr(self, w), getattr(self, b))
        self._sync_tp_attributes()
        self.reset_parameters(defer_init=device.type == "meta")

    def _sync_tp_attributes(self) -> None:
        """TE's attribute names for the TP settings (plain attributes: Megatron's
        subclasses assign some of them themselves)."""
        self.parallel_mode, self.sequence_parallel = self.tp.parallel_mode, self.tp.sequence_parallel
        self.tp_group, self.tp_size = self.tp.tp_group, self.tp.tp_size

    def set_tensor_parallel_group(self, tp_group) -> None:
        """Attach the tensor-parallel group (for a module built with ``tp_size``)."""
        self.tp.set_group(tp_group)
        self._sync_tp_attributes()

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None,
                fp8_output: bool = False, fp8_grad: bool = False):
        """``inp W^T + b``; ``is_first_microbatch`` as in TE (FP8 weight caching across
        micro-batches, NOTE [FP8 weight cache] in fp8_operands.py). ``fp8_output`` /
        ``fp8_grad`` (FP8 tensors out of the module) are not implemented."""
        api = "te.Linear"
        if not (fp8_output is False and fp8_grad is False):
            reject_unsupported(f"{api}.forward", fp8_output=(fp8_output, False),
                               fp8_grad=(fp8_grad, False))
        if not torch.is_tensor(inp):
            raise TypeError(f"{api}: input must be a tensor, got {type(inp).__name__}")
        inp = inp.contiguous()          # NOTE [Contiguous module inputs] in module/base.py
        with self.prepare_forward(inp, is_first_microbatch) as plan:
            weight = joined_parameter(self, self.weight_names)
            bias = joined_parameter(self, self.bias_names)
            inp = self.tp.column_input(inp)
            row = self.tp.parallel_mode == "row"
            fused_bias = None if (self.return_bias or row) else bias
            out = fp8_linear(self.named_api(api), inp, weight, fused_bias, plan, self.fp8_meta,
                             fuse_wgrad_accumulation=self.fuse_wgrad_accumulation,
                             save_original_input=bool(self.save_original_input),
                             wgrad_store=self._forward_wgrad_store())
            out = self.tp.row_output(out)
        if self.return_bias:
            return out, bias
        if row and bias is not None:
            out = out + bias.to(out.dtype)
        return out

    def extra_repr(self) -> str:
        return ", ".join((f"in_features={self.in_features}", f"out_features={self.out_features}",
                          f"bias={self.use_bias}") + self.tp.describe())
