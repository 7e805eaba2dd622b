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
from transformer_engine.pytorch.attention.rope import (apply_fused_qkv_rotary_pos_emb,
                                                       apply_rotary_pos_emb)
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


@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
def test_arbitrary_freqs_forward_and_gradient(interleaved):
    """TE accepts any ``freqs`` (its tests pass random ones): with angles that differ
    within a pair the rotation is no longer one, and forward and gradient are those of
    ``x cos + turn(x) sin`` itself, against float64 autograd."""
    g = torch.Generator().manual_seed(8)
    t = torch.randn(S, B, HEADS, D, generator=g).requires_grad_()
    freqs = torch.randn(S, 1, 1, D // 2, generator=g) * 3          # partial, unpaired
    out = apply_rotary_pos_emb(t, freqs, "sbhd", interleaved=interleaved)
    t64 = leaf64(t)
    x, f = t64[..., :D // 2], freqs.double()
    if interleaved:
        turned = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    else:
        turned = torch.cat((-x[..., D // 4:], x[..., :D // 4]), dim=-1)
    ref = torch.cat((x * f.cos() + turned * f.sin(), t64[..., D // 2:]), dim=-1)
    dy = torch.randn(t.shape, generator=g)
    out.backward(dy)
    ref.backward(dy.double())
    assert_close(out, ref, 1e-6, "out")
    assert_close(t.grad, t64.grad, 1e-6, "grad")


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


def _cp_local(full, cp_size, rank, dim=0):
    """Rank ``rank``'s share of ``full`` under the load-balanced split: chunks ``rank``
    and ``2 cp_size - 1 - rank`` of ``2 cp_size`` along ``dim``."""
    chunks = full.chunk(2 * cp_size, dim=dim)
    return torch.cat((chunks[rank], chunks[2 * cp_size - 1 - rank]), dim=dim)


CP_CASES = [pytest.param(2, id="cp2"), pytest.param(3, id="cp3")]


@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
@pytest.mark.parametrize("starts", [None, [3, 0]], ids=["no-starts", "starts"])
@pytest.mark.parametrize("cp_size", CP_CASES)
@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
def test_context_parallel_matches_the_full_sequence(fmt, cp_size, starts, interleaved):
    """Each rank's rotation (and gradient) is the float64 rotation of the whole
    sequence, at positions ``start + p``, restricted to that rank's two chunks
    (``fused`` both ways: it names a kernel choice in TE, the same math here)."""
    fused = cp_size == 3
    g = torch.Generator().manual_seed(4)
    seq = 4 * cp_size                                       # two tokens a chunk
    full = torch.randn(seq, B, HEADS, D, generator=g)       # sbhd, global
    angles = rope_angles_ref(D // 2, range(seq + 4))        # a partial rotation
    freqs = _layout(angles, interleaved).float()
    pos = torch.arange(seq).reshape(seq, 1) + torch.tensor(starts or [0, 0]).reshape(1, B)
    per_token = angles[pos].unsqueeze(2)                    # [s, b, 1, d2/2]
    dy_full = torch.randn(seq, B, HEADS, D, generator=g)
    full64 = full.double().requires_grad_()
    ref_full = rotate_ref(full64, per_token, interleaved)
    ref_full.backward(dy_full.double())
    seq_dim = 0 if fmt == "sbhd" else 1
    to_fmt = (lambda x: x) if fmt == "sbhd" else (lambda x: x.transpose(0, 1).contiguous())
    start_positions = None if starts is None else torch.tensor(starts, dtype=torch.int32)
    for rank in range(cp_size):
        local = to_fmt(_cp_local(full, cp_size, rank)).requires_grad_()
        out = apply_rotary_pos_emb(local, freqs, fmt, start_positions=start_positions,
                                   interleaved=interleaved, fused=fused, cp_size=cp_size,
                                   cp_rank=rank)
        out.backward(to_fmt(_cp_local(dy_full, cp_size, rank)))
        assert_close(out, to_fmt(_cp_local(ref_full.detach(), cp_size, rank)), 1e-6,
                     f"rank {rank} out")
        assert_close(local.grad, to_fmt(_cp_local(full64.grad, cp_size, rank)), 1e-6,
                     f"rank {rank} grad")
        assert out.shape[seq_dim] == seq // cp_size


@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
@pytest.mark.parametrize("with_starts", [False, True], ids=["no-starts", "starts"])
@pytest.mark.parametrize("cp_size", CP_CASES)
def test_context_parallel_thd_matches_each_full_sequence(cp_size, with_starts, interleaved):
    """Packed sequences (global lengths multiples of 2 cp_size, ``cu_seqlens`` the
    global bounds): each rank's tokens of sequence ``i`` are rotated as chunks of
    sequence ``i`` alone, at positions ``start_i + p``."""
    g = torch.Generator().manual_seed(5)
    lens = [2 * cp_size, 6 * cp_size, 4 * cp_size]
    starts = [2, 0, 5] if with_starts else [0, 0, 0]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    angles = rope_angles_ref(D, range(max(lens) + 5))
    freqs = _layout(angles, interleaved).float()
    seqs = [torch.randn(n, HEADS, D, generator=g) for n in lens]
    refs = [rotate_ref(x.double(), angles[s0:s0 + x.shape[0]].reshape(-1, 1, D // 2),
                       interleaved) for x, s0 in zip(seqs, starts)]
    start_positions = torch.tensor(starts, dtype=torch.int32) if with_starts else None
    for rank in range(cp_size):
        local = torch.cat([_cp_local(x, cp_size, rank) for x in seqs])
        out = apply_rotary_pos_emb(local, freqs, "thd", start_positions=start_positions,
                                   interleaved=interleaved, cu_seqlens=cu, cp_size=cp_size,
                                   cp_rank=rank)
        assert_close(out, torch.cat([_cp_local(r, cp_size, rank) for r in refs]), 1e-6,
                     f"rank {rank}")


def test_context_parallel_thd_equals_bshd():
    """Equal-length sequences: packed (thd) and batched (bshd) give the same bits."""
    g = torch.Generator().manual_seed(6)
    bshd = torch.randn(B, 8, HEADS, D, generator=g)                 # local: 8 of 16 tokens
    cu = torch.tensor([0, 16, 32], dtype=torch.int32)
    freqs = te.RotaryPositionEmbedding(D, device="cpu")(64)
    starts = cu[:-1]
    for rank in range(2):
        a = apply_rotary_pos_emb(bshd, freqs, "bshd", start_positions=starts, cp_size=2,
                                 cp_rank=rank)
        b = apply_rotary_pos_emb(bshd.reshape(-1, HEADS, D), freqs, "thd",
                                 start_positions=starts, cu_seqlens=cu, cp_size=2, cp_rank=rank)
        assert torch.equal(a.reshape(-1, HEADS, D), b)


@pytest.mark.parametrize("cp_size", [1, 2])
@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
def test_fused_qkv_rotation_equals_separate_rotations(fmt, cp_size):
    """``apply_fused_qkv_rotary_pos_emb``: TE's split of a [.., h, q + k + v] tensor
    (each head's query part is q / k heads of size k), each part rotated as
    `apply_rotary_pos_emb` rotates it, gradients flowing back into qkv."""
    g = torch.Generator().manual_seed(7)
    shape = (8, B, 2, 6 * D) if fmt == "sbhd" else (B, 8, 2, 6 * D)
    qkv = torch.randn(shape, generator=g).requires_grad_()
    q_freqs = _layout(rope_angles_ref(D, range(16)), False).float()
    k_freqs = _layout(rope_angles_ref(D // 2, range(3, 19)), False).float()
    q, k, v = apply_fused_qkv_rotary_pos_emb(qkv, q_freqs, k_freqs, [4 * D, D, D], fmt,
                                             cp_size=cp_size, cp_rank=cp_size - 1)
    assert q.shape == (*shape[:2], 8, D) and k.shape == v.shape == (*shape[:2], 2, D)
    ref = qkv.detach().double().requires_grad_()
    rq, rk, rv = ref.split([4 * D, D, D], dim=-1)
    rot = dict(tensor_format=fmt, cp_size=cp_size, cp_rank=cp_size - 1)
    rq = apply_rotary_pos_emb(rq.reshape(*shape[:2], 8, D), q_freqs, **rot)
    rk = apply_rotary_pos_emb(rk, k_freqs, **rot)
    for got, want in ((q, rq), (k, rk), (v, rv)):
        assert_close(got, want, 1e-6, "qkv part")
    grads = [torch.randn(t.shape, generator=g) for t in (q, k, v)]
    torch.autograd.backward((q, k, v), grads)
    torch.autograd.backward((rq, rk, rv), [t.double() for t in grads])
    assert_close(qkv.grad, ref.grad, 1e-6, "grad")
    with pytest.raises(ValueError, match="start_positions cannot be combined with cp_size > 1"):
        apply_fused_qkv_rotary_pos_emb(qkv, q_freqs, k_freqs, [4 * D, D, D], fmt,
                                       start_positions=torch.zeros(B, dtype=torch.int32),
                                       cp_size=2)
    with pytest.raises(ValueError, match=r"qkv_split_arg_list must be three positive ints"):
        apply_fused_qkv_rotary_pos_emb(qkv, q_freqs, k_freqs, [4 * D, D], fmt)


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
