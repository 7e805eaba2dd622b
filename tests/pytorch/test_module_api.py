"""The module surface TE's clients call: TE's signatures (argument names and order),
the keyword arguments Megatron-LM's Transformer Engine extension passes, TE's
parameter names, order and state_dict keys, and refusals of what is not implemented
(parameters and gradients: test_module_params.py).
"""

import inspect
from collections import OrderedDict

import pytest
import torch

import transformer_engine.pytorch as te

# ---- TE's signatures ---------------------------------------------------------------------

TE_SIGNATURES = {
    te.Linear: ["in_features", "out_features", "sequence_parallel", "fuse_wgrad_accumulation",
                "tp_group", "tp_size", "get_rng_state_tracker", "rng_tracker_name",
                "init_method", "bias", "return_bias", "params_dtype", "parallel_mode",
                "parameters_split", "device", "ub_overlap_ag", "ub_overlap_rs",
                "ub_overlap_rs_dgrad", "ub_bulk_dgrad", "ub_bulk_wgrad", "ub_name",
                "delay_wgrad_compute", "symmetric_ar_type", "save_original_input", "name"],
    te.LayerNormLinear: ["in_features", "out_features", "eps", "sequence_parallel",
                         "fuse_wgrad_accumulation", "tp_group", "tp_size",
                         "get_rng_state_tracker", "init_method", "bias", "normalization",
                         "return_bias", "params_dtype", "parallel_mode",
                         "return_layernorm_output", "return_layernorm_output_gathered",
                         "parameters_split", "zero_centered_gamma", "device", "ub_overlap_ag",
                         "ub_overlap_rs", "ub_overlap_rs_dgrad", "ub_bulk_wgrad", "ub_bulk_dgrad",
                         "ub_name", "delay_wgrad_compute", "symmetric_ar_type", "name"],
    te.LayerNormMLP: ["hidden_size", "ffn_hidden_size", "eps", "sequence_parallel", "return_bias",
                      "get_rng_state_tracker", "tp_group", "tp_size", "init_method", "bias",
                      "normalization", "activation", "activation_params",
                      "output_layer_init_method", "fuse_wgrad_accumulation", "params_dtype",
                      "return_layernorm_output", "return_layernorm_output_gathered",
                      "seq_length", "micro_batch_size", "set_parallel_mode",
                      "zero_centered_gamma", "device", "ub_overlap_ag", "name", "ub_overlap_rs",
                      "ub_overlap_rs_dgrad", "ub_bulk_dgrad", "ub_bulk_wgrad",
                      "delay_wgrad_compute", "symmetric_ar_type", "checkpoint"],
    te.LayerNorm: ["normalized_shape", "eps", "sequence_parallel", "params_dtype",
                   "zero_centered_gamma", "hidden_size"],
    te.DotProductAttention: ["num_attention_heads", "kv_channels", "num_gqa_groups",
                             "attention_dropout", "qkv_format", "attn_mask_type", "window_size",
                             "sequence_parallel", "tp_size", "get_rng_state_tracker", "tp_group",
                             "layer_number", "attention_type", "cp_group", "cp_global_ranks",
                             "cp_stream", "cp_comm_type", "softmax_scale", "softmax_type",
                             "return_max_logit"],
    te.MultiheadAttention: ["hidden_size", "num_attention_heads", "kv_channels",
                            "attention_dropout", "layernorm_epsilon", "init_method",
                            "output_layer_init_method", "layer_number", "attn_mask_type",
                            "window_size", "tp_group", "tp_size", "num_gqa_groups",
                            "fuse_wgrad_accumulation", "get_rng_state_tracker",
                            "sequence_parallel", "params_dtype", "return_bias",
                            "return_layernorm_output", "input_layernorm", "attention_type",
                            "set_parallel_mode", "fuse_qkv_params", "zero_centered_gamma",
                            "qkv_weight_interleaved", "rotary_pos_interleaved", "ub_overlap_ag",
                            "ub_overlap_rs", "ub_overlap_rs_dgrad", "ub_bulk_dgrad",
                            "ub_bulk_wgrad", "bias", "normalization", "device", "qkv_format",
                            "name", "qk_norm_type", "qk_norm_eps", "qk_norm_before_rope",
                            "seq_length", "micro_batch_size", "softmax_type"],
    te.TransformerLayer: ["hidden_size", "ffn_hidden_size", "num_attention_heads",
                          "num_gqa_groups", "layernorm_epsilon", "hidden_dropout",
                          "attention_dropout", "init_method", "output_layer_init_method",
                          "layer_number", "kv_channels", "self_attn_mask_type", "window_size",
                          "enc_dec_attn_mask_type", "enc_dec_window_size", "tp_group", "tp_size",
                          "params_dtype", "get_rng_state_tracker", "fuse_wgrad_accumulation",
                          "seq_length", "micro_batch_size", "sequence_parallel",
                          "apply_residual_connection_post_layernorm", "output_layernorm",
                          "parallel_attention_mlp", "layer_type", "drop_path_rate",
                          "set_parallel_mode", "fuse_qkv_params", "zero_centered_gamma",
                          "qkv_weight_interleaved", "ub_tp_comm_overlap", "ub_overlap_ag",
                          "ub_overlap_rs", "ub_overlap_rs_dgrad", "ub_bulk_dgrad",
                          "ub_bulk_wgrad", "bias", "activation", "normalization", "device",
                          "attn_input_format", "name"],
}

TE_FORWARDS = {
    te.Linear: ["inp", "is_first_microbatch", "fp8_output", "fp8_grad"],
    te.LayerNormLinear: ["inp", "is_first_microbatch", "fp8_output", "fp8_grad"],
    te.LayerNormMLP: ["inp", "is_first_microbatch"],
    te.DotProductAttention: ["query_layer", "key_layer", "value_layer", "attention_mask",
                             "qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded",
                             "cu_seqlens_kv_padded", "max_seqlen_q", "max_seqlen_kv",
                             "attn_mask_type", "window_size", "checkpoint_core_attention",
                             "core_attention_bias_type", "core_attention_bias", "alibi_slopes",
                             "fast_zero_fill", "inference_params", "pad_between_seqs",
                             "fp8_output", "num_splits"],
    te.MultiheadAttention: ["hidden_states", "attention_mask", "encoder_output", "attn_mask_type",
                            "window_size", "is_first_microbatch", "checkpoint_core_attention",
                            "inference_params", "rotary_pos_emb", "core_attention_bias_type",
                            "core_attention_bias", "alibi_slopes", "cu_seqlens_q",
                            "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded",
                            "max_seqlen_q", "max_seqlen_kv", "fast_zero_fill",
                            "pad_between_seqs"],
    te.TransformerLayer: ["hidden_states", "attention_mask", "self_attn_mask_type", "window_size",
                          "encoder_output", "enc_dec_attn_mask", "enc_dec_attn_mask_type",
                          "enc_dec_window_size", "is_first_microbatch",
                          "checkpoint_core_attention", "inference_params", "rotary_pos_emb",
                          "core_attention_bias_type", "core_attention_bias", "alibi_slopes",
                          "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded",
                          "cu_seqlens_kv_padded", "max_seqlen_q", "max_seqlen_kv",
                          "fast_zero_fill", "pad_between_seqs"],
}


def _names(fn):
    return [n for n in inspect.signature(fn).parameters if n != "self"]


@pytest.mark.parametrize("cls", list(TE_SIGNATURES), ids=lambda c: c.__name__)
def test_constructor_takes_te_arguments_in_te_order(cls):
    expected = TE_SIGNATURES[cls]
    assert _names(cls.__init__)[:len(expected)] == expected


@pytest.mark.parametrize("cls", list(TE_FORWARDS), ids=lambda c: c.__name__)
def test_forward_takes_te_arguments_in_te_order(cls):
    expected = TE_FORWARDS[cls]
    assert _names(cls.forward)[:len(expected)] == expected


# ---- what Megatron Core's extension passes (megatron/core/extensions/transformer_engine.py,
# megatron-core 0.16.1, with its default config: no userbuffers, no delayed wgrad) --------

def _rng_tracker():
    tracker = te.CudaRNGStatesTracker(device="cpu")
    tracker.add("model-parallel-rng", 1234)
    tracker.add("expert-parallel-rng", 5678)
    return tracker


_TRACKER = _rng_tracker()


def _megatron_init(w):
    torch.nn.init.normal_(w, mean=0.0, std=0.02)


def test_megatron_linear_kwargs():
    for mode in ("column", "row", None):
        m = te.Linear(in_features=64, out_features=32, sequence_parallel=False,
                      fuse_wgrad_accumulation=False, tp_group=None, tp_size=1,
                      get_rng_state_tracker=lambda: _TRACKER, init_method=_megatron_init,
                      bias=True, return_bias=True, parallel_mode=mode,
                      params_dtype=torch.float32, device="cpu", rng_tracker_name=None)
        out, bias = m(torch.randn(16, 64), is_first_microbatch=True)
        assert out.shape == (16, 32) and bias is m.bias
        m(torch.randn(16, 64), is_first_microbatch=False)


def test_megatron_layernorm_linear_kwargs():
    m = te.LayerNormLinear(in_features=64, out_features=96, eps=1e-5, sequence_parallel=False,
                           fuse_wgrad_accumulation=False, tp_group=None, tp_size=1,
                           get_rng_state_tracker=lambda: _TRACKER, init_method=_megatron_init,
                           bias=True, return_bias=False, parallel_mode="column",
                           return_layernorm_output=False, zero_centered_gamma=False,
                           normalization="RMSNorm", params_dtype=torch.float32, device="cpu")
    assert m(torch.randn(4, 2, 64), is_first_microbatch=None).shape == (4, 2, 96)


@pytest.mark.parametrize("cls", [te.LayerNorm, te.RMSNorm], ids=lambda c: c.__name__)
def test_megatron_norm_kwargs(cls):
    m = cls(hidden_size=64, eps=1e-5, sequence_parallel=True, zero_centered_gamma=True,
            params_dtype=torch.float32, device="cpu")
    assert m(torch.randn(4, 64)).shape == (4, 64)
    assert m.weight.sequence_parallel is True


def test_megatron_dot_product_attention_kwargs():
    dpa = te.DotProductAttention(num_attention_heads=4, kv_channels=16, attention_dropout=0.0,
                                 attn_mask_type="causal", sequence_parallel=False, tp_size=1,
                                 get_rng_state_tracker=lambda: _TRACKER, tp_group=None,
                                 layer_number=1, num_gqa_groups=2, attention_type="self",
                                 softmax_scale=None, window_size=(8, 0))
    q, kv = torch.randn(6, 2, 4, 16), torch.randn(6, 2, 2, 16)
    assert dpa(q, kv, kv, None, attn_mask_type="causal").shape == (6, 2, 64)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    packed = dict(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=None,
                  cu_seqlens_kv_padded=None, max_seqlen_q=4, max_seqlen_kv=4)
    out = dpa(q[:, 0], kv[:, 0], kv[:, 0], None, attn_mask_type="padding_causal", **packed)
    assert out.shape == (6, 64)
    bias = torch.zeros(1, 4, 6, 6)
    assert dpa(q, kv, kv, None, attn_mask_type="no_mask", core_attention_bias_type="post_scale_bias",
               core_attention_bias=bias).shape == (6, 2, 64)


# ---- TE's parameter names, order and shapes ----------------------------------------------

def _params(m):
    return [(n, tuple(p.shape)) for n, p in m.named_parameters()]


def test_parameter_names_and_order():
    assert _params(te.Linear(32, 48, device="cpu")) == [("weight", (48, 32)), ("bias", (48,))]
    split = te.Linear(32, 48, parameters_split=OrderedDict(query_=16, key_=16, value=16),
                      device="cpu")
    assert _params(split) == [("query_weight", (16, 32)), ("key_weight", (16, 32)),
                              ("value_weight", (16, 32)), ("query_bias", (16,)),
                              ("key_bias", (16,)), ("value_bias", (16,))]
    assert _params(te.LayerNormLinear(32, 48, normalization="RMSNorm", bias=False,
                                      device="cpu")) == [("layer_norm_weight", (32,)),
                                                         ("weight", (48, 32))]
    assert _params(te.LayerNormMLP(32, 64, activation="swiglu", device="cpu")) == [
        ("layer_norm_weight", (32,)), ("layer_norm_bias", (32,)), ("fc1_weight", (128, 32)),
        ("fc1_bias", (128,)), ("fc2_weight", (32, 64)), ("fc2_bias", (32,))]


def test_transformer_layer_parameters_follow_te():
    layer = te.TransformerLayer(64, 128, 4, num_gqa_groups=2, device="cpu")
    qkv = "self_attention.layernorm_qkv."
    assert _params(layer) == [
        (qkv + "layer_norm_weight", (64,)), (qkv + "layer_norm_bias", (64,)),
        (qkv + "query_weight", (64, 64)), (qkv + "key_weight", (32, 64)),
        (qkv + "value_weight", (32, 64)), (qkv + "query_bias", (64,)),
        (qkv + "key_bias", (32,)), (qkv + "value_bias", (32,)),
        ("self_attention.proj.weight", (64, 64)), ("self_attention.proj.bias", (64,)),
        ("layernorm_mlp.layer_norm_weight", (64,)), ("layernorm_mlp.layer_norm_bias", (64,)),
        ("layernorm_mlp.fc1_weight", (128, 64)), ("layernorm_mlp.fc1_bias", (128,)),
        ("layernorm_mlp.fc2_weight", (64, 128)), ("layernorm_mlp.fc2_bias", (64,))]
    assert [k for k in layer.state_dict() if k.endswith("_extra_state")] == [
        "self_attention.layernorm_qkv._extra_state", "self_attention.core_attention._extra_state",
        "self_attention.proj._extra_state", "layernorm_mlp._extra_state"]
    fused = te.TransformerLayer(64, 128, 4, fuse_qkv_params=True, device="cpu")
    assert _params(fused)[2:4] == [(qkv + "weight", (192, 64)), (qkv + "bias", (192,))]
    decoder = te.TransformerLayer(64, 128, 4, layer_type="decoder", output_layernorm=True,
                                  device="cpu")
    names = [n for n, _ in decoder.named_parameters()]
    assert names[:4] == ["self_attention.qkv.query_weight", "self_attention.qkv.key_weight",
                         "self_attention.qkv.value_weight", "self_attention.qkv.query_bias"]
    assert [n for n in names if n.startswith("inter_attention.")] == [
        "inter_attention.layernorm_query.layer_norm_weight",
        "inter_attention.layernorm_query.layer_norm_bias",
        "inter_attention.layernorm_query.query_weight",
        "inter_attention.layernorm_query.query_bias",
        "inter_attention.key_value.key_weight", "inter_attention.key_value.value_weight",
        "inter_attention.key_value.key_bias", "inter_attention.key_value.value_bias",
        "inter_attention.proj.weight", "inter_attention.proj.bias"]
    assert names[-2:] == ["layernorm.weight", "layernorm.bias"]


def test_split_and_fused_qkv_compute_the_same():
    """fuse_qkv_params=False is the non-interleaved fused layout, parameter for parameter."""
    torch.manual_seed(0)
    split = te.MultiheadAttention(64, 4, num_gqa_groups=2, attention_dropout=0.0,
                                  input_layernorm=True, device="cpu")
    fused = te.MultiheadAttention(64, 4, num_gqa_groups=2, attention_dropout=0.0,
                                  input_layernorm=True, fuse_qkv_params=True,
                                  qkv_weight_interleaved=False, device="cpu")
    s = split.state_dict()
    p = "layernorm_qkv."
    s[p + "weight"] = torch.cat([s.pop(p + n + "_weight") for n in ("query", "key", "value")])
    s[p + "bias"] = torch.cat([s.pop(p + n + "_bias") for n in ("query", "key", "value")])
    fused.load_state_dict(s)
    x = torch.randn(8, 2, 64)
    assert torch.equal(split(x), fused(x))


def test_dot_product_attention_extra_state():
    dpa = te.DotProductAttention(4, 16)
    state = dpa.state_dict()
    assert list(state) == ["_extra_state"] and state["_extra_state"].numel() == 0
    dpa.load_state_dict(state)
    with pytest.raises(ValueError, match="holds no FP8 state, so only an empty payload loads"):
        dpa.load_state_dict({"_extra_state": torch.ones(3, dtype=torch.uint8)})


# ---- refusals of what is not implemented ------------------------------------------------

UNSUPPORTED = [
    (lambda: te.Linear(16, 16, ub_overlap_ag=True), "ub_overlap_ag=True"),
    (lambda: te.Linear(16, 16, symmetric_ar_type="two_shot"), "symmetric_ar_type='two_shot'"),
    (lambda: te.Linear(16, 16, device="cpu")(torch.randn(2, 16), fp8_output=True),
     "fp8_output=True"),
    (lambda: te.Linear(16, 32, parameters_split=("a", "b"), fuse_wgrad_accumulation=True),
     "fuse_wgrad_accumulation=True with parameters_split"),
    (lambda: te.LayerNormLinear(16, 16, ub_bulk_wgrad=True), "ub_bulk_wgrad=True"),
    (lambda: te.LayerNormMLP(16, 32, ub_overlap_rs=True), "ub_overlap_rs=True"),
    (lambda: te.LayerNorm(16, sm_margin=8), "sm_margin=8"),
    (lambda: te.DotProductAttention(4, 16, cp_group=object()), "cp_group="),
    (lambda: te.DotProductAttention(4, 16, return_max_logit=True), "return_max_logit=True"),
    (lambda: te.MultiheadAttention(64, 4, ub_bulk_dgrad=True), "ub_bulk_dgrad=True"),
    (lambda: te.TransformerLayer(64, 128, 4, ub_tp_comm_overlap=True),
     "ub_tp_comm_overlap=True"),
    (lambda: te.TransformerLayer(64, 128, 4, device="cpu")(torch.randn(4, 2, 64),
                                                           inference_params=object()),
     "inference_params="),
]


@pytest.mark.parametrize("build, name", UNSUPPORTED, ids=[n for _, n in UNSUPPORTED])
def test_unimplemented_arguments_raise_naming_the_argument(build, name):
    with pytest.raises(NotImplementedError, match=name.replace("(", r"\(").replace("[", r"\[")):
        build()


def test_ub_flags_without_ub_tp_comm_overlap_are_inert_as_in_te():
    """TE's TransformerLayer ANDs every ub_* flag with ub_tp_comm_overlap (its defaults
    are True): without it they change nothing, so they are accepted."""
    te.TransformerLayer(64, 128, 4, ub_overlap_ag=True, ub_bulk_wgrad=True, device="cpu")
