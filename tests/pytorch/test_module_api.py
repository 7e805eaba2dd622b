"""The module surface TE's clients call: TE's signatures (argument names and order),
the keyword arguments Megatron-LM's Transformer Engine extension passes, TE's
parameter names and order, refusals of what is not implemented, deferred
initialization (device="meta" then reset_parameters()), initializers under the RNG
tracker, fuse_wgrad_accumulation (main_grad), params_dtype=torch.float16 and
is_first_microbatch. Numbers against float64 references or, bit for bit, against the
same module without the feature.
"""

import inspect
from collections import OrderedDict

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling
from transformer_engine.pytorch.module.base import TransformerEngineBaseModule
from float64_refs import assert_close, leaf64

RECIPE = DelayedScaling(amax_history_len=4)

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
    (lambda: te.Linear(16, 16, delay_wgrad_compute=True), "delay_wgrad_compute=True"),
    (lambda: te.Linear(16, 16, symmetric_ar_type="two_shot"), "symmetric_ar_type='two_shot'"),
    (lambda: te.Linear(16, 16, device="cpu")(torch.randn(2, 16), fp8_output=True),
     "fp8_output=True"),
    (lambda: te.Linear(16, 16, save_original_input=True, device="cpu")(torch.randn(2, 16)),
     "save_original_input=True"),
    (lambda: te.Linear(16, 32, parameters_split=("a", "b"), fuse_wgrad_accumulation=True),
     "fuse_wgrad_accumulation=True with parameters_split"),
    (lambda: te.LayerNormLinear(16, 16, ub_bulk_wgrad=True), "ub_bulk_wgrad=True"),
    (lambda: te.LayerNormMLP(16, 32, ub_overlap_rs=True), "ub_overlap_rs=True"),
    (lambda: te.LayerNormMLP(16, 32, activation="clamped_swiglu"),
     "activation='clamped_swiglu'"),
    (lambda: te.LayerNormMLP(16, 32, activation_params={"limit": 7.0}), "activation_params="),
    (lambda: te.LayerNorm(16, sm_margin=8), "sm_margin=8"),
    (lambda: te.DotProductAttention(4, 16, cp_group=object()), "cp_group="),
    (lambda: te.DotProductAttention(4, 16, return_max_logit=True), "return_max_logit=True"),
    (lambda: te.MultiheadAttention(64, 4, qk_norm_type="L2Normalization"),
     "qk_norm_type='L2Normalization'"),
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


# ---- deferred initialization, initializers, RNG tracker ---------------------------------

BUILDERS = {
    "Linear": lambda d: te.Linear(32, 48, device=d, parallel_mode="column"),
    "Linear-split": lambda d: te.Linear(32, 48, parameters_split=("q", "k", "v"), device=d),
    "LayerNormLinear": lambda d: te.LayerNormLinear(32, 48, device=d),
    "LayerNormMLP": lambda d: te.LayerNormMLP(32, 64, activation="geglu", device=d),
    "LayerNorm": lambda d: te.LayerNorm(32, zero_centered_gamma=True, sequence_parallel=True,
                                        device=d),
    "RMSNorm": lambda d: te.RMSNorm(32, device=d),
    "TransformerLayer": lambda d: te.TransformerLayer(64, 128, 4, layer_type="decoder",
                                                      device=d),
}


def _tensors(m):
    return {k: v for k, v in m.state_dict().items() if not k.endswith("_extra_state")}


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_meta_then_reset_parameters_equals_direct_build(kind):
    torch.manual_seed(42)
    direct = BUILDERS[kind]("cpu")
    deferred = BUILDERS[kind]("meta")
    assert all(p.is_meta for p in deferred.parameters())
    torch.manual_seed(42)
    for module in deferred.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    a, b = _tensors(direct), _tensors(deferred)
    assert list(a) == list(b)
    for k in a:
        assert b[k].device.type == "cpu" and torch.equal(a[k], b[k]), k
    for (n, p), (_, q) in zip(direct.named_parameters(), deferred.named_parameters()):
        assert isinstance(q, torch.nn.Parameter) and q.requires_grad
        for attr in ("tensor_model_parallel", "partition_dim", "sequence_parallel"):
            assert getattr(p, attr, None) == getattr(q, attr, None), (n, attr)


def test_reset_parameters_reinitializes_in_place():
    torch.manual_seed(3)
    m = te.LayerNormLinear(32, 48, device="cpu")
    before = {k: v.clone() for k, v in _tensors(m).items()}
    params = list(m.parameters())
    with torch.no_grad():
        for p in params:
            p.add_(1.0)
    torch.manual_seed(3)
    m.reset_parameters()
    assert all(a is b for a, b in zip(params, m.parameters()))         # same Parameters
    for k, v in _tensors(m).items():
        assert torch.equal(v, before[k]), k


def test_init_method_and_rng_tracker():
    tracker = _rng_tracker()
    before_default = torch.get_rng_state()
    seen = []
    m = te.Linear(32, 48, init_method=lambda w: seen.append(w.shape) or w.normal_(0.0, 1.0),
                  get_rng_state_tracker=lambda: tracker, device="cpu")
    assert seen == [(48, 32)]
    assert torch.equal(torch.get_rng_state(), before_default)       # default stream untouched
    expected = torch.empty(48, 32).normal_(0.0, 1.0, generator=torch.Generator().manual_seed(1234))
    assert torch.equal(m.weight, expected)                            # the tracker's stream
    assert torch.equal(m.bias, torch.zeros(48))
    named = te.Linear(32, 48, init_method=lambda w: w.normal_(0.0, 1.0),
                      get_rng_state_tracker=lambda: _rng_tracker(),
                      rng_tracker_name="expert-parallel-rng", device="cpu")
    expected = torch.empty(48, 32).normal_(0.0, 1.0, generator=torch.Generator().manual_seed(5678))
    assert torch.equal(named.weight, expected)


# ---- fuse_wgrad_accumulation --------------------------------------------------------------

def _with_main_grad(module, flag=False):
    for name, p in module.named_parameters():
        if name.endswith("weight") and p.dim() == 2:
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
            if flag:
                p.grad_added_to_main_grad = False
    return module


def test_main_grad_accumulates_float32_wgrad_of_bf16_weights():
    torch.manual_seed(0)
    m = _with_main_grad(te.Linear(64, 48, params_dtype=torch.bfloat16, fuse_wgrad_accumulation=True,
                                  device="cpu"))
    xs = [torch.randn(32, 64).bfloat16() for _ in range(2)]
    dys = [torch.randn(32, 48).bfloat16() for _ in range(2)]
    for x, dy in zip(xs, dys):
        m(x).backward(dy)
    assert m.weight.grad is None                                      # no grad_added flag
    ref = sum(dy.double().t() @ x.double() for x, dy in zip(xs, dys))
    assert_close(m.weight.main_grad, ref, 1e-6, "main_grad")          # float32 accumulation
    plain = te.Linear(64, 48, params_dtype=torch.bfloat16, device="cpu")
    plain.load_state_dict(m.state_dict())
    for x, dy in zip(xs, dys):
        plain(x).backward(dy)
    err_bf16 = ((plain.weight.grad.double() - ref).abs().max() / ref.abs().max()).item()
    assert err_bf16 > 1e-4, "the comparison above needs a wgrad that bfloat16 rounds"
    assert torch.equal(m.bias.grad, plain.bias.grad)


@pytest.mark.parametrize("fp8", [False, True], ids=["hp", "fp8"])
@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "LayerNormMLP"])
def test_main_grad_equals_unfused_weight_grad(kind, fp8):
    """float32 weights: main_grad holds, bit for bit, what .grad gets without fusion;
    with Megatron's grad_added_to_main_grad flag, .grad is zeros and the flag is set."""
    build = {"Linear": lambda **kw: te.Linear(64, 48, device="cpu", **kw),
             "LayerNormLinear": lambda **kw: te.LayerNormLinear(64, 48, device="cpu", **kw),
             "LayerNormMLP": lambda **kw: te.LayerNormMLP(64, 32, device="cpu", **kw)}[kind]
    torch.manual_seed(1)
    plain = build()
    fused = _with_main_grad(build(fuse_wgrad_accumulation=True), flag=True)
    fused.load_state_dict(plain.state_dict())
    for step in range(2):
        x = torch.randn(32, 64) * (step + 1)
        for m in (plain, fused):
            with te.autocast(enabled=fp8, recipe=RECIPE):
                out = m(x)
            out.pow(2).sum().backward()
    for (name, p), q in zip(plain.named_parameters(), fused.parameters()):
        if hasattr(q, "main_grad"):
            assert torch.equal(q.main_grad, p.grad), name
            assert q.grad_added_to_main_grad is True
            assert torch.equal(q.grad, torch.zeros_like(q)), name
        else:
            assert torch.equal(q.grad, p.grad), name


def test_fused_wgrad_needs_main_grad_and_one_qkv_weight():
    m = te.Linear(16, 16, fuse_wgrad_accumulation=True, device="cpu")
    with pytest.raises(ValueError, match="accumulates the weight gradient into weight.main_grad, "
                                         "but the weight has none"):
        m(torch.randn(4, 16))
    with torch.no_grad():
        m(torch.randn(4, 16))                                         # no wgrad, no buffer needed
    with pytest.raises(ValueError, match="fuse_wgrad_accumulation=True needs fuse_qkv_params=True"):
        te.TransformerLayer(64, 128, 4, fuse_wgrad_accumulation=True)
    layer = te.TransformerLayer(64, 128, 4, fuse_wgrad_accumulation=True, fuse_qkv_params=True,
                                device="cpu")
    _with_main_grad(layer)
    layer(torch.randn(4, 2, 64)).sum().backward()
    assert all(p.main_grad.abs().sum() > 0 for p in layer.parameters() if hasattr(p, "main_grad"))


# ---- params_dtype=torch.float16 ---------------------------------------------------------

@pytest.mark.parametrize("fp8", [False, True], ids=["hp", "fp8"])
def test_float16_parameters(fp8):
    torch.manual_seed(2)
    ref32 = te.TransformerLayer(64, 128, 4, hidden_dropout=0.0, attention_dropout=0.0,
                                activation="glu", device="cpu")
    half = te.TransformerLayer(64, 128, 4, hidden_dropout=0.0, attention_dropout=0.0,
                               activation="glu", params_dtype=torch.float16, device="cpu")
    assert {p.dtype for p in half.parameters()} == {torch.float16}
    half.load_state_dict(ref32.state_dict())
    x = torch.randn(16, 2, 64)
    with te.autocast(enabled=fp8, recipe=RECIPE):
        y32 = ref32(x)
        y16 = half(x.half())
    assert y16.dtype == torch.float16
    assert_close(y16, y32, 2e-2 if fp8 else 5e-3, "float16 layer against float32 layer")
    y16.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float16 for p in half.parameters())


def test_glu_activation_matches_float64():
    m = te.LayerNormMLP(32, 24, activation="glu", device="cpu")
    x = torch.randn(8, 32, requires_grad=True)
    y = m(x)
    p = {n: leaf64(t) for n, t in m.named_parameters()}
    x64 = leaf64(x)
    mean, var = x64.mean(-1, keepdim=True), x64.var(-1, unbiased=False, keepdim=True)
    h = (x64 - mean) / torch.sqrt(var + 1e-5) * p["layer_norm_weight"] + p["layer_norm_bias"]
    a, b = (h @ p["fc1_weight"].t() + p["fc1_bias"]).chunk(2, dim=-1)
    ref = (torch.sigmoid(a) * b) @ p["fc2_weight"].t() + p["fc2_bias"]    # TE gates the first half
    assert_close(y, ref, 1e-5, "glu")


# ---- is_first_microbatch reaches prepare_forward -----------------------------------------

def test_is_first_microbatch_reaches_prepare_forward(monkeypatch):
    seen = []
    real = TransformerEngineBaseModule.prepare_forward

    def recording(self, inp=None, is_first_microbatch=None):
        seen.append((type(self).__name__, is_first_microbatch))
        return real(self, inp, is_first_microbatch)

    monkeypatch.setattr(TransformerEngineBaseModule, "prepare_forward", recording)
    layer = te.TransformerLayer(64, 128, 4, device="cpu")
    layer(torch.randn(4, 2, 64), is_first_microbatch=True)
    assert seen == [("LayerNormLinear", True), ("Linear", True), ("LayerNormMLP", True)]
    seen.clear()
    te.Linear(16, 16, device="cpu")(torch.randn(2, 16), is_first_microbatch=False)
    assert seen == [("Linear", False)]
    with pytest.raises(TypeError, match="is_first_microbatch must be None, True or False, got 1"):
        te.Linear(16, 16, device="cpu")(torch.randn(2, 16), is_first_microbatch=1)


# ---- LayerNorm's TE arguments --------------------------------------------------------------

def test_layernorm_normalized_shape_and_aliases():
    m = te.LayerNorm((4, 8), eps=1e-3, device="cpu")
    with torch.no_grad():
        m.weight.normal_()
        m.bias.normal_()
    x = torch.randn(3, 4, 8)
    x64 = x.double().reshape(3, 32)
    mean, var = x64.mean(-1, keepdim=True), x64.var(-1, unbiased=False, keepdim=True)
    ref = ((x64 - mean) / torch.sqrt(var + 1e-3)).reshape(3, 4, 8) * m.weight.double() \
        + m.bias.double()
    assert_close(m(x), ref, 1e-6, "LayerNorm over (4, 8)")
    assert te.RMSNorm(hidden_size=16, dtype=torch.bfloat16, device="cpu").weight.dtype == \
        torch.bfloat16
    with pytest.raises(ValueError, match="pass normalized_shape or its older name hidden_size"):
        te.LayerNorm(16, hidden_size=16)
