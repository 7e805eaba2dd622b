"""Triton kernels for FP8 on CUDA: the cast (one pass over a tensor that records its
amax, casts it to FP8 with a given scale and writes the row-major and/or the
transposed FP8 copy), the amax, and the delayed-scaling update of many tensors in
one launch.

Imported lazily by `quantize.py`, only for CUDA tensors and only when Triton
imports; the CPU path never loads this file. The kernels compute exactly what the
torch reference path in `quantize.py` computes (bit for bit):

- amax: ``max|x|`` before scaling, as float32. It is reduced on the float32 *bit
  patterns* with the sign bit cleared: for non-negative floats integer order is
  float order and every NaN sorts above +inf, so a NaN propagates as torch's
  ``amax`` does, and the fold into the history slot is an integer ``atomic_max``
  (the slot holds a non-negative float or NaN, never a negative value).
- cast: ``fp8(clamp(float32(x) * scale, -max, max))`` with round-to-nearest-even,
  NaN kept (the clamp propagates NaN like ``torch.clamp``).
- ``scale_inv = 1 / scale`` with IEEE rounding (``div_rn``), written by one program
  into a fresh tensor, as ``torch.reciprocal`` does.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None

AVAILABLE = triton is not None

__all__ = ["AVAILABLE", "cast_transpose", "amax", "delayed_update"]

# One tile per program. Picked by timing on an H200 (benchmarks/bench_linear.py --tune).
_TILE_M, _TILE_N, _WARPS = 64, 64, 4
_AMAX_BLOCK, _AMAX_WARPS = 4096, 8
_UPDATE_BLOCK_L, _UPDATE_BLOCK_N = 64, 32

if AVAILABLE:
    _TL_FP8 = {torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5}

    @triton.jit
    def _cast_transpose_kernel(x_ptr, scale_ptr, q_ptr, qt_ptr, amax_ptr, scale_inv_ptr, index,
                               M, N, stride_xm, stride_xn,
                               FP8_MAX: tl.constexpr, OUT_DTYPE: tl.constexpr,
                               WRITE_Q: tl.constexpr, WRITE_QT: tl.constexpr,
                               WRITE_AMAX: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm64 = rm.to(tl.int64)
        rn64 = rn.to(tl.int64)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        x = tl.load(x_ptr + rm64[:, None] * stride_xm + rn64[None, :] * stride_xn,
                    mask=mask, other=0.0).to(tl.float32)
        scale = tl.load(scale_ptr + index)
        if WRITE_AMAX:
            bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
            tl.atomic_max(amax_ptr.to(tl.pointer_type(tl.int32)) + index,
                          tl.max(tl.max(bits, axis=1), axis=0))
        y = tl.clamp(x * scale, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
        if WRITE_Q:
            tl.store(q_ptr + rm64[:, None] * N + rn64[None, :], y.to(OUT_DTYPE), mask=mask)
        if WRITE_QT:
            # The transposed tile is loaded again in transposed order (a hit in L2) and
            # cast the same way, rather than transposed in registers: on an H200 with
            # Triton 3.6, tl.trans of the tile before the store wrote wrong rows.
            mask_t = (rn[:, None] < N) & (rm[None, :] < M)
            xt = tl.load(x_ptr + rn64[:, None] * stride_xn + rm64[None, :] * stride_xm,
                         mask=mask_t, other=0.0).to(tl.float32)
            yt = tl.clamp(xt * scale, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
            tl.store(qt_ptr + rn64[:, None] * M + rm64[None, :], yt.to(OUT_DTYPE), mask=mask_t)
        if (pid_m == 0) & (pid_n == 0):
            tl.store(scale_inv_ptr, tl.div_rn(1.0, scale))   # IEEE-rounded

    @triton.jit
    def _max_nan(a, b):
        """max that propagates NaN, as torch.amax does."""
        return tl.where((a > b) | (a != a), a, b)

    @triton.jit
    def _delayed_update_kernel(hist_ptr, scale_ptr, new_hist_ptr, new_scale_ptr,
                               new_scale_inv_ptr, n, max_value, margin_factor, L: tl.constexpr,
                               ALGO_MAX: tl.constexpr, BLOCK_L: tl.constexpr,
                               BLOCK_N: tl.constexpr, FP32_MAX: tl.constexpr):
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < n
        amax = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for r0 in range(0, L, BLOCK_L):
            rows = r0 + tl.arange(0, BLOCK_L)
            m = (rows[:, None] < L) & cmask[None, :]
            h = tl.load(hist_ptr + rows[:, None] * n + cols[None, :], mask=m, other=0.0)
            if ALGO_MAX:
                amax = _max_nan(amax, tl.reduce(h, 0, _max_nan))
            # roll by one row (old row r -> new row r - 1, row 0 -> row L - 1), then
            # zero the new live row 0
            dst = (rows + L - 1) % L
            tl.store(new_hist_ptr + dst[:, None] * n + cols[None, :],
                     tl.where(dst[:, None] == 0, 0.0, h), mask=m)
        if not ALGO_MAX:
            amax = tl.load(hist_ptr + cols, mask=cmask, other=0.0)
        old = tl.load(scale_ptr + cols, mask=cmask, other=1.0)
        # as the torch formula computes it: reciprocal(amax) * max, then / 2**margin
        new = tl.div_rn(1.0, amax) * max_value * margin_factor
        ok = (amax > 0) & (amax <= FP32_MAX)       # positive and finite (NaN fails both)
        new = tl.minimum(tl.where(ok, new, old), FP32_MAX, propagate_nan=tl.PropagateNan.ALL)
        tl.store(new_scale_ptr + cols, new, mask=cmask)
        tl.store(new_scale_inv_ptr + cols, tl.div_rn(1.0, new), mask=cmask)

    @triton.jit
    def _amax_kernel(x_ptr, out_ptr, numel, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < numel, other=0.0).to(tl.float32)
        bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        tl.atomic_max(out_ptr, tl.max(bits, axis=0))


def _set_tiles(tile_m: int, tile_n: int, warps: int) -> Tuple[int, int, int]:
    """Change the cast tile (for tuning runs); returns the previous setting."""
    global _TILE_M, _TILE_N, _WARPS
    old = (_TILE_M, _TILE_N, _WARPS)
    _TILE_M, _TILE_N, _WARPS = tile_m, tile_n, warps
    return old


def cast_transpose(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, *, index: int = 0,
                   amax_history: Optional[torch.Tensor] = None, data: bool = True,
                   transpose: bool = False):
    """Cast a 2-D CUDA tensor ``x [M, N]`` to FP8 with ``scale[index]`` in one pass.
    Returns ``(q [M, N] or None, q_t [N, M] or None, scale_inv [1])``.

    ``amax_history``: a contiguous float32 tensor whose flat element ``index`` (row
    0, column ``index`` of an ``[L, n]`` history) ``max|x|`` is folded into. The
    caller (`quantize.py`) has checked devices, dtypes, contiguity and shapes.
    """
    m, n = x.shape
    q = torch.empty((m, n), dtype=dtype, device=x.device) if data else None
    q_t = torch.empty((n, m), dtype=dtype, device=x.device) if transpose else None
    scale_inv = torch.empty(1, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, _TILE_M), triton.cdiv(n, _TILE_N))
    _cast_transpose_kernel[grid](
        x, scale, q if data else scale_inv, q_t if transpose else scale_inv,
        amax_history if amax_history is not None else scale_inv, scale_inv, index,
        m, n, x.stride(0), x.stride(1),
        FP8_MAX=torch.finfo(dtype).max, OUT_DTYPE=_TL_FP8[dtype],
        WRITE_Q=data, WRITE_QT=transpose, WRITE_AMAX=amax_history is not None,
        BLOCK_M=_TILE_M, BLOCK_N=_TILE_N, num_warps=_WARPS)
    return q, q_t, scale_inv


def delayed_update(history: torch.Tensor, scale: torch.Tensor, max_value: float, margin: int,
                   algo: str):
    """One launch of the delayed-scaling update of ``n`` tensors: from ``history
    [L, n]`` and ``scale [n]`` (contiguous float32 CUDA tensors) return ``(new_scale,
    new_scale_inv, new_history)``, the values of `quantize.amax_from_history`,
    `scale_from_amax`, ``reciprocal`` and `roll_amax_history`."""
    length, n = history.shape
    new_history = torch.empty_like(history)
    new_scale = torch.empty_like(scale)
    new_scale_inv = torch.empty_like(scale)
    _delayed_update_kernel[(triton.cdiv(n, _UPDATE_BLOCK_N),)](
        history, scale, new_history, new_scale, new_scale_inv, n,
        float(max_value), 2.0 ** -margin, L=length, ALGO_MAX=algo == "max",
        BLOCK_L=_UPDATE_BLOCK_L, BLOCK_N=_UPDATE_BLOCK_N, FP32_MAX=torch.finfo(torch.float32).max,
        num_warps=4)
    return new_scale, new_scale_inv, new_history


def amax(x: torch.Tensor) -> torch.Tensor:
    """``max|x|`` of a contiguous, non-empty CUDA tensor as a float32 scalar tensor."""
    out = torch.zeros((), dtype=torch.int32, device=x.device)
    numel = x.numel()
    _amax_kernel[(triton.cdiv(numel, _AMAX_BLOCK),)](x, out, numel, BLOCK=_AMAX_BLOCK,
                                                      num_warps=_AMAX_WARPS)
    return out.view(torch.float32)
