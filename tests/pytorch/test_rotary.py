"""Rotary position embeddings: te.RotaryPositionEmbedding's angles, apply_rotary_pos_emb
and rotary_pos_emb in te.MultiheadAttention / te.TransformerLayer, against float64
references that rotate each channel pair as a complex number (references.py).

Bounds relative to max |reference|: 1e-6 for float32 rotations (one rounding of
cos/sin and of the sum), 1e-5 through attention, 8e-3 for bfloat16 outputs (one
rounding to bfloat16).
"""

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.pytorch.attention.rope import apply_rotary_pos_emb
from references import (allowed_ref, assert_close, attend_ref, leaf64, norm_ref,
                        rope_angles_ref, rotate_ref)

S, B, HEADS, D = 12, 2, 4, 16


def _layout(angles, interleaved):
    """TE's freqs layout of ``[s, d2/2]`` angles (NOTE [Rotary layouts])."""
    emb = angles.repeat_interleave(2, -1) if interleaved else torch.cat((angles, angles), -1)
    return emb.reshape(angles.shape[0], 1, 1, -1)


@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
@pytest.mark.parametrize("offset", [0, 5])
def test_angles_match_float64(offset, interleaved):
    rope = te.RotaryPositionEmbedding(D, rotary_base=500.0, interleaved=interleaved, device="cpu")
    freqs = rope(S, offset=offset)
    assert freqs.shape == (S, 1, 1, D) and freqs.dtype == torch.float32
    ref = _layout(rope_angles_ref(D, range(offset, offset + S), base=500.0), interleaved)
    assert_close(freqs, ref, 1e-6, "freqs")


def test_angle_options():
    part = te.RotaryPositionEmbedding(D, rotary_percent=0.5, device="cpu")(S)
    assert_close(part, _layout(rope_angles_ref(D // 2, range(S)), False), 1e-6, "rotary_percent")
    interp = te.RotaryPositionEmbedding(D, seq_len_interpolation_factor=4, device="cpu")(S)
    assert_close(interp, _layout(rope_angles_ref(D, [p / 4 for p in range(S)]), False), 1e-6,
                 "interpolation")
    dyn = te.RotaryPositionEmbedding(D, seq_len_interpolation_factor=2,
                                     pretrained_max_position_embeddings=4, device="cpu")(S)
    assert_close(dyn, _layout(rope_angles_ref(D, [p * 4 / S for p in range(S)]), False), 1e-6,
                 "dynamic interpolation beyond pretrained * factor")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rot_dim", [D, D // 2], ids=["full", "partial"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
def test_apply_matches_complex_rotation(fmt, interleaved, rot_dim, dtype):
    g = torch.Generator().manual_seed(1)
    shape = (S, B, HEADS, D) if fmt == "sbhd" else (B, S, HEADS, D)
    t = torch.randn(shape, generator=g).to(dtype).requires_grad_()
    angles = rope_angles_ref(rot_dim, range(S + 3))                 # longer than needed
    freqs = _layout(angles, interleaved).float()
    out = apply_rotary_pos_emb(t, freqs, fmt, interleaved=interleaved)
    assert out.dtype == dtype
    t64 = leaf64(t)
    per_pos = angles[:S].reshape(S, 1, -1) if fmt == "sbhd" else angles[:S].reshape(1, S, 1, -1)
    if fmt == "sbhd":
        per_pos = per_pos.unsqueeze(1)
    ref = rotate_ref(t64, per_pos, interleaved)
    dy = torch.randn(shape, generator=g).to(dtype)
    out.backward(dy)
    ref.backward(dy.double())
    bound = 1e-6 if dtype == torch.float32 else 8e-3
    assert_close(out, ref, bound, "out")
    assert_close(t.grad, t64.grad, bound, "grad")
    if rot_dim < D:                                                  # the rest passes through
        assert torch.equal(out[..., rot_dim:], t[..., rot_dim:])


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("rot_dim", [D, D // 2], ids=["full", "partial"])
def test_output_is_contiguous_whatever_the_input_strides(rot_dim, fused):
    """As TE's: a transposed view in, a contiguous output, equal to the contiguous
    input's."""
    g = torch.Generator().manual_seed(2)
    t = torch.randn(S, HEADS, B, D, generator=g).transpose(1, 2)       # [s, b, h, d] view
    freqs = _layout(rope_angles_ref(rot_dim, range(S)), False).float()
    out = apply_rotary_pos_emb(t, freqs, "sbhd", fused=fused)
    assert out.is_contiguous()
    assert torch.equal(out, apply_rotary_pos_emb(t.contiguous(), freqs, "sbhd", fused=fused))


def test_lengths_given_as_integer_tensors():
    """TE's callers pass ``max_seqlen`` as a device integer tensor."""
    rope = te.RotaryPositionEmbedding(D, device="cpu")
    assert torch.equal(rope(torch.tensor(S), offset=torch.tensor(3)), rope(S, offset=3))
    with pytest.raises(ValueError, match="max_seq_len must be a positive int"):
        rope(torch.tensor(2.5))


def test_start_positions():
    g = torch.Generator().manual_seed(2)
    t = torch.randn(S, B, HEADS, D, generator=g)
    angles = rope_angles_ref(D, range(40))
    starts = torch.tensor([0, 7])
    out = apply_rotary_pos_emb(t, _layout(angles, False).float(), "sbhd", start_positions=starts)
    for b, s0 in enumerate(starts.tolist()):
        ref = rotate_ref(t[:, b].double(), angles[s0:s0 + S].reshape(S, 1, -1), False)
        assert_close(out[:, b], ref, 1e-6, f"batch {b}")


@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
def test_thd_positions_restart_per_sequence(interleaved):
    g = torch.Generator().manual_seed(3)
    lens = [5, 1, 4]
    cu = torch.tensor([0, 5, 6, 10], dtype=torch.int32)
    t = torch.randn(12, HEADS, D, generator=g)                       # 2 trailing tokens
    angles = rope_angles_ref(D, range(S))
    out = apply_rotary_pos_emb(t, _layout(angles, interleaved).float(), "thd",
                               interleaved=interleaved, cu_seqlens=cu)
    start = 0
    for n in lens:
        ref = rotate_ref(t[start:start + n].double(), angles[:n].reshape(n, 1, -1), interleaved)
        assert_close(out[start:start + n], ref, 1e-6, f"sequence at {start}")
        start += n
    assert torch.equal(out[10:], t[10:])                              # beyond cu_seqlens


@pytest.mark.parametrize("fmt", ["sbhd", "thd"])
def test_context_parallel_positions(fmt):
    """Rank r of 2 holds chunks r and 3 - r of each sequence: its rotation equals the
    full sequence's rotation restricted to those chunks."""
    g = torch.Generator().manual_seed(4)
    full = torch.randn(8, HEADS, D, generator=g)
    freqs = _layout(rope_angles_ref(D, range(8)), False).float()
    cu_full = torch.tensor([0, 8], dtype=torch.int32)
    whole = apply_rotary_pos_emb(full.unsqueeze(1), freqs, "sbhd").squeeze(1)
    chunks = whole.chunk(4)
    for rank in range(2):
        local = torch.cat((full.chunk(4)[rank], full.chunk(4)[3 - rank]))
        if fmt == "sbhd":
            got = apply_rotary_pos_emb(local.unsqueeze(1), freqs, "sbhd", cp_size=2,
                                       cp_rank=rank).squeeze(1)
        else:
            got = apply_rotary_pos_emb(local, freqs, "thd", cu_seqlens=cu_full, cp_size=2,
                                       cp_rank=rank)
        assert torch.equal(got, torch.cat((chunks[rank], chunks[3 - rank])))


# ---- inside MultiheadAttention and TransformerLayer -----------------------------------

def _mha_ref(m, x, q_angles, k_angles, interleaved):
    """MultiheadAttention(input_layernorm=True, fuse_qkv_params=False), causal, in
    float64 from its parameters, with rotated queries and keys (sbhd)."""
    p = {n: t.detach().double() for n, t in m.named_parameters()}
    h = norm_ref(x, p["layernorm_qkv.layer_norm_weight"], p["layernorm_qkv.layer_norm_bias"],
                 "LayerNorm", 1e-5, False)
    proj = {n: h @ p[f"layernorm_qkv.{n}_weight"].t() + p[f"layernorm_qkv.{n}_bias"]
            for n in ("query", "key", "value")}
    s, b = x.shape[:2]
    q, k, v = (proj[n].reshape(s, b, HEADS, D) for n in ("query", "key", "value"))
    q = rotate_ref(q, q_angles[:s].reshape(s, 1, 1, -1), interleaved)
    k = rotate_ref(k, k_angles[:s].reshape(s, 1, 1, -1), interleaved)
    allowed = allowed_ref("causal", None, s, s).unsqueeze(0)
    ctx = torch.stack([attend_ref(q[:, i], k[:, i], v[:, i], allowed, D ** -0.5)
                       for i in range(b)], dim=1)
    return ctx @ p["proj.weight"].t() + p["proj.bias"]


@pytest.mark.parametrize("pair", [False, True], ids=["one-emb", "q-k-pair"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
def test_multihead_attention_rotary_matches_float64(interleaved, pair):
    m = te.MultiheadAttention(HEADS * D, HEADS, attention_dropout=0.0, input_layernorm=True,
                              rotary_pos_interleaved=interleaved, device="cpu")
    x = torch.randn(S, B, HEADS * D, generator=torch.Generator().manual_seed(5))
    q_angles = rope_angles_ref(D, range(S))
    k_angles = rope_angles_ref(D, range(3, S + 3)) if pair else q_angles
    emb = _layout(q_angles, interleaved).float()
    if pair:
        emb = (emb, _layout(k_angles, interleaved).float())
    out = m(x, rotary_pos_emb=emb)
    ref = _mha_ref(m, x.double(), q_angles, k_angles, interleaved)
    assert_close(out, ref, 1e-5, "out")
    assert not torch.allclose(out, m(x)), "the rotary embedding had no effect"


def test_transformer_layer_rotary_bshd_equals_sbhd():
    torch.manual_seed(6)
    a = te.TransformerLayer(64, 128, 4, hidden_dropout=0.0, attention_dropout=0.0, device="cpu")
    b = te.TransformerLayer(64, 128, 4, hidden_dropout=0.0, attention_dropout=0.0, device="cpu",
                            attn_input_format="bshd")
    b.load_state_dict(a.state_dict())
    emb = te.RotaryPositionEmbedding(16, device="cpu")(S)
    x = torch.randn(S, B, 64)
    got = b(x.transpose(0, 1), rotary_pos_emb=emb).transpose(0, 1)
    torch.testing.assert_close(got, a(x, rotary_pos_emb=emb), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(a(x, rotary_pos_emb=emb), a(x), atol=1e-3)


def test_bad_rotary_input():
    t = torch.randn(S, B, HEADS, D)
    with pytest.raises(ValueError, match=r"freqs must be \[s, 1, 1, d2\] with an even d2 <= the "
                                         "head size 16"):
        apply_rotary_pos_emb(t, torch.zeros(S, 1, 1, 2 * D))
    with pytest.raises(ValueError, match="freqs covers 4 positions, but position 11 is needed"):
        apply_rotary_pos_emb(t, torch.zeros(4, 1, 1, D))
    with pytest.raises(ValueError, match="tensor_format='thd' needs cu_seqlens"):
        apply_rotary_pos_emb(t[:, 0], torch.zeros(S, 1, 1, D), "thd")
    with pytest.raises(ValueError, match="rotary dimension must be an even number"):
        te.RotaryPositionEmbedding(7, device="cpu")
