"""TE's "clamped_swiglu" activation with its ``activation_params`` (NOTE [Clamped
SwiGLU] in module/activations.py): the activation and its gradient against TE's formula
in float64 (values beyond the limit included), te.LayerNormMLP with it in high
precision, bfloat16 and FP8 (delayed and current scaling) against float64 references,
its recompute, te.TransformerLayer passing the parameters through, and the errors for
bad ``activation_params``.
"""

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import Float8CurrentScaling
from transformer_engine.pytorch.module import layernorm_mlp
from transformer_engine.pytorch.module.activations import ACTIVATION_PARAMS, activate
from helpers import RECIPE, assert_runs_equal, capture, params, te_modules
from references import (assert_close, cast_scale, clamped_swiglu_grad_ref, clamped_swiglu_ref,
                        deq, leaf64, mlp_ref, norm_ref, randomize_)

DEFAULTS = ACTIVATION_PARAMS["clamped_swiglu"]
PARAMS = [pytest.param({}, id="defaults"),
          pytest.param({"limit": 1.5, "alpha": 1.0, "glu_linear_offset": 0.25}, id="custom")]
# a small limit so that many pre-activations of an MLP with unit-scale inputs pass it
SMALL = {"limit": 0.75, "alpha": 1.702}


def _sample(limit: float, rows: int = 64, half: int = 64) -> torch.Tensor:
    """``[rows, 2 * half]`` values spread to twice the limit both ways, with entries at
    exactly ``+-limit`` and far beyond it in both halves."""
    torch.manual_seed(0)
    x = torch.randn(rows, 2 * half) * limit
    x[0, :6] = torch.tensor([limit, -limit, limit + 3.0, -limit - 3.0, 100.0, -100.0])
    x[0, half:half + 6] = torch.tensor([limit, -limit, limit + 3.0, -limit - 3.0, 100.0, -100.0])
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("given", PARAMS)
def test_activation_and_gradient_match_te_formula(given, dtype):
    p = {**DEFAULTS, **given}
    x = _sample(p["limit"]).to(dtype).requires_grad_()
    dy = torch.randn(x.shape[0], x.shape[1] // 2).to(dtype)
    y = activate(x, "clamped_swiglu", p if given else None)
    y.backward(dy)
    x64, dy64 = x.detach().double(), dy.double()
    ref = clamped_swiglu_ref(x64, **p)
    ref_dx = clamped_swiglu_grad_ref(x64, dy64, **p)
    assert y.dtype == dtype and x.grad.dtype == dtype
    # float32 math, rounded once to the dtype: half an ulp (plus float32 error)
    rel = 2.0 ** -8 if dtype == torch.bfloat16 else 1e-6
    assert ((y.double() - ref).abs() <= rel * ref.abs() + 1e-6).all()
    assert ((x.grad.double() - ref_dx).abs() <= rel * ref_dx.abs() + 1e-5).all()
    # clamped regions pass no gradient; a value at the limit keeps its own
    half = x.shape[1] // 2
    a, b = x64[:, :half], x64[:, half:]
    dx_a, dx_b = x.grad[:, :half], x.grad[:, half:]
    assert (a > p["limit"]).sum() > 10 and (b.abs() > p["limit"]).sum() > 10
    assert (dx_a[a > p["limit"]] == 0).all() and (dx_b[b.abs() > p["limit"]] == 0).all()
    assert dx_a[0, 0] != 0 and dx_b[0, 0] != 0 and dx_b[0, 1] != 0
    # the autograd of the float64 formula is the written-out gradient (inclusive masks)
    x64 = x64.requires_grad_()
    clamped_swiglu_ref(x64, **p).backward(dy64)
    torch.testing.assert_close(x64.grad, ref_dx, rtol=1e-12, atol=1e-12)


def _mlp(dtype=torch.float32, checkpoint=False, activation_params=SMALL):
    torch.manual_seed(1)
    m = te.LayerNormMLP(64, 32, activation="clamped_swiglu", activation_params=activation_params,
                        params_dtype=dtype, return_layernorm_output=True,
                        checkpoint=checkpoint, device="cpu")
    randomize_(m)
    with torch.no_grad():
        m.fc1_weight.mul_(40.0)         # pre-activations of order 1: both clamps active
    return m


def _clamped_fraction(m, x):
    """The fractions of FC1's outputs beyond the limit, in each half (float64)."""
    p = {n: t.detach().double() for n, t in m.named_parameters()}
    ln = norm_ref(x.detach().double(), p["layer_norm_weight"], p["layer_norm_bias"],
                  "LayerNorm", 1e-5, False)
    h = ln @ p["fc1_weight"].t() + p["fc1_bias"]
    a, b = h.chunk(2, dim=-1)
    return (a > SMALL["limit"]).double().mean(), (b.abs() > SMALL["limit"]).double().mean()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_layernorm_mlp_matches_float64(dtype):
    m = _mlp(dtype)
    assert m.fc1_weight.shape == (64, 64) and m.activation_params is SMALL
    x = torch.randn(2, 16, 64).to(dtype).requires_grad_()
    dy = torch.randn(2, 16, 64).to(dtype)
    assert min(_clamped_fraction(m, x)) > 0.1
    y, _ = m(x)
    y.backward(dy)
    p = {n: leaf64(t) for n, t in m.named_parameters()}
    x64 = leaf64(x)
    ref = mlp_ref(p, x64, "LayerNorm", "clamped_swiglu", SMALL)
    ref.backward(dy.double())
    # fp32: float32 rounding; bf16: bfloat16 activations between the GEMMs
    fwd, bwd = (1e-5, 1e-4) if dtype == torch.float32 else (2e-2, 3e-2)
    assert_close(y, ref, fwd, "y")
    assert_close(x.grad, x64.grad, bwd, "dx")
    for n, t in m.named_parameters():
        assert_close(t.grad, p[n].grad, bwd, f"d{n}")


@pytest.mark.parametrize("recipe", [pytest.param(RECIPE, id="delayed"),
                                    pytest.param(Float8CurrentScaling(), id="current")])
def test_layernorm_mlp_fp8_matches_float64_on_fp8_operands(recipe):
    """Each GEMM against float64 on its dequantized FP8 operands; between them the
    module's own float32 activation (checked against float64 above), as in
    test_modules.py's FP8 LayerNormMLP test. The second step runs on the delayed
    scales the first one set."""
    m = _mlp()
    fmt = recipe.fp8_format.value
    for step in range(2):
        x = (torch.randn(32, 64) * (step + 1)).requires_grad_()
        dy = torch.randn(32, 64) * 1e-3
        m.zero_grad()
        if step == 1 and recipe.delayed():
            fwd_before = m.fp8_meta["scaling_fwd"].scale.clone()
            bwd_before = m.fp8_meta["scaling_bwd"].scale.clone()
        with te.autocast(recipe=recipe):
            y, ln_out = m(x)
        y.backward(dy)
    assert min(_clamped_fraction(m, x)) > 0.1
    if recipe.delayed():
        assert (fwd_before != 1).all()          # scales the first step's amaxes set
    p = {n: leaf64(t) for n, t in m.named_parameters()}
    scale = lambda fwd, slot, t: (((fwd_before if fwd else bwd_before)[slot:slot + 1])
                                  if recipe.delayed() else cast_scale(m, recipe, fwd, slot, t))
    lnq = deq(ln_out, scale(True, 0, ln_out), fmt.dtype_fwd)
    w1q = deq(m.fc1_weight, scale(True, 1, m.fc1_weight), fmt.dtype_fwd)
    w2q = deq(m.fc2_weight, scale(True, 3, m.fc2_weight), fmt.dtype_fwd)
    h32 = (lnq @ w1q.t() + p["fc1_bias"]).float().requires_grad_()
    a32 = activate(h32, "clamped_swiglu", {**DEFAULTS, **SMALL})
    aq = deq(a32, scale(True, 2, a32), fmt.dtype_fwd)
    assert_close(y, aq @ w2q.t() + p["fc2_bias"], 1e-5, "y")
    dyq = deq(dy, scale(False, 1, dy), fmt.dtype_bwd)
    dh64 = clamped_swiglu_grad_ref(h32.detach().double(), dyq @ w2q, **SMALL)
    dhq = deq(dh64.float(), scale(False, 0, dh64.float()), fmt.dtype_bwd)
    assert_close(m.fc2_weight.grad, dyq.t() @ aq, 1e-5, "dfc2_weight")
    assert_close(m.fc1_weight.grad, dhq.t() @ lnq, 1e-5, "dfc1_weight")
    assert_close(m.fc1_bias.grad, dh64.sum(0), 1e-5, "dfc1_bias")
    x64 = leaf64(x)
    norm_ref(x64, p["layer_norm_weight"], p["layer_norm_bias"], "LayerNorm", 1e-5,
             False).backward(dhq @ w1q)
    assert_close(x.grad, x64.grad, 1e-4, "dx")


def test_checkpointed_mlp_is_bit_identical(monkeypatch):
    """``checkpoint=True`` recomputes the clamped activation in backward (counted) and
    gives the plain run's outputs, gradients and FP8 state bit for bit."""
    calls = []
    real = layernorm_mlp.activate
    monkeypatch.setattr(layernorm_mlp, "activate",
                        lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    runs = []
    for checkpoint in (False, True):
        m = _mlp(checkpoint=checkpoint)
        run, gen = [], torch.Generator().manual_seed(5)
        calls.clear()
        for _ in range(2):
            x = torch.randn(16, 64, generator=gen).requires_grad_()
            with te.autocast(recipe=RECIPE):
                y, _ = m(x)
            loss = y.float().pow(2).mean()
            loss.backward()
            run.append(capture(loss, [x], params([m]), te_modules(m)))
            m.zero_grad(set_to_none=True)
        runs.append(run)
        assert calls == ["clamped_swiglu"] * (4 if checkpoint else 2)
    assert_runs_equal(runs[0], runs[1], "checkpoint=True against plain,")


def test_transformer_layer_passes_the_parameters_through():
    given = {"limit": 2.0, "alpha": 1.0, "glu_linear_offset": 0.5}
    layer = te.TransformerLayer(64, 128, 4, activation="clamped_swiglu",
                                activation_params=given, hidden_dropout=0.0,
                                attention_dropout=0.0, device="cpu")
    mlp = te.LayerNormMLP(64, 128, activation="clamped_swiglu", activation_params=given,
                          device="cpu")
    assert layer.layernorm_mlp.activation_params is given
    assert layer.layernorm_mlp.fc1_weight.shape == (256, 64)
    mlp.load_state_dict({k: v for k, v in layer.layernorm_mlp.state_dict().items()})
    x = torch.randn(8, 2, 64)
    with torch.no_grad():
        assert torch.equal(layer.layernorm_mlp(x), mlp(x))
        default = te.LayerNormMLP(64, 128, activation="clamped_swiglu", device="cpu")
        default.load_state_dict(mlp.state_dict())
        assert not torch.equal(default(x), mlp(x))         # the parameters matter
        assert torch.isfinite(layer(x)).all()


def test_accepted_params():
    make = lambda act, given: te.LayerNormMLP(16, 32, activation=act,  # noqa: E731
                                              activation_params=given, device="cpu")
    assert make("clamped_swiglu", None)._act_params == DEFAULTS
    assert make("clamped_swiglu", {"limit": 3, "alpha": 2})._act_params == {
        "limit": 3.0, "alpha": 2.0, "glu_linear_offset": 1.0}
    for act in ("gelu", "swiglu"):
        assert make(act, None)._act_params is None and make(act, {})._act_params is None


@pytest.mark.parametrize("activation, given, error, match", [
    ("gelu", {"limit": 7.0}, TypeError, r"activation='gelu' takes no activation_params"),
    ("clamped_swiglu", {"limit": 7.0, "beta": 1.0}, TypeError,
     r"keys \['alpha', 'glu_linear_offset', 'limit'\], got unknown key\(s\) 'beta'"),
    ("clamped_swiglu", {"limit": "7"}, TypeError,
     r"activation_params\['limit'\] must be a float, got str '7'"),
    ("clamped_swiglu", {"alpha": True}, TypeError, r"activation_params\['alpha'\] must be"),
    ("clamped_swiglu", [("limit", 7.0)], TypeError,
     r"activation_params must be a dict or None, got list"),
    ("clamped_swiglu", {"limit": float("nan")}, ValueError,
     r"activation_params\['limit'\] must not be NaN"),
    ("clamped_swiglue", None, ValueError, r"activation must be one of .*'clamped_swiglu'.*"
                                          r"got 'clamped_swiglue'"),
])
def test_bad_activation_params(activation, given, error, match):
    with pytest.raises(error, match=r"te\.LayerNormMLP: .*" + match):
        te.LayerNormMLP(16, 32, activation=activation, activation_params=given, device="cpu")
    with pytest.raises(error, match=match):
        te.TransformerLayer(64, 128, 4, activation=activation, activation_params=given,
                            device="cpu")
