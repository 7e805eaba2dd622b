"""te.DotProductAttention's masks, windows, biases and packed (thd) sequences against a
float64 reference that builds each mask from TE's definitions by explicit loops over
(query, key) and attends one sequence at a time (references.py).

Bounds: 1e-5 (forward) and 1e-4 (gradients) relative to max |reference|: float32
rounding of the softmax and two GEMMs.
"""

import pytest
import torch

import transformer_engine.pytorch as te
from helpers import DEVICES
from references import allowed_ref, assert_close, attend_ref, leaf64

B, H, G, D = 2, 4, 2, 8
SCALE = D ** -0.5
MASK_TYPES = ["no_mask", "causal", "causal_bottom_right", "padding", "padding_causal",
              "padding_causal_bottom_right"]
WINDOWS = [pytest.param(None, id="no-window"), pytest.param((2, 0), id="w2-0"),
           pytest.param((1, 1), id="w1-1"), pytest.param((-1, 2), id="w-1-2")]
SHAPES = [pytest.param((6, 6), id="sq6-skv6"), pytest.param((4, 7), id="sq4-skv7"),
          pytest.param((7, 4), id="sq7-skv4")]


def _dpa(mask_type="causal", **kw):
    return te.DotProductAttention(H, D, num_gqa_groups=G, attention_dropout=0.0,
                                  attn_mask_type=mask_type, **kw)


def _qkv(sq, skv, fmt="sbhd", seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (lambda s, n: (s, B, n, D)) if fmt == "sbhd" else (lambda s, n: (B, s, n, D))
    return tuple(torch.randn(*shape(s, n), generator=g).requires_grad_()
                 for s, n in ((sq, H), (skv, G), (skv, G)))


def _pad_mask(lengths, s):
    """TE padding mask ``[b, 1, 1, s]``, True = padding (valid tokens first)."""
    return torch.stack([torch.arange(s) >= n for n in lengths]).reshape(len(lengths), 1, 1, s)


def _ref_sbhd(q, k, v, mask_type, window, q_lens=None, kv_lens=None, arbitrary=None, bias=None):
    """Float64 reference on sbhd tensors, one batch element at a time."""
    sq, skv = q.shape[0], k.shape[0]
    outs = []
    for b in range(q.shape[1]):
        ql = q_lens[b] if q_lens is not None else None
        kl = kv_lens[b] if kv_lens is not None else None
        if arbitrary is not None:
            allowed = torch.stack([allowed_ref(mask_type, window, sq, skv,
                                               arbitrary=arbitrary[b, h]) for h in range(H)])
        else:
            allowed = allowed_ref(mask_type, window, sq, skv, ql, kl).unsqueeze(0)
        q_valid = (torch.arange(sq) < ql) if ql is not None else None
        outs.append(attend_ref(q[:, b], k[:, b], v[:, b], allowed, SCALE,
                               None if bias is None else bias[b if bias.shape[0] > 1 else 0],
                               q_valid))
    return torch.stack(outs, dim=1)


def _check(out, ref, tensors, tensors64, what):
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    out.backward(dy)
    ref.backward(dy.double())
    assert_close(out, ref, 1e-5, f"{what}: out")
    for name, t, t64 in zip(("dq", "dk", "dv", "dbias"), tensors, tensors64):
        assert torch.isfinite(t.grad).all(), f"{what}: {name} not finite"
        assert_close(t.grad, t64.grad, 1e-4, f"{what}: {name}")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("mask_type", MASK_TYPES)
def test_mask_matches_float64(mask_type, window, shape):
    sq, skv = shape
    q, k, v = _qkv(sq, skv, seed=sq * 10 + skv)
    q_lens = kv_lens = mask = None
    if mask_type.startswith("padding"):
        q_lens, kv_lens = [sq, sq - 2], [skv - 1, skv]
        mask = (_pad_mask(q_lens, sq), _pad_mask(kv_lens, skv))
    out = _dpa(mask_type, window_size=window)(q, k, v, mask)
    q64, k64, v64 = (leaf64(t) for t in (q, k, v))
    ref = _ref_sbhd(q64, k64, v64, mask_type, window, q_lens, kv_lens)
    _check(out, ref, (q, k, v), (q64, k64, v64), f"{mask_type} {window} {shape}")


def test_window_changes_the_output():
    """The window test above is not vacuous: a window drops keys a causal mask keeps."""
    q, k, v = _qkv(6, 6)
    assert not torch.allclose(_dpa("causal")(q, k, v),
                              _dpa("causal", window_size=(1, 0))(q, k, v))


def test_bottom_right_differs_from_top_left_when_lengths_differ():
    q, k, v = _qkv(4, 7)
    top, bottom = _dpa("causal")(q, k, v), _dpa("causal_bottom_right")(q, k, v)
    assert not torch.allclose(top, bottom)
    q, k, v = _qkv(5, 5)
    assert torch.equal(_dpa("causal")(q, k, v), _dpa("causal_bottom_right")(q, k, v))


def test_padding_from_cu_seqlens_equals_padding_mask():
    q, k, v = _qkv(6, 6)
    lens = [6, 3]
    cu = torch.tensor([0, 6, 9], dtype=torch.int32)
    dpa = _dpa("padding_causal")
    by_mask = dpa(q, k, v, _pad_mask(lens, 6))
    by_lengths = dpa(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu)
    assert torch.equal(by_mask, by_lengths)
    assert torch.equal(by_mask[3:, 1], torch.zeros_like(by_mask[3:, 1]))   # padded queries


@pytest.mark.parametrize("window", [None, (1, 1)], ids=["no-window", "w1-1"])
def test_arbitrary_mask_matches_float64(window):
    q, k, v = _qkv(5, 6)
    g = torch.Generator().manual_seed(3)
    arbitrary = torch.rand(B, H, 5, 6, generator=g) < 0.4
    arbitrary[0, 1, 2, :] = True                         # a fully masked row
    out = _dpa("arbitrary", window_size=window)(q, k, v, arbitrary)
    q64, k64, v64 = (leaf64(t) for t in (q, k, v))
    ref = _ref_sbhd(q64, k64, v64, "no_mask", window, arbitrary=arbitrary)
    _check(out, ref, (q, k, v), (q64, k64, v64), f"arbitrary {window}")
    assert torch.equal(out[2, 0, D:2 * D], torch.zeros(D))     # that row outputs zeros


@pytest.mark.parametrize("bias_type", ["post_scale_bias", "pre_scale_bias"])
@pytest.mark.parametrize("bias_batch", [1, B], ids=["bias-1hss", "bias-bhss"])
def test_attention_bias_matches_float64(bias_type, bias_batch):
    q, k, v = _qkv(6, 6)
    bias = torch.randn(bias_batch, H, 6, 6, generator=torch.Generator().manual_seed(5))
    bias.requires_grad_()
    out = _dpa("causal")(q, k, v, core_attention_bias_type=bias_type, core_attention_bias=bias)
    q64, k64, v64, b64 = (leaf64(t) for t in (q, k, v, bias))
    ref = _ref_sbhd(q64, k64, v64, "causal", None,
                    bias=b64 * (SCALE if bias_type == "pre_scale_bias" else 1.0))
    _check(out, ref, (q, k, v, bias), (q64, k64, v64, b64), bias_type)


def test_bshd_equals_sbhd():
    q, k, v = _qkv(6, 4)
    sb = _dpa("causal_bottom_right", window_size=(2, 0))(q, k, v)
    bs = _dpa("causal_bottom_right", window_size=(2, 0), qkv_format="bshd")(
        *(t.transpose(0, 1) for t in (q, k, v)))
    assert torch.equal(sb, bs.transpose(0, 1))


def test_value_head_size_may_differ():
    dpa = te.DotProductAttention(H, (D, 2 * D), num_gqa_groups=G, attention_dropout=0.0,
                                 attn_mask_type="no_mask")
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(5, B, H, D, generator=g), torch.randn(5, B, G, D, generator=g)
    v = torch.randn(5, B, G, 2 * D, generator=g)
    out = dpa(q, k, v)
    assert out.shape == (5, B, H * 2 * D)
    ref = _ref_sbhd(q.double(), k.double(), v.double(), "no_mask", None)
    assert_close(out, ref, 1e-5, "out")


def test_mask_type_spellings():
    q, k, v = _qkv(6, 6)
    mask = _pad_mask([6, 4], 6)
    ref = _dpa("padding_causal")(q, k, v, mask)
    for spelling in ("padding,causal", "causal,padding", "causal_padding"):
        assert torch.equal(_dpa(spelling)(q, k, v, mask), ref)


# ---- thd: packed sequences against one reference call per sequence -----------------------

def _thd_case(q_lens, kv_lens, q_gaps, kv_gaps, seed=0):
    """Packed q / k / v with sequences of the given lengths, each followed by the given
    number of padding tokens; returns tensors and the cu_seqlens(_padded) tensors."""
    g = torch.Generator().manual_seed(seed)

    def offsets(lens, gaps):
        cu, cu_pad = [0], [0]
        for n, gap in zip(lens, gaps):
            cu.append(cu[-1] + n)
            cu_pad.append(cu_pad[-1] + n + gap)
        return torch.tensor(cu, dtype=torch.int32), torch.tensor(cu_pad, dtype=torch.int32)

    cu_q, pad_q = offsets(q_lens, q_gaps)
    cu_kv, pad_kv = offsets(kv_lens, kv_gaps)
    q = torch.randn(int(pad_q[-1]), H, D, generator=g).requires_grad_()
    k = torch.randn(int(pad_kv[-1]), G, D, generator=g).requires_grad_()
    v = torch.randn(int(pad_kv[-1]), G, D, generator=g).requires_grad_()
    return q, k, v, cu_q, cu_kv, pad_q, pad_kv


def _thd_ref(q, k, v, cu_q, cu_kv, pad_q, pad_kv, mask_type, window):
    out = torch.zeros(q.shape[0], H * D, dtype=torch.float64)
    pieces = []
    for i in range(len(cu_q) - 1):
        nq, nk = int(cu_q[i + 1] - cu_q[i]), int(cu_kv[i + 1] - cu_kv[i])
        q0, k0 = int(pad_q[i]), int(pad_kv[i])
        if nq == 0:
            continue
        allowed = allowed_ref(mask_type.replace("padding_", "").replace("padding", "no_mask"),
                              window, nq, nk).unsqueeze(0)
        pieces.append((q0, nq, attend_ref(q[q0:q0 + nq], k[k0:k0 + nk], v[k0:k0 + nk],
                                          allowed, SCALE)))
    rows = list(out.unbind(0))
    for q0, nq, piece in pieces:
        for r in range(nq):
            rows[q0 + r] = piece[r]
    return torch.stack(rows)


THD_CASES = {
    "contiguous": ([5, 3, 7], [5, 3, 7], [0, 0, 0], [0, 0, 0]),
    "padded": ([5, 3, 7], [5, 3, 7], [2, 0, 1], [2, 0, 1]),
    "cross-lengths": ([4, 6], [7, 2], [1, 0], [0, 3]),
    "empty-sequence": ([4, 0, 3], [4, 0, 3], [0, 2, 0], [0, 2, 0]),
}


@pytest.mark.parametrize("window", [None, (2, 0)], ids=["no-window", "w2-0"])
@pytest.mark.parametrize("mask_type", ["padding", "padding_causal",
                                       "padding_causal_bottom_right"])
@pytest.mark.parametrize("case", list(THD_CASES))
def test_thd_matches_per_sequence_float64(case, mask_type, window):
    q, k, v, cu_q, cu_kv, pad_q, pad_kv = _thd_case(*THD_CASES[case])
    padded = case != "contiguous"
    dpa = _dpa(mask_type, qkv_format="thd", window_size=window)
    out = dpa(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv,
              cu_seqlens_q_padded=pad_q if padded else None,
              cu_seqlens_kv_padded=pad_kv if padded else None, pad_between_seqs=padded)
    q64, k64, v64 = (leaf64(t) for t in (q, k, v))
    ref = _thd_ref(q64, k64, v64, cu_q, cu_kv, pad_q, pad_kv, mask_type, window)
    _check(out, ref, (q, k, v), (q64, k64, v64), f"thd {case} {mask_type} {window}")


def test_thd_checkpoint_core_attention_is_bit_identical():
    q, k, v, cu_q, cu_kv, pad_q, pad_kv = _thd_case(*THD_CASES["padded"])
    dpa = _dpa("padding_causal", qkv_format="thd")
    grads = []
    for ckpt in (False, True):
        for t in (q, k, v):
            t.grad = None
        out = dpa(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, cu_seqlens_q_padded=pad_q,
                  cu_seqlens_kv_padded=pad_kv, checkpoint_core_attention=ckpt)
        out.pow(2).sum().backward()
        grads.append([out.detach()] + [t.grad.clone() for t in (q, k, v)])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


# ---- tensor-parallel head counts and refusals ----------------------------------------------

def test_tp_size_means_local_heads():
    dpa = te.DotProductAttention(H, D, num_gqa_groups=G, attention_dropout=0.0, tp_size=2)
    q = torch.randn(5, B, H // 2, D)
    kv = torch.randn(5, B, G // 2, D)
    assert dpa(q, kv, kv).shape == (5, B, H // 2 * D)
    with pytest.raises(ValueError, match=r"query_layer must be .* with 2 heads"):
        dpa(torch.randn(5, B, H, D), kv, kv)


def _mha(mask_type="causal", **kw):
    """No grouped-query attention, so that one tensor serves as q, k and v."""
    return te.DotProductAttention(H, D, attention_dropout=0.0, attn_mask_type=mask_type, **kw)


_THD, _SBHD = torch.randn(6, H, D), torch.randn(6, B, H, D)
_CU7 = torch.tensor([0, 7], dtype=torch.int32)

BAD_CALLS = [
    pytest.param(lambda: _mha("padding", qkv_format="thd")(_THD, _THD, _THD), ValueError,
                 "qkv_format='thd' needs cu_seqlens_q", id="thd-without-cu-seqlens"),
    pytest.param(lambda: _mha("padding", qkv_format="thd")(
        _THD, _THD, _THD, torch.zeros(1, 1, 1, 6, dtype=torch.bool),
        cu_seqlens_q=torch.tensor([0, 6], dtype=torch.int32)), ValueError,
        "takes its padding from cu_seqlens", id="thd-with-mask"),
    pytest.param(lambda: _mha("padding", qkv_format="thd")(_THD, _THD, _THD, cu_seqlens_q=_CU7),
                 ValueError, "cu_seqlens_q must start at 0, never decrease and end within the 6",
                 id="thd-cu-past-end"),
    pytest.param(lambda: _mha("causal", window_size=(2,)), ValueError,
                 "window_size must be None or a pair", id="window-one-int"),
    pytest.param(lambda: _mha("causal")(_SBHD, _SBHD, _SBHD,
                                        core_attention_bias=torch.zeros(1, H, 6, 6)),
                 ValueError, "core_attention_bias was given with core_attention_bias_type='no_bias'",
                 id="bias-without-type"),
    pytest.param(lambda: _mha("causal")(_SBHD, _SBHD, _SBHD, core_attention_bias_type="alibi"),
                 NotImplementedError, "core_attention_bias_type='alibi' is not implemented",
                 id="alibi"),
    pytest.param(lambda: _mha("causal")(_SBHD, _SBHD, _SBHD, inference_params=object()),
                 NotImplementedError, "inference_params=.* is not implemented", id="kv-cache"),
    pytest.param(lambda: _mha("causal")(_SBHD, _SBHD, _SBHD, num_splits=2), NotImplementedError,
                 "num_splits=2 is not implemented", id="num-splits"),
    pytest.param(lambda: _mha("causal", softmax_type="learnable"), NotImplementedError,
                 "softmax_type='learnable' is not implemented", id="sink-softmax"),
    pytest.param(lambda: _mha("sliding"), ValueError, "attn_mask_type must be one of",
                 id="unknown-mask-type"),
]


@pytest.mark.parametrize("call, exc, match", BAD_CALLS)
def test_bad_calls_are_refused(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


# ---- attention_mask with the mask types that do not read it ---------------------------------
# TE reads attention_mask only for the padding types and "arbitrary"; with the others the
# output and gradients are those of no mask, whatever the mask holds.

def _odd_masks(b, sq, skv, device="cpu"):
    """Masks that would change (or break) the output if they were read."""
    everything = torch.ones(sq, skv, dtype=torch.bool, device=device)   # masks every key
    half = torch.arange(skv, device=device) >= skv // 2
    return {"all-true": everything, "padding-shaped": half.expand(b, 1, 1, skv).clone(),
            "pair": (half[:sq].expand(b, 1, 1, sq).clone(), half.expand(b, 1, 1, skv).clone()),
            "int": torch.ones(b, 1, 1, skv, dtype=torch.int64, device=device)}


def _out_and_grads(fn, inputs):
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*inputs)
    out.backward(torch.ones_like(out))
    return [out.detach()] + [t.grad for t in inputs]


def _assert_same(a, b):
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("mask_type", ["no_mask", "causal", "causal_bottom_right"])
def test_dpa_ignores_attention_mask_of_maskless_types(mask_type, fmt):
    sq, skv = 5, 7
    q, k, v = _qkv(sq, skv, fmt)
    dpa = _dpa(mask_type, qkv_format=fmt)
    plain = _out_and_grads(dpa, (q, k, v))
    for mask in _odd_masks(B, sq, skv).values():
        masked = _out_and_grads(lambda *t: dpa(*t, attention_mask=mask), (q, k, v))
        _assert_same(masked, plain)
    # the same mask under "arbitrary" is read: the output changes
    half = _odd_masks(B, sq, skv)["padding-shaped"]
    assert not torch.equal(_dpa("arbitrary", qkv_format=fmt)(q, k, v, half), plain[0])


def test_dpa_thd_ignores_attention_mask_of_maskless_types():
    t = torch.randn(9, H, D, generator=torch.Generator().manual_seed(2))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    dpa = _mha("causal", qkv_format="thd")
    plain = dpa(t, t, t, cu_seqlens_q=cu, cu_seqlens_kv=cu)
    masked = dpa(t, t, t, torch.ones(9, 9, dtype=torch.bool), cu_seqlens_q=cu, cu_seqlens_kv=cu)
    assert torch.equal(masked, plain)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("attention_type", ["self", "cross"])
@pytest.mark.parametrize("mask_type", ["no_mask", "causal", "causal_bottom_right"])
def test_multihead_attention_ignores_attention_mask_of_maskless_types(mask_type, attention_type,
                                                                      device):
    torch.manual_seed(0)
    mha = te.MultiheadAttention(16, 2, attention_dropout=0.0, attn_mask_type=mask_type,
                                attention_type=attention_type, device=device)
    x = torch.randn(5, B, 16, device=device)
    enc = torch.randn(7, B, 16, device=device) if attention_type == "cross" else None
    skv = 7 if attention_type == "cross" else 5
    plain = _out_and_grads(lambda h: mha(h, encoder_output=enc), (x,))
    masks = _odd_masks(B, 5, skv, device)
    for mask in (masks["all-true"], masks["pair"]):
        masked = _out_and_grads(lambda h: mha(h, attention_mask=mask, encoder_output=enc), (x,))
        _assert_same(masked, plain)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mask_type", ["no_mask", "causal", "causal_bottom_right"])
def test_transformer_layer_ignores_attention_masks_of_maskless_types(mask_type, device):
    torch.manual_seed(0)
    layer = te.TransformerLayer(16, 32, 2, hidden_dropout=0.0, attention_dropout=0.0,
                                layer_type="decoder", self_attn_mask_type=mask_type,
                                enc_dec_attn_mask_type=mask_type, device=device)
    x, enc = torch.randn(5, B, 16, device=device), torch.randn(7, B, 16, device=device)
    plain = _out_and_grads(lambda h, e: layer(h, encoder_output=e), (x, enc))
    self_masks, cross_masks = _odd_masks(B, 5, 5, device), _odd_masks(B, 5, 7, device)
    for name in ("all-true", "int"):
        masked = _out_and_grads(lambda h, e: layer(
            h, attention_mask=self_masks[name], encoder_output=e,
            enc_dec_attn_mask=cross_masks[name]), (x, enc))
        _assert_same(masked, plain)
