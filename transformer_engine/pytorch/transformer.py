"""te.TransformerLayer: a pre-norm transformer block built from TE modules."""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .attention import MultiheadAttention
from .module.layernorm import LayerNorm, RMSNorm, apply_norm
from .module.layernorm_mlp import LayerNormMLP

__all__ = ["TransformerLayer"]


class TransformerLayer(torch.nn.Module):
    """``x + drop(Attn(Norm(x)))`` then ``+ drop(MLP(Norm(.)))`` on ``[seq, batch, hidden]``.

    Parameters
    ----------
    hidden_size, ffn_hidden_size, num_attention_heads : int
    num_gqa_groups : int, optional
        Key/value heads for grouped-query attention.
    layernorm_epsilon : float, default 1e-5
    hidden_dropout, attention_dropout : float, default 0.1
    self_attn_mask_type : "causal" | "padding" | "no_mask", default "causal"
    normalization : "LayerNorm" | "RMSNorm", default "LayerNorm"
    activation : str, default "gelu"
    kv_channels : int, optional
    apply_residual_connection_post_layernorm : bool, default False
        Take the residuals from the normalized inputs instead of the inputs.
    output_layernorm : bool, default False
        Normalize the layer's output.
    zero_centered_gamma, bias, params_dtype, device, layer_number
        Passed to the sub-modules.
    get_rng_state_tracker : callable, optional
        Attention and hidden dropout draw from the tracker's ``fork()`` when given.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_attention_heads: int,
                 num_gqa_groups: Optional[int] = None, layernorm_epsilon: float = 1e-5,
                 hidden_dropout: float = 0.1, attention_dropout: float = 0.1,
                 layer_number: Optional[int] = None, kv_channels: Optional[int] = None,
                 self_attn_mask_type: str = "causal",
                 get_rng_state_tracker: Optional[Callable] = None,
                 apply_residual_connection_post_layernorm: bool = False,
                 output_layernorm: bool = False, zero_centered_gamma: bool = False,
                 bias: bool = True, activation: str = "gelu", normalization: str = "LayerNorm",
                 params_dtype: Optional[torch.dtype] = None, device=None):
        super().__init__()
        if not 0.0 <= hidden_dropout < 1.0:
            raise ValueError(f"te.TransformerLayer: hidden_dropout must be in [0, 1), got {hidden_dropout}")
        common = dict(zero_centered_gamma=zero_centered_gamma, bias=bias, params_dtype=params_dtype,
                      device=device, normalization=normalization)
        self.self_attention = MultiheadAttention(
            hidden_size, num_attention_heads, kv_channels=kv_channels,
            attention_dropout=attention_dropout, layernorm_epsilon=layernorm_epsilon,
            layer_number=layer_number, attn_mask_type=self_attn_mask_type,
            num_gqa_groups=num_gqa_groups, input_layernorm=True,
            get_rng_state_tracker=get_rng_state_tracker, **common)
        self.layernorm_mlp = LayerNormMLP(hidden_size, ffn_hidden_size, eps=layernorm_epsilon,
                                          activation=activation, return_layernorm_output=True,
                                          **common)
        self.output_layernorm = None
        if output_layernorm:
            norm = LayerNorm if normalization == "LayerNorm" else RMSNorm
            self.output_layernorm = norm(hidden_size, eps=layernorm_epsilon, params_dtype=params_dtype,
                                         zero_centered_gamma=zero_centered_gamma, device=device)
        self.hidden_size, self.hidden_dropout = hidden_size, hidden_dropout
        self.post_ln_residual = apply_residual_connection_post_layernorm
        self.get_rng_state_tracker = get_rng_state_tracker
        self.layer_number = layer_number

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.hidden_dropout == 0.0:
            return x
        fork = (self.get_rng_state_tracker().fork() if self.get_rng_state_tracker
                else contextlib.nullcontext())
        with fork:
            return F.dropout(x, p=self.hidden_dropout, training=True)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                self_attn_mask_type: Optional[str] = None,
                checkpoint_core_attention: bool = False) -> torch.Tensor:
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError("te.TransformerLayer: hidden_states must be [seq, batch, "
                             f"hidden={self.hidden_size}], got shape {tuple(hidden_states.shape)}")
        attn = self.self_attention(hidden_states, attention_mask=attention_mask,
                                   attn_mask_type=self_attn_mask_type,
                                   checkpoint_core_attention=checkpoint_core_attention)
        residual = hidden_states
        if self.post_ln_residual:
            ln = self.self_attention.layernorm_qkv
            residual = apply_norm(hidden_states, ln.normalization, ln.layer_norm_weight,
                                  ln.layer_norm_bias, ln.eps, ln.zero_centered_gamma)
        h = residual + self._dropout(attn)
        mlp, mlp_ln = self.layernorm_mlp(h)
        out = (mlp_ln if self.post_ln_residual else h) + self._dropout(mlp)
        if self.output_layernorm is not None:
            out = self.output_layernorm(out)
        return out
