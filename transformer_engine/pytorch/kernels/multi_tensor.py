"""Triton kernels of the multi-tensor operations (`optimizers/multi_tensor.py`): scale,
sum of squares (for the L2 norm), the Adam step and the SGD step, each over many tensors
in one launch.

NOTE [Chunk table]
    A launch covers every tensor of its lists that shares one dtype signature. The host
    describes them in three int64 tables: the address of tensor ``t`` of list ``l`` at
    ``addr[l * n_tensors + t]``, its element count at ``numel[t]``, and one row per chunk
    of ``chunk`` elements: ``(t, first element)``. Program ``i`` handles chunk ``i`` in
    tiles of ``BLOCK``. The tables depend only on the addresses, dtypes and sizes, so
    they are made once and cached under that key (an optimizer's tensors do not move);
    a hit is right even where the memory now belongs to other tensors of the same sizes.

The arithmetic is the torch reference's (`optimizers/multi_tensor.py`), operation for
operation in float32: IEEE division (``div_rn``) and square root (``sqrt_rn``), and no
multiply-add contraction (compiled with ``enable_fp_fusion=False``), so the two agree
bit for bit (tests/pytorch/test_multi_tensor_kernels.py runs these kernels under the
Triton interpreter). Imported only by `optimizers/multi_tensor.py`, for CUDA tensors (or
CPU tensors under the interpreter).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .common import AVAILABLE
from .launch import Launcher, int_spec

if AVAILABLE:
    import triton
    import triton.language as tl

    from .common import round_to

__all__ = ["AVAILABLE", "DTYPES", "chunk_table", "scale_", "sum_squares", "adam_", "sgd_"]

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_BLOCK = 1024
_WARPS = 4

if AVAILABLE:
    _TL = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16,
           torch.int16: tl.int16}

    @triton.jit
    def _chunk(chunks_ptr, numel_ptr):
        """(tensor index, first element, element count) of this program's chunk."""
        row = chunks_ptr + tl.program_id(0) * 2
        t = tl.load(row)
        return t, tl.load(row + 1), tl.load(numel_ptr + t)

    @triton.jit
    def _address(addr_ptr, n_tensors, lst: tl.constexpr, t, DT: tl.constexpr):
        return tl.load(addr_ptr + lst * n_tensors + t).to(tl.pointer_type(DT))

    @triton.jit
    def _scale_kernel(addr_ptr, numel_ptr, chunks_ptr, n_tensors, noop_ptr, scale, scale_ptr,
                      IN_DT: tl.constexpr, OUT_DT: tl.constexpr, SCALE_PTR: tl.constexpr,
                      CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        t, start, n = _chunk(chunks_ptr, numel_ptr)
        x_ptr = _address(addr_ptr, n_tensors, 0, t, IN_DT)
        y_ptr = _address(addr_ptr, n_tensors, 1, t, OUT_DT)
        if SCALE_PTR:
            scale = tl.load(scale_ptr)
        bad = tl.zeros([BLOCK], dtype=tl.int32)
        for off in range(0, CHUNK, BLOCK):
            idx = start + off + tl.arange(0, BLOCK)
            mask = idx < n
            x = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32)
            bad = bad | (tl.abs(x) > 3.4028234663852886e38).to(tl.int32) | (x != x).to(tl.int32)
            tl.store(y_ptr + idx, round_to(x * scale, OUT_DT), mask=mask)
        if tl.max(bad, axis=0) > 0:
            tl.store(noop_ptr, 1)

    @triton.jit
    def _sum_squares_kernel(addr_ptr, numel_ptr, chunks_ptr, n_tensors, partial_ptr, scale_ptr,
                            IN_DT: tl.constexpr, SCALED: tl.constexpr, CHUNK: tl.constexpr,
                            BLOCK: tl.constexpr):
        t, start, n = _chunk(chunks_ptr, numel_ptr)
        x_ptr = _address(addr_ptr, n_tensors, 0, t, IN_DT)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for off in range(0, CHUNK, BLOCK):
            idx = start + off + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + idx, mask=idx < n, other=0.0).to(tl.float32)
            if SCALED:
                x = x * tl.load(scale_ptr)
            acc += x * x
        tl.store(partial_ptr + tl.program_id(0), tl.sum(acc, axis=0))

    @triton.jit
    def _adam_kernel(addr_ptr, numel_ptr, chunks_ptr, n_tensors, noop_ptr, dev_ptr,
                     beta1, beta2, omb1, omb2, bc1, bc2, eps, lr, decay,
                     G_DT: tl.constexpr, P_DT: tl.constexpr, M_DT: tl.constexpr,
                     V_DT: tl.constexpr, MASTER: tl.constexpr, REMAINDER: tl.constexpr,
                     ADAMW: tl.constexpr, CAPTURABLE: tl.constexpr, CHUNK: tl.constexpr,
                     BLOCK: tl.constexpr):
        # lists: grad, param, exp_avg, exp_avg_sq[, master (float32) or remainder (int16)]
        t, start, n = _chunk(chunks_ptr, numel_ptr)
        g_ptr = _address(addr_ptr, n_tensors, 0, t, G_DT)
        p_ptr = _address(addr_ptr, n_tensors, 1, t, P_DT)
        m_ptr = _address(addr_ptr, n_tensors, 2, t, M_DT)
        v_ptr = _address(addr_ptr, n_tensors, 3, t, V_DT)
        inv_scale = 1.0
        live = tl.full([BLOCK], 1, tl.int1)
        if CAPTURABLE:      # dev_ptr: lr, bias corrections 1 and 2, 1 / loss scale
            lr = tl.load(dev_ptr)
            bc1 = tl.load(dev_ptr + 1)
            bc2 = tl.load(dev_ptr + 2)
            inv_scale = tl.load(dev_ptr + 3)
            live = live & (tl.load(noop_ptr) == 0)
        for off in range(0, CHUNK, BLOCK):
            idx = start + off + tl.arange(0, BLOCK)
            mask = (idx < n) & live
            g = tl.load(g_ptr + idx, mask=mask, other=0.0).to(tl.float32)
            if CAPTURABLE:
                g = g * inv_scale
                tl.store(g_ptr + idx, round_to(g, G_DT), mask=mask)
            if REMAINDER:
                r_ptr = _address(addr_ptr, n_tensors, 4, t, tl.int16)
                hi = tl.load(p_ptr.to(tl.pointer_type(tl.int16)) + idx, mask=mask,
                             other=0).to(tl.int32)
                lo = tl.load(r_ptr + idx, mask=mask, other=0).to(tl.int32)
                hi = tl.where(lo < 0, hi - 1, hi)
                p = ((hi << 16) | (lo & 0xFFFF)).to(tl.float32, bitcast=True)
            elif MASTER:
                w_ptr = _address(addr_ptr, n_tensors, 4, t, tl.float32)
                p = tl.load(w_ptr + idx, mask=mask, other=0.0)
            else:
                p = tl.load(p_ptr + idx, mask=mask, other=0.0).to(tl.float32)
            m = tl.load(m_ptr + idx, mask=mask, other=0.0).to(tl.float32)
            v = tl.load(v_ptr + idx, mask=mask, other=0.0).to(tl.float32)
            if not ADAMW:
                g = g + decay * p
            m = beta1 * m + omb1 * g
            v = beta2 * v + omb2 * g * g
            denom = tl.sqrt_rn(tl.div_rn(v, bc2)) + eps
            update = tl.div_rn(tl.div_rn(m, bc1), denom)
            if ADAMW:
                update = update + decay * p
            p = p - lr * update
            tl.store(m_ptr + idx, round_to(m, M_DT), mask=mask)
            tl.store(v_ptr + idx, round_to(v, V_DT), mask=mask)
            if REMAINDER:
                bits = p.to(tl.int32, bitcast=True)
                lo = (bits & 0xFFFF).to(tl.int16)
                hi = bits >> 16
                hi = tl.where(lo < 0, hi + 1, hi)
                tl.store(r_ptr + idx, lo, mask=mask)
                tl.store(p_ptr.to(tl.pointer_type(tl.int16)) + idx, hi.to(tl.int16), mask=mask)
            else:
                if MASTER:
                    tl.store(w_ptr + idx, p, mask=mask)
                tl.store(p_ptr + idx, round_to(p, P_DT), mask=mask)

    @triton.jit
    def _sgd_kernel(addr_ptr, numel_ptr, chunks_ptr, n_tensors, noop_ptr,
                    wd, momentum, omd, lr, scale,
                    G_DT: tl.constexpr, P_DT: tl.constexpr, M_DT: tl.constexpr,
                    C_DT: tl.constexpr, COPY: tl.constexpr, NESTEROV: tl.constexpr,
                    FIRST: tl.constexpr, WD_AFTER: tl.constexpr, HAS_WD: tl.constexpr,
                    HAS_MOMENTUM: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        # lists: grad, param, momentum[, a copy of the param in C_DT]
        t, start, n = _chunk(chunks_ptr, numel_ptr)
        g_ptr = _address(addr_ptr, n_tensors, 0, t, G_DT)
        p_ptr = _address(addr_ptr, n_tensors, 1, t, P_DT)
        m_ptr = _address(addr_ptr, n_tensors, 2, t, M_DT)
        live = tl.full([BLOCK], 1, tl.int1) & (tl.load(noop_ptr) == 0)
        for off in range(0, CHUNK, BLOCK):
            idx = start + off + tl.arange(0, BLOCK)
            mask = (idx < n) & live
            g = tl.load(g_ptr + idx, mask=mask, other=0.0).to(tl.float32) * scale
            p = tl.load(p_ptr + idx, mask=mask, other=0.0).to(tl.float32)
            if HAS_WD and not WD_AFTER:
                g = g + wd * p
            if HAS_MOMENTUM:
                if FIRST:
                    m = g
                else:
                    m = tl.load(m_ptr + idx, mask=mask, other=0.0).to(tl.float32)
                    m = m * momentum + omd * g
                if NESTEROV:
                    g = g + momentum * m
                else:
                    g = m
                tl.store(m_ptr + idx, round_to(m, M_DT), mask=mask)
            if HAS_WD and WD_AFTER:
                g = g + wd * p
            p = p + (-lr) * g
            tl.store(p_ptr + idx, round_to(p, P_DT), mask=mask)
            if COPY:
                c_ptr = _address(addr_ptr, n_tensors, 3, t, C_DT)
                tl.store(c_ptr + idx, round_to(p, C_DT), mask=mask)

    _launch_scale = Launcher(_scale_kernel, enable_fp_fusion=False)
    _launch_sum_squares = Launcher(_sum_squares_kernel, enable_fp_fusion=False)
    _launch_adam = Launcher(_adam_kernel, enable_fp_fusion=False)
    _launch_sgd = Launcher(_sgd_kernel, enable_fp_fusion=False)


class ChunkTable:
    """The device tables of one launch (NOTE [Chunk table])."""

    def __init__(self, addr: torch.Tensor, numel: torch.Tensor, chunks: torch.Tensor,
                 tensor_of_chunk: torch.Tensor, n_tensors: int):
        self.addr, self.numel, self.chunks = addr, numel, chunks
        self.tensor_of_chunk, self.n_tensors = tensor_of_chunk, n_tensors

    @property
    def n_chunks(self) -> int:
        return self.chunks.shape[0]


_TABLES: Dict[tuple, ChunkTable] = {}
_TABLES_MAX = 256


def chunk_table(lists: Sequence[Sequence[torch.Tensor]], chunk: int) -> ChunkTable:
    """The cached chunk table of aligned tensor lists (the first list's sizes rule)."""
    first = lists[0]
    key = (chunk, first[0].device,
           tuple((t.data_ptr(), t.dtype) for lst in lists for t in lst),
           tuple(t.numel() for t in first))
    table = _TABLES.get(key)
    if table is None:
        if len(_TABLES) >= _TABLES_MAX:
            _TABLES.clear()
        device = first[0].device
        rows: List[Tuple[int, int]] = []
        for i, t in enumerate(first):
            rows.extend((i, s) for s in range(0, t.numel(), chunk))
        chunks = torch.tensor(rows, dtype=torch.int64).reshape(-1, 2)
        table = ChunkTable(
            torch.tensor([t.data_ptr() for lst in lists for t in lst], dtype=torch.int64,
                         device=device),
            torch.tensor([t.numel() for t in first], dtype=torch.int64, device=device),
            chunks.to(device), chunks[:, 0].to(device), len(first))
        _TABLES[key] = table
    return table


def _dt(t: torch.Tensor):
    return _TL[t.dtype]


def scale_(lists, chunk: int, noop: torch.Tensor, scale: float,
           scale_tensor: Optional[torch.Tensor]) -> None:
    """``out = in * scale`` for one dtype signature; ``noop = 1`` on a non-finite input."""
    table = chunk_table(lists, chunk)
    in_dt, out_dt = _dt(lists[0][0]), _dt(lists[1][0])
    by_ptr = scale_tensor is not None
    _launch_scale((table.n_chunks, 1, 1), _WARPS,
                  (in_dt, out_dt, by_ptr, chunk, int_spec(table.n_tensors)),
                  table.addr, table.numel, table.chunks, table.n_tensors, noop,
                  float(scale), scale_tensor if by_ptr else noop, in_dt, out_dt, by_ptr,
                  chunk, _BLOCK)


def sum_squares(lst, chunk: int, scale_tensor: Optional[torch.Tensor]) -> Tuple[torch.Tensor,
                                                                               ChunkTable]:
    """float32 sum of squares of each chunk (times ``scale_tensor`` first, if given)."""
    table = chunk_table([lst], chunk)
    partial = torch.empty(table.n_chunks, dtype=torch.float32, device=lst[0].device)
    scaled = scale_tensor is not None
    in_dt = _dt(lst[0])
    _launch_sum_squares((table.n_chunks, 1, 1), _WARPS,
                        (in_dt, scaled, chunk, int_spec(table.n_tensors)),
                        table.addr, table.numel, table.chunks, table.n_tensors, partial,
                        scale_tensor if scaled else partial, in_dt, scaled, chunk, _BLOCK)
    return partial, table


def adam_(lists, chunk: int, noop: torch.Tensor, consts: Sequence[float], adamw: bool,
          remainder: bool, device_scalars: Optional[torch.Tensor]) -> None:
    """The Adam step of one dtype signature (see `_adam_kernel`); ``consts``: beta1,
    beta2, 1 - beta1, 1 - beta2, bias corrections 1 and 2, eps, lr, decay (float32
    values). ``device_scalars`` (capturable): float32 [lr, bc1, bc2, 1 / loss scale]."""
    table = chunk_table(lists, chunk)
    dts = tuple(_dt(lst[0]) for lst in lists[:4])
    master = len(lists) == 5
    capturable = device_scalars is not None
    _launch_adam((table.n_chunks, 1, 1), _WARPS,
                 (*dts, master, remainder, adamw, capturable, chunk,
                  int_spec(table.n_tensors)),
                 table.addr, table.numel, table.chunks, table.n_tensors, noop,
                 device_scalars if capturable else noop, *consts, *dts, master, remainder,
                 adamw, capturable, chunk, _BLOCK)


def sgd_(lists, chunk: int, noop: torch.Tensor, wd: float, momentum: float, omd: float,
         lr: float, nesterov: bool, first_run: bool, wd_after_momentum: bool,
         scale: float) -> None:
    """The SGD step of one dtype signature (see `_sgd_kernel`); ``omd``: 1 - dampening
    (float32 values)."""
    table = chunk_table(lists, chunk)
    dts = tuple(_dt(lst[0]) for lst in lists[:3])
    copy = len(lists) == 4
    c_dt = _dt(lists[3][0]) if copy else dts[1]
    flags = (copy, bool(nesterov), bool(first_run), bool(wd_after_momentum), wd != 0.0,
             momentum != 0.0)
    _launch_sgd((table.n_chunks, 1, 1), _WARPS,
                (*dts, c_dt, *flags, chunk, int_spec(table.n_tensors)),
                table.addr, table.numel, table.chunks, table.n_tensors, noop,
                float(wd), float(momentum), float(omd), float(lr), float(scale),
                *dts, c_dt, *flags, chunk, _BLOCK)
