"""te.Linear: FP8 forward/backward against float64 on the FP8 operands (tight) and
against a high-precision linear (loose); dtypes, saved tensors and bad input."""

import pytest
import torch
import torch.nn.functional as F

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling, Format
from helpers import DEVICES
from references import assert_close, cast_scale, deq, norm_rel_err

RECIPES = [DelayedScaling(amax_history_len=4), DelayedScaling(fp8_format=Format.E4M3, margin=1),
           Float8CurrentScaling()]
RECIPE_IDS = ["delayed-hybrid", "delayed-e4m3-margin1", "current"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fp8_linear_matches_float64_on_fp8_operands(device, recipe, dtype):
    m = te.Linear(64, 48, params_dtype=dtype, device=device)
    with torch.no_grad():
        m.bias.normal_()
    fmt = recipe.fp8_format.value
    for step in range(2):   # step 0 moves the delayed scales away from 1, step 1 is checked
        x = (torch.randn(4, 8, 64, device=device) * (step + 1)).to(dtype).requires_grad_()
        dy = (torch.randn(4, 8, 48, device=device) * 1e-3).to(dtype)
        if step == 1:
            # the scales te.Linear casts x, W (forward) and dy (backward) with
            sx, sw, sdy = (cast_scale(m, recipe, forward, slot, t) for forward, slot, t in
                           ((True, 0, x), (True, 1, m.weight), (False, 0, dy)))
        m.zero_grad()
        with te.autocast(recipe=recipe):
            y = m(x)
        y.backward(dy)
    if recipe.delayed():
        assert sx.item() != 1.0 and sdy.item() != 1.0   # step 0 really moved the scales
    x2, dy2 = x.detach().reshape(-1, 64), dy.reshape(-1, 48)
    xq, wq = deq(x2, sx, fmt.dtype_fwd), deq(m.weight.detach(), sw, fmt.dtype_fwd)
    dyq = deq(dy2, sdy, fmt.dtype_bwd)
    refs = {"y": xq @ wq.t() + m.bias.detach().double(), "dx": dyq @ wq, "dw": dyq.t() @ xq,
            "db": dy2.double().sum(0)}
    got = {"y": y.reshape(-1, 48), "dx": x.grad.reshape(-1, 64), "dw": m.weight.grad, "db": m.bias.grad}
    # Within the output dtype's rounding (plus float32 accumulation order).
    # On CUDA, float32 outputs are limited by the tensor cores' FP8 accumulation (see
    # test_quantize.CUDA_FP8_ACCUM_REL): measured up to 6.8e-5 on an H200.
    rel = 2.0 ** -8 if dtype == torch.bfloat16 else (1e-5 if device == "cpu" else 2.0 ** -11)
    for k, ref in refs.items():
        assert got[k].dtype == dtype, k
        assert_close(got[k], ref, rel, k)


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
def test_fp8_linear_close_to_high_precision(recipe):
    m = te.Linear(128, 64, device="cpu")
    x = torch.randn(64, 128, requires_grad=True)
    dy = torch.randn(64, 64)
    x_hp = x.detach().clone().requires_grad_()
    w_hp = m.weight.detach().clone().requires_grad_()
    F.linear(x_hp, w_hp, m.bias.detach()).backward(dy)
    for _ in range(2):     # second step uses calibrated delayed scales
        m.zero_grad()
        x.grad = None
        with te.autocast(recipe=recipe):
            y = m(x)
        y.backward(dy)
    # E4M3 operands: ~2^-4 per-element relative rounding, ~3% in norm; E5M2 dy: ~6%.
    assert norm_rel_err(y, F.linear(x, m.weight, m.bias)) < 0.08
    assert norm_rel_err(x.grad, x_hp.grad) < 0.12
    assert norm_rel_err(m.weight.grad, w_hp.grad) < 0.12


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
def test_non_contiguous_input_equals_its_contiguous_copy(device, recipe):
    """An input with transposed strides (and a 3-D one sliced along its last dim)
    gives the bits its contiguous copy gives: output, input and weight gradients,
    and the FP8 state after the step."""
    def step(x):
        torch.manual_seed(0)
        m = te.Linear(64, 48, params_dtype=torch.bfloat16, device=device)
        x = x.detach().requires_grad_()
        with te.autocast(recipe=recipe):
            y = m(x)
        y.backward(torch.linspace(-1, 1, y.numel(), device=device).view_as(y).to(y.dtype))
        state = [m.fp8_meta[k].amax_history.clone() for k in ("scaling_fwd", "scaling_bwd")
                 if m.fp8_meta.get(k) is not None]
        return y, x.grad, m.weight.grad, state

    base = torch.randn(64, 32, device=device, dtype=torch.bfloat16)
    wide = torch.randn(2, 16, 80, device=device, dtype=torch.bfloat16)
    for strided in (base.t(), wide[..., 8:72]):
        assert not strided.is_contiguous()
        got, ref = step(strided), step(strided.contiguous())
        for a, b in zip(got[:3], ref[:3]):
            assert torch.equal(a, b)
        assert all(torch.equal(a, b) for a, b in zip(got[3], ref[3]))


def test_saves_fp8_copies_for_backward():
    m = te.Linear(32, 32, device="cpu")
    x = torch.randn(16, 32, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with te.autocast(recipe=DelayedScaling()):
            m(x)
    big = [t for t in saved if t.numel() > 1]
    assert len(big) == 2 and all(t.dtype == torch.float8_e4m3fn for t in big)


def test_outside_autocast_is_ordinary_linear():
    m = te.Linear(32, 16, device="cpu")
    x = torch.randn(3, 5, 32)
    assert torch.equal(m(x), F.linear(x, m.weight, m.bias))
    assert m.fp8_meta["scaling_fwd"] is None    # no FP8 state created outside autocast


@pytest.mark.parametrize("fp8", [False, True], ids=["hp", "fp8"])
def test_honors_torch_autocast(fp8):
    m = te.Linear(32, 16, device="cpu")
    x = torch.randn(16, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), te.autocast(enabled=fp8):
        y = m(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and m.weight.grad.dtype == torch.float32


def test_return_bias_and_no_bias():
    m = te.Linear(32, 16, return_bias=True, device="cpu")
    with torch.no_grad():
        m.bias.normal_()
    full = te.Linear(32, 16, device="cpu")
    full.load_state_dict(m.state_dict())
    x = torch.randn(16, 32)
    with te.autocast():
        out, b = m(x)
        y = full(x)
    assert b is m.bias
    torch.testing.assert_close(out + b, y, rtol=1e-6, atol=1e-6)   # bias not added, returned instead
    assert not torch.allclose(out, y)
    nb = te.Linear(32, 16, bias=False, device="cpu")
    assert nb.bias is None and nb(x).shape == (16, 16)


def test_bad_input():
    m = te.Linear(32, 16, device="cpu")
    with pytest.raises(ValueError, match=r"te.Linear: the input's last dimension must be "
                                         r"in_features=32, got input of shape \(16, 24\)"):
        m(torch.randn(16, 24))
    with te.autocast():
        with pytest.raises(ValueError, match=r"te.Linear: FP8 execution requires .* the input "
                                             r"of shape \(10, 32\), height 10"):
            m(torch.randn(10, 32))
        with pytest.raises(TypeError, match="te.Linear: input must be a tensor"):
            m([1.0] * 32)
    with pytest.raises(ValueError, match=r"the input of shape \(16, 24\), height 16 and "
                                         r"width 24"):
        with te.autocast():
            te.Linear(24, 16, device="cpu")(torch.randn(16, 24))
    with pytest.raises(ValueError, match="in_features must be a positive int, got 0"):
        te.Linear(0, 16)
    with pytest.raises(TypeError, match="params_dtype must be torch.float32, torch.bfloat16 or "
                       "torch.float16"):
        te.Linear(16, 16, params_dtype=torch.float64)
    with te.autocast():
        with pytest.raises(TypeError, match="FP8 GEMMs produce float32, bfloat16 or float16"):
            te.Linear(16, 16, device="cpu")(torch.randn(16, 16, dtype=torch.float64))
