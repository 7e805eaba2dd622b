"""Triton kernel of the block-scaled cast of Float8BlockScaling: one pass computes the
block amaxes, the scales as `quantize.current_scale` does, and the FP8 values (NOTE
[Block scaling layout] in block_scaling.py). Reached through `casts`.
"""

from __future__ import annotations

from typing import Tuple

import torch

from .common import AVAILABLE, F32 as _F32, FP32_MAX as _FP32_MAX, FP8_MAX as _FP8_MAX
from .launch import Launcher, aligned, int_spec

if AVAILABLE:
    import triton
    import triton.language as tl

    from .common import TL_FP8 as _TL_FP8, max_nan, store_fp8, to_fp8

__all__ = ["block_cast"]


if AVAILABLE:
    @triton.jit
    def _block_cast_kernel(x_ptr, q_ptr, scale_inv_ptr, amax_ptr, R, C, stride_r, stride_c,
                           col_blocks, amax_epsilon,
                           FP8_MAX: tl.constexpr, OUT_DTYPE: tl.constexpr, POW2: tl.constexpr,
                           EPSILON: tl.constexpr, TILE: tl.constexpr, ROWS: tl.constexpr,
                           BLOCK: tl.constexpr, FP32_MAX: tl.constexpr):
        # Program (i, j): rows [i * ROWS, (i + 1) * ROWS), columns of block j. One scale
        # per row of the block (1x128), or with TILE one for the ROWS x BLOCK tile.
        pid_r = tl.program_id(0)
        pid_c = tl.program_id(1)
        rows = pid_r * ROWS + tl.arange(0, ROWS)
        cols = pid_c * BLOCK + tl.arange(0, BLOCK)
        r64 = rows.to(tl.int64)
        c64 = cols.to(tl.int64)
        mask = (rows[:, None] < R) & (cols[None, :] < C)
        x = tl.load(x_ptr + r64[:, None] * stride_r + c64[None, :] * stride_c, mask=mask,
                    other=0.0).to(tl.float32)
        block_amax = tl.reduce(tl.abs(x), 1, max_nan)                 # [ROWS]
        if TILE:
            block_amax = tl.reduce(block_amax, 0, max_nan)            # one for the tile
        # quantize.current_scale, value for value
        finite = block_amax <= FP32_MAX                                # NaN and inf fail
        a = block_amax
        if EPSILON:
            a = tl.maximum(a, amax_epsilon, propagate_nan=tl.PropagateNan.ALL)
        scale = tl.where((a > 0) & finite, tl.div_rn(FP8_MAX, a), 1.0)
        scale = tl.minimum(scale, FP32_MAX)
        if POW2:
            scale = (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
        if TILE:
            y = x * scale
        else:
            y = x * scale[:, None]
        y = tl.clamp(y, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
        # FP8 data through store_fp8 only (NOTE [FP8 stores] in common.py)
        store_fp8(q_ptr + r64[:, None] * C + c64[None, :], to_fp8(y, OUT_DTYPE), mask)
        if TILE:
            tl.store(scale_inv_ptr + pid_r * col_blocks + pid_c, tl.div_rn(1.0, scale))
            tl.store(amax_ptr + pid_r * col_blocks + pid_c, block_amax)
        else:
            rmask = rows < R
            tl.store(scale_inv_ptr + r64 * col_blocks + pid_c, tl.div_rn(1.0, scale), mask=rmask)
            tl.store(amax_ptr + r64 * col_blocks + pid_c, block_amax, mask=rmask)

    _launch_block_cast = Launcher(_block_cast_kernel)

_BLOCK = 128
_BLOCK_CAST_ROWS, _BLOCK_CAST_WARPS = 32, 4      # 1x128 blocks: rows per program
_TILE_CAST_WARPS = 8                            # 128x128 blocks: one tile per program


def block_cast(x: torch.Tensor, dtype: torch.dtype, block_rows: int, power_2_scale: bool,
               amax_epsilon: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block-scaled cast of a 2-D CUDA tensor ``x [R, C]`` (any strides) in one pass:
    ``(q [R, C], scale_inv, block_amax)``, both [ceil(R / block_rows), ceil(C / 128)]
    float32, as `block_scaling`'s torch path computes them (NOTE [Block scaling
    layout]); ``block_rows`` is 1 or 128. The caller checks ``x`` is non-empty."""
    r, c = x.shape
    rb, cb = -(-r // block_rows), -(-c // _BLOCK)
    q = torch.empty((r, c), dtype=dtype, device=x.device)
    scale_inv = torch.empty((rb, cb), dtype=_F32, device=x.device)
    block_amax = torch.empty((rb, cb), dtype=_F32, device=x.device)
    tile = block_rows == _BLOCK
    rows = _BLOCK if tile else _BLOCK_CAST_ROWS
    epsilon = amax_epsilon > 0
    sr, sc = x.stride()
    key = (x.dtype, dtype, power_2_scale, epsilon, tile, aligned(x), int_spec(r),
           int_spec(c), int_spec(sr), int_spec(sc), int_spec(cb))
    _launch_block_cast((-(-r // rows), cb, 1), _TILE_CAST_WARPS if tile else _BLOCK_CAST_WARPS,
                       key, x, q, scale_inv, block_amax, r, c, sr, sc, cb, float(amax_epsilon),
                       _FP8_MAX[dtype], _TL_FP8[dtype], power_2_scale, epsilon, tile,
                       rows, _BLOCK, _FP32_MAX)
    return q, scale_inv, block_amax
