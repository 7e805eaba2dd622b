"""Triton kernel of the in-place delayed-scaling update of many modules' states in one
launch: roll each amax history, compute each new scale and ``1 / scale`` as
`delayed_scaling.delayed_scaling_update` does (bit for bit; a column whose live amax
is 0 keeps its history and scale), and count non-finite live amaxes (NOTE
[Non-finite amaxes] in non_finite.py). Reached through `casts`.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch

from .common import AVAILABLE, F32 as _F32, FP32_MAX as _FP32_MAX
from .launch import Launcher, aligned

if AVAILABLE:
    import triton
    import triton.language as tl

    from .common import max_nan

__all__ = ["delayed_update_"]

_UPDATE_BLOCK_L, _UPDATE_BLOCK_N = 256, 16

if AVAILABLE:
    @triton.jit
    def _delayed_update_kernel(table_ptr, count_ptr, max_value, margin_factor,
                               L: tl.constexpr, ALGO_MAX: tl.constexpr, COUNT: tl.constexpr,
                               BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr,
                               FP32_MAX: tl.constexpr):
        # Program (i, j): columns [j * BLOCK_N, (j + 1) * BLOCK_N) of state i. Table row
        # i: addresses of its history [L, n], scale [n], scale_inv [n] (contiguous
        # float32), and n.
        row = table_ptr + tl.program_id(0) * 4
        hist_ptr = tl.load(row).to(tl.pointer_type(tl.float32))
        scale_ptr = tl.load(row + 1).to(tl.pointer_type(tl.float32))
        scale_inv_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
        n = tl.load(row + 3).to(tl.int32)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < n
        raw = tl.load(hist_ptr + cols, mask=cmask, other=0.0)       # row 0
        # A non-finite live amax keeps its scale and enters the history as 0.
        finite = tl.abs(raw) <= FP32_MAX                      # NaN fails, inf fails
        live = tl.where(finite, raw, 0.0)
        # A live amax of 0 (none recorded) leaves the column alone: no roll, same scale.
        busy = raw != 0.0
        wmask = cmask & busy
        if COUNT:
            tl.atomic_add(count_ptr, tl.sum((~finite).to(tl.int32), axis=0))
        amax = live
        # Roll in place, rows ascending: new row r - 1 = old row r for r >= 1. Each
        # block is loaded completely (barrier) before any of it is overwritten; the
        # rows a block writes were read by this or the previous block.
        for r0 in range(1, L, BLOCK_L):
            rows = r0 + tl.arange(0, BLOCK_L)
            m = (rows[:, None] < L) & cmask[None, :]
            offs = rows[:, None] * n + cols[None, :]
            h = tl.load(hist_ptr + offs, mask=m, other=0.0)
            if ALGO_MAX:
                amax = max_nan(amax, tl.reduce(h, 0, max_nan))
            tl.debug_barrier()
            tl.store(hist_ptr + offs - n, h, mask=m & busy[None, :])
        tl.debug_barrier()
        # old row 0 goes to the end, then the new live row 0 is zeroed
        if L > 1:
            tl.store(hist_ptr + (L - 1) * n + cols, live, mask=wmask)
            tl.debug_barrier()
        tl.store(hist_ptr + cols, tl.zeros_like(live), mask=wmask)
        old = tl.load(scale_ptr + cols, mask=cmask, other=1.0)
        # as the torch formula computes it: reciprocal(amax) * max, then / 2**margin
        new = tl.div_rn(1.0, amax) * max_value * margin_factor
        ok = busy & finite & (amax > 0) & (amax <= FP32_MAX)   # positive and finite
        new = tl.minimum(tl.where(ok, new, old), FP32_MAX, propagate_nan=tl.PropagateNan.ALL)
        tl.store(scale_ptr + cols, new, mask=cmask)
        tl.store(scale_inv_ptr + cols, tl.div_rn(1.0, new), mask=cmask)

    _launch_update = Launcher(_delayed_update_kernel)


# Device tables of state addresses, keyed by those addresses (the table is a function
# of its key, so a hit is right even if the memory now belongs to other tensors).
_UPDATE_TABLES: Dict[tuple, torch.Tensor] = {}
_UPDATE_TABLES_MAX = 256


def delayed_update_(histories: Sequence[torch.Tensor], scales: Sequence[torch.Tensor],
                    scale_invs: Sequence[torch.Tensor], max_value: float, margin: int,
                    algo: str, non_finite: Optional[torch.Tensor] = None) -> bool:
    """One launch of the delayed-scaling update of many states, in place: for each
    ``i``, from ``histories[i] [L, n_i]`` and ``scales[i] [n_i]`` write the new scale,
    ``1 / scale`` and the rolled history, the values of
    `delayed_scaling.delayed_scaling_update`, and add the number of non-finite live amaxes to
    ``non_finite`` (an int32 scalar tensor) if given. Returns False, having done
    nothing, unless every tensor is a contiguous float32 tensor on the first history's
    CUDA device, the histories share ``L`` and the shapes agree."""
    first = histories[0]
    length, device = first.shape[0], first.get_device()
    key, widest = [], 0
    for h, s, si in zip(histories, scales, scale_invs):
        n = s.numel()
        if not (h.dtype is _F32 and s.dtype is _F32 and si.dtype is _F32 and h.dim() == 2
                and h.shape[0] == length and h.shape[1] == n == si.numel()
                and h.is_contiguous() and s.is_contiguous() and si.is_contiguous()
                and h.get_device() == device == s.get_device() == si.get_device()):
            return False
        key.append((h.data_ptr(), s.data_ptr(), si.data_ptr(), n))
        widest = max(widest, n)
    key = tuple(key)
    table = _UPDATE_TABLES.get(key)
    if table is None:
        if len(_UPDATE_TABLES) >= _UPDATE_TABLES_MAX:
            _UPDATE_TABLES.clear()
        table = torch.tensor(key, dtype=torch.int64, device=first.device)
        _UPDATE_TABLES[key] = table
    count = non_finite is not None
    if count and not (non_finite.dtype is torch.int32 and non_finite.numel() == 1
                      and non_finite.get_device() == device):
        return False
    algo_max = algo == "max"
    spec = (length, algo_max, count, count and aligned(non_finite))
    _launch_update((len(key), -(-widest // _UPDATE_BLOCK_N), 1), 4, spec,
                   table, non_finite if count else table, float(max_value), 2.0 ** -margin,
                   length, algo_max, count, _UPDATE_BLOCK_L, _UPDATE_BLOCK_N, _FP32_MAX)
    return True
