"""Recipes' ``backward_override`` (NOTE [Backward override] in
module/backward_override.py): the FP8 forward with a high-precision backward, exact
against torch products of the operands each mode keeps, and no FP8 cast in the
backward of any module built on the FP8 linear path."""

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import (DelayedScaling, Float8BlockScaling,
                                              Float8CurrentScaling, MXFP8BlockScaling)
from transformer_engine.pytorch import block_scaling, quantize
from transformer_engine.pytorch.kernel_config import kernel_config
from transformer_engine.pytorch.module import fp8_operands
from helpers import DEVICES

MODES = ["high_precision", "dequantized"]
RECIPES = [pytest.param(Float8CurrentScaling, id="current"),
           pytest.param(Float8BlockScaling, id="block")]


def _forward_backward(module, x, recipe, dy_seed=7, **kwargs):
    with te.autocast(recipe=recipe):
        y = module(x, **kwargs)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(dy_seed)).to(y)
    y.backward(dy)
    return y, dy


# ---- the recipe field ----------------------------------------------------------------------

@pytest.mark.parametrize("cls", [Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling])
def test_stateless_recipes_take_the_three_values(cls):
    for value in (None, "high_precision", "dequantized"):
        assert cls(backward_override=value).backward_override == value
    with pytest.raises(ValueError, match=r"backward_override \(NVTE_BACKWARD_OVERRIDE\) must be "
                                         r"None, 'high_precision' or 'dequantized', got 'fp32'"):
        cls(backward_override="fp32")


def test_delayed_scaling_takes_only_none():
    assert DelayedScaling().backward_override is None
    with pytest.raises(ValueError, match="delayed scaling only supports backward_override=None, "
                                         "got 'high_precision'"):
        DelayedScaling(backward_override="high_precision")


def test_default_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("NVTE_BACKWARD_OVERRIDE", "dequantized")
    assert Float8CurrentScaling().backward_override == "dequantized"
    assert Float8BlockScaling().backward_override == "dequantized"
    with pytest.raises(ValueError, match="delayed scaling only supports"):
        DelayedScaling()
    monkeypatch.delenv("NVTE_BACKWARD_OVERRIDE")
    assert Float8CurrentScaling().backward_override is None


def test_a_value_set_later_is_checked_at_autocast_entry():
    recipe = Float8CurrentScaling()
    recipe.backward_override = "half"
    with pytest.raises(ValueError, match=r"te.autocast: Float8CurrentScaling: backward_override"):
        with te.autocast(recipe=recipe):
            pytest.fail("te.autocast entered with an invalid backward_override")


# ---- te.Linear: exact backward -------------------------------------------------------------

def _fp8_operands(recipe, x, w):
    """The forward's FP8 operands, made by the casts the module uses, dequantized."""
    fmt = recipe.fp8_format.value.dtype_fwd
    if recipe.float8_block_scaling():
        xq, _ = block_scaling.cast_for_role(recipe, "fwd_inp", x, fmt, True, False)
        wq, _ = block_scaling.cast_for_role(recipe, "fwd_weight", w, fmt, True, False)
        return xq.dequantize(), wq.dequantize()
    q = recipe.fp8_quant_fwd_inp
    xq, _ = quantize.current_scaling_cast(x, fmt, q.power_2_scale, q.amax_epsilon, None)
    wq, _ = quantize.current_scaling_cast(w, fmt, q.power_2_scale, q.amax_epsilon, None)
    return xq.dequantize(), wq.dequantize()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("recipe_cls", RECIPES)
@pytest.mark.parametrize("mode", MODES)
def test_linear_backward_is_the_product_of_the_kept_operands(mode, recipe_cls, dtype, device):
    """high_precision: ``dx = dy W``, ``dW = dy^T x`` on the unquantized tensors;
    dequantized: on the forward's dequantized FP8 operands; in the activation dtype,
    bit for bit. The bias gradient is the FP8 backward's."""
    recipe = recipe_cls(backward_override=mode)
    lin = te.Linear(160, 48, params_dtype=dtype, device=device)
    x = torch.randn(24, 160, dtype=dtype, device=device, requires_grad=True)
    _, dy = _forward_backward(lin, x, recipe)
    w = lin.weight.detach()
    if mode == "high_precision":
        x_op, w_op = x.detach(), w
    else:
        x_op, w_op = (t.to(dtype) for t in _fp8_operands(recipe, x.detach(), w))
    assert torch.equal(x.grad, torch.mm(dy, w_op))
    assert torch.equal(lin.weight.grad, torch.mm(dy.t(), x_op))
    assert torch.equal(lin.bias.grad, dy.sum(0, dtype=torch.float32).to(dtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", MODES)
def test_dequantized_keeps_copies_high_precision_keeps_the_input(mode, device):
    """The dequantized backward reads the forward's FP8 copies: an in-place write into
    the input after the forward changes nothing. The high-precision backward reads the
    input itself, so autograd refuses the modified tensor."""
    recipe = Float8CurrentScaling(backward_override=mode)
    lin = te.Linear(32, 16, bias=False, device=device)
    x = torch.randn(8, 32, device=device)
    x_used = x.clone()
    with te.autocast(recipe=recipe):
        y = lin(x)
    x.mul_(100.0)
    if mode == "high_precision":
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.backward(torch.ones_like(y))
        return
    dy = torch.ones_like(y)
    y.backward(dy)
    x_op, _ = _fp8_operands(recipe, x_used, lin.weight.detach())
    assert torch.equal(lin.weight.grad, torch.mm(dy.t(), x_op))


@pytest.mark.parametrize("device", DEVICES)
def test_fused_wgrad_accumulation_adds_the_float32_product(device):
    recipe = Float8BlockScaling(backward_override="high_precision")
    lin = te.Linear(64, 32, bias=False, params_dtype=torch.bfloat16,
                    fuse_wgrad_accumulation=True, device=device)
    lin.weight.main_grad = torch.ones(32, 64, device=device)
    x = torch.randn(16, 64, dtype=torch.bfloat16, device=device)
    _, dy = _forward_backward(lin, x, recipe)
    expected = 1.0 + dy.t().float() @ x.float()
    assert torch.equal(lin.weight.main_grad, expected)


# ---- every module: no FP8 cast in the backward ---------------------------------------------

def _modules(device):
    return {
        "Linear": (lambda: te.Linear(64, 32, device=device), {}),
        "LayerNormLinear": (lambda: te.LayerNormLinear(64, 32, device=device), {}),
        "LayerNormMLP": (lambda: te.LayerNormMLP(64, 128, device=device), {}),
        "GroupedLinear": (lambda: te.GroupedLinear(2, 64, 32, device=device),
                          {"m_splits": [8, 8]}),
    }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe_cls", RECIPES)
@pytest.mark.parametrize("mode", [None] + MODES)
def test_backward_casts_nothing(mode, recipe_cls, device, monkeypatch):
    """Counting the operand casts of each module: the forward casts as usual; the
    backward of an override mode casts nothing (None: each GEMM's output gradient is
    cast). The fused producers (NOTE [Fused producers]; on CUDA, and only without an
    override) cast inside their kernels, not through ``cast_operand``: they are off
    here, so that the run without an override counts every cast on each device."""
    calls = []
    original = fp8_operands.cast_operand

    def counting(*args, **kw):
        calls.append(args[6])           # the role
        return original(*args, **kw)

    monkeypatch.setattr(fp8_operands, "cast_operand", counting)
    monkeypatch.setattr(te.module.fp8_linear, "cast_operand", counting)
    recipe = recipe_cls(backward_override=mode)
    for name, (make, kwargs) in _modules(device).items():
        module = make()
        x = torch.randn(16, 64, device=device, requires_grad=True)
        calls.clear()
        with kernel_config(fused_producers=False):
            with te.autocast(recipe=recipe):
                y = module(x, **kwargs)
            forward_calls = list(calls)
            assert "fwd_inp" in forward_calls, name
            y.sum().backward()
        backward_calls = calls[len(forward_calls):]
        if mode is None:
            assert backward_calls and set(backward_calls) == {"bwd_grad"}, name
        else:
            assert backward_calls == [], name
        assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_linear_gradients_are_per_split_products(device):
    recipe = Float8CurrentScaling(backward_override="high_precision")
    module = te.GroupedLinear(2, 32, 16, bias=False, device=device)
    x = torch.randn(24, 32, device=device, requires_grad=True)
    _, dy = _forward_backward(module, x, recipe, m_splits=[8, 16])
    for i, (rows, dy_i) in enumerate(zip((slice(0, 8), slice(8, 24)), dy.split([8, 16]))):
        w = getattr(module, f"weight{i}").detach()
        assert torch.equal(x.grad[rows], torch.mm(dy_i, w))
        assert torch.equal(getattr(module, f"weight{i}").grad, torch.mm(dy_i.t(), x[rows].detach()))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("mode", MODES)
def test_recompute_gives_the_same_gradients(mode, reentrant, device):
    recipe = Float8BlockScaling(backward_override=mode)
    torch.manual_seed(3)
    module = te.LayerNormLinear(64, 32, device=device)
    x = torch.randn(16, 64, device=device, requires_grad=True)
    grads = []
    for checkpointed in (False, True):
        module.zero_grad(set_to_none=True)
        x.grad = None
        with te.autocast(recipe=recipe):
            y = (te.checkpoint(module, x, use_reentrant=reentrant) if checkpointed
                 else module(x))
        y.sum().backward()
        grads.append([x.grad.clone()] + [p.grad.clone() for p in module.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_the_field_travels_in_the_extra_state(device):
    recipe = Float8BlockScaling(backward_override="dequantized")
    lin = te.Linear(32, 16, device=device)
    with te.autocast(recipe=recipe):
        lin(torch.randn(8, 32, device=device))
    fresh = te.Linear(32, 16, device=device)
    fresh.load_state_dict(lin.state_dict())
    assert fresh.fp8_meta["recipe"].backward_override == "dequantized"
