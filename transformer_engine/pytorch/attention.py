"""te.DotProductAttention (on ``torch.nn.functional.scaled_dot_product_attention``)
and te.MultiheadAttention (fused QKV projection, attention core, output projection).

The attention core ``softmax(Q K^T * scale) V`` runs in high precision; only the
projections are FP8 (they are TE modules, each with its own scaling state).

Masks follow TE: a boolean ``attention_mask`` in which True means *masked out*
(SDPA's boolean masks mean the opposite; we invert). Padding masks are
``[batch, 1, 1, seq]`` for self-attention, or a pair ``(q_mask, kv_mask)``; padded
query positions produce zeros. A query row whose keys are all masked gets zeros.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F

from . import distributed, recompute
from .module.base import default_device
from .fp8 import FP8GlobalStateManager
from .rng import check_dropout_replayable
from .module.layernorm_linear import LayerNormLinear, pack_outputs
from .module.linear import Linear
from .utils import (check_choice, check_dropout, check_eps, check_hidden_states_dtype,
                    check_params_dtype, check_positive_int)

__all__ = ["DotProductAttention", "MultiheadAttention", "MASK_TYPES", "QKV_FORMATS"]

MASK_TYPES = ("no_mask", "causal", "padding", "padding_causal", "arbitrary")
QKV_FORMATS = ("sbhd", "bshd")


def _padding_mask(api: str, mask, batch: int, seq: int, which: str, device) -> torch.Tensor:
    """``[batch, 1, 1, seq]`` bool (True = padding) -> ``[batch, seq]`` keep-mask."""
    if not torch.is_tensor(mask) or mask.dtype != torch.bool or tuple(mask.shape) != (
            batch, 1, 1, seq):
        got = (f"{mask.dtype} tensor of shape {tuple(mask.shape)}" if torch.is_tensor(mask)
               else type(mask).__name__)
        raise ValueError(f"{api}: a padding mask for the {which} must be a bool tensor of "
                         f"shape [batch, 1, 1, seq] = {[batch, 1, 1, seq]} (True = padding), "
                         f"got {got}")
    return ~mask.reshape(batch, seq).to(device)


def build_sdpa_mask(api: str, mask_type: str, attention_mask, batch: int, heads: int,
                    sq: int, skv: int, device) -> Tuple[Optional[torch.Tensor], bool,
                                                        Optional[torch.Tensor]]:
    """Translate a TE mask into SDPA's terms: ``(attn_mask, is_causal, q_keep)`` where
    ``attn_mask`` is True where attention is *allowed* and ``q_keep`` ``[batch, sq]``
    marks the query positions whose output is kept (None: all)."""
    if mask_type in ("no_mask", "causal"):
        if attention_mask is not None:
            raise ValueError(f"{api}: attn_mask_type={mask_type!r} takes no attention_mask; "
                             "use 'padding', 'padding_causal' or 'arbitrary' to pass one")
        return None, mask_type == "causal", None
    if attention_mask is None:
        raise ValueError(f"{api}: attn_mask_type={mask_type!r} needs an attention_mask "
                         "(bool, True = masked out)")
    if mask_type == "arbitrary":
        if not torch.is_tensor(attention_mask) or attention_mask.dtype != torch.bool:
            raise ValueError(f"{api}: an 'arbitrary' attention_mask must be a bool tensor "
                             "broadcastable to [batch, heads, seq_q, seq_kv] (True = masked "
                             f"out), got {getattr(attention_mask, 'dtype', type(attention_mask))}")
        try:
            allowed = ~attention_mask.broadcast_to(batch, heads, sq, skv).to(device)
        except RuntimeError:
            raise ValueError(f"{api}: an 'arbitrary' attention_mask of shape "
                             f"{tuple(attention_mask.shape)} does not broadcast to "
                             f"[batch, heads, seq_q, seq_kv] = {[batch, heads, sq, skv]}") from None
        return allowed, False, None
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
    q_keep = _padding_mask(api, q_mask, batch, sq, "queries", device)
    kv_keep = _padding_mask(api, kv_mask, batch, skv, "keys", device)
    allowed = kv_keep[:, None, None, :].expand(batch, 1, sq, skv)
    if mask_type == "padding_causal":
        allowed = allowed & torch.ones(sq, skv, dtype=torch.bool, device=device).tril()
    return allowed, False, q_keep


class DotProductAttention(torch.nn.Module):
    """``softmax(Q K^T * softmax_scale + mask) V`` per head, with grouped-query
    attention and attention dropout, on ``F.scaled_dot_product_attention``.

    Parameters
    ----------
    num_attention_heads : int
    kv_channels : int
        Head size d.
    num_gqa_groups : int, optional
        Key/value heads (``num_attention_heads`` when None); must divide it. Query
        head i attends with key/value head ``i // (num_attention_heads / num_gqa_groups)``.
    attention_dropout : float, default 0.0
        Dropout on the attention probabilities, in training mode only.
    qkv_format : "sbhd" | "bshd", default "sbhd"
        Layout of query/key/value: ``[seq, batch, heads, d]`` or ``[batch, seq, heads, d]``.
    attn_mask_type : str, default "causal"
        "no_mask", "causal", "padding", "padding_causal" or "arbitrary" (see module doc).
    get_rng_state_tracker : callable, optional
        Returns a `CudaRNGStatesTracker`; attention dropout then draws from its
        ``fork()`` and ``checkpoint_core_attention`` replays it.
    layer_number : int, optional
        Kept for TE compatibility (not used by the math).
    softmax_scale : float, optional
        ``1 / sqrt(kv_channels)`` when None.

    Forward returns ``[seq, batch, heads * d]`` (sbhd) or ``[batch, seq, heads * d]``.
    """

    def __init__(self, num_attention_heads: int, kv_channels: int,
                 num_gqa_groups: Optional[int] = None, attention_dropout: float = 0.0,
                 qkv_format: str = "sbhd", attn_mask_type: str = "causal", *,
                 get_rng_state_tracker: Optional[Callable] = None,
                 layer_number: Optional[int] = None, softmax_scale: Optional[float] = None):
        super().__init__()
        api = "te.DotProductAttention"
        self.num_attention_heads = check_positive_int(api, "num_attention_heads",
                                                      num_attention_heads)
        self.kv_channels = check_positive_int(api, "kv_channels", kv_channels)
        groups = num_gqa_groups if num_gqa_groups is not None else num_attention_heads
        self.num_gqa_groups = check_positive_int(api, "num_gqa_groups", groups)
        if num_attention_heads % groups != 0:
            raise ValueError(f"{api}: num_gqa_groups={groups} must divide "
                             f"num_attention_heads={num_attention_heads}")
        self.attention_dropout = check_dropout(api, "attention_dropout", attention_dropout)
        self.qkv_format = check_choice(api, "qkv_format", qkv_format, QKV_FORMATS)
        self.attn_mask_type = check_choice(api, "attn_mask_type", attn_mask_type, MASK_TYPES)
        if get_rng_state_tracker is not None and not callable(get_rng_state_tracker):
            raise TypeError(f"{api}: get_rng_state_tracker must be a callable returning a "
                            f"CudaRNGStatesTracker, got {type(get_rng_state_tracker).__name__}")
        self.get_rng_state_tracker = get_rng_state_tracker
        self.layer_number = layer_number
        if softmax_scale is not None and (
                isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float))
                or not math.isfinite(softmax_scale) or not softmax_scale > 0):
            raise ValueError(f"{api}: softmax_scale must be None or a finite positive float, "
                             f"got {softmax_scale!r}")
        self.softmax_scale = (float(softmax_scale) if softmax_scale is not None
                              else 1.0 / math.sqrt(kv_channels))

    def _check_qkv(self, api: str, fmt: str, q, k, v) -> None:
        for name, t, heads in (("query_layer", q, self.num_attention_heads),
                               ("key_layer", k, self.num_gqa_groups),
                               ("value_layer", v, self.num_gqa_groups)):
            if not torch.is_tensor(t):
                raise TypeError(f"{api}: {name} must be a tensor, got {type(t).__name__}")
            if t.dim() != 4 or t.shape[2] != heads or t.shape[3] != self.kv_channels:
                layout = "[seq, batch, heads, d]" if fmt == "sbhd" else "[batch, seq, heads, d]"
                raise ValueError(f"{api}: {name} must be {layout} ({fmt}) with {heads} heads "
                                 f"of size d={self.kv_channels}, got shape {tuple(t.shape)}")
        if not q.is_floating_point() or not (q.dtype == k.dtype == v.dtype):
            raise TypeError(f"{api}: query_layer, key_layer and value_layer must be floating-point "
                            f"tensors of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
        if not (q.device == k.device == v.device):
            raise ValueError(f"{api}: query_layer, key_layer and value_layer must be on one "
                             f"device, got {q.device}, {k.device}, {v.device}")
        b_dim = 1 if fmt == "sbhd" else 0
        if not (q.shape[b_dim] == k.shape[b_dim] == v.shape[b_dim]) or k.shape != v.shape:
            raise ValueError(f"{api}: query, key and value disagree on batch or key/value "
                             f"length: {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)} "
                             f"({fmt})")

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fmt: str,
                allowed: Optional[torch.Tensor], is_causal: bool,
                q_keep: Optional[torch.Tensor]) -> torch.Tensor:
        """The attention core on ``fmt`` tensors; the part ``checkpoint_core_attention``
        recomputes."""
        to_bhsd = (1, 2, 0, 3) if fmt == "sbhd" else (0, 2, 1, 3)
        q, k, v = (t.permute(*to_bhsd) for t in (q, k, v))
        rep = self.num_attention_heads // self.num_gqa_groups
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        p = self.attention_dropout if self.training else 0.0
        check_dropout_replayable("te.DotProductAttention", p, q, recompute.in_region())
        rng = (self.get_rng_state_tracker().fork()
               if p > 0.0 and self.get_rng_state_tracker is not None else contextlib.nullcontext())
        with rng:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=p,
                                                 is_causal=is_causal, scale=self.softmax_scale)
        if q_keep is not None:
            out = out.masked_fill(~q_keep[:, None, :, None], 0.0)
        b, h, s, d = out.shape
        if fmt == "sbhd":
            return out.permute(2, 0, 1, 3).reshape(s, b, h * d)
        return out.transpose(1, 2).reshape(b, s, h * d)

    def forward(self, query_layer: torch.Tensor, key_layer: torch.Tensor,
                value_layer: torch.Tensor, attention_mask=None, qkv_format: Optional[str] = None,
                *, attn_mask_type: Optional[str] = None,
                checkpoint_core_attention: bool = False) -> torch.Tensor:
        """Attention of ``query_layer`` over ``key_layer`` / ``value_layer``.

        ``qkv_format`` and ``attn_mask_type`` override the constructor's for this call;
        ``checkpoint_core_attention`` recomputes the core during backward (through
        ``te.checkpoint``, replaying dropout) instead of keeping its activations.
        """
        api = "te.DotProductAttention"
        fmt = check_choice(api, "qkv_format", qkv_format if qkv_format is not None
                            else self.qkv_format, QKV_FORMATS)
        mask_type = check_choice(api, "attn_mask_type", attn_mask_type
                                  if attn_mask_type is not None else self.attn_mask_type,
                                  MASK_TYPES)
        self._check_qkv(api, fmt, query_layer, key_layer, value_layer)
        s_dim, b_dim = (0, 1) if fmt == "sbhd" else (1, 0)
        allowed, is_causal, q_keep = build_sdpa_mask(
            api, mask_type, attention_mask, query_layer.shape[b_dim], self.num_attention_heads,
            query_layer.shape[s_dim], key_layer.shape[s_dim], query_layer.device)
        args = (query_layer, key_layer, value_layer, fmt, allowed, is_causal, q_keep)
        needs_graph = torch.is_grad_enabled() and any(
            t.requires_grad for t in (query_layer, key_layer, value_layer))
        if checkpoint_core_attention and needs_graph:
            return distributed.checkpoint(self._attend, *args, use_reentrant=False,
                                          get_rng_state_tracker=self.get_rng_state_tracker)
        return self._attend(*args)

    def extra_repr(self) -> str:
        return (f"num_attention_heads={self.num_attention_heads}, kv_channels={self.kv_channels}, "
                f"num_gqa_groups={self.num_gqa_groups}, attention_dropout={self.attention_dropout}, "
                f"qkv_format={self.qkv_format!r}, attn_mask_type={self.attn_mask_type!r}")


class MultiheadAttention(torch.nn.Module):
    """Self-attention: fused QKV projection (a `LayerNormLinear` named
    ``layernorm_qkv`` with ``input_layernorm``, else a `Linear` named ``qkv``),
    `DotProductAttention` (``core_attention``) and the output projection ``proj``.

    Parameters
    ----------
    hidden_size, num_attention_heads : int
    kv_channels : int, optional
        Head size; ``hidden_size // num_attention_heads`` when None.
    attention_dropout : float, default 0.1
    layernorm_epsilon : float, default 1e-5
    init_method, output_layer_init_method : callable, optional
        Initialize the QKV and the output projection weights (normal(0, 0.023) when None).
    layer_number : int, optional
    attn_mask_type : str, default "causal"
    num_gqa_groups : int, optional
        Key/value heads for grouped-query attention.
    input_layernorm : bool, default False
        Normalize the input inside the QKV projection.
    return_layernorm_output : bool, default False
        Also return the normalized input (needs ``input_layernorm``).
    return_bias : bool, default False
        Return the output projection's bias instead of adding it.
    qkv_weight_interleaved : bool, default True
        QKV weight rows are grouped per key/value head, ``[q heads of the group, k, v]``
        for each group, as TE lays them out; False: all q rows, then k, then v.
    normalization, zero_centered_gamma, bias, params_dtype, device
        As in `LayerNormLinear`.
    qkv_format : "sbhd" | "bshd", default "sbhd"
        Layout of ``hidden_states``: ``[seq, batch, hidden]`` or ``[batch, seq, hidden]``.
    get_rng_state_tracker : callable, optional
        Passed to `DotProductAttention`.

    Returns
    -------
    ``out``, then the projection bias if ``return_bias``, then the normalized input
    if ``return_layernorm_output``.
    """

    def __init__(self, hidden_size: int, num_attention_heads: int,
                 kv_channels: Optional[int] = None, attention_dropout: float = 0.1,
                 layernorm_epsilon: float = 1e-5, init_method: Optional[Callable] = None,
                 output_layer_init_method: Optional[Callable] = None,
                 layer_number: Optional[int] = None, attn_mask_type: str = "causal", *,
                 num_gqa_groups: Optional[int] = None,
                 get_rng_state_tracker: Optional[Callable] = None,
                 input_layernorm: bool = False, return_layernorm_output: bool = False,
                 return_bias: bool = False, qkv_weight_interleaved: bool = True,
                 normalization: str = "LayerNorm", zero_centered_gamma: bool = False,
                 bias: bool = True, params_dtype: Optional[torch.dtype] = None, device=None,
                 qkv_format: str = "sbhd"):
        super().__init__()
        api = "te.MultiheadAttention"
        self.hidden_size = check_positive_int(api, "hidden_size", hidden_size)
        heads = check_positive_int(api, "num_attention_heads", num_attention_heads)
        if kv_channels is None:
            if hidden_size % heads != 0:
                raise ValueError(f"{api}: hidden_size={hidden_size} is not divisible by "
                                 f"num_attention_heads={heads}; pass kv_channels")
            kv_channels = hidden_size // heads
        groups = num_gqa_groups if num_gqa_groups is not None else heads
        if return_layernorm_output and not input_layernorm:
            raise ValueError(f"{api}: return_layernorm_output=True needs input_layernorm=True "
                             "(there is no normalization output otherwise)")
        check_eps(api, layernorm_epsilon, "layernorm_epsilon")
        check_params_dtype(api, params_dtype)
        device = default_device(device)
        # DotProductAttention validates heads, groups, dropout, mask type and format.
        self.core_attention = DotProductAttention(
            heads, kv_channels, groups, attention_dropout, qkv_format, attn_mask_type,
            get_rng_state_tracker=get_rng_state_tracker, layer_number=layer_number)
        self.num_attention_heads, self.kv_channels, self.num_gqa_groups = heads, kv_channels, groups
        self.qkv_weight_interleaved = qkv_weight_interleaved
        self.input_layernorm, self.return_layernorm_output = input_layernorm, return_layernorm_output
        self.return_bias, self.layer_number = return_bias, layer_number
        qkv_size = (heads + 2 * groups) * kv_channels
        if input_layernorm:
            self.layernorm_qkv = LayerNormLinear(
                hidden_size, qkv_size, layernorm_epsilon, bias=bias, normalization=normalization,
                zero_centered_gamma=zero_centered_gamma, init_method=init_method,
                return_layernorm_output=return_layernorm_output, params_dtype=params_dtype,
                device=device)
        else:
            self.qkv = Linear(hidden_size, qkv_size, bias=bias, params_dtype=params_dtype,
                              device=device)
            if init_method is not None:
                init_method(self.qkv.weight)
        self.proj = Linear(heads * kv_channels, hidden_size, bias=bias, params_dtype=params_dtype,
                           device=device, return_bias=return_bias)
        if output_layer_init_method is not None:
            output_layer_init_method(self.proj.weight)

    def _split_qkv(self, mixed: torch.Tensor):
        h, g, d = self.num_attention_heads, self.num_gqa_groups, self.kv_channels
        lead = mixed.shape[:-1]
        if self.qkv_weight_interleaved:
            per_group = mixed.view(*lead, g, h // g + 2, d)
            q = per_group[..., :h // g, :].reshape(*lead, h, d)
            return q, per_group[..., h // g, :], per_group[..., h // g + 1, :]
        q, k, v = mixed.split([h * d, g * d, g * d], dim=-1)
        return q.reshape(*lead, h, d), k.reshape(*lead, g, d), v.reshape(*lead, g, d)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, *,
                attn_mask_type: Optional[str] = None, checkpoint_core_attention: bool = False):
        api = "te.MultiheadAttention"
        if not torch.is_tensor(hidden_states) or hidden_states.dim() != 3:
            got = (tuple(hidden_states.shape) if torch.is_tensor(hidden_states)
                   else type(hidden_states).__name__)
            raise ValueError(f"{api}: hidden_states must be a 3-D tensor "
                             f"({self.core_attention.qkv_format[0]}, "
                             f"{self.core_attention.qkv_format[1]}, hidden), got {got}")
        check_hidden_states_dtype(api, hidden_states, self.proj.weight,
                                  FP8GlobalStateManager.is_fp8_enabled())
        ln_out = None
        if self.input_layernorm:
            mixed = self.layernorm_qkv(hidden_states)
            if self.return_layernorm_output:
                mixed, ln_out = mixed
        else:
            mixed = self.qkv(hidden_states)
        q, k, v = self._split_qkv(mixed)
        context = self.core_attention(q, k, v, attention_mask, attn_mask_type=attn_mask_type,
                                      checkpoint_core_attention=checkpoint_core_attention)
        out = self.proj(context)
        proj_bias = None
        if self.return_bias:
            out, proj_bias = out
        return pack_outputs(out, proj_bias, self.return_bias, ln_out)
