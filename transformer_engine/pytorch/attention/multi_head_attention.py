"""te.MultiheadAttention: QKV projection, rotary embedding, attention core and the
output projection, with TE's signature, submodule and parameter names.

NOTE [QKV parameter layouts]
    ``fuse_qkv_params=False`` (TE's default): the QKV projection (``layernorm_qkv``
    or ``qkv``; for cross attention ``layernorm_query`` / ``query_layer`` and
    ``key_value``) holds separate parameters ``query_weight``, ``key_weight``,
    ``value_weight`` (then ``query_bias``, ``key_bias``, ``value_bias``), and its
    output is ``[all q heads | k heads | v heads]`` (``qkv_weight_interleaved`` is
    then False, as in TE). ``fuse_qkv_params=True``: one ``weight`` / ``bias``;
    ``qkv_weight_interleaved=True`` lays its rows out per key/value group,
    ``[q heads of the group, k, v]`` (cross attention's ``key_value``: ``[k, v]`` per
    group), else ``[q | k | v]``. With ``set_parallel_mode`` the projection is
    column-parallel (each rank holds its heads' rows: whole groups when interleaved,
    its slice of each of q, k, v when split) and ``proj`` row-parallel.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Optional, Tuple

import torch

from ..fp8 import FP8GlobalStateManager
from ..module.layernorm import LayerNorm, RMSNorm
from ..module.layernorm_linear import LayerNormLinear, pack_outputs
from ..module.linear import Linear
from ..ops.basic.l2normalization import L2Normalization
from ..utils import (check_bool, check_choice, check_eps, check_hidden_states_dtype,
                     check_optional_positive_int, check_params_dtype, check_positive_int,
                     reject_unsupported)
from .dot_product_attention import DotProductAttention
from .masks import canonical_mask_type, check_window_size
from .rope import apply_rotary_pos_emb

__all__ = ["MultiheadAttention", "QK_NORM_TYPES"]

QK_NORM_TYPES = (None, "L2Normalization", "RMSNorm", "LayerNorm")
_UB = ("ub_overlap_ag", "ub_overlap_rs", "ub_overlap_rs_dgrad", "ub_bulk_dgrad", "ub_bulk_wgrad")


class MultiheadAttention(torch.nn.Module):
    """Self or cross attention with projections; TE's signature (NOTE [QKV parameter
    layouts] for the parameters).

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
    window_size : (int, int), optional
        Sliding-window attention (see `DotProductAttention`).
    tp_group, tp_size, sequence_parallel, set_parallel_mode
        Tensor parallelism: QKV column-parallel, ``proj`` row-parallel.
    num_gqa_groups : int, optional
        Key/value heads for grouped-query attention.
    fuse_wgrad_accumulation : bool, default False
        Weight gradients into ``main_grad`` (needs ``fuse_qkv_params=True``).
    get_rng_state_tracker : callable, optional
        For weight initialization and attention dropout.
    params_dtype : torch.dtype, optional
    return_bias : bool, default False
        Return the output projection's bias instead of adding it.
    return_layernorm_output : bool, default False
        Also return the normalized input (needs ``input_layernorm``).
    input_layernorm : bool, default False
        Normalize the input inside the QKV projection.
    attention_type : "self" | "cross", default "self"
        Cross attention takes keys and values from ``encoder_output``.
    fuse_qkv_params : bool, default False
    zero_centered_gamma, normalization, bias, device
        As in `LayerNormLinear`.
    qkv_weight_interleaved : bool, default True
        Only with ``fuse_qkv_params=True``.
    rotary_pos_interleaved : bool, default False
        The rotary layout (NOTE [Rotary layouts] in rope.py).
    qkv_format : "sbhd" | "bshd" | "thd", default "sbhd"
        Layout of ``hidden_states``: ``[s, b, hidden]``, ``[b, s, hidden]`` or
        packed ``[tokens, hidden]`` (with ``cu_seqlens_q/kv`` in forward).
    name : str, optional
    qk_norm_type : None | "L2Normalization" | "RMSNorm" | "LayerNorm", optional
        Normalize each query and key head (``q_norm`` / ``k_norm`` over the head
        size), after the rotary embedding unless ``qk_norm_before_rope``.
        "L2Normalization" is parameter-free: ``q_norm`` and ``k_norm`` are one
        ``te.ops.L2Normalization`` module, as in TE.
    qk_norm_eps : float, default 1e-6
    seq_length, micro_batch_size : int, optional
        TE's JIT warm-up hints: checked, no effect here.
    ub_overlap_ag, ub_overlap_rs, ub_overlap_rs_dgrad, ub_bulk_dgrad, ub_bulk_wgrad,
    softmax_type
        Not implemented: anything but the default raises ``NotImplementedError``.

    Returns
    -------
    ``out``, then the projection bias if ``return_bias``, then the normalized input
    if ``return_layernorm_output``.
    """

    def __init__(self, hidden_size: int, num_attention_heads: int,
                 kv_channels: Optional[int] = None, attention_dropout: float = 0.1,
                 layernorm_epsilon: float = 1e-5, init_method: Optional[Callable] = None,
                 output_layer_init_method: Optional[Callable] = None,
                 layer_number: Optional[int] = None, attn_mask_type: str = "causal",
                 window_size: Optional[Tuple[int, int]] = None, tp_group=None, tp_size: int = 1,
                 num_gqa_groups: Optional[int] = None, fuse_wgrad_accumulation: bool = False,
                 get_rng_state_tracker: Optional[Callable] = None, sequence_parallel: bool = False,
                 params_dtype: Optional[torch.dtype] = None, return_bias: bool = False,
                 return_layernorm_output: bool = False, input_layernorm: bool = False,
                 attention_type: str = "self", set_parallel_mode: bool = False,
                 fuse_qkv_params: bool = False, zero_centered_gamma: bool = False,
                 qkv_weight_interleaved: bool = True, rotary_pos_interleaved: bool = False,
                 ub_overlap_ag: bool = False, ub_overlap_rs: bool = False,
                 ub_overlap_rs_dgrad: bool = False, ub_bulk_dgrad: bool = False,
                 ub_bulk_wgrad: bool = False, bias: bool = True, normalization: str = "LayerNorm",
                 device=None, qkv_format: str = "sbhd", name: Optional[str] = None,
                 qk_norm_type: Optional[str] = None, qk_norm_eps: float = 1e-6,
                 qk_norm_before_rope: bool = False, seq_length: Optional[int] = None,
                 micro_batch_size: Optional[int] = None, softmax_type: str = "vanilla"):
        super().__init__()
        api = "te.MultiheadAttention"
        ub = dict(zip(_UB, (ub_overlap_ag, ub_overlap_rs, ub_overlap_rs_dgrad, ub_bulk_dgrad,
                            ub_bulk_wgrad)))
        reject_unsupported(api, **{k: (v, False) for k, v in ub.items()})
        check_choice(api, "qk_norm_type", qk_norm_type, QK_NORM_TYPES)
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
        self.fuse_qkv_params = check_bool(api, "fuse_qkv_params", fuse_qkv_params)
        self.set_parallel_mode = check_bool(api, "set_parallel_mode", set_parallel_mode)
        self.qkv_weight_interleaved = fuse_qkv_params and check_bool(
            api, "qkv_weight_interleaved", qkv_weight_interleaved)
        if fuse_wgrad_accumulation and not fuse_qkv_params:
            raise ValueError(f"{api}: fuse_wgrad_accumulation=True needs fuse_qkv_params=True "
                             "(one QKV weight, as in TE)")
        self.attention_type = check_choice(api, "attention_type", attention_type,
                                           ("self", "cross"))
        self.qkv_format = check_choice(api, "qkv_format", qkv_format, ("sbhd", "bshd", "thd"))
        self.attn_mask_type = canonical_mask_type(api, "attn_mask_type", attn_mask_type)
        self.window_size = check_window_size(api, window_size)
        self.rotary_pos_interleaved = check_bool(api, "rotary_pos_interleaved",
                                                 rotary_pos_interleaved)
        self.qk_norm_before_rope = check_bool(api, "qk_norm_before_rope", qk_norm_before_rope)
        self.seq_length = check_optional_positive_int(api, "seq_length", seq_length)
        self.micro_batch_size = check_optional_positive_int(api, "micro_batch_size",
                                                            micro_batch_size)
        self.name, self.layer_number = name, 1 if layer_number is None else layer_number
        self.input_layernorm = check_bool(api, "input_layernorm", input_layernorm)
        self.return_layernorm_output, self.return_bias = return_layernorm_output, return_bias
        # DotProductAttention validates heads, groups, tp divisibility, dropout, format.
        core = DotProductAttention(
            heads, kv_channels, groups, attention_dropout, qkv_format,
            sequence_parallel=sequence_parallel, tp_size=tp_size,
            get_rng_state_tracker=get_rng_state_tracker, tp_group=tp_group,
            layer_number=self.layer_number, attention_type=attention_type,
            softmax_type=softmax_type)
        self.num_attention_heads, self.kv_channels, self.num_gqa_groups = heads, kv_channels, groups
        if self.set_parallel_mode and self.fuse_qkv_params and not self.qkv_weight_interleaved \
                and core.tp_size > 1:
            raise NotImplementedError(f"{api}: set_parallel_mode with fuse_qkv_params=True and "
                                      "qkv_weight_interleaved=False is not implemented (a "
                                      "contiguous split of [q | k | v] rows mixes q and k heads); "
                                      "use the interleaved layout or fuse_qkv_params=False")
        common = dict(fuse_wgrad_accumulation=fuse_wgrad_accumulation, tp_group=tp_group,
                      tp_size=tp_size, get_rng_state_tracker=get_rng_state_tracker,
                      sequence_parallel=sequence_parallel, params_dtype=params_dtype,
                      device=device)
        self._qk_norms(qk_norm_type, qk_norm_eps, kv_channels, device)
        self._projections(api, hidden_size, layernorm_epsilon, init_method, bias, normalization,
                          zero_centered_gamma, name, common)
        self.core_attention = core
        self.proj = Linear(heads * kv_channels, hidden_size, init_method=output_layer_init_method,
                           bias=bias, return_bias=return_bias,
                           parallel_mode="row" if set_parallel_mode else None,
                           name=None if name is None else name + ".proj", **common)

    def _qk_norms(self, qk_norm_type, eps, kv_channels, device) -> None:
        """``q_norm`` / ``k_norm`` over the head size (registered first, as in TE)."""
        if qk_norm_type is None:
            self.q_norm = self.k_norm = None
            return
        if qk_norm_type == "L2Normalization":
            self.q_norm = self.k_norm = L2Normalization(eps=eps)
            return
        cls = RMSNorm if qk_norm_type == "RMSNorm" else LayerNorm
        self.q_norm = cls(kv_channels, eps=eps, device=device)
        self.k_norm = cls(kv_channels, eps=eps, device=device)

    def _projections(self, api, hidden, eps, init_method, bias, normalization, zcg, name,
                     common) -> None:
        h = self.num_attention_heads * self.kv_channels
        kv = self.num_gqa_groups * self.kv_channels
        split = not self.fuse_qkv_params
        mode = "column" if self.set_parallel_mode else None
        ln = dict(eps=eps, init_method=init_method, bias=bias, parallel_mode=mode,
                  return_layernorm_output=self.return_layernorm_output, normalization=normalization,
                  zero_centered_gamma=zcg, **common)
        lin = dict(init_method=init_method, bias=bias, parallel_mode=mode, **common)
        sub = (lambda s: None) if name is None else (lambda s: f"{name}.{s}")
        if self.attention_type == "self":
            parts = OrderedDict((("query", h), ("key", kv), ("value", kv))) if split else None
            if self.input_layernorm:
                self.layernorm_qkv = LayerNormLinear(hidden, h + 2 * kv, parameters_split=parts,
                                                     name=sub("layernorm_linear_qkv"), **ln)
            else:
                self.qkv = Linear(hidden, h + 2 * kv, parameters_split=parts,
                                  name=sub("linear_qkv"), **lin)
            return
        if self.input_layernorm:
            self.layernorm_query = LayerNormLinear(hidden, h, name=sub("layernorm_linear_q"),
                                                   parameters_split=("query",) if split else None,
                                                   **ln)
        else:
            self.query_layer = Linear(hidden, h, name=sub("linear_q"),
                                      parameters_split=("query",) if split else None, **lin)
        self.key_value = Linear(hidden, 2 * kv, name=sub("linear_kv"),
                                parameters_split=("key", "value") if split else None, **lin)

    # ---- parallel groups -----------------------------------------------------------
    def set_tensor_parallel_group(self, tp_group) -> None:
        for child in self.children():
            if hasattr(child, "set_tensor_parallel_group"):
                child.set_tensor_parallel_group(tp_group)

    def set_context_parallel_group(self, cp_group, cp_global_ranks=None, cp_stream=None,
                                   cp_comm_type: str = "p2p") -> None:
        self.core_attention.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream,
                                                       cp_comm_type)

    # ---- forward -------------------------------------------------------------------
    def _split(self, mixed: torch.Tensor, parts: int):
        """``[..., n]`` projection output -> q, k, v (``parts=3``) or k, v (``parts=2``)
        as ``[..., heads, d]`` (NOTE [QKV parameter layouts])."""
        core, d = self.core_attention, self.kv_channels
        h, g = core.heads_local, core.groups_local
        lead = mixed.shape[:-1]
        q_heads = h // g if parts == 3 else 0
        if self.qkv_weight_interleaved:
            grouped = mixed.reshape(*lead, g, q_heads + 2, d)
            out = (grouped[..., q_heads, :], grouped[..., q_heads + 1, :])
            if parts == 3:
                out = (grouped[..., :q_heads, :].reshape(*lead, h, d),) + out
            return out
        sizes = ([h * d] if parts == 3 else []) + [g * d, g * d]
        pieces = mixed.split(sizes, dim=-1)
        heads = ([h] if parts == 3 else []) + [g, g]
        return tuple(p.reshape(*lead, n, d) for p, n in zip(pieces, heads))

    def _check_input(self, api: str, name: str, t) -> None:
        dims = 2 if self.qkv_format == "thd" else 3
        if not torch.is_tensor(t) or t.dim() != dims:
            got = tuple(t.shape) if torch.is_tensor(t) else type(t).__name__
            layout = {"sbhd": "(s, b, hidden)", "bshd": "(b, s, hidden)",
                      "thd": "(tokens, hidden)"}[self.qkv_format]
            raise ValueError(f"{api}: {name} must be a {dims}-D tensor {layout}, got {got}")

    def forward(self, hidden_states: torch.Tensor, attention_mask=None,
                encoder_output: Optional[torch.Tensor] = None, attn_mask_type: Optional[str] = None,
                window_size: Optional[Tuple[int, int]] = None,
                is_first_microbatch: Optional[bool] = None, checkpoint_core_attention: bool = False,
                inference_params=None, rotary_pos_emb=None, core_attention_bias_type: str = "no_bias",
                core_attention_bias: Optional[torch.Tensor] = None,
                alibi_slopes: Optional[torch.Tensor] = None,
                cu_seqlens_q: Optional[torch.Tensor] = None,
                cu_seqlens_kv: Optional[torch.Tensor] = None,
                cu_seqlens_q_padded: Optional[torch.Tensor] = None,
                cu_seqlens_kv_padded: Optional[torch.Tensor] = None,
                max_seqlen_q: Optional[int] = None, max_seqlen_kv: Optional[int] = None,
                fast_zero_fill: bool = True, pad_between_seqs: Optional[bool] = None):
        """Attention of ``hidden_states`` (over ``encoder_output`` for cross attention).

        ``rotary_pos_emb``: the angles of `RotaryPositionEmbedding` (one tensor for
        queries and keys, or a ``(q_angles, k_angles)`` pair), applied to the
        projected queries and keys. The mask, window, bias, ``cu_seqlens_*`` and
        ``checkpoint_core_attention`` arguments go to `DotProductAttention`;
        ``is_first_microbatch`` to the projections. ``inference_params`` (KV cache)
        and ``alibi_slopes`` are not implemented.
        """
        api = "te.MultiheadAttention"
        reject_unsupported(f"{api}.forward", inference_params=(inference_params, None))
        self._check_input(api, "hidden_states", hidden_states)
        check_hidden_states_dtype(api, hidden_states, self.proj.weight,
                                  FP8GlobalStateManager.is_fp8_enabled())
        ln_out = None
        if self.attention_type == "self":
            if encoder_output is not None:
                raise ValueError(f"{api}: encoder_output is for attention_type='cross'")
            if self.input_layernorm:
                mixed = self.layernorm_qkv(hidden_states, is_first_microbatch)
                if self.return_layernorm_output:
                    mixed, ln_out = mixed
            else:
                mixed = self.qkv(hidden_states, is_first_microbatch)
            q, k, v = self._split(mixed, 3)
        else:
            if encoder_output is None:
                raise ValueError(f"{api}: attention_type='cross' needs encoder_output")
            self._check_input(api, "encoder_output", encoder_output)
            if self.input_layernorm:
                q = self.layernorm_query(hidden_states, is_first_microbatch)
                if self.return_layernorm_output:
                    q, ln_out = q
            else:
                q = self.query_layer(hidden_states, is_first_microbatch)
            q = q.reshape(*q.shape[:-1], self.core_attention.heads_local, self.kv_channels)
            k, v = self._split(self.key_value(encoder_output, is_first_microbatch), 2)
        if self.q_norm is not None and self.qk_norm_before_rope:
            q, k = self.q_norm(q), self.k_norm(k)
        if rotary_pos_emb is not None:
            # thd positions restart at each (padded) sequence start
            cu_q = cu_seqlens_q_padded if cu_seqlens_q_padded is not None else cu_seqlens_q
            cu_kv = cu_seqlens_kv_padded if cu_seqlens_kv_padded is not None else cu_seqlens_kv
            q, k = self._rotate(api, q, k, rotary_pos_emb, cu_q, cu_kv)
        if self.q_norm is not None and not self.qk_norm_before_rope:
            q, k = self.q_norm(q), self.k_norm(k)
        context = self.core_attention(
            q, k, v, attention_mask, self.qkv_format, cu_seqlens_q, cu_seqlens_kv,
            cu_seqlens_q_padded, cu_seqlens_kv_padded, max_seqlen_q, max_seqlen_kv,
            attn_mask_type if attn_mask_type is not None else self.attn_mask_type,
            window_size if window_size is not None else self.window_size,
            checkpoint_core_attention, core_attention_bias_type, core_attention_bias,
            alibi_slopes, fast_zero_fill, None, pad_between_seqs)
        out = self.proj(context, is_first_microbatch)
        proj_bias = None
        if self.return_bias:
            out, proj_bias = out
        return pack_outputs(out, proj_bias, self.return_bias, ln_out)

    def _rotate(self, api, q, k, rotary_pos_emb, cu_q, cu_kv):
        if isinstance(rotary_pos_emb, (tuple, list)):
            if len(rotary_pos_emb) != 2:
                raise ValueError(f"{api}: rotary_pos_emb must be one tensor or a pair "
                                 f"(q_emb, k_emb), got {len(rotary_pos_emb)} items")
            q_emb, k_emb = rotary_pos_emb
        else:
            q_emb = k_emb = rotary_pos_emb
        fmt, inter = self.qkv_format, self.rotary_pos_interleaved
        if fmt == "thd" and cu_kv is None:
            cu_kv = cu_q
        return (apply_rotary_pos_emb(q, q_emb, fmt, interleaved=inter, cu_seqlens=cu_q),
                apply_rotary_pos_emb(k, k_emb, fmt, interleaved=inter, cu_seqlens=cu_kv))
