"""The TE module family against the float64 references of references.py:
LayerNorm / RMSNorm, LayerNormLinear, LayerNormMLP, DotProductAttention,
MultiheadAttention (TransformerLayer: test_transformer_layer.py).

High precision (outside te.autocast): forward and every gradient against float64.
FP8: each GEMM against float64 on its dequantized FP8 operands, cast with the scale the
module used (the delayed scale before the step, or the tensor's own amax for current
scaling). Between two GEMMs the reference takes the module's own float32 elementwise
part (activation, attention core; each checked against float64 in its own test), so
that the FP8 casts see the module's float32 values (see the LayerNormMLP FP8 test).

Error measure: ``max|got - ref| / max|ref|``. Bounds: 1e-5 where the only error is
float32 rounding of one op; 1e-4 through a norm's backward (it subtracts means);
looser, stated per test, where FP8 rounding itself is compared with high precision.
"""

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling
from transformer_engine.pytorch import distributed, quantize
from transformer_engine.pytorch.module.layernorm_mlp import ACTIVATIONS, activate
from helpers import (DEVICES, RECIPE, REENTRANT, assert_runs_equal, assert_tensors_equal, capture,
                     record_recompute_scales)
from references import (GATED_ACTIVATIONS, assert_close, attention_ref, cast_scale, deq, leaf64,
                        mha_ref, mlp_ref, norm_ref, norm_rel_err, padding_mask, qkv_split_ref,
                        randomize_, rel_err)

NORMS = ["LayerNorm", "RMSNorm"]
RECIPES = [pytest.param(RECIPE, id="delayed"), pytest.param(Float8CurrentScaling(), id="current")]
ALL_ACTIVATIONS = ["gelu", "geglu", "qgelu", "qgeglu", "relu", "reglu", "srelu", "sreglu",
                   "silu", "swiglu"]


# ---- LayerNorm, RMSNorm ---------------------------------------------------------------

@pytest.mark.parametrize("zero_centered_gamma", [False, True], ids=["gamma", "zc-gamma"])
@pytest.mark.parametrize("normalization", NORMS)
def test_norm_matches_float64(normalization, zero_centered_gamma):
    cls = te.LayerNorm if normalization == "LayerNorm" else te.RMSNorm
    m = cls(64, eps=1e-3, zero_centered_gamma=zero_centered_gamma, device="cpu")
    assert torch.equal(m.weight, torch.full((64,), 0.0 if zero_centered_gamma else 1.0))
    assert (m.bias is None) == (normalization == "RMSNorm")
    randomize_(m)
    x = (torch.randn(4, 8, 64) * 3 + 1).requires_grad_()
    dy = torch.randn(4, 8, 64)
    y = m(x)
    y.backward(dy)
    x64, w64, b64 = leaf64(x), leaf64(m.weight), leaf64(m.bias)
    ref = norm_ref(x64, w64, b64, normalization, 1e-3, zero_centered_gamma)
    ref.backward(dy.double())
    assert y.dtype == torch.float32
    assert_close(y, ref, 1e-6, "y")
    assert_close(x.grad, x64.grad, 1e-5, "dx")
    assert_close(m.weight.grad, w64.grad, 1e-5, "dweight")
    if b64 is not None:
        assert_close(m.bias.grad, b64.grad, 1e-5, "dbias")


def test_norm_dtypes():
    m = te.RMSNorm(32, params_dtype=torch.bfloat16, device="cpu")
    assert m.weight.dtype == torch.bfloat16
    x = torch.randn(16, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert m(x).dtype == torch.bfloat16                  # the autocast dtype
    assert m(x.bfloat16()).dtype == torch.bfloat16
    assert m(x).dtype == torch.float32


# ---- LayerNormLinear --------------------------------------------------------------------

@pytest.mark.parametrize("zero_centered_gamma", [False, True], ids=["gamma", "zc-gamma"])
@pytest.mark.parametrize("normalization", NORMS)
def test_layernorm_linear_high_precision(normalization, zero_centered_gamma):
    m = te.LayerNormLinear(64, 48, normalization=normalization,
                           zero_centered_gamma=zero_centered_gamma, device="cpu")
    assert m.weight.shape == (48, 64) and m.layer_norm_weight.shape == (64,)
    randomize_(m)
    x = torch.randn(2, 16, 64, requires_grad=True)
    dy = torch.randn(2, 16, 48)
    y = m(x)
    y.backward(dy)
    p = {n: leaf64(t) for n, t in m.named_parameters()}
    x64 = leaf64(x)
    ln = norm_ref(x64, p["layer_norm_weight"], p.get("layer_norm_bias"), normalization, 1e-5,
                  zero_centered_gamma)
    ref = ln @ p["weight"].t() + p["bias"]
    ref.backward(dy.double())
    assert_close(y, ref, 1e-5, "y")
    assert_close(x.grad, x64.grad, 1e-4, "dx")
    for n, t in m.named_parameters():
        assert_close(t.grad, p[n].grad, 1e-4, f"d{n}")


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("normalization", NORMS)
def test_layernorm_linear_fp8_matches_float64_on_fp8_operands(normalization, recipe):
    m = te.LayerNormLinear(64, 48, normalization=normalization, return_layernorm_output=True,
                           device="cpu")
    randomize_(m)
    fmt = recipe.fp8_format.value
    for step in range(2):        # step 0 moves the delayed scales away from 1; step 1 is checked
        x = (torch.randn(32, 64) * (step + 1)).requires_grad_()
        dy = torch.randn(32, 48) * 1e-3
        m.zero_grad()
        if recipe.delayed() and step == 1:
            s_in, s_w = (cast_scale(m, recipe, True, i, None) for i in (0, 1))
            s_dy = cast_scale(m, recipe, False, 0, None)
            assert s_in.item() != 1.0 and s_dy.item() != 1.0
        with te.autocast(recipe=recipe):
            y, ln_out = m(x)
        y.backward(dy)
    if not recipe.delayed():
        s_in, s_w, s_dy = (cast_scale(m, recipe, fwd, 0, t) for fwd, t in
                           ((True, ln_out), (True, m.weight), (False, dy)))
    p = {n: leaf64(t) for n, t in m.named_parameters()}
    x64 = leaf64(x)
    ln64 = norm_ref(x64, p["layer_norm_weight"], p.get("layer_norm_bias"), normalization, 1e-5, False)
    assert_close(ln_out, ln64, 1e-6, "layernorm output")
    lnq, wq, dyq = deq(ln_out, s_in, fmt.dtype_fwd), deq(m.weight, s_w, fmt.dtype_fwd), \
        deq(dy, s_dy, fmt.dtype_bwd)
    assert_close(y, lnq @ wq.t() + p["bias"], 1e-5, "y")
    assert_close(m.weight.grad, dyq.t() @ lnq, 1e-5, "dweight")
    assert_close(m.bias.grad, dy.double().sum(0), 1e-5, "dbias")
    ln64.backward(dyq @ wq)                                  # dgrad, then the norm's backward
    assert_close(x.grad, x64.grad, 1e-4, "dx")
    for n in [n for n in p if n.startswith("layer_norm")]:
        assert_close(getattr(m, n).grad, p[n].grad, 1e-4, f"d{n}")


def test_layernorm_linear_outputs_and_dtypes():
    m = te.LayerNormLinear(32, 16, return_bias=True, return_layernorm_output=True, device="cpu")
    randomize_(m)
    x = torch.randn(16, 32)
    out, bias, ln_out = m(x)
    assert bias is m.bias and ln_out.shape == (16, 32)
    plain = te.LayerNormLinear(32, 16, device="cpu")
    plain.load_state_dict(m.state_dict())
    torch.testing.assert_close(out + bias, plain(x), rtol=1e-6, atol=1e-6)
    assert te.LayerNormLinear(32, 16, bias=False, device="cpu").bias is None
    for fp8 in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16), te.autocast(enabled=fp8):
            y = plain(x.requires_grad_())
        assert y.dtype == torch.bfloat16
        y.float().sum().backward()
        assert plain.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.float32


# ---- LayerNormMLP ----------------------------------------------------------------------

@pytest.mark.parametrize("activation", ALL_ACTIVATIONS)
def test_layernorm_mlp_high_precision(activation):
    normalization = "RMSNorm" if activation.endswith("glu") else "LayerNorm"
    m = te.LayerNormMLP(64, 32, normalization=normalization, activation=activation, device="cpu")
    gated = activation in GATED_ACTIVATIONS
    assert m.fc1_weight.shape == ((64 if gated else 32), 64) and m.fc2_weight.shape == (64, 32)
    randomize_(m)
    with torch.no_grad():
        m.fc1_weight.mul_(20.0)             # pre-activations of order 1: every branch used
    x = torch.randn(2, 16, 64, requires_grad=True)
    dy = torch.randn(2, 16, 64)
    y = m(x)
    y.backward(dy)
    p = {n: leaf64(t) for n, t in m.named_parameters()}
    x64 = leaf64(x)
    mlp_ref(p, x64, normalization, activation).backward(dy.double())
    assert_close(y, mlp_ref(p, x64.detach(), normalization, activation), 1e-5, "y")
    assert_close(x.grad, x64.grad, 1e-4, "dx")
    for n, t in m.named_parameters():
        assert_close(t.grad, p[n].grad, 1e-4, f"d{n}")


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_layernorm_is_float32_rounded_once(device):
    """A bfloat16 LayerNorm (bfloat16 input and parameters) computes in float32: every
    output is within half a bfloat16 ulp (plus float32 error) of the float64 result,
    which bfloat16 arithmetic would miss; the gradients match the float64 ones to
    bfloat16 precision."""
    torch.manual_seed(0)
    m = te.LayerNorm(1024, params_dtype=torch.bfloat16, device=device)
    randomize_(m)
    x = (2.0 * torch.randn(64, 1024, device=device) + 0.5).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(64, 1024, device=device).to(torch.bfloat16)
    y = m(x)
    y.backward(dy)
    assert y.dtype == torch.bfloat16
    w64, b64, x64 = leaf64(m.weight), leaf64(m.bias), leaf64(x)
    ref = norm_ref(x64, w64, b64, "LayerNorm", m.eps, False)
    ref.backward(dy.double())
    ref = ref.detach()
    half_ulp = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(2.0 ** -100))) - 8)
    # float32 error (1e-4) is far below bfloat16 arithmetic's (2^-8 of values of order 1)
    assert ((y.double() - ref).abs() <= half_ulp + 1e-4 * (1.0 + ref.abs())).all()
    for got, want, name in ((x.grad, x64.grad, "dx"), (m.weight.grad, w64.grad, "dgamma"),
                            (m.bias.grad, b64.grad, "dbeta")):
        assert_close(got, want, 1e-2, name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("under_autocast", [False, True], ids=["plain", "autocast"])
def test_16bit_layernorm_matches_the_float32_path(under_autocast, dtype, device):
    """A 16-bit LayerNorm (on CUDA one native kernel, NOTE in layernorm.py) gives what the
    float32 computation on upcast tensors, rounded once, gives: every output and
    gradient within one ulp of the dtype at the largest magnitude, also when a
    torch.autocast of that dtype is on (which would otherwise run layer_norm in float32)."""
    torch.manual_seed(0)
    m = te.LayerNorm(2048, params_dtype=torch.float32, device=device).to(dtype)
    randomize_(m)
    x = (2.0 * torch.randn(128, 2048, device=device) + 0.5).to(dtype).requires_grad_()
    dy = torch.randn(128, 2048, device=device).to(dtype)
    with torch.autocast(device, dtype=dtype, enabled=under_autocast):
        y = m(x)
    y.backward(dy)
    assert y.dtype == dtype
    x32, w32, b32 = (t.detach().float().requires_grad_() for t in (x, m.weight, m.bias))
    ref = torch.nn.functional.layer_norm(x32, (2048,), w32, b32, m.eps)
    ref.to(dtype).backward(dy)
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
    assert_close(y, ref.to(dtype), ulp, "y")
    for got, want, name in ((x.grad, x32.grad, "dx"), (m.weight.grad, w32.grad, "dgamma"),
                            (m.bias.grad, b32.grad, "dbeta")):
        assert got.dtype == dtype, name
        assert_close(got, want.to(dtype), ulp, name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("activation", ["gelu", "relu", "silu"])
def test_one_op_activation_is_float32_rounded_once(activation, dtype, device):
    """The activations `activate` applies to a 16-bit input directly (one torch op) equal
    the float32 computation on the upcast input rounded once, forward and backward."""
    fn, _ = ACTIVATIONS[activation]
    torch.manual_seed(0)
    x = (3.0 * torch.randn(256, 512, device=device)).to(dtype).requires_grad_()
    dy = torch.randn(256, 512, device=device).to(dtype)
    y = activate(x, activation)
    y.backward(dy)
    dx, x.grad = x.grad, None
    ref = fn(x.float()).to(dtype)
    ref.backward(dy)
    assert y.dtype == dtype
    assert torch.equal(y, ref) and torch.equal(dx, x.grad)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("activation", ["gelu", "relu", "swiglu", "geglu"])
def test_layernorm_mlp_fp8_matches_float64_on_fp8_operands(activation, recipe):
    m = te.LayerNormMLP(64, 32, activation=activation, return_layernorm_output=True,
                        device="cpu")
    randomize_(m)
    with torch.no_grad():
        m.fc1_weight.mul_(20.0)
    fmt = recipe.fp8_format.value
    for step in range(2):
        x = (torch.randn(32, 64) * (step + 1)).requires_grad_()
        dy = torch.randn(32, 64) * 1e-3
        m.zero_grad()
        if step == 1:
            fwd_before = m.fp8_meta["scaling_fwd"].scale.clone() if recipe.delayed() else None
            bwd_before = m.fp8_meta["scaling_bwd"].scale.clone() if recipe.delayed() else None
        with te.autocast(recipe=recipe):
            y, ln_out = m(x)
        y.backward(dy)
    p = {n: leaf64(t) for n, t in m.named_parameters()}
    scale = lambda fwd, slot, t: (((fwd_before if fwd else bwd_before)[slot:slot + 1])
                                  if recipe.delayed() else cast_scale(m, recipe, fwd, slot, t))
    # Each GEMM in float64 on FP8 operands, rounded to float32 where the module's tensors
    # are float32. The activation between the GEMMs is the module's own float32 `activate`
    # (checked against float64 in test_layernorm_mlp_high_precision), so that the FP8
    # casts see float32 values equal to the module's up to the GEMM's last-bit rounding:
    # a value within an ulp of an FP8 rounding tie would move by a whole FP8 step (seen
    # as an error of ~1e-3 here); these seeds have none.
    lnq, w1q, w2q = deq(ln_out, scale(True, 0, ln_out), fmt.dtype_fwd), \
        deq(m.fc1_weight, scale(True, 1, m.fc1_weight), fmt.dtype_fwd), \
        deq(m.fc2_weight, scale(True, 3, m.fc2_weight), fmt.dtype_fwd)
    h32 = (lnq @ w1q.t() + p["fc1_bias"]).float().requires_grad_()
    a32 = activate(h32, activation)
    aq = deq(a32, scale(True, 2, a32), fmt.dtype_fwd)
    assert_close(y, aq @ w2q.t() + p["fc2_bias"], 1e-5, "y")
    # backward chain
    dyq = deq(dy, scale(False, 1, dy), fmt.dtype_bwd)
    dh32, = torch.autograd.grad(a32, h32, (dyq @ w2q).float())
    dhq = deq(dh32, scale(False, 0, dh32), fmt.dtype_bwd)
    assert_close(m.fc2_weight.grad, dyq.t() @ aq, 1e-5, "dfc2_weight")
    assert_close(m.fc2_bias.grad, dy.double().sum(0), 1e-5, "dfc2_bias")
    assert_close(m.fc1_weight.grad, dhq.t() @ lnq, 1e-5, "dfc1_weight")
    assert_close(m.fc1_bias.grad, dh32.double().sum(0), 1e-5, "dfc1_bias")
    x64 = leaf64(x)
    norm_ref(x64, p["layer_norm_weight"], p["layer_norm_bias"], "LayerNorm", 1e-5,
             False).backward(dhq @ w1q)
    assert_close(x.grad, x64.grad, 1e-4, "dx")
    if recipe.delayed():
        # each GEMM has its own slots; the step recorded its amaxes into them, once
        hist_f, hist_b = m.fp8_meta["scaling_fwd"].amax_history, m.fp8_meta["scaling_bwd"].amax_history
        want_f = torch.stack([quantize.amax(t) for t in (ln_out, m.fc1_weight, a32, m.fc2_weight)])
        want_b = torch.stack([quantize.amax(t) for t in (dh32, dy)])
        # (the activation and its gradient are the reference's: equal to a few float32 ulps)
        torch.testing.assert_close(hist_f[-1], want_f, rtol=1e-6, atol=0)
        torch.testing.assert_close(hist_b[-1], want_b, rtol=1e-6, atol=0)
        # one backward update per step: the history advanced by exactly one row
        assert torch.count_nonzero(hist_b[:-2]) == 0 and torch.count_nonzero(hist_b[-2]) == 2


def _mlp_train(checkpoint, outer, use_reentrant, steps=3):
    """LayerNormMLP(checkpoint=...) in an inner FP8 autocast, optionally inside an outer
    te.checkpoint as well (two producers of recompute stashes)."""
    torch.manual_seed(0)
    pre = te.Linear(64, 64, device="cpu")
    mlp = te.LayerNormMLP(64, 64, activation="swiglu", device="cpu", checkpoint=checkpoint)
    params = list(pre.parameters()) + list(mlp.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    record = []

    def region(h):
        with te.autocast(recipe=DelayedScaling(amax_history_len=3)):
            return mlp(pre(h))

    for step in range(steps):
        x = (torch.randn(32, 64) * 2.0 ** step).requires_grad_()
        y = te.checkpoint(region, x, use_reentrant=use_reentrant) if outer else region(x)
        loss = y.float().pow(2).mean()
        loss.backward()
        record.append(capture(loss, [x], params, [pre, mlp]))
        opt.step()
        opt.zero_grad()
    return record


@pytest.mark.parametrize("outer", [False, True], ids=["alone", "inside-checkpoint"])
@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_layernorm_mlp_checkpoint_is_invisible(use_reentrant, outer, monkeypatch):
    ref = _mlp_train(False, False, use_reentrant)
    recomputes = record_recompute_scales(monkeypatch)
    got = _mlp_train(True, outer, use_reentrant)
    # per step: the MLP's own recompute, plus the outer recompute of pre and mlp
    assert len(recomputes) == 3 * (3 if outer else 1)
    assert_runs_equal(ref, got)
    assert distributed.recompute_stash_count() == 0


# ---- DotProductAttention -----------------------------------------------------------------

@pytest.mark.parametrize("qkv_format", ["sbhd", "bshd"])
@pytest.mark.parametrize("mask_type", ["no_mask", "causal", "padding", "padding_causal", "arbitrary"])
@pytest.mark.parametrize("groups", [4, 2, 1], ids=["mha", "gqa2", "mqa"])
def test_dot_product_attention_matches_float64(groups, mask_type, qkv_format):
    b, s, h, d = 2, 16, 4, 16
    attn = te.DotProductAttention(h, d, num_gqa_groups=groups, qkv_format=qkv_format,
                                  attn_mask_type=mask_type)
    shape = lambda heads: (s, b, heads, d) if qkv_format == "sbhd" else (b, s, heads, d)
    q, k, v = (torch.randn(*shape(n), requires_grad=True) for n in (h, groups, groups))
    mask = None
    if mask_type in ("padding", "padding_causal"):
        mask = padding_mask(b, s, [11, 16])
    elif mask_type == "arbitrary":
        mask = torch.rand(b, 1, s, s) < 0.3
        mask[..., 0] = False                     # every query sees at least one key
    out = attn(q, k, v, attention_mask=mask)
    dout = torch.randn_like(out)
    out.backward(dout)
    q64, k64, v64 = leaf64(q), leaf64(k), leaf64(v)
    ref = attention_ref(q64, k64, v64, qkv_format, mask_type, mask)
    ref.backward(dout.double())
    assert out.shape == ((s, b, h * d) if qkv_format == "sbhd" else (b, s, h * d))
    assert_close(out, ref, 1e-5, "out")
    for name, t, t64 in (("dq", q, q64), ("dk", k, k64), ("dv", v, v64)):
        assert_close(t.grad, t64.grad, 1e-5, name)
    if mask_type == "padding":
        assert torch.count_nonzero(out[11:, 0]) == 0     # padded queries give zeros


def test_attention_dropout_and_checkpoint_core_attention():
    attn = te.DotProductAttention(4, 16, attention_dropout=0.5)
    q, k, v = (torch.randn(16, 2, 4, 16, requires_grad=True) for _ in range(3))
    results = []
    for ckpt in (False, True):
        torch.manual_seed(7)
        out = attn(q, k, v, checkpoint_core_attention=ckpt)
        out.pow(2).sum().backward()
        results.append([out.detach()] + [t.grad.clone() for t in (q, k, v)])
        for t in (q, k, v):
            t.grad = None
    assert_tensors_equal(results[0], results[1], "checkpoint_core_attention")
    attn.eval()
    ref = attention_ref(q.double(), k.double(), v.double(), "sbhd", "causal")
    assert_close(attn(q, k, v), ref, 1e-5, "eval: no dropout")
    assert rel_err(results[0][0], ref) > 0.1, "training: dropout had no effect"


def test_attention_dropout_draws_from_tracker():
    tracker = te.CudaRNGStatesTracker(device="cpu")
    tracker.add("model-parallel-rng", 99)
    attn = te.DotProductAttention(4, 16, attention_dropout=0.5,
                                  get_rng_state_tracker=lambda: tracker)
    q = torch.randn(16, 2, 4, 16, requires_grad=True)
    before_default, before_tracker = torch.get_rng_state(), tracker.get_states()
    a = attn(q, q, q, checkpoint_core_attention=True)
    assert torch.equal(torch.get_rng_state(), before_default)      # default stream untouched
    assert not torch.equal(tracker.get_states()["model-parallel-rng"],
                           before_tracker["model-parallel-rng"])
    tracker.set_states(before_tracker)
    b = attn(q, q, q)
    assert torch.equal(a, b)
    a.sum().backward()                                             # the recompute replays it
    g_ckpt, q.grad = q.grad, None
    b.sum().backward()
    assert torch.equal(g_ckpt, q.grad)


# ---- MultiheadAttention ----------------------------------------------------------------

@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "concatenated"])
@pytest.mark.parametrize("groups", [4, 2], ids=["mha", "gqa2"])
def test_multihead_attention_high_precision(groups, interleaved):
    m = te.MultiheadAttention(64, 4, attention_dropout=0.0, num_gqa_groups=groups,
                              input_layernorm=True, qkv_weight_interleaved=interleaved,
                              fuse_qkv_params=True, attn_mask_type="padding", device="cpu")
    assert m.layernorm_qkv.weight.shape == ((4 + 2 * groups) * 16, 64)
    randomize_(m)
    mask = padding_mask(2, 16, [16, 9])
    x = torch.randn(16, 2, 64, requires_grad=True)
    dy = torch.randn(16, 2, 64)
    y = m(x, mask)
    y.backward(dy)
    p = {n: leaf64(t) for n, t in m.named_parameters()}
    x64 = leaf64(x)
    ref, _ = mha_ref(p, x64, 4, groups, 16, interleaved, "padding", mask)
    ref.backward(dy.double())
    assert_close(y, ref, 1e-5, "y")
    assert_close(x.grad, x64.grad, 1e-4, "dx")
    for n, t in m.named_parameters():
        assert_close(t.grad, p[n].grad, 1e-4, f"d{n}")


@pytest.mark.parametrize("recipe", RECIPES)
def test_multihead_attention_fp8(recipe):
    m = te.MultiheadAttention(64, 4, attention_dropout=0.0, num_gqa_groups=2, input_layernorm=True,
                              return_layernorm_output=True, return_bias=True, fuse_qkv_params=True,
                              device="cpu")
    randomize_(m)
    fmt = recipe.fp8_format.value
    for step in range(2):
        x = (torch.randn(16, 2, 64) * (step + 1)).requires_grad_()
        if step == 1 and recipe.delayed():
            s_qkv = m.layernorm_qkv.fp8_meta["scaling_fwd"].scale.clone()
            s_proj = m.proj.fp8_meta["scaling_fwd"].scale.clone()
        m.zero_grad()
        with te.autocast(recipe=recipe):
            out, bias, ln_out = m(x)
        (out + bias).pow(2).sum().backward()
    p = {n: leaf64(t) for n, t in m.named_parameters()}
    if not recipe.delayed():
        cur = lambda t: quantize.current_scale(quantize.amax(t.detach()), fmt.dtype_fwd)
        s_qkv = torch.cat([cur(ln_out), cur(m.layernorm_qkv.weight)])
    # the QKV GEMM on FP8 operands, the attention core, the proj GEMM on FP8 operands
    mixed = (deq(ln_out, s_qkv[0:1], fmt.dtype_fwd)
             @ deq(m.layernorm_qkv.weight, s_qkv[1:2], fmt.dtype_fwd).t() + p["layernorm_qkv.bias"])
    # the attention core is the module's own, in float32 (checked against float64 in
    # test_dot_product_attention_matches_float64), for the reason given in the MLP test
    q, k, v = qkv_split_ref(mixed.float(), 4, 2, 16, True)
    with torch.no_grad():
        ctx = m.core_attention(q, k, v)
    if not recipe.delayed():
        s_proj = torch.cat([cur(ctx), cur(m.proj.weight)])
    ref = (deq(ctx, s_proj[0:1], fmt.dtype_fwd)
           @ deq(m.proj.weight, s_proj[1:2], fmt.dtype_fwd).t())
    assert_close(out, ref.reshape(16, 2, 64), 1e-5, "out")
    assert bias is m.proj.bias
    # FP8 against high precision (E4M3 forward, E5M2 backward: a few percent)
    x64 = leaf64(x)
    hp, _ = mha_ref(p, x64, 4, 2, 16, True, "causal")
    assert norm_rel_err(out + bias, hp.detach()) < 0.08
    hp.pow(2).sum().backward()
    assert norm_rel_err(x.grad, x64.grad) < 0.15
    for n, t in m.named_parameters():
        assert norm_rel_err(t.grad, p[n].grad) < 0.15, n
