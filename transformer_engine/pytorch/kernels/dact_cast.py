"""The backward of te.LayerNormMLP's activation writing FC1's FP8 output gradient: one
kernel reads FC1's output ``x`` and the activation's output gradient ``dy``, computes
``dx`` as torch's autograd does (NOTE [Same arithmetic] in activations.py), rounds it to
``x``'s dtype and, in the same pass, writes its FP8 copy (FC1's dgrad operand), the
transposed copy (FC1's wgrad operand), its amax and the partial column sums of FC1's
bias gradient; ``dx`` itself is never written.

Program ``(g, j)`` takes column tile ``j`` (for a gated activation: columns ``j`` of both
halves, ``da`` and ``db``) over row tiles ``g, g + G, ...``, so the bias gradient is
``G`` partial sums per column, added in a fixed order: deterministic, with no atomics.
Delayed scaling: one launch. Current scaling: two (the amax and the bias gradient;
then the cast, recomputing ``dx`` bit for bit), no host synchronisation.
"""

from __future__ import annotations

from typing import Optional

import torch

from .activations import activation_code
from .common import AVAILABLE, F32, FP32_MAX, FP8_MAX, cast_outputs
from .launch import Launcher, aligned, int_spec

if AVAILABLE:
    import triton
    import triton.language as tl

    from .activations import act_bwd, act_fwd
    from .casts import finish_current_scale, partials_block
    from .common import (TL_FP8, fold_amax, round_to, saturate, store_fp8, tile_amax_bits,
                         to_fp8)

__all__ = ["dact_cast"]

_TILE_M, _TILE_N, _WARPS = 64, 64, 4
_TARGET_PROGRAMS = 1024     # enough programs to fill a GPU; fewer row groups, fewer sums


if AVAILABLE:
    @triton.jit
    def _store_fp8(q_ptr, qt_ptr, v, scale, rm64, cols64, mask, M, W,
                   FP8_MAX: tl.constexpr, OUT_DTYPE: tl.constexpr, WRITE_Q: tl.constexpr,
                   WRITE_QT: tl.constexpr):
        q = to_fp8(saturate(v, scale, FP8_MAX), OUT_DTYPE)
        if WRITE_Q:     # NOTE [FP8 stores] in common.py
            store_fp8(q_ptr + rm64[:, None] * W + cols64[None, :], q, mask)
        if WRITE_QT:
            store_fp8(qt_ptr + cols64[None, :] * M + rm64[:, None], q, mask)

    # rows and counts derived from them are not specialized on (one binary for every
    # number of rows)
    @triton.jit(do_not_specialize=["index", "partials", "M", "groups"])
    def _dact_cast_kernel(x_ptr, dy_ptr, q_ptr, qt_ptr, dbias_ptr, scale_ptr, amax_ptr, index,
                          scale_inv_ptr, partial_ptr, partials, non_finite_ptr, amax_epsilon,
                          M, F, stride_xm, stride_dym, groups,
                          ACT: tl.constexpr, GATED: tl.constexpr, MODE: tl.constexpr,
                          WRITE_Q: tl.constexpr, WRITE_QT: tl.constexpr,
                          WRITE_AMAX: tl.constexpr, DBIAS: tl.constexpr,
                          X_DTYPE: tl.constexpr, FP8_MAX: tl.constexpr,
                          OUT_DTYPE: tl.constexpr, EPSILON: tl.constexpr, POW2: tl.constexpr,
                          COUNT: tl.constexpr, FP32_MAX: tl.constexpr, BLOCK_P: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        # MODE 0: delayed (scale[index]; amax into amax[index]); 1: current, first
        # launch (partial amax, bias-gradient sums); 2: current, the cast.
        g = tl.program_id(0)
        j = tl.program_id(1)
        if GATED:
            W = 2 * F
        else:
            W = F
        if MODE == 0:
            scale = tl.load(scale_ptr + index)
            if (g == 0) & (j == 0):
                tl.store(scale_inv_ptr, tl.div_rn(1.0, scale))
        elif MODE == 2:
            # one program of the 2-D grid writes scale_inv and counts
            scale = finish_current_scale(partial_ptr, partials, scale_inv_ptr, non_finite_ptr,
                                         amax_epsilon, (g == 0) & (j == 0), FP8_MAX, EPSILON, POW2,
                                         COUNT, FP32_MAX, BLOCK_P)
        rn = j * BLOCK_N + tl.arange(0, BLOCK_N)
        rn64 = rn.to(tl.int64)
        cmask = rn < F
        best = tl.full([], 0, tl.int32)
        sum_a = tl.zeros([BLOCK_N], dtype=tl.float32)
        sum_b = tl.zeros([BLOCK_N], dtype=tl.float32)
        for r0 in range(0, M, groups * BLOCK_M):
            rm = r0 + g * BLOCK_M + tl.arange(0, BLOCK_M)
            rm64 = rm.to(tl.int64)
            mask = (rm[:, None] < M) & cmask[None, :]
            xo = rm64[:, None] * stride_xm + rn64[None, :]
            a = tl.load(x_ptr + xo, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + rm64[:, None] * stride_dym + rn64[None, :], mask=mask,
                         other=0.0).to(tl.float32)
            if GATED:
                b = tl.load(x_ptr + xo + F, mask=mask, other=0.0).to(tl.float32)
                db = round_to(dy * act_fwd(a, ACT), X_DTYPE).to(tl.float32)
                da = round_to(act_bwd(dy * b, a, ACT), X_DTYPE).to(tl.float32)
            else:
                da = round_to(act_bwd(dy, a, ACT), X_DTYPE).to(tl.float32)
            if MODE != 2:
                best = tl.maximum(best, tile_amax_bits(da, mask))
                if GATED:
                    best = tl.maximum(best, tile_amax_bits(db, mask))
                if DBIAS:
                    sum_a += tl.sum(tl.where(mask, da, 0.0), axis=0)
                    if GATED:
                        sum_b += tl.sum(tl.where(mask, db, 0.0), axis=0)
            if MODE != 1:
                _store_fp8(q_ptr, qt_ptr, da, scale, rm64, rn64, mask, M, W, FP8_MAX,
                           OUT_DTYPE, WRITE_Q, WRITE_QT)
                if GATED:
                    _store_fp8(q_ptr, qt_ptr, db, scale, rm64, rn64 + F, mask, M, W, FP8_MAX,
                               OUT_DTYPE, WRITE_Q, WRITE_QT)
        if MODE != 2:
            if DBIAS:
                row = dbias_ptr + g.to(tl.int64) * W
                tl.store(row + rn64, sum_a, mask=cmask)
                if GATED:
                    tl.store(row + F + rn64, sum_b, mask=cmask)
            if MODE == 0:
                if WRITE_AMAX:
                    fold_amax(amax_ptr, index, best)
            else:
                tl.store(partial_ptr.to(tl.pointer_type(tl.int32)) + g * tl.cdiv(F, BLOCK_N) + j,
                         best)

    _launch = Launcher(_dact_cast_kernel, enable_fp_fusion=False, enable_reflect_ftz=False)


def row_groups(m: int, column_tiles: int) -> int:
    """How many row groups (programs per column tile) a ``[m, ...]`` gradient gets."""
    row_tiles = -(-m // _TILE_M)
    return max(1, min(row_tiles, _TARGET_PROGRAMS // max(column_tiles, 1)))


def dact_cast(x: torch.Tensor, dy: torch.Tensor, activation: str, dtype: torch.dtype, *,
              scale: Optional[torch.Tensor] = None, index: int = 0,
              amax_history: Optional[torch.Tensor] = None, power_2_scale: bool = False,
              amax_epsilon: float = 0.0, non_finite: Optional[torch.Tensor] = None,
              data: bool = True, transpose: bool = False,
              dbias_dtype: Optional[torch.dtype] = None, separate: bool = False):
    """The gradient ``dx [M, W]`` of ``act(x)`` for ``dy [M, F]`` (``W = F``, or ``2F``
    gated; both 2-D with unit column stride), in ``x.dtype``, cast to FP8 ``dtype``.
    Returns ``(q [M, W] or None, q_t [W, M] or None, scale_inv [1], dbias [W] or None)``;
    ``dbias`` (with ``dbias_dtype``) is ``dx``'s column sum, accumulated in float32
    and rounded once; like torch's sum it adds onto +0 (masked rows add +0), so a
    column whose every gradient is -0 sums to +0, and one row's is ``dx + 0.0``.
    Scaling arguments as `act_cast.act_cast`."""
    code, gated = activation_code(activation)
    m, w = x.shape
    f = w // 2 if gated else w
    device = x.device
    delayed = scale is not None
    tiles_f = -(-f // _TILE_N)
    groups = row_groups(m, tiles_f)
    partials = groups * tiles_f
    q, q_t, scale_inv, partial = cast_outputs(m, w, dtype, device, data, transpose,
                                              scratch=0 if delayed else partials,
                                              separate=separate)
    want_dbias = dbias_dtype is not None
    if m == 0:
        if delayed:
            torch.reciprocal(scale[index:index + 1], out=scale_inv)
        else:
            scale_inv.fill_(1.0)
        dbias = torch.zeros(w, dtype=dbias_dtype, device=device) if want_dbias else None
        return q, q_t, scale_inv, dbias
    sums = torch.empty((groups, w), dtype=F32, device=device) if want_dbias else None
    has_amax = delayed and amax_history is not None
    count = non_finite is not None and not delayed
    epsilon = amax_epsilon > 0
    block_p = partials_block(partials)
    dummy = scale_inv
    spec = (x.dtype, dy.dtype, dtype, code, gated, aligned(x), aligned(dy), int_spec(f),
            int_spec(x.stride(0)), int_spec(dy.stride(0)), data, transpose, want_dbias, epsilon,
            power_2_scale, count, count and aligned(non_finite), has_amax,
            delayed and aligned(scale), has_amax and aligned(amax_history))
    common = (x, dy, q if data else dummy, q_t if transpose else dummy,
              sums if want_dbias else dummy, scale if delayed else dummy,
              amax_history if has_amax else dummy, index, scale_inv,
              partial if not delayed else dummy, partials, non_finite if count else dummy,
              float(amax_epsilon), m, f, x.stride(0), dy.stride(0), groups, code, gated)
    # BLOCK_P (`casts.partials_block` of the row-dependent partial count) is read by the
    # cast launch only: the others get 1, the cast's key holds it
    tail = (_tl_dtype(x.dtype), FP8_MAX[dtype], TL_FP8[dtype], epsilon, power_2_scale, count,
            FP32_MAX)
    grid = (groups, tiles_f, 1)
    if delayed:
        _launch(grid, _WARPS, (spec, 0), *common, 0, data, transpose, has_amax, want_dbias,
                *tail, 1, _TILE_M, _TILE_N)
    else:
        _launch(grid, _WARPS, (spec, 1), *common, 1, False, False, has_amax, want_dbias,
                *tail, 1, _TILE_M, _TILE_N)
        _launch(grid, _WARPS, (spec, 2, block_p), *common, 2, data, transpose, has_amax, False,
                *tail, block_p, _TILE_M, _TILE_N)
    dbias = None
    if want_dbias:
        total = sums[0] if groups == 1 else sums.sum(0)
        dbias = total if dbias_dtype == F32 else total.to(dbias_dtype)
    return q, q_t, scale_inv, dbias


def _tl_dtype(dtype: torch.dtype):
    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16,
            torch.float16: tl.float16}[dtype]
