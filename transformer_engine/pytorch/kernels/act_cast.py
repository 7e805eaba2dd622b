"""The activation of te.LayerNormMLP writing FC2's FP8 input: one kernel reads FC1's
output, applies the activation (gated or not; NOTE [Same arithmetic] in
activations.py), rounds to the output dtype and, in the same pass, writes the FP8
copy, its transposed copy (FC2's wgrad operand) and the amax, and the high-precision
output only when asked for.

Delayed scaling: one launch (the scale is known; the amax is folded into the live
history slot). Current scaling: two launches, no host synchronisation: the first
computes the output's amax (partials, as `casts.current_cast`; it also writes the
high-precision output if asked for), the second recomputes the output, bit for bit
the same, and casts it with the scale of that amax.
"""

from __future__ import annotations

from typing import Optional

import torch

from .activations import activation_code
from .common import AVAILABLE, FP32_MAX, FP8_MAX, cast_outputs
from .launch import Launcher, aligned, int_spec

if AVAILABLE:
    import triton
    import triton.language as tl

    from .activations import act_fwd
    from .casts import finish_current_scale, partials_block
    from .common import (TL_FP8, fold_amax, round_to, saturate, store_fp8, tile_amax_bits,
                         to_fp8)

__all__ = ["act_cast"]

_TILE_M, _TILE_N, _WARPS = 64, 64, 4
# programs per launch, each looping over tiles: few enough for every program of a
# current-scaling cast to reduce all partial amaxes, and for few amax atomics
_PROGRAMS = 1024

if AVAILABLE:
    # rows and counts derived from them are not specialized on (one binary for every
    # number of rows)
    @triton.jit(do_not_specialize=["index", "partials", "M", "tiles", "programs"])
    def _act_cast_kernel(x_ptr, y_ptr, q_ptr, qt_ptr, scale_ptr, amax_ptr, index, scale_inv_ptr,
                         partial_ptr, partials, non_finite_ptr, amax_epsilon,
                         M, F, stride_xm, tiles_f, tiles, programs,
                         ACT: tl.constexpr, GATED: tl.constexpr, MODE: tl.constexpr,
                         WRITE_Y: tl.constexpr, WRITE_Q: tl.constexpr, WRITE_QT: tl.constexpr,
                         WRITE_AMAX: tl.constexpr, Y_DTYPE: tl.constexpr,
                         FP8_MAX: tl.constexpr, OUT_DTYPE: tl.constexpr,
                         EPSILON: tl.constexpr, POW2: tl.constexpr, COUNT: tl.constexpr,
                         FP32_MAX: tl.constexpr, BLOCK_P: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        # y [M, F] = act(x) (gated: act(x[:, :F]) * x[:, F:]). Program p takes tiles p,
        # p + programs, ... MODE 0: delayed (scale[index]; amax into amax[index]);
        # 1: current, first launch (partial amax; y if asked); 2: current, the cast.
        pid = tl.program_id(0)
        if MODE == 0:
            scale = tl.load(scale_ptr + index)
            if pid == 0:
                tl.store(scale_inv_ptr, tl.div_rn(1.0, scale))
        elif MODE == 2:
            scale = finish_current_scale(partial_ptr, partials, scale_inv_ptr, non_finite_ptr,
                                         amax_epsilon, pid == 0, FP8_MAX, EPSILON, POW2,
                                         COUNT, FP32_MAX, BLOCK_P)
        best = tl.full([], 0, tl.int32)
        for t0 in range(0, tiles, programs):
            t = t0 + pid                # past the last tile: all masked out
            rm = (t // tiles_f) * BLOCK_M + tl.arange(0, BLOCK_M)
            rn = (t % tiles_f) * BLOCK_N + tl.arange(0, BLOCK_N)
            rm64 = rm.to(tl.int64)
            rn64 = rn.to(tl.int64)
            mask = (rm[:, None] < M) & (rn[None, :] < F)
            offs = rm64[:, None] * stride_xm + rn64[None, :]
            a = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            y = act_fwd(a, ACT)
            if GATED:
                b = tl.load(x_ptr + offs + F, mask=mask, other=0.0).to(tl.float32)
                y = y * b
            y_out = round_to(y, Y_DTYPE)
            v = y_out.to(tl.float32)           # the value the unfused path casts
            if WRITE_Y:
                tl.store(y_ptr + rm64[:, None] * F + rn64[None, :], y_out, mask=mask)
            if MODE != 2:
                best = tl.maximum(best, tile_amax_bits(v, mask))
            if MODE != 1:
                q = to_fp8(saturate(v, scale, FP8_MAX), OUT_DTYPE)
                if WRITE_Q:     # NOTE [FP8 stores] in common.py
                    store_fp8(q_ptr + rm64[:, None] * F + rn64[None, :], q, mask)
                if WRITE_QT:
                    store_fp8(qt_ptr + rn64[None, :] * M + rm64[:, None], q, mask)
        if MODE == 0:
            if WRITE_AMAX:
                fold_amax(amax_ptr, index, best)
        elif MODE == 1:
            tl.store(partial_ptr.to(tl.pointer_type(tl.int32)) + pid, best)

    _launch = Launcher(_act_cast_kernel, enable_fp_fusion=False, enable_reflect_ftz=False)


def act_cast(x: torch.Tensor, activation: str, dtype: torch.dtype, *,
             scale: Optional[torch.Tensor] = None, index: int = 0,
             amax_history: Optional[torch.Tensor] = None, power_2_scale: bool = False,
             amax_epsilon: float = 0.0, non_finite: Optional[torch.Tensor] = None,
             write_y: bool = False, data: bool = True, transpose: bool = False,
             separate: bool = False):
    """``act(x)`` of a contiguous 2-D ``x [M, W]`` (``W = F``, or ``2F`` for a gated
    activation) in ``x.dtype``, cast to FP8 ``dtype`` in the same pass. Returns ``(y
    [M, F] or None, q [M, F] or None, q_t [F, M] or None, scale_inv [1])``.

    With ``scale`` (a float32 vector): delayed scaling with ``scale[index]``, the amax
    folded into ``amax_history``'s flat element ``index`` when given (one launch).
    Without: current scaling (``power_2_scale``, ``amax_epsilon`` and ``non_finite``
    as `casts.current_cast`; two launches). The FP8 bits are those of casting ``y``
    (NOTE [FP8 cast formula] in common.py)."""
    code, gated = activation_code(activation)
    m, w = x.shape
    f = w // 2 if gated else w
    device = x.device
    delayed = scale is not None
    tiles_f = -(-f // _TILE_N)
    tiles = -(-m // _TILE_M) * tiles_f
    programs = min(tiles, _PROGRAMS)
    y = torch.empty((m, f), dtype=x.dtype, device=device) if write_y else None
    q, q_t, scale_inv, partial = cast_outputs(m, f, dtype, device, data, transpose,
                                              scratch=0 if delayed else programs,
                                              separate=separate)
    if m == 0 or f == 0:
        if delayed:
            torch.reciprocal(scale[index:index + 1], out=scale_inv)
        else:
            scale_inv.fill_(1.0)
        return y, q, q_t, scale_inv
    has_amax = delayed and amax_history is not None
    count = non_finite is not None and not delayed
    epsilon = amax_epsilon > 0
    block_p = partials_block(programs)
    dummy = scale_inv
    spec = (x.dtype, dtype, code, gated, aligned(x), int_spec(f), int_spec(x.stride(0)),
            int_spec(tiles_f), data, transpose, epsilon, power_2_scale, count,
            count and aligned(non_finite), has_amax, delayed and aligned(scale),
            has_amax and aligned(amax_history))
    common = (x, y if write_y else dummy, q if data else dummy, q_t if transpose else dummy,
              scale if delayed else dummy, amax_history if has_amax else dummy, index,
              scale_inv, partial if not delayed else dummy, programs,
              non_finite if count else dummy, float(amax_epsilon), m, f, x.stride(0), tiles_f,
              tiles, programs, code, gated)
    # BLOCK_P (`casts.partials_block` of the row-dependent partial count) is read by the
    # cast launch only: the others get 1, the cast's key holds it
    tail = (has_amax, _tl_dtype(x.dtype), FP8_MAX[dtype], TL_FP8[dtype], epsilon,
            power_2_scale, count, FP32_MAX)
    if delayed:
        _launch((programs, 1, 1), _WARPS, (spec, 0, write_y), *common, 0, write_y, data,
                transpose, *tail, 1, _TILE_M, _TILE_N)
    else:
        _launch((programs, 1, 1), _WARPS, (spec, 1, write_y), *common, 1, write_y, False,
                False, *tail, 1, _TILE_M, _TILE_N)
        cast_args = (x, dummy) + common[2:]     # (the cast writes no y)
        _launch((programs, 1, 1), _WARPS, (spec, 2, block_p), *cast_args, 2, False, data,
                transpose, *tail, block_p, _TILE_M, _TILE_N)
    return y, q, q_t, scale_inv


def _tl_dtype(dtype: torch.dtype):
    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16,
            torch.float16: tl.float16}[dtype]
