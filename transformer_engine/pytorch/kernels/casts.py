"""Triton kernels for FP8 casts on CUDA: the cast (one pass over a tensor that records
its amax, casts it to FP8 with a given scale and writes the row-major and/or the
transposed FP8 copy), the current-scaling cast (amax, scale and cast in two launches,
no host synchronisation), the amax and the FP8 transpose. The module `quantize.py`
hands out: it also carries the delayed-scaling update of many states in one launch
(scale_update.py) and the block-scaled cast of Float8BlockScaling (block_cast.py).

Imported lazily by `quantize.py`, only for CUDA tensors and only when Triton
imports; the CPU path never loads this package. The kernels compute exactly what the
torch reference path in `quantize.py` computes (bit for bit; NOTE [FP8 cast formula]
in common.py), and ``scale_inv = 1 / scale`` with IEEE rounding (``div_rn``), written by
one program, as ``torch.reciprocal`` does.

Launches go through `launch.py` (NOTE [Launch overhead]).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

# the block-scaled cast and the delayed-scaling update: reached through this module,
# the one `quantize.fused_kernels` hands out
from .block_cast import block_cast  # noqa: F401
from .common import AVAILABLE, FP32_MAX as _FP32_MAX, FP8_MAX as _FP8_MAX, cast_outputs
from .launch import (DIRECT_LAUNCH_TRITON_VERSIONS, Launcher, aligned,
                     direct_launch_supported, int_spec)
from .scale_update import delayed_update_  # noqa: F401

if AVAILABLE:
    import triton
    import triton.language as tl

    from .common import (TL_FP8 as _TL_FP8, abs_bits, current_scale, fold_amax, saturate,
                         store_fp8, tile_amax_bits, to_fp8)

__all__ = ["AVAILABLE", "cast_transpose", "cast_pair", "current_cast", "amax", "delayed_update_",
           "block_cast", "transpose", "direct_launch_supported", "DIRECT_LAUNCH_TRITON_VERSIONS"]

# One tile per program. Picked by timing on an H200 (benchmarks/bench_linear.py --tune).
_TILE_M, _TILE_N, _WARPS = 64, 64, 4
_AMAX_BLOCK, _AMAX_WARPS = 4096, 8
# Current scaling: at most this many programs per launch, each looping over tiles, so
# that every program of the cast can reduce all partial amaxes cheaply.
_CURRENT_PROGRAMS = 1024

if AVAILABLE:
    @triton.jit
    def _cast_tile(x_ptr, scale_ptr, q_ptr, qt_ptr, amax_ptr, scale_inv_ptr, index,
                   M, N, stride_xm, stride_xn, pid_m, pid_n,
                   FP8_MAX: tl.constexpr, OUT_DTYPE: tl.constexpr, WRITE_Q: tl.constexpr,
                   WRITE_QT: tl.constexpr, WRITE_AMAX: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        # Tile (pid_m, pid_n) of x [M, N]: amax folded into amax[index], FP8 values
        # into q and/or (transposed) qt; tile (0, 0) writes scale_inv.
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm64 = rm.to(tl.int64)
        rn64 = rn.to(tl.int64)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        x = tl.load(x_ptr + rm64[:, None] * stride_xm + rn64[None, :] * stride_xn,
                    mask=mask, other=0.0).to(tl.float32)
        scale = tl.load(scale_ptr + index)
        if WRITE_AMAX:
            fold_amax(amax_ptr, index, tl.max(tl.max(abs_bits(x), axis=1), axis=0))
        if WRITE_Q:         # FP8 data through store_fp8 only (NOTE [FP8 stores])
            store_fp8(q_ptr + rm64[:, None] * N + rn64[None, :],
                      to_fp8(saturate(x, scale, FP8_MAX), OUT_DTYPE), mask)
        if WRITE_QT:
            # The transposed tile is loaded again in transposed order (a hit in L2) and
            # cast the same way, rather than transposed in registers: on an H200 with
            # Triton 3.6, tl.trans of the tile before the store wrote wrong rows.
            mask_t = (rn[:, None] < N) & (rm[None, :] < M)
            xt = tl.load(x_ptr + rn64[:, None] * stride_xn + rm64[None, :] * stride_xm,
                         mask=mask_t, other=0.0).to(tl.float32)
            store_fp8(qt_ptr + rn64[:, None] * M + rm64[None, :],
                      to_fp8(saturate(xt, scale, FP8_MAX), OUT_DTYPE), mask_t)
        if (pid_m == 0) & (pid_n == 0):
            tl.store(scale_inv_ptr, tl.div_rn(1.0, scale))   # IEEE-rounded

    # The row count is not specialized on: Triton 3.6 specializes M == 1 (a one-row
    # cast) into a lowering whose PTX reads registers it never writes, which the
    # ptxas it ships miscompiles (NOTE [FP8 stores] in common.py)
    @triton.jit(do_not_specialize=["M"])
    def _cast_transpose_kernel(x_ptr, scale_ptr, q_ptr, qt_ptr, amax_ptr, scale_inv_ptr, index,
                               M, N, stride_xm, stride_xn,
                               FP8_MAX: tl.constexpr, OUT_DTYPE: tl.constexpr,
                               WRITE_Q: tl.constexpr, WRITE_QT: tl.constexpr,
                               WRITE_AMAX: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        _cast_tile(x_ptr, scale_ptr, q_ptr, qt_ptr, amax_ptr, scale_inv_ptr, index, M, N,
                   stride_xm, stride_xn, tl.program_id(0), tl.program_id(1), FP8_MAX,
                   OUT_DTYPE, WRITE_Q, WRITE_QT, WRITE_AMAX, BLOCK_M, BLOCK_N)

    @triton.jit(do_not_specialize=["MA", "MB"])     # as _cast_transpose_kernel
    def _cast_pair_kernel(a_ptr, b_ptr, scale_ptr, qa_ptr, qta_ptr, qb_ptr, qtb_ptr, amax_ptr,
                          scale_inv_a_ptr, scale_inv_b_ptr, index_a, index_b,
                          MA, NA, stride_am, stride_an, MB, NB, stride_bm, stride_bn,
                          FP8_MAX: tl.constexpr, OUT_DTYPE: tl.constexpr,
                          WRITE_QTA: tl.constexpr, WRITE_QTB: tl.constexpr,
                          WRITE_AMAX: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        # A 1-D grid: the first tiles(a) programs cast a's tiles, the rest b's.
        pid = tl.program_id(0)
        tiles_an = tl.cdiv(NA, BLOCK_N)
        programs_a = tl.cdiv(MA, BLOCK_M) * tiles_an
        if pid < programs_a:
            _cast_tile(a_ptr, scale_ptr, qa_ptr, qta_ptr, amax_ptr, scale_inv_a_ptr, index_a,
                       MA, NA, stride_am, stride_an, pid // tiles_an, pid % tiles_an,
                       FP8_MAX, OUT_DTYPE, True, WRITE_QTA, WRITE_AMAX, BLOCK_M, BLOCK_N)
        else:
            p = pid - programs_a
            tiles_bn = tl.cdiv(NB, BLOCK_N)
            _cast_tile(b_ptr, scale_ptr, qb_ptr, qtb_ptr, amax_ptr, scale_inv_b_ptr, index_b,
                       MB, NB, stride_bm, stride_bn, p // tiles_bn, p % tiles_bn,
                       FP8_MAX, OUT_DTYPE, True, WRITE_QTB, WRITE_AMAX, BLOCK_M, BLOCK_N)

    @triton.jit
    def _amax_kernel(x_ptr, out_ptr, numel, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < numel, other=0.0).to(tl.float32)
        tl.atomic_max(out_ptr, tl.max(abs_bits(x), axis=0))


if AVAILABLE:
    _launch_cast = Launcher(_cast_transpose_kernel)
    _launch_cast_pair = Launcher(_cast_pair_kernel)
    _launch_amax = Launcher(_amax_kernel)


def _set_tiles(tile_m: int, tile_n: int, warps: int) -> Tuple[int, int, int]:
    """Change the cast tile (for tuning runs); returns the previous setting."""
    global _TILE_M, _TILE_N, _WARPS
    old = (_TILE_M, _TILE_N, _WARPS)
    _TILE_M, _TILE_N, _WARPS = tile_m, tile_n, warps
    return old


def _cast_operand(x: torch.Tensor, dtype: torch.dtype, data: bool, transpose: bool,
                  separate: bool = False):
    """The outputs of casting a 2-D ``x`` (``q`` / ``q_t`` as asked for, a fresh
    ``scale_inv``) and the part of the launch key ``x`` decides (NOTE [Launch
    overhead]): its dtype, alignment, and its shape's and strides' specializations."""
    m, n = x.shape
    sm, sn = x.stride()
    q, q_t, scale_inv, _ = cast_outputs(m, n, dtype, x.device, data, transpose,
                                        separate=separate)
    spec = (x.dtype, aligned(x), int_spec(n), int_spec(sm), int_spec(sn))    # M: any
    return q, q_t, scale_inv, spec


def _tiles(x: torch.Tensor) -> Tuple[int, int]:
    m, n = x.shape
    return -(-m // _TILE_M), -(-n // _TILE_N)


def cast_transpose(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, *, index: int = 0,
                   amax_history: Optional[torch.Tensor] = None, data: bool = True,
                   transpose: bool = False, separate: bool = False):
    """Cast a 2-D CUDA tensor ``x [M, N]`` to FP8 with ``scale[index]`` in one pass.
    Returns ``(q [M, N] or None, q_t [N, M] or None, scale_inv [1])``.

    ``amax_history``: a contiguous float32 tensor whose flat element ``index`` (row
    0, column ``index`` of an ``[L, n]`` history) ``max|x|`` is folded into. The
    caller (`quantize.py`) has checked devices, dtypes, contiguity and shapes.
    """
    q, q_t, scale_inv, spec = _cast_operand(x, dtype, data, transpose, separate)
    has_amax = amax_history is not None
    key = (spec, dtype, data, transpose, has_amax, aligned(scale),
           has_amax and aligned(amax_history), int_spec(index), _TILE_M, _TILE_N, _WARPS)
    m, n = x.shape
    _launch_cast((*_tiles(x), 1), _WARPS, key,
                 x, scale, q if data else scale_inv, q_t if transpose else scale_inv,
                 amax_history if has_amax else scale_inv, scale_inv, index, m, n, *x.stride(),
                 _FP8_MAX[dtype], _TL_FP8[dtype], data, transpose, has_amax,
                 _TILE_M, _TILE_N)
    return q, q_t, scale_inv


def cast_pair(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
              index_a: int, index_b: int, amax_history: Optional[torch.Tensor],
              transpose_a: bool, transpose_b: bool):
    """`cast_transpose` of two 2-D CUDA tensors with the same scale vector and amax
    history (a GEMM's two forward operands, slots ``index_a`` and ``index_b``) in one
    launch, the same bits: ``((qa, qa_t or None, scale_inv_a), (qb, qb_t or None,
    scale_inv_b))``. The caller has checked what it checks for `cast_transpose`."""
    qa, qa_t, inv_a, spec_a = _cast_operand(a, dtype, True, transpose_a)
    qb, qb_t, inv_b, spec_b = _cast_operand(b, dtype, True, transpose_b)
    has_amax = amax_history is not None
    key = (spec_a, spec_b, dtype, transpose_a, transpose_b, has_amax, aligned(scale),
           has_amax and aligned(amax_history), int_spec(index_a), int_spec(index_b),
           _TILE_M, _TILE_N, _WARPS)
    (tam, tan), (tbm, tbn) = _tiles(a), _tiles(b)
    _launch_cast_pair((tam * tan + tbm * tbn, 1, 1), _WARPS, key, a, b, scale, qa,
                      qa_t if transpose_a else qa, qb, qb_t if transpose_b else qb,
                      amax_history if has_amax else inv_a, inv_a, inv_b, index_a, index_b,
                      *a.shape, *a.stride(), *b.shape, *b.stride(), _FP8_MAX[dtype],
                      _TL_FP8[dtype], transpose_a, transpose_b, has_amax, _TILE_M, _TILE_N)
    return (qa, qa_t, inv_a), (qb, qb_t, inv_b)


if AVAILABLE:
    @triton.jit
    def _partial_amax_kernel(x_ptr, partial_ptr, M, N, stride_xm, stride_xn, tiles_n, tiles,
                             programs, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        # Launch 1 of a current-scaling cast: program p folds tiles p, p + P, ... of
        # x [M, N] into partial[p], the int32 `abs_bits` maximum (no zeroed buffer to
        # prepare, nothing atomic: the cast reduces the P partials).
        pid = tl.program_id(0)
        best = tl.full([], 0, tl.int32)
        for t0 in range(0, tiles, programs):
            t = t0 + pid                # past the last tile: all masked out
            rm = (t // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
            rn = (t % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
            mask = (rm[:, None] < M) & (rn[None, :] < N)
            x = tl.load(x_ptr + rm.to(tl.int64)[:, None] * stride_xm
                        + rn.to(tl.int64)[None, :] * stride_xn, mask=mask, other=0.0)
            best = tl.maximum(best, tile_amax_bits(x.to(tl.float32), mask))
        tl.store(partial_ptr.to(tl.pointer_type(tl.int32)) + pid, best)

    @triton.jit
    def reduce_partials(partial_ptr, partials, BLOCK_P: tl.constexpr):
        """The float32 amax of ``partials`` int32 `abs_bits` partial maxima."""
        offs = tl.arange(0, BLOCK_P)
        bits = tl.load(partial_ptr.to(tl.pointer_type(tl.int32)) + offs, mask=offs < partials,
                       other=0)
        return tl.max(bits, axis=0).to(tl.float32, bitcast=True)

    @triton.jit
    def finish_current_scale(partial_ptr, partials, scale_inv_ptr, non_finite_ptr,
                             amax_epsilon, first, FP8_MAX: tl.constexpr, EPSILON: tl.constexpr,
                             POW2: tl.constexpr, COUNT: tl.constexpr, FP32_MAX: tl.constexpr,
                             BLOCK_P: tl.constexpr):
        """The scale of a current-scaling cast from the partial amaxes of its first
        launch; the one program for which ``first`` holds writes ``scale_inv`` and
        counts a non-finite amax."""
        amax = reduce_partials(partial_ptr, partials, BLOCK_P)
        scale = current_scale(amax, amax_epsilon, FP8_MAX, EPSILON, POW2, FP32_MAX)
        if first:
            tl.store(scale_inv_ptr, tl.div_rn(1.0, scale))
            if COUNT:
                tl.atomic_add(non_finite_ptr, ((amax > FP32_MAX) | (amax != amax)).to(tl.int32))
        return scale

    @triton.jit(do_not_specialize=["M"])            # as _cast_transpose_kernel
    def _current_cast_kernel(x_ptr, q_ptr, qt_ptr, partial_ptr, partials, scale_inv_ptr,
                             non_finite_ptr, amax_epsilon, M, N, stride_xm, stride_xn,
                             tiles_n, tiles,
                             FP8_MAX: tl.constexpr, OUT_DTYPE: tl.constexpr,
                             WRITE_Q: tl.constexpr, WRITE_QT: tl.constexpr,
                             EPSILON: tl.constexpr, POW2: tl.constexpr, COUNT: tl.constexpr,
                             FP32_MAX: tl.constexpr, BLOCK_P: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        # Launch 2, with as many programs as launch 1 had (``partials``): every program
        # reduces the partials to the amax and the scale (`quantize.current_scale`),
        # then casts tiles p, p + P, ... as `_cast_tile` does.
        scale = finish_current_scale(partial_ptr, partials, scale_inv_ptr, non_finite_ptr,
                                     amax_epsilon, tl.program_id(0) == 0, FP8_MAX, EPSILON,
                                     POW2, COUNT, FP32_MAX, BLOCK_P)
        for t0 in range(0, tiles, partials):
            t = t0 + tl.program_id(0)   # past the last tile: all masked out
            rm = (t // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
            rn = (t % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
            rm64 = rm.to(tl.int64)
            rn64 = rn.to(tl.int64)
            if WRITE_Q:
                mask = (rm[:, None] < M) & (rn[None, :] < N)
                x = tl.load(x_ptr + rm64[:, None] * stride_xm + rn64[None, :] * stride_xn,
                            mask=mask, other=0.0).to(tl.float32)
                store_fp8(q_ptr + rm64[:, None] * N + rn64[None, :],
                          to_fp8(saturate(x, scale, FP8_MAX), OUT_DTYPE), mask)
            if WRITE_QT:        # loaded in transposed order, as in _cast_tile
                mask_t = (rn[:, None] < N) & (rm[None, :] < M)
                xt = tl.load(x_ptr + rn64[:, None] * stride_xn + rm64[None, :] * stride_xm,
                             mask=mask_t, other=0.0).to(tl.float32)
                store_fp8(qt_ptr + rn64[:, None] * M + rm64[None, :],
                          to_fp8(saturate(xt, scale, FP8_MAX), OUT_DTYPE), mask_t)

    _launch_partial_amax = Launcher(_partial_amax_kernel)
    _launch_current_cast = Launcher(_current_cast_kernel)


# The cast launch of a current-scaling cast reduces the partial amaxes in a block of at
# least this many lanes (masked past the count): one binary for every partial count up
# to it, not one per power of two of the row count.
_PARTIALS_BLOCK = 1024


def partials_block(partials: int) -> int:
    """BLOCK_P (a constexpr) of a cast launch that reduces ``partials`` partial amaxes."""
    if partials <= _PARTIALS_BLOCK:     # (Triton's next_power_of_2 is slow to call)
        return _PARTIALS_BLOCK
    return triton.next_power_of_2(partials)


def current_programs(tiles: int) -> int:
    """Programs of each launch of a current-scaling cast over ``tiles`` tiles."""
    return min(tiles, _CURRENT_PROGRAMS)


def current_cast(x: torch.Tensor, dtype: torch.dtype, power_2_scale: bool, amax_epsilon: float,
                 non_finite: Optional[torch.Tensor], data: bool = True,
                 transpose: bool = False, separate: bool = False):
    """Current-scaling cast of a non-empty 2-D CUDA tensor ``x [M, N]`` (any strides):
    ``(q or None, q_t or None, scale_inv [1])``, the bits of `quantize.amax`, then
    `quantize.current_scale` (``non_finite``, an int32 scalar, counts a NaN or
    infinite amax), then the cast. Two launches (partial amaxes; scale and cast), no
    host synchronisation; the outputs and the partials share one allocation
    (`cast_outputs`)."""
    m, n = x.shape
    sm, sn = x.stride()
    tiles_m, tiles_n = _tiles(x)
    tiles = tiles_m * tiles_n
    programs = current_programs(tiles)
    q, q_t, scale_inv, partial = cast_outputs(m, n, dtype, x.device, data, transpose,
                                              scratch=programs, separate=separate)
    spec = (x.dtype, aligned(x), int_spec(m), int_spec(n), int_spec(sm), int_spec(sn),
            int_spec(tiles_n), int_spec(tiles), int_spec(programs))
    _launch_partial_amax((programs, 1, 1), _WARPS, (spec, _TILE_M, _TILE_N, _WARPS),
                         x, partial, m, n, sm, sn, tiles_n, tiles, programs, _TILE_M, _TILE_N)
    count = non_finite is not None
    epsilon = amax_epsilon > 0
    block_p = partials_block(programs)
    key = (spec, dtype, data, transpose, epsilon, power_2_scale, count,
           count and aligned(non_finite), block_p, _TILE_M, _TILE_N, _WARPS)
    _launch_current_cast((programs, 1, 1), _WARPS, key, x, q if data else scale_inv,
                         q_t if transpose else scale_inv, partial, programs, scale_inv,
                         non_finite if count else scale_inv, float(amax_epsilon), m, n, sm, sn,
                         tiles_n, tiles, _FP8_MAX[dtype], _TL_FP8[dtype], data, transpose,
                         epsilon, power_2_scale, count, _FP32_MAX, block_p, _TILE_M, _TILE_N)
    return q, q_t, scale_inv


if AVAILABLE:
    @triton.jit
    def _transpose_kernel(x_ptr, y_ptr, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        # y [N, M] = x [M, N]^T, bytes; the tile is read in transposed order, as the
        # cast kernel's transposed copy is
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rm64 = rm.to(tl.int64)
        rn64 = rn.to(tl.int64)
        mask = (rn[:, None] < N) & (rm[None, :] < M)
        v = tl.load(x_ptr + rm64[None, :] * N + rn64[:, None], mask=mask)
        tl.store(y_ptr + rn64[:, None] * M + rm64[None, :], v, mask=mask)

    _launch_transpose = Launcher(_transpose_kernel)


def transpose(x: torch.Tensor) -> torch.Tensor:
    """``x.t().contiguous()`` of a contiguous, non-empty 2-D CUDA tensor of one-byte
    elements (FP8 data), bit for bit, in one pass (torch's copy of the transposed view
    runs at a fraction of the bandwidth there)."""
    m, n = x.shape
    y = torch.empty((n, m), dtype=x.dtype, device=x.device)
    xb, yb = x.view(torch.uint8), y.view(torch.uint8)
    key = (aligned(x), aligned(y), int_spec(m), int_spec(n), _TILE_M, _TILE_N, _WARPS)
    _launch_transpose((-(-m // _TILE_M), -(-n // _TILE_N), 1), _WARPS, key, xb, yb, m, n,
                      _TILE_M, _TILE_N)
    return y


def amax(x: torch.Tensor) -> torch.Tensor:
    """``max|x|`` of a contiguous, non-empty CUDA tensor as a float32 scalar tensor."""
    out = torch.zeros((), dtype=torch.int32, device=x.device)
    numel = x.numel()
    _launch_amax((-(-numel // _AMAX_BLOCK), 1, 1), _AMAX_WARPS,
                 (x.dtype, aligned(x), int_spec(numel)), x, out, numel, _AMAX_BLOCK)
    return out.view(torch.float32)
