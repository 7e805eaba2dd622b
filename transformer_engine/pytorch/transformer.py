"""te.TransformerLayer: a transformer block built from TE modules, with TE's
signature and submodule names.

Pre-norm (the default)::

    a   = residual_a + drop_path(dropout(SelfAttention(Norm1(x))))     residual_a = x
    c   = a + dropout(CrossAttention(Norm(a), encoder_output))          (layer_type="decoder")
    out = residual_m + drop_path(dropout(MLP(Norm2(c))))                residual_m = c

With ``apply_residual_connection_post_layernorm`` the residuals are the norms'
outputs. With ``output_layernorm`` the attention takes ``x`` unnormalized and ``out``
is normalized at the end (post-norm). With ``parallel_attention_mlp`` both blocks
read ``x`` (each through its own norm): ``out = x + drop_path(dropout(attn + mlp))``.
The biases of the projection and of FC2 are added in their GEMMs (TE returns them for
a fused bias-dropout-add; here the GEMM's epilogue is that fusion: one launch fewer
each, and the sum is rounded once). Every GEMM belongs to a TE module
(``self_attention.layernorm_qkv``, ``self_attention.proj``, ``layernorm_mlp``, ...)
with its own FP8 scaling state.

Hidden dropout and drop path draw from torch's default generator (the hidden
states are the same on every tensor-parallel rank); attention dropout draws from
the RNG tracker's ``fork()`` when ``get_rng_state_tracker`` is given.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F

from .attention import MultiheadAttention
from .attention.masks import canonical_mask_type, check_window_size
from .fp8 import FP8GlobalStateManager
from .module.layernorm import LayerNorm, RMSNorm
from .module.layernorm_mlp import LayerNormMLP
from .rng import check_dropout_replayable
from .tensor_parallel import get_distributed_world_size
from .utils import (check_bool, check_choice, check_dropout, check_eps, check_hidden_states_dtype,
                    check_normalization, check_optional_positive_int, check_positive_int,
                    reject_unsupported, check_process_group)

__all__ = ["TransformerLayer"]

INPUT_FORMATS = ("sbhd", "bshd", "thd")


class TransformerLayer(torch.nn.Module):
    """Self-attention (and cross attention for ``layer_type="decoder"``) and MLP blocks
    with residual connections, hidden dropout and drop path. TE's signature.

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
    window_size : (int, int), optional
        Sliding window of the self-attention (see `DotProductAttention`).
    enc_dec_attn_mask_type : str, default "no_mask"
    enc_dec_window_size : (int, int), optional
        The cross attention's.
    tp_group, tp_size, sequence_parallel, set_parallel_mode
        Tensor parallelism (QKV and FC1 column-parallel, PROJ and FC2 row-parallel).
    params_dtype : torch.dtype, optional
        float32, bfloat16 or float16.
    get_rng_state_tracker : callable, optional
        Weight initialization and attention dropout draw from its ``fork()``.
    fuse_wgrad_accumulation : bool, default False
        Weight gradients into ``main_grad`` (needs ``fuse_qkv_params=True``).
    seq_length, micro_batch_size : int, optional
        With ``sequence_parallel`` the input's sequence dimension must be
        ``seq_length / tp_size``; otherwise no effect (TE's JIT warm-up hints).
    apply_residual_connection_post_layernorm : bool, default False
    output_layernorm : bool, default False
    parallel_attention_mlp : bool, default False
    layer_type : "encoder" | "decoder", default "encoder"
    drop_path_rate : float, default 0.0
        Stochastic depth: drop each sample's block output with this probability
        (training mode only), scaling the kept ones by ``1 / (1 - rate)``. At 1.0
        every block output is dropped (the layer passes its residuals through, with
        zero gradients into the blocks), where TE's formula divides 0 by 0.
    fuse_qkv_params : bool, default False
        One QKV weight instead of ``query_weight`` / ``key_weight`` / ``value_weight``
        (NOTE [QKV parameter layouts] in multi_head_attention.py).
    zero_centered_gamma, qkv_weight_interleaved, bias, activation, normalization, device
        Passed to the sub-modules (``activation``: see `LayerNormMLP`).
    attn_input_format : "sbhd" | "bshd" | "thd", default "sbhd"
        ``[seq, batch, hidden]``, ``[batch, seq, hidden]`` or packed ``[tokens, hidden]``.
    name : str, optional
    activation_params, qk_norm_type, qk_norm_eps, qk_norm_before_rope,
    rotary_pos_interleaved, softmax_type
        Passed to the sub-modules.
    ub_tp_comm_overlap : bool, default False
        Not implemented (True raises ``NotImplementedError``); the other ``ub_*``
        flags only act together with it, as in TE.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_attention_heads: int,
                 num_gqa_groups: Optional[int] = None, layernorm_epsilon: float = 1e-5,
                 hidden_dropout: float = 0.1, attention_dropout: float = 0.1,
                 init_method: Optional[Callable] = None,
                 output_layer_init_method: Optional[Callable] = None,
                 layer_number: Optional[int] = None, kv_channels: Optional[int] = None,
                 self_attn_mask_type: str = "causal",
                 window_size: Optional[Tuple[int, int]] = None,
                 enc_dec_attn_mask_type: str = "no_mask",
                 enc_dec_window_size: Optional[Tuple[int, int]] = None, tp_group=None,
                 tp_size: int = 1, params_dtype: Optional[torch.dtype] = None,
                 get_rng_state_tracker: Optional[Callable] = None,
                 fuse_wgrad_accumulation: bool = False, seq_length: Optional[int] = None,
                 micro_batch_size: Optional[int] = None, sequence_parallel: bool = False,
                 apply_residual_connection_post_layernorm: bool = False,
                 output_layernorm: bool = False, parallel_attention_mlp: bool = False,
                 layer_type: str = "encoder", drop_path_rate: float = 0.0,
                 set_parallel_mode: bool = False, fuse_qkv_params: bool = False,
                 zero_centered_gamma: bool = False, qkv_weight_interleaved: bool = True,
                 ub_tp_comm_overlap: bool = False, ub_overlap_ag: bool = True,
                 ub_overlap_rs: bool = True, ub_overlap_rs_dgrad: bool = False,
                 ub_bulk_dgrad: bool = True, ub_bulk_wgrad: bool = True, bias: bool = True,
                 activation: str = "gelu", normalization: str = "LayerNorm", device=None,
                 attn_input_format: str = "sbhd", name: Optional[str] = None, *,
                 activation_params: Optional[dict] = None, qk_norm_type: Optional[str] = None,
                 qk_norm_eps: float = 1e-6, qk_norm_before_rope: bool = False,
                 rotary_pos_interleaved: bool = False, softmax_type: str = "vanilla"):
        super().__init__()
        api = "te.TransformerLayer"
        reject_unsupported(api, ub_tp_comm_overlap=(ub_tp_comm_overlap, False))
        self.hidden_size = check_positive_int(api, "hidden_size", hidden_size)
        check_positive_int(api, "ffn_hidden_size", ffn_hidden_size)
        self.hidden_dropout = check_dropout(api, "hidden_dropout", hidden_dropout)
        self.drop_path_rate = check_dropout(api, "drop_path_rate", drop_path_rate,
                                            allow_one=True)
        check_eps(api, layernorm_epsilon, "layernorm_epsilon")
        check_normalization(api, normalization)
        self.attn_input_format = check_choice(api, "attn_input_format", attn_input_format,
                                              INPUT_FORMATS)
        self.layer_type = check_choice(api, "layer_type", layer_type, ("encoder", "decoder"))
        self.self_attn_mask_type = canonical_mask_type(api, "self_attn_mask_type",
                                                       self_attn_mask_type)
        self.enc_dec_attn_mask_type = canonical_mask_type(api, "enc_dec_attn_mask_type",
                                                          enc_dec_attn_mask_type)
        self.window_size = check_window_size(api, window_size)
        self.enc_dec_window_size = check_window_size(api, enc_dec_window_size)
        post_ln = check_bool(api, "apply_residual_connection_post_layernorm",
                             apply_residual_connection_post_layernorm)
        self.apply_residual_connection_post_layernorm = post_ln
        self.output_layernorm = check_bool(api, "output_layernorm", output_layernorm)
        self.parallel_attention_mlp = check_bool(api, "parallel_attention_mlp",
                                                 parallel_attention_mlp)
        if self.parallel_attention_mlp and (layer_type != "encoder" or post_ln
                                            or output_layernorm):
            raise ValueError(f"{api}: parallel_attention_mlp=True needs layer_type='encoder' and "
                             "neither apply_residual_connection_post_layernorm nor "
                             "output_layernorm (as in TE)")
        if fuse_wgrad_accumulation and not fuse_qkv_params:
            raise ValueError(f"{api}: fuse_wgrad_accumulation=True needs fuse_qkv_params=True "
                             "(one QKV weight, as in TE)")
        if self.attn_input_format == "thd" and self.drop_path_rate > 0.0:
            reject_unsupported(f"{api} (attn_input_format='thd')",
                               drop_path_rate=(drop_path_rate, 0.0))
        self.seq_length = check_optional_positive_int(api, "seq_length", seq_length)
        self.micro_batch_size = check_optional_positive_int(api, "micro_batch_size",
                                                            micro_batch_size)
        self.layer_number, self.name = layer_number, name
        check_process_group(api, "tp_group", tp_group)
        check_positive_int(api, "tp_size", tp_size)
        self.tp_size = tp_size if tp_group is None else get_distributed_world_size(tp_group)
        self.sequence_parallel = self.tp_size > 1 and check_bool(api, "sequence_parallel",
                                                                 sequence_parallel)
        sub = (lambda s: None) if name is None else (lambda s: f"{name}.{s}")
        mha = dict(num_gqa_groups=num_gqa_groups, layer_number=layer_number, tp_group=tp_group,
                   tp_size=tp_size, fuse_wgrad_accumulation=fuse_wgrad_accumulation,
                   get_rng_state_tracker=get_rng_state_tracker,
                   sequence_parallel=self.sequence_parallel, set_parallel_mode=set_parallel_mode,
                   fuse_qkv_params=fuse_qkv_params, zero_centered_gamma=zero_centered_gamma,
                   qkv_weight_interleaved=qkv_weight_interleaved, bias=bias,
                   normalization=normalization, device=device, qkv_format=attn_input_format,
                   params_dtype=params_dtype, qk_norm_type=qk_norm_type, qk_norm_eps=qk_norm_eps,
                   qk_norm_before_rope=qk_norm_before_rope,
                   rotary_pos_interleaved=rotary_pos_interleaved, softmax_type=softmax_type,
                   seq_length=seq_length, micro_batch_size=micro_batch_size)
        args = (hidden_size, num_attention_heads, kv_channels, attention_dropout,
                layernorm_epsilon, init_method, output_layer_init_method)
        self.self_attention = MultiheadAttention(
            *args, attn_mask_type=self.self_attn_mask_type, window_size=self.window_size,
            input_layernorm=not output_layernorm, attention_type="self",
            return_layernorm_output=post_ln and not output_layernorm, **mha,
            name=sub("self_attention"))
        if layer_type == "decoder":
            self.inter_attention = MultiheadAttention(
                *args, attn_mask_type=self.enc_dec_attn_mask_type,
                window_size=self.enc_dec_window_size, input_layernorm=True,
                attention_type="cross", return_layernorm_output=post_ln, **mha,
                name=sub("inter_attention"))
        self.layernorm_mlp = LayerNormMLP(
            hidden_size, ffn_hidden_size, layernorm_epsilon, self.sequence_parallel,
            get_rng_state_tracker=get_rng_state_tracker, tp_group=tp_group, tp_size=tp_size,
            init_method=init_method, bias=bias, normalization=normalization,
            activation=activation, activation_params=activation_params,
            output_layer_init_method=output_layer_init_method,
            fuse_wgrad_accumulation=fuse_wgrad_accumulation, params_dtype=params_dtype,
            return_layernorm_output=post_ln, seq_length=seq_length,
            micro_batch_size=micro_batch_size, set_parallel_mode=set_parallel_mode,
            zero_centered_gamma=zero_centered_gamma, device=device,
            name=sub("layernorm_mlp"))
        if output_layernorm:
            norm = LayerNorm if normalization == "LayerNorm" else RMSNorm
            self.layernorm = norm(hidden_size, layernorm_epsilon, self.sequence_parallel,
                                  params_dtype, zero_centered_gamma, device=device)

    # ---- parallel groups -----------------------------------------------------------
    def set_tensor_parallel_group(self, tp_group) -> None:
        for child in self.children():
            if hasattr(child, "set_tensor_parallel_group"):
                child.set_tensor_parallel_group(tp_group)

    def set_context_parallel_group(self, cp_group, cp_global_ranks=None, cp_stream=None,
                                   cp_comm_type: str = "p2p") -> None:
        for child in self.children():
            if hasattr(child, "set_context_parallel_group"):
                child.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream,
                                                 cp_comm_type)

    # ---- forward -------------------------------------------------------------------
    def _dropout_add(self, x: torch.Tensor, residual: torch.Tensor,
                     drop_path: bool = True) -> torch.Tensor:
        """``residual + drop_path(dropout(x))`` (dropout and drop path in training only)."""
        if not self.training or (self.hidden_dropout == 0.0
                                 and (self.drop_path_rate == 0.0 or not drop_path)):
            return residual + x
        check_dropout_replayable("te.TransformerLayer", max(
            self.hidden_dropout, self.drop_path_rate if drop_path else 0.0), x)
        if self.hidden_dropout > 0.0:
            x = F.dropout(x, p=self.hidden_dropout, training=True)
        if drop_path and self.drop_path_rate > 0.0:
            keep = 1.0 - self.drop_path_rate
            b_dim = 1 if self.attn_input_format == "sbhd" else 0
            shape = [1] * x.dim()
            shape[b_dim] = x.shape[b_dim]
            if keep == 0.0:                                   # every sample dropped
                x = x.masked_fill(torch.ones(shape, dtype=torch.bool, device=x.device), 0.0)
            else:
                mask = torch.empty(shape, dtype=x.dtype, device=x.device).bernoulli_(keep)
                x = x * mask / keep
        return residual + x

    def forward(self, hidden_states: torch.Tensor, attention_mask=None,
                self_attn_mask_type: Optional[str] = None,
                window_size: Optional[Tuple[int, int]] = None,
                encoder_output: Optional[torch.Tensor] = None, enc_dec_attn_mask=None,
                enc_dec_attn_mask_type: Optional[str] = None,
                enc_dec_window_size: Optional[Tuple[int, int]] = None,
                is_first_microbatch: Optional[bool] = None,
                checkpoint_core_attention: bool = False, inference_params=None,
                rotary_pos_emb=None, core_attention_bias_type: str = "no_bias",
                core_attention_bias: Optional[torch.Tensor] = None,
                alibi_slopes: Optional[torch.Tensor] = None,
                cu_seqlens_q: Optional[torch.Tensor] = None,
                cu_seqlens_kv: Optional[torch.Tensor] = None,
                cu_seqlens_q_padded: Optional[torch.Tensor] = None,
                cu_seqlens_kv_padded: Optional[torch.Tensor] = None,
                max_seqlen_q: Optional[int] = None, max_seqlen_kv: Optional[int] = None,
                fast_zero_fill: bool = True, pad_between_seqs: Optional[bool] = None
                ) -> torch.Tensor:
        """One layer on ``hidden_states`` (``[seq, batch, hidden]`` for "sbhd").

        The mask, window, rotary, bias and ``cu_seqlens_*`` arguments are the
        self-attention's (see `MultiheadAttention` / `DotProductAttention`);
        ``encoder_output``, ``enc_dec_attn_mask``, ``enc_dec_attn_mask_type`` and
        ``enc_dec_window_size`` the cross attention's (``layer_type="decoder"``).
        ``checkpoint_core_attention`` recomputes the attention cores during backward.
        ``is_first_microbatch`` goes to every GEMM module (FP8 weight caching).
        ``inference_params`` (KV cache) is not implemented.
        """
        api = "te.TransformerLayer"
        reject_unsupported(f"{api}.forward", inference_params=(inference_params, None))
        dims = 2 if self.attn_input_format == "thd" else 3
        if (not torch.is_tensor(hidden_states) or hidden_states.dim() != dims
                or hidden_states.shape[-1] != self.hidden_size):
            got = (tuple(hidden_states.shape) if torch.is_tensor(hidden_states)
                   else type(hidden_states).__name__)
            layout = {"sbhd": "[seq, batch, hidden]", "bshd": "[batch, seq, hidden]",
                      "thd": "[tokens, hidden]"}[self.attn_input_format]
            raise ValueError(f"{api}: hidden_states must be {layout} with "
                             f"hidden={self.hidden_size}, got {got}")
        check_hidden_states_dtype(api, hidden_states, self.layernorm_mlp.fc1_weight,
                                  FP8GlobalStateManager.is_fp8_enabled())
        if self.sequence_parallel and self.seq_length is not None \
                and hidden_states.shape[0] != self.seq_length // self.tp_size:
            raise ValueError(f"{api}: with sequence_parallel the input holds this rank's "
                             f"seq_length / tp_size = {self.seq_length // self.tp_size} tokens, "
                             f"got {hidden_states.shape[0]}")
        if self.layer_type == "decoder" and encoder_output is None:
            raise ValueError(f"{api}: layer_type='decoder' needs encoder_output")
        device_type = hidden_states.device.type
        if torch.is_autocast_enabled(device_type):
            # Under torch.autocast the layer runs in the autocast dtype from its input on,
            # residuals included (as TE's does), so its output has that dtype; the
            # input's gradient comes back in the input's own dtype through this cast.
            hidden_states = hidden_states.to(torch.get_autocast_dtype(device_type))
        if torch.compiler.is_compiling():
            # The residuals follow the input's layout, and so does the gradient of the
            # output; torch's traced dropout backward assumes a contiguous one (its fake
            # strides differ from the kernel's), so a transposed input would fail there.
            hidden_states = hidden_states.contiguous()
        attn = self.self_attention(
            hidden_states, attention_mask, None, self_attn_mask_type, window_size,
            is_first_microbatch, checkpoint_core_attention, None, rotary_pos_emb,
            core_attention_bias_type, core_attention_bias, alibi_slopes, cu_seqlens_q,
            cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded, max_seqlen_q,
            max_seqlen_kv, fast_zero_fill, pad_between_seqs)
        if self.parallel_attention_mlp:
            mlp = self.layernorm_mlp(hidden_states, is_first_microbatch)
            out = self._dropout_add(attn + mlp, hidden_states)
        else:
            post_ln = self.apply_residual_connection_post_layernorm and not self.output_layernorm
            attn_out, residual = attn if post_ln else (attn, hidden_states)
            hidden = self._dropout_add(attn_out, residual)
            if self.layer_type == "decoder":
                cross = self.inter_attention(
                    hidden, enc_dec_attn_mask, encoder_output, enc_dec_attn_mask_type,
                    enc_dec_window_size, is_first_microbatch, checkpoint_core_attention,
                    None, None, core_attention_bias_type, core_attention_bias, alibi_slopes,
                    fast_zero_fill=fast_zero_fill)
                cross_out, residual = (cross if self.apply_residual_connection_post_layernorm
                                       else (cross, hidden))
                hidden = self._dropout_add(cross_out, residual, drop_path=False)
            mlp = self.layernorm_mlp(hidden, is_first_microbatch)
            mlp_out, residual = (mlp if self.apply_residual_connection_post_layernorm
                                 else (mlp, hidden))
            out = self._dropout_add(mlp_out, residual)
        if self.output_layernorm:
            out = self.layernorm(out)
        return out
