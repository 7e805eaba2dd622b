"""te.DotProductAttention on ``torch.nn.functional.scaled_dot_product_attention``.

The attention core ``softmax(Q K^T * scale + bias, masked) V`` runs in high precision;
the FP8 GEMMs of attention layers are their projections. Masks follow NOTE [Attention
masks] (masks.py); the ``thd`` layout NOTE [Packed sequences] (packed.py).
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F

from .. import distributed
from ..rng import check_dropout_replayable
from ..tensor_parallel import get_distributed_world_size
from ..utils import check_process_group
from ..utils import (check_bool, check_choice, check_dropout, check_optional_positive_int,
                     check_positive_int, reject_unsupported)
from .masks import (CoreMask, build_core_mask, canonical_mask_type, causal_kind,
                    check_window_size, reads_attention_mask)
from .packed import packed_layout

__all__ = ["DotProductAttention", "QKV_FORMATS", "BIAS_TYPES"]

QKV_FORMATS = ("sbhd", "bshd", "thd")
BIAS_TYPES = ("no_bias", "pre_scale_bias", "post_scale_bias", "alibi")
_EMPTY_STATE = torch.empty(0, dtype=torch.uint8)


def _kv_channels(api: str, kv_channels) -> Tuple[int, int]:
    if isinstance(kv_channels, (tuple, list)):
        if len(kv_channels) != 2:
            raise ValueError(f"{api}: kv_channels must be an int or a pair (key size, value "
                             f"size), got {kv_channels!r}")
        return (check_positive_int(api, "kv_channels", kv_channels[0]),
                check_positive_int(api, "kv_channels", kv_channels[1]))
    d = check_positive_int(api, "kv_channels", kv_channels)
    return d, d


class DotProductAttention(torch.nn.Module):
    """``softmax(Q K^T * softmax_scale + bias + mask) V`` per head, with grouped-query
    attention and attention dropout. TE's signature.

    Parameters
    ----------
    num_attention_heads : int
    kv_channels : int or (int, int)
        Head size d, or (key/query size, value size).
    num_gqa_groups : int, optional
        Key/value heads (``num_attention_heads`` when None); must divide it. Query
        head i attends with key/value head ``i // (num_attention_heads / num_gqa_groups)``.
    attention_dropout : float, default 0.0
        Dropout on the attention probabilities, in training mode only.
    qkv_format : "sbhd" | "bshd" | "thd", default "sbhd"
        ``[seq, batch, heads, d]``, ``[batch, seq, heads, d]`` or packed
        ``[tokens, heads, d]`` (with ``cu_seqlens_q/kv`` in forward).
    attn_mask_type : str, default "causal"
        One of ``MASK_TYPES`` (NOTE [Attention masks]); "padding,causal" and
        "causal,padding" mean "padding_causal".
    window_size : (int, int), optional
        Sliding-window attention (NOTE [Attention masks]).
    sequence_parallel : bool, default False
        As in TE: attention dropout then draws from torch's generator, not the
        tracker's.
    tp_size : int, default 1
        The tensor-parallel size: the inputs hold ``num_attention_heads / tp_size``
        query heads and ``num_gqa_groups / tp_size`` key/value heads.
    get_rng_state_tracker : callable, optional
        Returns a `CudaRNGStatesTracker`; attention dropout then draws from its
        ``fork()`` and ``checkpoint_core_attention`` replays it.
    tp_group : ProcessGroup, optional
        Its size is the tensor-parallel size.
    layer_number : int, optional
        Kept for TE compatibility (1 when None; not used by the math).
    attention_type : "self" | "cross", default "self"
    softmax_scale : float, optional
        ``1 / sqrt(key size)`` when None.
    cp_group, cp_global_ranks, cp_stream, cp_comm_type, softmax_type, return_max_logit
        Context parallelism, sink softmax and max-logit output are not implemented:
        anything but the defaults raises ``NotImplementedError``.

    Forward returns ``[seq, batch, heads * d_v]`` (sbhd), ``[batch, seq, heads * d_v]``
    (bshd) or ``[tokens, heads * d_v]`` (thd).
    """

    def __init__(self, num_attention_heads: int, kv_channels, num_gqa_groups: Optional[int] = None,
                 attention_dropout: float = 0.0, qkv_format: str = "sbhd",
                 attn_mask_type: str = "causal", window_size: Optional[Tuple[int, int]] = None,
                 sequence_parallel: bool = False, tp_size: int = 1,
                 get_rng_state_tracker: Optional[Callable] = None, tp_group=None,
                 layer_number: Optional[int] = None, attention_type: str = "self",
                 cp_group=None, cp_global_ranks=None, cp_stream=None, cp_comm_type: str = "p2p",
                 softmax_scale: Optional[float] = None, softmax_type: str = "vanilla",
                 return_max_logit: Optional[bool] = False):
        super().__init__()
        api = "te.DotProductAttention"
        reject_unsupported(api, cp_group=(cp_group, None), cp_global_ranks=(cp_global_ranks, None),
                           cp_stream=(cp_stream, None), softmax_type=(softmax_type, "vanilla"),
                           return_max_logit=(bool(return_max_logit), False))
        check_choice(api, "cp_comm_type", cp_comm_type, ("p2p", "all_gather", "a2a", "a2a+p2p"))
        self.num_attention_heads = check_positive_int(api, "num_attention_heads",
                                                      num_attention_heads)
        self.kv_channels_qk, self.kv_channels_v = _kv_channels(api, kv_channels)
        self.kv_channels = kv_channels
        groups = num_gqa_groups if num_gqa_groups is not None else num_attention_heads
        self.num_gqa_groups = check_positive_int(api, "num_gqa_groups", groups)
        if num_attention_heads % groups != 0:
            raise ValueError(f"{api}: num_gqa_groups={groups} must divide "
                             f"num_attention_heads={num_attention_heads}")
        self.attention_dropout = check_dropout(api, "attention_dropout", attention_dropout)
        self.qkv_format = check_choice(api, "qkv_format", qkv_format, QKV_FORMATS)
        self.attn_mask_type = canonical_mask_type(api, "attn_mask_type", attn_mask_type)
        self.window_size = check_window_size(api, window_size)
        self.sequence_parallel = check_bool(api, "sequence_parallel", sequence_parallel)
        self.attention_type = check_choice(api, "attention_type", attention_type,
                                           ("self", "cross"))
        if get_rng_state_tracker is not None and not callable(get_rng_state_tracker):
            raise TypeError(f"{api}: get_rng_state_tracker must be a callable returning a "
                            f"CudaRNGStatesTracker, got {type(get_rng_state_tracker).__name__}")
        self.get_rng_state_tracker = get_rng_state_tracker
        self.layer_number = 1 if layer_number is None else layer_number
        if softmax_scale is not None and (
                isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float))
                or not math.isfinite(softmax_scale) or not softmax_scale > 0):
            raise ValueError(f"{api}: softmax_scale must be None or a finite positive float, "
                             f"got {softmax_scale!r}")
        self.softmax_scale = (float(softmax_scale) if softmax_scale is not None
                              else 1.0 / math.sqrt(self.kv_channels_qk))
        check_positive_int(api, "tp_size", tp_size)
        self.tp_size = tp_size
        self.set_tensor_parallel_group(tp_group)

    # ---- tensor and context parallelism ----------------------------------------------
    def set_tensor_parallel_group(self, tp_group) -> None:
        """The group whose ranks hold the heads (its size replaces ``tp_size``)."""
        api = "te.DotProductAttention"
        check_process_group(api, "tp_group", tp_group)
        self.tp_group = tp_group
        if tp_group is not None:
            self.tp_size = get_distributed_world_size(tp_group)
        for name, n in (("num_attention_heads", self.num_attention_heads),
                        ("num_gqa_groups", self.num_gqa_groups)):
            if n % self.tp_size:
                raise ValueError(f"{api}: {name}={n} must be divisible by the tensor-parallel "
                                 f"size {self.tp_size}")
        self.heads_local = self.num_attention_heads // self.tp_size
        self.groups_local = self.num_gqa_groups // self.tp_size

    def set_context_parallel_group(self, cp_group, cp_global_ranks=None, cp_stream=None,
                                   cp_comm_type: str = "p2p") -> None:
        """Context parallelism is not implemented: only ``cp_group=None`` (or a group
        of one rank) is accepted."""
        if cp_group is not None and get_distributed_world_size(cp_group) > 1:
            raise NotImplementedError("te.DotProductAttention.set_context_parallel_group: context "
                                      "parallelism is not implemented by this pure-PyTorch "
                                      "Transformer Engine")

    # ---- state_dict: TE's key, no FP8 state ---------------------------------------------
    def get_extra_state(self) -> torch.Tensor:
        """An empty payload under TE's ``_extra_state`` key: the core runs in high
        precision and holds no FP8 state, but TE's state_dict has the key."""
        return _EMPTY_STATE.clone()

    def set_extra_state(self, state) -> None:
        if state is None or (torch.is_tensor(state) and state.numel() == 0):
            return
        raise ValueError("te.DotProductAttention.set_extra_state: this attention core runs in "
                         "high precision and holds no FP8 state, so only an empty payload "
                         f"loads; got {type(state).__name__}"
                         + (f" of {state.numel()} elements" if torch.is_tensor(state) else ""))

    # ---- forward ---------------------------------------------------------------------
    def _check_qkv(self, api: str, fmt: str, q, k, v) -> None:
        dims = 3 if fmt == "thd" else 4
        layout = {"sbhd": "[seq, batch, heads, d]", "bshd": "[batch, seq, heads, d]",
                  "thd": "[tokens, heads, d]"}[fmt]
        for name, t, heads, d in (("query_layer", q, self.heads_local, self.kv_channels_qk),
                                  ("key_layer", k, self.groups_local, self.kv_channels_qk),
                                  ("value_layer", v, self.groups_local, self.kv_channels_v)):
            if not torch.is_tensor(t):
                raise TypeError(f"{api}: {name} must be a tensor, got {type(t).__name__}")
            if t.dim() != dims or t.shape[-2] != heads or t.shape[-1] != d:
                raise ValueError(f"{api}: {name} must be {layout} ({fmt}) with {heads} heads "
                                 f"of size d={d}, got shape {tuple(t.shape)}")
        if not q.is_floating_point() or not (q.dtype == k.dtype == v.dtype):
            raise TypeError(f"{api}: query_layer, key_layer and value_layer must be floating-point "
                            f"tensors of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
        if not (q.device == k.device == v.device):
            raise ValueError(f"{api}: query_layer, key_layer and value_layer must be on one "
                             f"device, got {q.device}, {k.device}, {v.device}")
        b_dim = {"sbhd": 1, "bshd": 0, "thd": None}[fmt]
        same_batch = b_dim is None or q.shape[b_dim] == k.shape[b_dim] == v.shape[b_dim]
        if not same_batch or k.shape[:-1] != v.shape[:-1]:
            raise ValueError(f"{api}: query, key and value disagree on batch or key/value "
                             f"length: {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)} "
                             f"({fmt})")

    def _dropout_context(self, p: float):
        if p == 0.0 or self.get_rng_state_tracker is None or self.sequence_parallel:
            return contextlib.nullcontext()
        return self.get_rng_state_tracker().fork()

    def _sdpa(self, q, k, v, mask: CoreMask, bias: Optional[torch.Tensor], p: float):
        """SDPA on ``[b, h, s, d]`` tensors (key/value heads repeated for GQA)."""
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        attn_mask = mask.allowed
        if bias is not None:
            bias = bias.to(q.dtype)
            attn_mask = bias if attn_mask is None else bias.masked_fill(~attn_mask, float("-inf"))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=p,
                                             is_causal=mask.is_causal, scale=self.softmax_scale)
        if mask.out_keep is not None:
            out = out.masked_fill(~mask.out_keep, 0.0)
        return out

    def _attend(self, q, k, v, fmt: str, mask: CoreMask, bias: Optional[torch.Tensor]):
        """The core on ``fmt`` tensors: what ``checkpoint_core_attention`` recomputes."""
        p = self.attention_dropout if self.training else 0.0
        check_dropout_replayable("te.DotProductAttention", p, q)
        to_bhsd = (1, 2, 0, 3) if fmt == "sbhd" else (0, 2, 1, 3)
        with self._dropout_context(p):
            out = self._sdpa(*(t.permute(*to_bhsd) for t in (q, k, v)), mask, bias, p)
        b, h, s, d = out.shape
        # Contiguous, as TE's: SDPA's output memory is [b, s, h, d] on CUDA's fused
        # backends (the CPU's follows the query's), so the sbhd result would otherwise
        # be a strided view that callers cannot .view (the projection copies it anyway)
        if fmt == "sbhd":
            return out.permute(2, 0, 1, 3).reshape(s, b, h * d).contiguous()
        return out.transpose(1, 2).reshape(b, s, h * d).contiguous()

    def _attend_packed(self, q, k, v, layout, mask_type: str, window):
        """``thd``: attention per sequence (NOTE [Packed sequences])."""
        p = self.attention_dropout if self.training else 0.0
        check_dropout_replayable("te.DotProductAttention", p, q)
        width = q.shape[1] * v.shape[-1]
        causal = causal_kind(mask_type)
        seq_type = {None: "no_mask", "top_left": "causal", "bottom_right": "causal_bottom_right"}
        pieces, at = [], 0
        with self._dropout_context(p):
            for q0, nq, k0, nk in zip(layout.q_starts, layout.q_lens, layout.kv_starts,
                                      layout.kv_lens):
                if q0 > at:                          # tokens of no sequence: zeros
                    pieces.append(q.new_zeros(q0 - at, width))
                    at = q0
                if nq == 0:
                    continue
                if nk == 0:
                    out = q.new_zeros(nq, width)
                else:
                    qs, ks, vs = (t[s0:s0 + n].permute(1, 0, 2).unsqueeze(0)
                                  for t, s0, n in ((q, q0, nq), (k, k0, nk), (v, k0, nk)))
                    mask = build_core_mask("te.DotProductAttention", seq_type[causal], window,
                                           None, 1, q.shape[1], nq, nk, q.device)
                    out = self._sdpa(qs, ks, vs, mask, None, p)[0].permute(1, 0, 2)
                    out = out.reshape(nq, width)
                pieces.append(out)
                at = q0 + nq
        if layout.total_q > at:
            pieces.append(q.new_zeros(layout.total_q - at, width))
        return torch.cat(pieces, dim=0)

    def forward(self, query_layer: torch.Tensor, key_layer: torch.Tensor,
                value_layer: torch.Tensor, attention_mask=None, qkv_format: Optional[str] = None,
                cu_seqlens_q: Optional[torch.Tensor] = None,
                cu_seqlens_kv: Optional[torch.Tensor] = None,
                cu_seqlens_q_padded: Optional[torch.Tensor] = None,
                cu_seqlens_kv_padded: Optional[torch.Tensor] = None,
                max_seqlen_q: Optional[int] = None, max_seqlen_kv: Optional[int] = None,
                attn_mask_type: Optional[str] = None,
                window_size: Optional[Tuple[int, int]] = None,
                checkpoint_core_attention: bool = False, core_attention_bias_type: str = "no_bias",
                core_attention_bias: Optional[torch.Tensor] = None,
                alibi_slopes: Optional[torch.Tensor] = None, fast_zero_fill: bool = True,
                inference_params=None, pad_between_seqs: Optional[bool] = None,
                fp8_output: Optional[bool] = False, num_splits: Optional[int] = 1
                ) -> torch.Tensor:
        """Attention of ``query_layer`` over ``key_layer`` / ``value_layer``.

        ``qkv_format``, ``attn_mask_type`` and ``window_size`` override the
        constructor's for this call. ``cu_seqlens_q/kv`` (``[b + 1]``) locate the
        sequences of ``thd`` input, or give padding masks' lengths for ``sbhd`` /
        ``bshd``; ``cu_seqlens_*_padded`` place ``thd`` sequences with padding
        between them. ``core_attention_bias_type``: "post_scale_bias" adds
        ``core_attention_bias`` (broadcastable to ``[b, h, s_q, s_kv]``) to the
        scaled scores, "pre_scale_bias" adds it before scaling. ``checkpoint_core_attention``
        recomputes the core during backward (through ``te.checkpoint``, replaying
        dropout). ``max_seqlen_*``, ``pad_between_seqs`` and ``fast_zero_fill`` are
        checked and need no action here (lengths are read from ``cu_seqlens``; padded
        outputs are always 0). ``alibi_slopes`` / "alibi", ``inference_params`` (KV
        cache), ``fp8_output`` and ``num_splits`` other than 1 are not implemented.
        """
        api = "te.DotProductAttention"
        reject_unsupported(f"{api}.forward", inference_params=(inference_params, None),
                           alibi_slopes=(alibi_slopes, None), fp8_output=(bool(fp8_output), False),
                           num_splits=(1 if num_splits is None else num_splits, 1))
        check_choice(api, "core_attention_bias_type", core_attention_bias_type, BIAS_TYPES)
        if core_attention_bias_type == "alibi":
            reject_unsupported(f"{api}.forward", core_attention_bias_type=("alibi", "no_bias"))
        for name, value in (("fast_zero_fill", fast_zero_fill),
                            ("checkpoint_core_attention", checkpoint_core_attention)):
            check_bool(api, name, value)
        if pad_between_seqs is not None:
            check_bool(api, "pad_between_seqs", pad_between_seqs)
        check_optional_positive_int(api, "max_seqlen_q", max_seqlen_q)
        check_optional_positive_int(api, "max_seqlen_kv", max_seqlen_kv)
        fmt = check_choice(api, "qkv_format", qkv_format if qkv_format is not None
                           else self.qkv_format, QKV_FORMATS)
        mask_type = canonical_mask_type(api, "attn_mask_type", attn_mask_type
                                        if attn_mask_type is not None else self.attn_mask_type)
        window = check_window_size(api, window_size if window_size is not None
                                   else self.window_size)
        self._check_qkv(api, fmt, query_layer, key_layer, value_layer)
        bias = self._bias(api, fmt, core_attention_bias_type, core_attention_bias)
        needs_graph = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad
            for t in (query_layer, key_layer, value_layer, bias))
        if fmt == "thd":
            if (attention_mask is not None and reads_attention_mask(mask_type)) \
                    or mask_type == "arbitrary":
                raise ValueError(f"{api}: qkv_format='thd' takes its padding from cu_seqlens_q/kv; "
                                 "pass no attention_mask and no 'arbitrary' mask type")
            layout = packed_layout(api, query_layer.shape[0], key_layer.shape[0], cu_seqlens_q,
                                   cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded)
            fn, args = self._attend_packed, (query_layer, key_layer, value_layer, layout,
                                             mask_type, window)
        else:
            s_dim, b_dim = (0, 1) if fmt == "sbhd" else (1, 0)
            mask = build_core_mask(api, mask_type, window, attention_mask,
                                   query_layer.shape[b_dim], self.heads_local,
                                   query_layer.shape[s_dim], key_layer.shape[s_dim],
                                   query_layer.device, cu_seqlens_q, cu_seqlens_kv,
                                   explicit=bias is not None)
            fn, args = self._attend, (query_layer, key_layer, value_layer, fmt, mask, bias)
        if checkpoint_core_attention and needs_graph:
            return distributed.checkpoint(fn, *args, use_reentrant=False,
                                          get_rng_state_tracker=self.get_rng_state_tracker)
        return fn(*args)

    def _bias(self, api: str, fmt: str, bias_type: str, bias) -> Optional[torch.Tensor]:
        """The additive score bias SDPA takes (``bias * softmax_scale`` before scaling)."""
        if bias_type == "no_bias":
            if bias is not None:
                raise ValueError(f"{api}: core_attention_bias was given with "
                                 "core_attention_bias_type='no_bias'; pass 'post_scale_bias' or "
                                 "'pre_scale_bias'")
            return None
        if fmt == "thd":
            reject_unsupported(f"{api}.forward (qkv_format='thd')",
                               core_attention_bias_type=(bias_type, "no_bias"))
        if not torch.is_tensor(bias) or not bias.is_floating_point() or bias.dim() != 4:
            raise ValueError(f"{api}: core_attention_bias_type={bias_type!r} needs "
                             "core_attention_bias, a 4-D floating-point tensor broadcastable to "
                             f"[b, h, s_q, s_kv], got "
                             f"{tuple(bias.shape) if torch.is_tensor(bias) else bias!r}")
        return bias * self.softmax_scale if bias_type == "pre_scale_bias" else bias

    def extra_repr(self) -> str:
        return (f"num_attention_heads={self.num_attention_heads}, kv_channels={self.kv_channels}, "
                f"num_gqa_groups={self.num_gqa_groups}, attention_dropout={self.attention_dropout}, "
                f"qkv_format={self.qkv_format!r}, attn_mask_type={self.attn_mask_type!r}")
