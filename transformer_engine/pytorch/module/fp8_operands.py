"""How a GEMM operand becomes FP8 under a `ForwardPlan`: the cast (delayed, current or
block scaling), and, for weights, the FP8 weight cache and its device-side skip flag.

NOTE [FP8 weight cache]
    As in TE, ``is_first_microbatch=True`` casts the weight and keeps the cast in the
    module; ``False`` reuses that cast (the weights do not change between the
    micro-batches of a step), recording no amax for it, so the next update leaves the
    weight's amax history and scale as they are (NOTE [Delayed-scaling update order]
    in amax_update.py); ``None`` casts every time and
    keeps nothing. With a cache in use, a recompute uses the FP8 weights its own phase
    1 used (held in its stash), never the cache, which a later first micro-batch may
    have refreshed; it writes no cache either. Without one, the recompute casts the
    weight again with the stashed scale, which gives the same FP8 values, so phase 1
    keeps no FP8 weight alive for it. Current scaling needs no stash: its cast is a
    function of the weight's values, which the recompute sees unchanged. Nor does
    block scaling; a weight in 1x128 blocks is cached with its columnwise copy, which
    cannot be made from the FP8 data later (NOTE [Block scaling layout]).

NOTE [Skip-update flag]
    A Python ``is_first_microbatch`` is frozen into a captured CUDA graph, so TE lets
    the choice live on the device instead:
    ``FP8GlobalStateManager.set_skip_fp8_weight_update_tensor(skip)`` fills a float32
    one-element tensor (1.0: keep the cached FP8 weight, 0.0: cast it afresh), and a
    module forward that runs while a graph is captured
    (``FP8GlobalStateManager.fp8_graph_capturing()``) reads that tensor instead of its
    ``is_first_microbatch`` argument. Here that forward casts the weight every time and
    writes into the cached FP8 weight, in place, ``torch.where(flag, cached, fresh)``
    (FP8 bits, ``scale_inv`` and the transposed copy alike; with block scaling the
    block scales and the columnwise copy); the weight's amax goes into the live
    history slot, and a non-finite block amax into the counter, only where the flag
    says refresh. A replay therefore
    reads and writes the same cache buffers and does exactly what
    ``is_first_microbatch=True`` (flag 0) or ``False`` (flag 1) does eagerly, bit for
    bit, without a host sync. As in TE, the cache is one buffer: a refresh overwrites
    the FP8 weight that earlier micro-batches saved for their backward (and stashed
    for their recompute), so refresh only at the first micro-batch of a step, after
    the previous step's backwards, as a training schedule does. The cache is made by
    the first forward with a cache in use (warm up before capturing): with none yet,
    the call casts as a first micro-batch does, whatever the flag holds.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import block_scaling, mx_scaling, nvfp4_scaling, quantize
from ..non_finite import non_finite_counter
from ..tensor import QuantizedTensor
from .forward_plan import ForwardPlan
from .fp8_params import weight_operands

__all__ = ["cast_operand", "fp8_weight", "forward_operands", "blockwise_recipe",
           "block_cast_for_role"]


def blockwise_recipe(recipe) -> bool:
    """Whether ``recipe`` scales blocks (Float8BlockScaling, MXFP8, NVFP4): its casts
    take any shape and its operands are `BlockScaledData`, `MXFP8Data` or `NVFP4Data`."""
    return recipe.float8_block_scaling() or recipe.mxfp8() or recipe.nvfp4()


def block_cast_for_role(recipe, role: str, x: torch.Tensor, dtype: torch.dtype,
                        rowwise: bool, columnwise: bool, count_non_finite: bool = True,
                        count_where=None):
    """``(rowwise, columnwise)`` copies of ``x`` by a block-scaling ``recipe`` for the
    tensors of ``role`` (block_scaling.py, mx_scaling.py, nvfp4_scaling.py)."""
    if recipe.mxfp8():
        return mx_scaling.cast_for_role(recipe, role, x, dtype, rowwise, columnwise,
                                        count_non_finite, count_where)
    if recipe.nvfp4():
        return nvfp4_scaling.cast_for_role(recipe, role, x, rowwise, columnwise,
                                           count_non_finite, count_where)
    return block_scaling.cast_for_role(recipe, role, x, dtype, rowwise, columnwise,
                                       count_where, count_non_finite)


def cast_operand(x: torch.Tensor, plan: ForwardPlan, state, index: int, dtype: torch.dtype,
                 record: bool, role: str, data: bool = True, transpose: bool = False,
                 count: Optional[bool] = None):
    """Cast a 2-D ``x``, whose role is ``role`` ("fwd_inp", "fwd_weight" or "bwd_grad"),
    with the delayed scale ``state.scale[index]`` (folding its amax into the live
    history slot when ``record``), for current scaling with its own amax and the role's
    `QParams`, for block scaling in blocks (block_scaling.py). Returns ``(x_fp8,
    x_fp8^T)`` as asked for (`quantize.cast_transpose_to_fp8`: one pass over ``x`` on
    CUDA); a block-scaled ``x_fp8^T`` is the columnwise copy (NOTE [Block scaling
    layout]). ``count``: whether current or block scaling counts non-finite amaxes
    (by default, unless the call is a recompute)."""
    if plan.delayed:        # (views made once, but not while dynamo traces)
        return quantize.cast_transpose_unchecked(x, state.scale, dtype, index,
                                                 state.amax_history if record else None,
                                                 data, transpose,
                                                 None if plan.traced else state)
    # a recompute counts no non-finite amax: its first forward did (NOTE [Non-finite amaxes])
    if count is None:
        count = not plan.recomputing
    if plan.blockwise:
        return block_cast_for_role(plan.recipe, role, x, dtype, data, transpose,
                                   count_non_finite=count)
    q = getattr(plan.recipe, "fp8_quant_" + role)
    return quantize.current_scaling_cast(x, dtype, q.power_2_scale, q.amax_epsilon,
                                         non_finite_counter(x.device, role == "bwd_grad")
                                         if count else None, data, transpose)


def forward_operands(x: torch.Tensor, weight: torch.Tensor, plan: ForwardPlan, fp8_meta: dict,
                     state, index: int, gemm: int, dtype: torch.dtype, transpose_x: bool,
                     transpose_w: bool):
    """``((x_fp8, x_fp8^T), (w_fp8, w_fp8^T))``, the forward operands of GEMM ``gemm``
    (input in slot ``index``, weight in ``index + 1``), transposes as asked for. A
    plain delayed-scaling weight cast (no cache in use, not an FP8 primary weight)
    shares one launch with the input's (`quantize.cast_pair_unchecked`)."""
    if plan.delayed and plan.is_first_microbatch is None and not isinstance(weight, QuantizedTensor):
        return quantize.cast_pair_unchecked(x, weight, state.scale, dtype, index,
                                            state.amax_history if plan.record_amax else None,
                                            transpose_x, transpose_w,
                                            None if plan.traced else state)
    return (cast_operand(x, plan, state, index, dtype, plan.record_amax, "fwd_inp",
                         transpose=transpose_x),
            fp8_weight(weight, plan, fp8_meta, state, index + 1, gemm, dtype, transpose_w))


def fp8_weight(weight: torch.Tensor, plan: ForwardPlan, fp8_meta: dict, state, index: int,
               gemm: int, dtype: torch.dtype, transpose: bool):
    """The FP8 weight (and its transpose) of GEMM ``gemm`` for this call (NOTE [FP8
    weight cache], NOTE [Skip-update flag]); an FP8 primary weight is its own (NOTE
    [FP8 primary weights] in fp8_params.py)."""
    if isinstance(weight, QuantizedTensor):
        return weight_operands(weight, transpose)
    if plan.is_first_microbatch is None:        # no cache in use: the plain cast
        return cast_operand(weight, plan, state, index, dtype, plan.record_amax, "fwd_weight",
                            transpose=transpose)
    if plan.recomputing and plan.stash is not None and gemm in plan.stash.weights:
        return _with_transpose(plan.stash.weights[gemm], transpose)
    cache = fp8_meta.setdefault("fp8_weight_cache", {})
    # (a first micro-batch does not look at the cache: compiled code would guard on it)
    cached = cache.get(gemm) if (plan.skip_weight_update is not None
                                 or plan.is_first_microbatch is False) else None
    if plan.skip_weight_update is not None and cached is not None:
        found = _flag_selected(weight, plan, state, index, dtype, transpose,
                               _with_transpose(cached, transpose))
    else:
        found = cached if plan.is_first_microbatch is False else None
        if found is None:
            recipe = plan.recipe
            # (a copy in 1-D blocks, or in FP4, cannot be transposed later: cast both)
            rowwise_blocks = (recipe.float8_block_scaling() and recipe.w_block_scaling_dim == 1
                              or recipe.mxfp8() or recipe.nvfp4())
            found = cast_operand(weight, plan, state, index, dtype, plan.record_amax,
                                 "fwd_weight", transpose=transpose or rowwise_blocks)
        found = _with_transpose(found, transpose)
    if not plan.recomputing:
        cache[gemm] = found
        if plan.stash is not None:
            plan.stash.weights[gemm] = found
    return found


def _with_transpose(w, transpose: bool):
    """``(w_fp8, w_fp8^T)`` with the transpose made from the FP8 data if it is missing
    (a cast made without one, e.g. under no_grad): the very same FP8 values."""
    if transpose and w[1] is None:
        if isinstance(w[0], (block_scaling.BlockScaledData, mx_scaling.MXFP8Data)):
            return w[0], w[0].t_contiguous()        # 2-D tiles: the transpose
        return w[0], quantize.transpose_fp8(w[0])
    return w


def _flag_selected(weight: torch.Tensor, plan: ForwardPlan, state, index: int,
                   dtype: torch.dtype, transpose: bool, cached):
    """The cached cast, refreshed in place where the skip flag is 0 (NOTE [Skip-update
    flag]); the fresh cast's amax is recorded only there."""
    keep = plan.skip_weight_update.reshape(()).to(weight.device) != 0
    if plan.blockwise:
        w, w_t = cached
        fresh, fresh_t = block_cast_for_role(plan.recipe, "fwd_weight", weight, dtype, True,
                                             w_t is not None, count_where=~keep,
                                             count_non_finite=not plan.recomputing)
        _keep_or_copy(keep, w, fresh)
        if w_t is not None:
            _keep_or_copy(keep, w_t, fresh_t)
        return _with_transpose((w, w_t), transpose)
    amax_value = quantize.amax(weight)
    if plan.delayed:
        scale = state.scale
        if plan.record_amax:
            slot = state.amax_history[0, index]
            slot.copy_(torch.where(keep, slot, torch.maximum(slot, amax_value)))
    else:
        q = plan.recipe.fp8_quant_fwd_weight
        if not plan.recomputing:
            non_finite_counter(weight.device).add_(~keep & ~torch.isfinite(amax_value))
        scale = quantize.current_scale(amax_value, dtype, q.power_2_scale, q.amax_epsilon)
        index = 0
    w, w_t = cached
    fresh, fresh_t = quantize.cast_transpose_unchecked(weight, scale, dtype, index, None, True,
                                                       w_t is not None)
    _keep_or_copy(keep, w, fresh)
    if w_t is not None:
        _keep_or_copy(keep, w_t, fresh_t)
    return _with_transpose((w, w_t), transpose)


def _keep_or_copy(keep: torch.Tensor, cached, fresh) -> None:
    """``cached := cached if keep else fresh``, in place, FP8 bits and ``scale_inv`` (of
    `Float8Data` or block-scaled `BlockScaledData`).
    The writes go through ``.data`` (no version-counter bump): the cache is a buffer
    that earlier micro-batches saved for backward, and keeping it changes nothing."""
    bits = cached.data.data.view(torch.uint8)
    bits.copy_(torch.where(keep, bits, fresh.data.view(torch.uint8)))
    for name in ("scale_inv", "global_scale_inv"):     # (the second: NVFP4 only)
        if hasattr(cached, name):
            kept = getattr(cached, name).data
            if kept.dtype.itemsize == 1:
                kept = kept.view(torch.uint8)
                kept.copy_(torch.where(keep, kept, getattr(fresh, name).view(torch.uint8)))
            else:
                kept.copy_(torch.where(keep, kept, getattr(fresh, name)))
