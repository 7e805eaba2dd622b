"""The ``thd`` layout: sequences of different lengths packed along one token
dimension, located by ``cu_seqlens`` (and ``cu_seqlens_padded`` when there is padding
between them).

NOTE [Packed sequences]
    ``cu_seqlens_q`` (``[b + 1]``, from 0) gives sequence ``i`` its length
    ``cu[i+1] - cu[i]``. Without ``cu_seqlens_q_padded`` the sequences follow one
    another from token 0; with it, sequence ``i`` starts at token
    ``cu_padded[i]`` and the tokens up to ``cu_padded[i+1]`` after it are padding. The
    same holds for keys and values. Attention runs per sequence (each one's own
    causal diagonal and window, with its own lengths), and every token that belongs
    to no sequence outputs 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

__all__ = ["PackedLayout", "packed_layout"]


@dataclass(frozen=True)
class PackedLayout:
    """Where each sequence's queries and keys lie (``starts``) and how long it is."""

    q_starts: List[int]
    q_lens: List[int]
    kv_starts: List[int]
    kv_lens: List[int]
    total_q: int


def _bounds(api: str, name: str, cu, total: int, count: Optional[int]) -> List[int]:
    if (not torch.is_tensor(cu) or cu.dim() != 1 or cu.is_floating_point()
            or cu.dtype == torch.bool or cu.numel() < 2
            or (count is not None and cu.numel() != count)):
        want = f"length {count}" if count is not None else "length batch + 1 >= 2"
        got = (f"{cu.dtype} tensor of shape {tuple(cu.shape)}" if torch.is_tensor(cu)
               else type(cu).__name__)
        raise ValueError(f"{api}: {name} must be a 1-D integer tensor of {want}, got {got}")
    bounds = [int(v) for v in cu.tolist()]
    if bounds[0] != 0 or any(b < a for a, b in zip(bounds, bounds[1:])) or bounds[-1] > total:
        raise ValueError(f"{api}: {name} must start at 0, never decrease and end within the "
                         f"{total} packed tokens, got {bounds}")
    return bounds


def packed_layout(api: str, t_q: int, t_kv: int, cu_seqlens_q, cu_seqlens_kv,
                  cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None) -> PackedLayout:
    """Check the ``thd`` boundaries (NOTE [Packed sequences]) and list the sequences."""
    if cu_seqlens_q is None:
        raise ValueError(f"{api}: qkv_format='thd' needs cu_seqlens_q (and cu_seqlens_kv for "
                         "keys of other lengths)")
    q = _bounds(api, "cu_seqlens_q", cu_seqlens_q, t_q, None)
    kv = q if cu_seqlens_kv is None else _bounds(api, "cu_seqlens_kv", cu_seqlens_kv, t_kv,
                                                  len(q))
    if kv[-1] > t_kv:
        raise ValueError(f"{api}: the key sequences end at token {kv[-1]}, past the {t_kv} "
                         "packed key tokens; pass cu_seqlens_kv")
    q_lens = [b - a for a, b in zip(q, q[1:])]
    kv_lens = [b - a for a, b in zip(kv, kv[1:])]
    q_starts = _starts(api, "q", q, q_lens, cu_seqlens_q_padded, t_q)
    kv_pad = cu_seqlens_kv_padded if cu_seqlens_kv is not None else cu_seqlens_q_padded
    kv_starts = _starts(api, "kv", kv, kv_lens, kv_pad, t_kv)
    return PackedLayout(q_starts, q_lens, kv_starts, kv_lens, t_q)


def _starts(api, which, bounds, lens, padded, total) -> List[int]:
    if padded is None:
        return bounds[:-1]
    pad = _bounds(api, f"cu_seqlens_{which}_padded", padded, total, len(bounds))
    for i, (start, n) in enumerate(zip(pad, lens)):
        if start + n > pad[i + 1]:
            raise ValueError(f"{api}: sequence {i} has {n} tokens but cu_seqlens_{which}_padded "
                             f"leaves it only {pad[i + 1] - start} ({pad})")
    return pad[:-1]
