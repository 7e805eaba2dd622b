"""te.TransformerLayer's TE variants beyond the pre-norm encoder (test_transformer_layer.py):
layer_type="decoder" (cross attention over encoder_output), parallel_attention_mlp,
drop_path_rate, qk norms, packed thd input and sliding windows, against float64
references written from the parameters (references.py), and te.MultiheadAttention
in cross-attention mode.
"""

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.pytorch.ops.basic.l2normalization import L2Normalization
from references import act_ref, allowed_ref, assert_close, attend_ref, leaf64, norm_ref

S, S_ENC, B, HIDDEN, FFN, HEADS, GROUPS = 8, 6, 2, 64, 128, 4, 2
D = HIDDEN // HEADS
EPS = 1e-5


def _randomize(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith(("layer_norm_weight", "layernorm.weight", "norm.weight")):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def _sub(p, prefix):
    return {n[len(prefix):]: t for n, t in p.items() if n.startswith(prefix)}


def _linear(p, x, names=("query", "key", "value")):
    """A projection with TE's split parameters (or one ``weight``)."""
    if "weight" in p:
        return x @ p["weight"].t() + p["bias"]
    return torch.cat([x @ p[f"{n}_weight"].t() + p[f"{n}_bias"] for n in names], dim=-1)


def layer_norm_ref(x, w, b, eps):
    return norm_ref(x, w, b, "LayerNorm", eps, False)


def l2_norm_ref(x, eps):
    return x / torch.sqrt(x.square().sum(-1, keepdim=True) + eps)


def _attention(q, k, v, mask_type, window=None, q_norm=None, k_norm=None):
    """``q [s, b, h, d]``, ``k, v [s_kv, b, g, d]`` -> ``[s, b, h * d]``. ``q_norm`` /
    ``k_norm``: LayerNorm parameters, or a float for an L2 normalization with that eps."""
    if isinstance(q_norm, float):
        q, k = l2_norm_ref(q, q_norm), l2_norm_ref(k, q_norm)
    elif q_norm is not None:
        q = layer_norm_ref(q, q_norm["weight"], q_norm["bias"], 1e-6)
        k = layer_norm_ref(k, k_norm["weight"], k_norm["bias"], 1e-6)
    allowed = allowed_ref(mask_type, window, q.shape[0], k.shape[0]).unsqueeze(0)
    return torch.stack([attend_ref(q[:, b], k[:, b], v[:, b], allowed, D ** -0.5)
                        for b in range(q.shape[1])], dim=1)


def _self_attn_ref(p, x, mask_type="causal", window=None, qk_norm=False):
    h = layer_norm_ref(x, p["layernorm_qkv.layer_norm_weight"],
                       p["layernorm_qkv.layer_norm_bias"], EPS)
    mixed = _linear(_sub(p, "layernorm_qkv."), h)
    q, k, v = mixed.split([HEADS * D, GROUPS * D, GROUPS * D], dim=-1)
    s, b = x.shape[:2]
    if isinstance(qk_norm, float):
        norms = (qk_norm, qk_norm)
    else:
        norms = (_sub(p, "q_norm."), _sub(p, "k_norm.")) if qk_norm else (None, None)
    ctx = _attention(q.reshape(s, b, HEADS, D), k.reshape(s, b, GROUPS, D),
                     v.reshape(s, b, GROUPS, D), mask_type, window, *norms)
    return ctx @ p["proj.weight"].t() + p["proj.bias"]


def _cross_attn_ref(p, x, enc, mask_type="no_mask"):
    h = layer_norm_ref(x, p["layernorm_query.layer_norm_weight"],
                       p["layernorm_query.layer_norm_bias"], EPS)
    q = _linear(_sub(p, "layernorm_query."), h, ("query",))
    kv = _linear(_sub(p, "key_value."), enc, ("key", "value"))
    k, v = kv.split([GROUPS * D, GROUPS * D], dim=-1)
    s, b, s_kv = x.shape[0], x.shape[1], enc.shape[0]
    ctx = _attention(q.reshape(s, b, HEADS, D), k.reshape(s_kv, b, GROUPS, D),
                     v.reshape(s_kv, b, GROUPS, D), mask_type)
    return ctx @ p["proj.weight"].t() + p["proj.bias"]


def _mlp_ref(p, x):
    h = layer_norm_ref(x, p["layer_norm_weight"], p["layer_norm_bias"], EPS)
    return act_ref(h @ p["fc1_weight"].t() + p["fc1_bias"], "gelu") @ p["fc2_weight"].t() \
        + p["fc2_bias"]


def _layer(**kw):
    kw = dict(num_gqa_groups=GROUPS, hidden_dropout=0.0, attention_dropout=0.0, device="cpu",
              **kw)
    layer = te.TransformerLayer(HIDDEN, FFN, HEADS, **kw)
    _randomize(layer)
    return layer


def _check_grads(out, ref, x, x64, layer, p64):
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    out.backward(dy)
    ref.backward(dy.double())
    assert_close(out, ref, 1e-5, "out")
    assert_close(x.grad, x64.grad, 1e-4, "dx")
    for n, t in layer.named_parameters():
        if p64[n].grad.abs().max() < 1e-9:      # the key bias: softmax ignores a shift per row
            assert t.grad.abs().max() < 1e-5, f"d{n} should vanish"
        else:
            assert_close(t.grad, p64[n].grad, 1e-4, f"d{n}")


def test_decoder_layer_matches_float64():
    layer = _layer(layer_type="decoder", enc_dec_attn_mask_type="no_mask")
    x = torch.randn(S, B, HIDDEN, requires_grad=True)
    enc = torch.randn(S_ENC, B, HIDDEN, requires_grad=True)
    out = layer(x, encoder_output=enc)
    p = {n: leaf64(t) for n, t in layer.named_parameters()}
    x64, enc64 = leaf64(x), leaf64(enc)
    a = x64 + _self_attn_ref(_sub(p, "self_attention."), x64)
    c = a + _cross_attn_ref(_sub(p, "inter_attention."), a, enc64)
    ref = c + _mlp_ref(_sub(p, "layernorm_mlp."), c)
    _check_grads(out, ref, x, x64, layer, p)
    assert_close(enc.grad, enc64.grad, 1e-4, "d encoder_output")


def test_parallel_attention_mlp_matches_float64():
    layer = _layer(parallel_attention_mlp=True)
    x = torch.randn(S, B, HIDDEN, requires_grad=True)
    out = layer(x)
    p = {n: leaf64(t) for n, t in layer.named_parameters()}
    x64 = leaf64(x)
    ref = x64 + _self_attn_ref(_sub(p, "self_attention."), x64) \
        + _mlp_ref(_sub(p, "layernorm_mlp."), x64)
    _check_grads(out, ref, x, x64, layer, p)


def test_sliding_window_and_qk_norm_match_float64():
    layer = _layer(window_size=(3, 0), qk_norm_type="LayerNorm")
    names = [n for n, _ in layer.named_parameters()]
    assert names[:4] == ["self_attention.q_norm.weight", "self_attention.q_norm.bias",
                         "self_attention.k_norm.weight", "self_attention.k_norm.bias"]
    x = torch.randn(S, B, HIDDEN, requires_grad=True)
    out = layer(x)
    p = {n: leaf64(t) for n, t in layer.named_parameters()}
    x64 = leaf64(x)
    a = x64 + _self_attn_ref(_sub(p, "self_attention."), x64, "causal", (3, 0), qk_norm=True)
    ref = a + _mlp_ref(_sub(p, "layernorm_mlp."), a)
    _check_grads(out, ref, x, x64, layer, p)


def test_l2_qk_norm_matches_float64():
    """qk_norm_type="L2Normalization": one parameter-free module serves queries and
    keys (as in TE), each head scaled to unit norm: ``x / sqrt(sum(x**2) + eps)``."""
    layer = _layer(qk_norm_type="L2Normalization", qk_norm_eps=1e-3)
    attn = layer.self_attention
    assert isinstance(attn.q_norm, L2Normalization) and attn.q_norm is attn.k_norm
    assert not any("q_norm" in n or "k_norm" in n for n, _ in layer.named_parameters())
    x = torch.randn(S, B, HIDDEN, requires_grad=True)
    out = layer(x)
    p = {n: leaf64(t) for n, t in layer.named_parameters()}
    x64 = leaf64(x)
    a = x64 + _self_attn_ref(_sub(p, "self_attention."), x64, qk_norm=1e-3)
    ref = a + _mlp_ref(_sub(p, "layernorm_mlp."), a)
    _check_grads(out, ref, x, x64, layer, p)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_l2_normalization_op_matches_float64(dtype):
    """Computed in float32, rounded once to the input's dtype; gradient in float32."""
    op = L2Normalization(eps=1e-6)
    x = (torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(4)) * 3).to(dtype)
    x.requires_grad_()
    y = op(x)
    assert y.dtype == dtype
    x64 = leaf64(x)
    ref = l2_norm_ref(x64, 1e-6)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
    y.backward(dy)
    ref.backward(dy.double())
    bound = 1e-6 if dtype == torch.float32 else 8e-3
    assert_close(y, ref, bound, "y")
    assert_close(x.grad, x64.grad, bound * 10, "dx")
    with pytest.raises(ValueError, match="te.ops.L2Normalization: eps must be a finite positive"):
        L2Normalization(eps=float("nan"))


def test_thd_layer_equals_one_sequence_at_a_time():
    """Packed sequences through the whole layer give each sequence's own result."""
    layer = _layer(attn_input_format="thd", self_attn_mask_type="padding_causal")
    single = _layer()
    single.load_state_dict(layer.state_dict())
    lens = [5, 3]
    x = torch.randn(sum(lens), HIDDEN)
    cu = torch.tensor([0, 5, 8], dtype=torch.int32)
    packed = layer(x, cu_seqlens_q=cu, cu_seqlens_kv=cu)
    for start, n in ((0, 5), (5, 3)):
        alone = single(x[start:start + n].unsqueeze(1)).squeeze(1)
        torch.testing.assert_close(packed[start:start + n], alone, rtol=1e-5, atol=1e-5)


def test_drop_path_drops_whole_samples():
    layer = te.TransformerLayer(HIDDEN, FFN, HEADS, hidden_dropout=0.0, drop_path_rate=0.5,
                                device="cpu")
    residual = torch.randn(S, 64, HIDDEN)
    block = torch.randn(S, 64, HIDDEN)
    torch.manual_seed(0)
    out = layer._dropout_add(block, residual)
    kept = [torch.allclose(out[:, b], residual[:, b] + 2.0 * block[:, b]) for b in range(64)]
    dropped = [torch.equal(out[:, b], residual[:, b]) for b in range(64)]
    assert all(k or d for k, d in zip(kept, dropped))
    assert 10 < sum(kept) < 54                               # about half of the samples kept
    layer.eval()
    assert torch.equal(layer._dropout_add(block, residual), residual + block)


def test_drop_path_rate_one_passes_the_residuals_through():
    """drop_path_rate=1.0 (TE accepts it): every block output dropped in training, so
    the layer is its residual path, the blocks get zero gradients; eval is unchanged."""
    torch.manual_seed(1)
    layer = te.TransformerLayer(HIDDEN, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0,
                                drop_path_rate=1.0, device="cpu")
    x = torch.randn(S, B, HIDDEN, requires_grad=True)
    out = layer(x)
    assert torch.equal(out, x)
    out.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
    for name, p in layer.named_parameters():
        assert p.grad is not None and not p.grad.any(), name
    layer.eval()
    with torch.no_grad():
        assert not torch.allclose(layer(x), x)
    with pytest.raises(ValueError, match=r"drop_path_rate must be a float in \[0, 1\], got 1.5"):
        te.TransformerLayer(HIDDEN, FFN, HEADS, drop_path_rate=1.5, device="cpu")


def test_cross_attention_module_with_fused_kv():
    """attention_type="cross" with fuse_qkv_params: one key_value weight whose rows are
    [k, v] per group (interleaved), matching the split layout after reordering."""
    torch.manual_seed(4)
    fused = te.MultiheadAttention(HIDDEN, HEADS, num_gqa_groups=GROUPS, attention_dropout=0.0,
                                  attention_type="cross", fuse_qkv_params=True,
                                  attn_mask_type="no_mask", device="cpu")
    split = te.MultiheadAttention(HIDDEN, HEADS, num_gqa_groups=GROUPS, attention_dropout=0.0,
                                  attention_type="cross", attn_mask_type="no_mask", device="cpu")
    s = fused.state_dict()
    w = s.pop("key_value.weight").reshape(GROUPS, 2, D, HIDDEN)
    bias = s.pop("key_value.bias").reshape(GROUPS, 2, D)
    s["key_value.key_weight"], s["key_value.value_weight"] = (w[:, i].reshape(-1, HIDDEN)
                                                              for i in (0, 1))
    s["key_value.key_bias"], s["key_value.value_bias"] = (bias[:, i].reshape(-1) for i in (0, 1))
    s["query_layer.query_weight"] = s.pop("query_layer.weight")
    s["query_layer.query_bias"] = s.pop("query_layer.bias")
    split.load_state_dict(s)
    x, enc = torch.randn(S, B, HIDDEN), torch.randn(S_ENC, B, HIDDEN)
    torch.testing.assert_close(fused(x, encoder_output=enc), split(x, encoder_output=enc),
                               rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="attention_type='cross' needs encoder_output"):
        fused(x)
