"""te.TransformerLayer: a transformer block built from TE modules, on
``[seq, batch, hidden]``.

Pre-norm (the default)::

    a   = residual_a + dropout(SelfAttention(Norm1(x)))     residual_a = x
    out = residual_m + dropout(MLP(Norm2(a)))                residual_m = a

With ``apply_residual_connection_post_layernorm`` the residuals are ``Norm1(x)`` and
``Norm2(a)``. With ``output_layernorm`` the attention takes ``x`` unnormalized and
``out`` is normalized at the end (post-norm), as TE does. The biases of the
projection and of FC2 are added in their GEMMs (TE returns them for a fused
bias-dropout-add; here the GEMM's epilogue is that fusion: one launch fewer each, and
the sum is rounded once). Every GEMM belongs to a TE
module (``self_attention.layernorm_qkv``, ``self_attention.proj``, ``layernorm_mlp``)
with its own FP8 scaling state.

Hidden dropout draws from torch's default generator (the hidden states are the same
on every tensor-parallel rank); attention dropout draws from the RNG tracker's
``fork()`` when ``get_rng_state_tracker`` is given.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from . import recompute
from .attention import QKV_FORMATS, MultiheadAttention
from .fp8 import FP8GlobalStateManager
from .module.layernorm import LayerNorm, RMSNorm
from .module.layernorm_mlp import LayerNormMLP
from .rng import check_dropout_replayable
from .utils import (check_choice, check_dropout, check_eps, check_hidden_states_dtype,
                    check_normalization, check_positive_int)

__all__ = ["TransformerLayer"]


class TransformerLayer(torch.nn.Module):
    """Self-attention and MLP blocks with residual connections and hidden dropout.

    Parameters
    ----------
    hidden_size, ffn_hidden_size, num_attention_heads : int
    num_gqa_groups : int, optional
        Key/value heads for grouped-query attention (``num_attention_heads`` when None).
    layernorm_epsilon : float, default 1e-5
    hidden_dropout : float, default 0.1
        Dropout on each block's output before its residual add (training mode only).
    attention_dropout : float, default 0.1
    init_method, output_layer_init_method : callable, optional
        Initialize the QKV/FC1 and the projection/FC2 weights (normal(0, 0.023) when None).
    layer_number : int, optional
    kv_channels : int, optional
        Head size; ``hidden_size // num_attention_heads`` when None.
    self_attn_mask_type : str, default "causal"
        See `DotProductAttention`.
    get_rng_state_tracker : callable, optional
        Returns the `CudaRNGStatesTracker` for attention dropout.
    apply_residual_connection_post_layernorm : bool, default False
    output_layernorm : bool, default False
    zero_centered_gamma, bias, activation, normalization, params_dtype, device
        Passed to the sub-modules (``activation``: see `LayerNormMLP`).
    attn_input_format : "sbhd" | "bshd", default "sbhd"
        ``[seq, batch, hidden]`` or ``[batch, seq, hidden]``.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_attention_heads: int,
                 num_gqa_groups: Optional[int] = None, layernorm_epsilon: float = 1e-5,
                 hidden_dropout: float = 0.1, attention_dropout: float = 0.1,
                 init_method: Optional[Callable] = None,
                 output_layer_init_method: Optional[Callable] = None,
                 layer_number: Optional[int] = None, kv_channels: Optional[int] = None,
                 self_attn_mask_type: str = "causal", *,
                 get_rng_state_tracker: Optional[Callable] = None,
                 apply_residual_connection_post_layernorm: bool = False,
                 output_layernorm: bool = False, zero_centered_gamma: bool = False,
                 bias: bool = True, activation: str = "gelu", normalization: str = "LayerNorm",
                 params_dtype: Optional[torch.dtype] = None, device=None,
                 attn_input_format: str = "sbhd"):
        super().__init__()
        api = "te.TransformerLayer"
        self.hidden_size = check_positive_int(api, "hidden_size", hidden_size)
        check_positive_int(api, "ffn_hidden_size", ffn_hidden_size)
        self.hidden_dropout = check_dropout(api, "hidden_dropout", hidden_dropout)
        check_eps(api, layernorm_epsilon, "layernorm_epsilon")
        check_normalization(api, normalization)
        self.attn_input_format = check_choice(api, "attn_input_format", attn_input_format,
                                               QKV_FORMATS)
        self.apply_residual_connection_post_layernorm = apply_residual_connection_post_layernorm
        self.output_layernorm = output_layernorm
        self.layer_number = layer_number
        post_ln_residual = apply_residual_connection_post_layernorm
        common = dict(normalization=normalization, zero_centered_gamma=zero_centered_gamma,
                      bias=bias, params_dtype=params_dtype, device=device)
        self.self_attention = MultiheadAttention(
            hidden_size, num_attention_heads, kv_channels, attention_dropout, layernorm_epsilon,
            init_method, output_layer_init_method, layer_number, self_attn_mask_type,
            num_gqa_groups=num_gqa_groups, get_rng_state_tracker=get_rng_state_tracker,
            input_layernorm=not output_layernorm,
            return_layernorm_output=post_ln_residual and not output_layernorm,
            return_bias=False, qkv_format=attn_input_format, **common)
        self.layernorm_mlp = LayerNormMLP(
            hidden_size, ffn_hidden_size, layernorm_epsilon, activation=activation,
            init_method=init_method, output_layer_init_method=output_layer_init_method,
            return_layernorm_output=post_ln_residual, return_bias=False, **common)
        if output_layernorm:
            norm = LayerNorm if normalization == "LayerNorm" else RMSNorm
            self.layernorm = norm(hidden_size, layernorm_epsilon, params_dtype=params_dtype,
                                  zero_centered_gamma=zero_centered_gamma, device=device)

    def _dropout_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if self.hidden_dropout == 0.0 or not self.training:
            return residual + x
        check_dropout_replayable("te.TransformerLayer", self.hidden_dropout, x,
                                 recompute.in_region())
        return residual + F.dropout(x, p=self.hidden_dropout, training=True)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None,
                self_attn_mask_type: Optional[str] = None, *,
                checkpoint_core_attention: bool = False) -> torch.Tensor:
        """One layer on ``hidden_states`` (``[seq, batch, hidden]`` for "sbhd").

        ``attention_mask`` and ``self_attn_mask_type`` as in `DotProductAttention`;
        ``checkpoint_core_attention`` recomputes the attention core during backward
        (through ``te.checkpoint``) instead of keeping its activations.
        """
        api = "te.TransformerLayer"
        if (not torch.is_tensor(hidden_states) or hidden_states.dim() != 3
                or hidden_states.shape[-1] != self.hidden_size):
            got = (tuple(hidden_states.shape) if torch.is_tensor(hidden_states)
                   else type(hidden_states).__name__)
            layout = "[seq, batch, hidden]" if self.attn_input_format == "sbhd" else \
                "[batch, seq, hidden]"
            raise ValueError(f"{api}: hidden_states must be {layout} with "
                             f"hidden={self.hidden_size}, got {got}")
        check_hidden_states_dtype(api, hidden_states, self.layernorm_mlp.fc1_weight,
                                  FP8GlobalStateManager.is_fp8_enabled())
        attn = self.self_attention(hidden_states, attention_mask,
                                   attn_mask_type=self_attn_mask_type,
                                   checkpoint_core_attention=checkpoint_core_attention)
        if self.apply_residual_connection_post_layernorm and not self.output_layernorm:
            attn_out, residual = attn
        else:
            attn_out, residual = attn, hidden_states
        hidden = self._dropout_add(attn_out, residual)
        mlp = self.layernorm_mlp(hidden)
        if self.apply_residual_connection_post_layernorm:
            mlp_out, residual = mlp
        else:
            mlp_out, residual = mlp, hidden
        out = self._dropout_add(mlp_out, residual)
        if self.output_layernorm:
            out = self.layernorm(out)
        return out
