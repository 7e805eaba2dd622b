"""te.DotProductAttention (on torch's scaled_dot_product_attention) and
te.MultiheadAttention (fused QKV projection, attention core, output projection).

The attention core runs in high precision; the projections are TE modules and run
in FP8 inside an enabled ``te.autocast``.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .distributed import checkpoint
from .module.base import default_device
from .module.layernorm_linear import LayerNormLinear
from .module.linear import Linear, check_params_dtype

__all__ = ["DotProductAttention", "MultiheadAttention"]

MASK_TYPES = ("causal", "padding", "no_mask")
QKV_FORMATS = ("sbhd", "bshd")


def _positive_int(api: str, name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"{api}: {name} must be a positive int, got {v!r}")


class DotProductAttention(torch.nn.Module):
    """``softmax(Q K^T / sqrt(d) + mask) V`` with optional GQA and dropout.

    Parameters
    ----------
    num_attention_heads : int
    kv_channels : int
        Head size d.
    num_gqa_groups : int, optional
        Number of key/value heads (default: ``num_attention_heads``); must divide it.
    attention_dropout : float, default 0.0
    qkv_format : "sbhd" | "bshd", default "sbhd"
    attn_mask_type : "causal" | "padding" | "no_mask", default "causal"
    get_rng_state_tracker : callable, optional
        Dropout draws from the tracker's ``fork()`` when given.
    """

    def __init__(self, num_attention_heads: int, kv_channels: int,
                 num_gqa_groups: Optional[int] = None, attention_dropout: float = 0.0,
                 qkv_format: str = "sbhd", attn_mask_type: str = "causal",
                 get_rng_state_tracker: Optional[Callable] = None, layer_number=None):
        super().__init__()
        api = "te.DotProductAttention"
        _positive_int(api, "num_attention_heads", num_attention_heads)
        _positive_int(api, "kv_channels", kv_channels)
        groups = num_gqa_groups if num_gqa_groups is not None else num_attention_heads
        _positive_int(api, "num_gqa_groups", groups)
        if num_attention_heads % groups != 0:
            raise ValueError(f"{api}: num_gqa_groups={groups} must divide "
                             f"num_attention_heads={num_attention_heads}")
        if qkv_format not in QKV_FORMATS:
            raise ValueError(f"{api}: qkv_format must be one of {QKV_FORMATS}, got {qkv_format!r}")
        if attn_mask_type not in MASK_TYPES:
            raise ValueError(f"{api}: attn_mask_type must be one of {MASK_TYPES}, got {attn_mask_type!r}")
        if not 0.0 <= attention_dropout < 1.0:
            raise ValueError(f"{api}: attention_dropout must be in [0, 1), got {attention_dropout}")
        self.num_attention_heads, self.kv_channels, self.num_gqa_groups = (
            num_attention_heads, kv_channels, groups)
        self.attention_dropout, self.qkv_format = attention_dropout, qkv_format
        self.attn_mask_type, self.get_rng_state_tracker = attn_mask_type, get_rng_state_tracker
        self.layer_number = layer_number

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              attention_mask: Optional[torch.Tensor], mask_type: str) -> torch.Tensor:
        # to [batch, heads, seq, dim]
        perm = (1, 2, 0, 3) if self.qkv_format == "sbhd" else (0, 2, 1, 3)
        q, k, v = (t.permute(*perm) for t in (q, k, v))
        if self.num_gqa_groups != self.num_attention_heads:
            rep = self.num_attention_heads // self.num_gqa_groups
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        mask = None
        if mask_type == "padding":
            if attention_mask is None:
                raise ValueError("te.DotProductAttention: attn_mask_type='padding' needs an "
                                 "attention_mask (bool [batch, 1, 1, seq], True = masked out)")
            mask = ~attention_mask.to(torch.bool)
        elif attention_mask is not None and mask_type == "no_mask":
            mask = ~attention_mask.to(torch.bool)
        p = self.attention_dropout if self.training else 0.0
        fork = (self.get_rng_state_tracker().fork() if (self.get_rng_state_tracker and p > 0)
                else contextlib.nullcontext())
        with fork:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p,
                                                 is_causal=(mask_type == "causal"))
        # back to the input format, heads folded into the hidden dimension
        if self.qkv_format == "sbhd":
            out = out.permute(2, 0, 1, 3)
        else:
            out = out.permute(0, 2, 1, 3)
        return out.reshape(*out.shape[:2], -1)

    def forward(self, query_layer: torch.Tensor, key_layer: torch.Tensor,
                value_layer: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                attn_mask_type: Optional[str] = None,
                checkpoint_core_attention: bool = False) -> torch.Tensor:
        api = "te.DotProductAttention"
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if mask_type not in MASK_TYPES:
            raise ValueError(f"{api}: attn_mask_type must be one of {MASK_TYPES}, got {mask_type!r}")
        for name, t, heads in (("query_layer", query_layer, self.num_attention_heads),
                               ("key_layer", key_layer, self.num_gqa_groups),
                               ("value_layer", value_layer, self.num_gqa_groups)):
            if t.dim() != 4 or t.shape[2] != heads or t.shape[3] != self.kv_channels:
                raise ValueError(f"{api}: {name} must be [{self.qkv_format}] with {heads} heads of "
                                 f"size {self.kv_channels}, got shape {tuple(t.shape)}")
        if checkpoint_core_attention and torch.is_grad_enabled():
            return checkpoint(self._core, query_layer, key_layer, value_layer, attention_mask,
                              mask_type, use_reentrant=False,
                              get_rng_state_tracker=self.get_rng_state_tracker)
        return self._core(query_layer, key_layer, value_layer, attention_mask, mask_type)


class MultiheadAttention(torch.nn.Module):
    """Self-attention: (Norm +) fused QKV projection, `DotProductAttention`, output
    projection. Takes and returns ``[seq, batch, hidden]`` (``qkv_format="sbhd"``).

    Parameters
    ----------
    hidden_size, num_attention_heads : int
    kv_channels : int, optional
        Head size (default ``hidden_size // num_attention_heads``).
    attention_dropout : float, default 0.1
    layernorm_epsilon : float, default 1e-5
    attn_mask_type : str, default "causal"
    num_gqa_groups : int, optional
    input_layernorm : bool, default False
        Normalize the input inside the QKV projection (a `LayerNormLinear`).
    normalization, zero_centered_gamma, bias, params_dtype, device, qkv_format,
    get_rng_state_tracker
        As in the modules they are passed to.
    """

    def __init__(self, hidden_size: int, num_attention_heads: int,
                 kv_channels: Optional[int] = None, attention_dropout: float = 0.1,
                 layernorm_epsilon: float = 1e-5, layer_number=None,
                 attn_mask_type: str = "causal", num_gqa_groups: Optional[int] = None,
                 input_layernorm: bool = False, normalization: str = "LayerNorm",
                 zero_centered_gamma: bool = False, bias: bool = True,
                 params_dtype: Optional[torch.dtype] = None, device=None,
                 qkv_format: str = "sbhd", get_rng_state_tracker: Optional[Callable] = None):
        super().__init__()
        api = "te.MultiheadAttention"
        _positive_int(api, "hidden_size", hidden_size)
        _positive_int(api, "num_attention_heads", num_attention_heads)
        if kv_channels is None:
            if hidden_size % num_attention_heads != 0:
                raise ValueError(f"{api}: hidden_size={hidden_size} is not divisible by "
                                 f"num_attention_heads={num_attention_heads}; pass kv_channels")
            kv_channels = hidden_size // num_attention_heads
        groups = num_gqa_groups if num_gqa_groups is not None else num_attention_heads
        check_params_dtype(api, params_dtype)
        device = default_device(device)
        self.hidden_size, self.num_attention_heads = hidden_size, num_attention_heads
        self.kv_channels, self.num_gqa_groups = kv_channels, groups
        qkv_size = (num_attention_heads + 2 * groups) * kv_channels
        common = dict(bias=bias, params_dtype=params_dtype, device=device)
        if input_layernorm:
            self.layernorm_qkv = LayerNormLinear(hidden_size, qkv_size, eps=layernorm_epsilon,
                                                 normalization=normalization,
                                                 zero_centered_gamma=zero_centered_gamma, **common)
        else:
            self.qkv = Linear(hidden_size, qkv_size, **common)
        self.core_attention = DotProductAttention(
            num_attention_heads, kv_channels, num_gqa_groups=groups,
            attention_dropout=attention_dropout, qkv_format=qkv_format,
            attn_mask_type=attn_mask_type, get_rng_state_tracker=get_rng_state_tracker,
            layer_number=layer_number)
        self.proj = Linear(num_attention_heads * kv_channels, hidden_size, **common)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                attn_mask_type: Optional[str] = None,
                checkpoint_core_attention: bool = False) -> torch.Tensor:
        qkv_proj = getattr(self, "layernorm_qkv", None) or self.qkv
        qkv = qkv_proj(hidden_states)
        h, g, d = self.num_attention_heads, self.num_gqa_groups, self.kv_channels
        q, k, v = qkv.split([h * d, g * d, g * d], dim=-1)
        q = q.reshape(*q.shape[:2], h, d)
        k = k.reshape(*k.shape[:2], g, d)
        v = v.reshape(*v.shape[:2], g, d)
        context = self.core_attention(q, k, v, attention_mask=attention_mask,
                                      attn_mask_type=attn_mask_type,
                                      checkpoint_core_attention=checkpoint_core_attention)
        return self.proj(context)
