"""TE's attention masks, translated into the boolean masks of
``F.scaled_dot_product_attention``.

NOTE [Attention masks]
    TE's masks say what is *masked out* (True = excluded); SDPA's boolean masks say
    what is *allowed*. A mask type combines:

    padding        per-sequence valid tokens, from ``attention_mask`` (``[b, 1, 1, s]``
                   bool, or a ``(q_mask, kv_mask)`` pair) or from ``cu_seqlens_q/kv``
                   (sequence ``i`` has ``cu[i+1] - cu[i]`` valid tokens, at the start);
                   a padded query's output is 0.
    causal         query ``i`` sees keys ``j <= i``: the diagonal starts at the top
                   left. ``*_bottom_right``: ``j <= i + (len_kv - len_q)``, the
                   diagonal ends at the bottom right (KV-cache inference), with each
                   sequence's actual lengths.
    arbitrary      ``attention_mask`` broadcastable to ``[b, h, s_q, s_kv]``.

    ``attention_mask`` is read only by the padding types and "arbitrary"; with
    "no_mask", "causal" and "causal_bottom_right" it is ignored, unchecked and
    without a warning, as TE's FlashAttention and FusedAttention backends (its
    defaults on Hopper) ignore it. (TE's unfused fallback alone ORs such a mask into
    the causal ones; a caller that wants a mask applied says so with "arbitrary".)
    window_size    ``(left, right)``, -1 for unbounded: query ``i`` sees keys
                   ``i + off - left <= j <= i + off + right`` with ``off = 0`` for the
                   top-left causal types and ``len_kv - len_q`` for all others (TE's
                   definition), intersected with the mask type's own rule.

    A query row left with no key (bottom-right causal with more queries than keys,
    a window past the keys, an arbitrary mask that masks a whole row) outputs 0 with
    zero gradients: its row is opened for the kernel and its output zeroed, so no
    backend ever sees an empty softmax. This is done on the device for every built
    mask, whether or not a row is empty: building a mask reads nothing back to the
    host, so a CUDA graph can capture it (``te.make_graphed_callables`` with an
    ``attention_mask`` in ``sample_kwargs``). ``cu_seqlens`` are checked on the host
    (their lengths), except while a graph is captured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

__all__ = ["MASK_TYPES", "canonical_mask_type", "check_window_size", "CoreMask",
           "build_core_mask", "causal_kind", "reads_attention_mask"]

MASK_TYPES = ("no_mask", "padding", "causal", "padding_causal", "causal_bottom_right",
              "padding_causal_bottom_right", "arbitrary")


def canonical_mask_type(api: str, name: str, mask_type) -> str:
    """TE's spellings: "padding,causal", "causal,padding" and "causal_padding" are
    "padding_causal"."""
    if isinstance(mask_type, str):
        mask_type = mask_type.replace(",", "_")
        if mask_type == "causal_padding":
            mask_type = "padding_causal"
    if mask_type not in MASK_TYPES:
        raise ValueError(f"{api}: {name} must be one of {MASK_TYPES}, got {mask_type!r}")
    return mask_type


def check_window_size(api: str, window_size) -> Optional[Tuple[int, int]]:
    """None, or ``(left, right)`` ints >= -1 (-1: unbounded on that side)."""
    if window_size is None:
        return None
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or any(isinstance(w, bool) or not isinstance(w, int) or w < -1
                   for w in window_size)):
        raise ValueError(f"{api}: window_size must be None or a pair (left, right) of ints >= -1 "
                         f"(-1 = unbounded), got {window_size!r}")
    return (int(window_size[0]), int(window_size[1]))


def reads_attention_mask(mask_type: str) -> bool:
    """Whether ``attention_mask`` means anything to this mask type (NOTE [Attention
    masks]): the padding types and "arbitrary"."""
    return mask_type.startswith("padding") or mask_type == "arbitrary"


def causal_kind(mask_type: str) -> Optional[str]:
    """None, "top_left" or "bottom_right"."""
    if "causal" not in mask_type:
        return None
    return "bottom_right" if mask_type.endswith("bottom_right") else "top_left"


@dataclass
class CoreMask:
    """What the attention core applies. ``allowed``: bool, broadcastable to
    ``[b, h, s_q, s_kv]``, True = attend (no row empty), or None; ``is_causal``:
    SDPA's own top-left causal mask instead; ``out_keep``: bool broadcastable to
    ``[b, h, s_q, 1]``, the output rows kept (the others are zeroed), or None."""

    allowed: Optional[torch.Tensor]
    is_causal: bool
    out_keep: Optional[torch.Tensor]


def _padding_keep(api: str, mask, batch: int, seq: int, which: str, device) -> torch.Tensor:
    """``[batch, 1, 1, seq]`` bool (True = padding) -> ``[batch, seq]`` keep-mask."""
    if not torch.is_tensor(mask) or mask.dtype != torch.bool or tuple(mask.shape) != (
            batch, 1, 1, seq):
        got = (f"{mask.dtype} tensor of shape {tuple(mask.shape)}" if torch.is_tensor(mask)
               else type(mask).__name__)
        raise ValueError(f"{api}: a padding mask for the {which} must be a bool tensor of "
                         f"shape [batch, 1, 1, seq] = {[batch, 1, 1, seq]} (True = padding), "
                         f"got {got}")
    return ~mask.reshape(batch, seq).to(device)


def _lengths_keep(api: str, cu_seqlens, batch: int, seq: int, which: str,
                  device) -> torch.Tensor:
    """``[batch + 1]`` cumulative lengths -> ``[batch, seq]`` keep-mask (valid tokens
    first in each row)."""
    if (not torch.is_tensor(cu_seqlens) or cu_seqlens.dim() != 1
            or cu_seqlens.is_floating_point() or cu_seqlens.numel() != batch + 1):
        got = (f"{cu_seqlens.dtype} tensor of shape {tuple(cu_seqlens.shape)}"
               if torch.is_tensor(cu_seqlens) else type(cu_seqlens).__name__)
        raise ValueError(f"{api}: cu_seqlens_{which} must be a 1-D integer tensor of length "
                         f"batch + 1 = {batch + 1}, got {got}")
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).to(device)
    capturing = lens.is_cuda and torch.cuda.is_current_stream_capturing()
    if not capturing and (bool((lens < 0).any()) or bool((lens > seq).any())):
        raise ValueError(f"{api}: cu_seqlens_{which} must give lengths in [0, {seq}], got "
                         f"{lens.tolist()}")
    return torch.arange(seq, device=device).reshape(1, seq) < lens.reshape(batch, 1)


def _padding(api, mask_type, attention_mask, cu_q, cu_kv, batch, sq, skv, device):
    """The ``[b, s_q]`` and ``[b, s_kv]`` keep-masks of a padding mask type."""
    if attention_mask is None:
        if cu_q is None:
            raise ValueError(f"{api}: attn_mask_type={mask_type!r} needs an attention_mask "
                             "(bool, True = masked out) or cu_seqlens_q/cu_seqlens_kv")
        cu_kv = cu_q if cu_kv is None else cu_kv
        return (_lengths_keep(api, cu_q, batch, sq, "q", device),
                _lengths_keep(api, cu_kv, batch, skv, "kv", device))
    if isinstance(attention_mask, (tuple, list)):
        if len(attention_mask) != 2:
            raise ValueError(f"{api}: a padding attention_mask pair must be (q_mask, kv_mask), "
                             f"got {len(attention_mask)} tensors")
        q_mask, kv_mask = attention_mask
    else:
        if sq != skv:
            raise ValueError(f"{api}: with seq_q={sq} != seq_kv={skv} pass the padding mask as "
                             "a pair (q_mask, kv_mask)")
        q_mask = kv_mask = attention_mask
    return (_padding_keep(api, q_mask, batch, sq, "queries", device),
            _padding_keep(api, kv_mask, batch, skv, "keys", device))


def build_core_mask(api: str, mask_type: str, window: Optional[Tuple[int, int]], attention_mask,
                    batch: int, heads: int, sq: int, skv: int, device, cu_seqlens_q=None,
                    cu_seqlens_kv=None, explicit: bool = False) -> CoreMask:
    """NOTE [Attention masks] for one batch of equal-length rows. ``explicit``: build
    the boolean mask even where SDPA's ``is_causal`` would do (a bias is added to it)."""
    padding = mask_type.startswith("padding")
    causal = causal_kind(mask_type)
    if not reads_attention_mask(mask_type):
        attention_mask = None
    unbounded = window is None or window == (-1, -1) or (causal and window[0] == -1)
    if mask_type in ("no_mask", "causal", "causal_bottom_right") and unbounded and not explicit:
        if mask_type == "no_mask":
            return CoreMask(None, False, None)
        if mask_type == "causal" or sq == skv:
            return CoreMask(None, True, None)
    q_keep = kv_keep = None
    if padding:
        q_keep, kv_keep = _padding(api, mask_type, attention_mask, cu_seqlens_q, cu_seqlens_kv,
                                   batch, sq, skv, device)
    i = torch.arange(sq, device=device).reshape(1, 1, sq, 1)
    j = torch.arange(skv, device=device).reshape(1, 1, 1, skv)
    if q_keep is not None:
        delta = (kv_keep.sum(-1) - q_keep.sum(-1)).reshape(batch, 1, 1, 1)
    else:
        delta = torch.full((1, 1, 1, 1), skv - sq, device=device)
    allowed = torch.ones(1, 1, sq, skv, dtype=torch.bool, device=device)
    if kv_keep is not None:
        allowed = allowed & kv_keep.reshape(batch, 1, 1, skv)
    if causal is not None:
        allowed = allowed & (j <= i + (delta if causal == "bottom_right" else 0))
    if window is not None:
        off = 0 if causal == "top_left" else delta
        left, right = window
        if left >= 0:
            allowed = allowed & (j >= i + off - left)
        if right >= 0:
            allowed = allowed & (j <= i + off + right)
    if mask_type == "arbitrary":
        allowed = allowed & ~_arbitrary(api, attention_mask, batch, heads, sq, skv, device)
    # rows with no key are opened and their output zeroed, on the device: no host read
    # of the mask (a CUDA graph captures this, NOTE [Attention masks])
    row_open = allowed.any(-1, keepdim=True)
    out_keep = None if q_keep is None else q_keep.reshape(batch, 1, sq, 1)
    allowed = allowed | ~row_open
    out_keep = row_open if out_keep is None else out_keep & row_open
    return CoreMask(allowed, False, out_keep)


def _arbitrary(api: str, attention_mask, batch, heads, sq, skv, device) -> torch.Tensor:
    if attention_mask is None:
        raise ValueError(f"{api}: attn_mask_type='arbitrary' needs an attention_mask "
                         "(bool, True = masked out)")
    if not torch.is_tensor(attention_mask) or attention_mask.dtype != torch.bool:
        raise ValueError(f"{api}: an 'arbitrary' attention_mask must be a bool tensor "
                         "broadcastable to [batch, heads, seq_q, seq_kv] (True = masked "
                         f"out), got {getattr(attention_mask, 'dtype', type(attention_mask))}")
    try:
        return attention_mask.broadcast_to(batch, heads, sq, skv).to(device)
    except RuntimeError:
        raise ValueError(f"{api}: an 'arbitrary' attention_mask of shape "
                         f"{tuple(attention_mask.shape)} does not broadcast to "
                         f"[batch, heads, seq_q, seq_kv] = {[batch, heads, sq, skv]}") from None
