"""te.Linear and te.GroupedLinear(save_original_input=True) (NOTE [Saving the original input] in
module/fp8_linear.py): the high-precision input saved for backward and cast again there
for the wgrad; outputs and gradients equal the default path's bit for bit."""

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import (DelayedScaling, Float8BlockScaling,
                                              Float8CurrentScaling)
from transformer_engine.pytorch.module import fp8_linear as linear_module
from helpers import DEVICES

RECIPES = [pytest.param(None, id="no-fp8"), pytest.param(Float8CurrentScaling(), id="current"),
           pytest.param(Float8BlockScaling(), id="block")]


def _run(module, x, dy, recipe, dtype, *args):
    x = x.clone().requires_grad_()
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        y = module(x, *args)
    y.backward(dy)
    grads = [p.main_grad.clone() if hasattr(p, "main_grad") else p.grad.clone()
             for p in module.parameters()]
    return [y.detach(), x.grad] + grads


@pytest.mark.parametrize("fuse_wgrad", [False, True], ids=["grad", "main_grad"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("device", DEVICES)
def test_equals_the_default_path_bit_for_bit(device, recipe, dtype, fuse_wgrad, monkeypatch):
    torch.manual_seed(0)
    kwargs = dict(bias=not fuse_wgrad, params_dtype=dtype, device=device,
                  fuse_wgrad_accumulation=fuse_wgrad)
    ref = te.Linear(64, 128, **kwargs)
    mod = te.Linear(64, 128, save_original_input=True, **kwargs)
    mod.load_state_dict(ref.state_dict())
    if fuse_wgrad:
        for a, b in zip(ref.parameters(), mod.parameters()):
            a.main_grad = torch.rand_like(a, dtype=torch.float32)
            b.main_grad = a.main_grad.clone()
    # the backward's cast of the original input runs (and only with the flag)
    calls = []
    original = linear_module._requantized_input
    monkeypatch.setattr(linear_module, "_requantized_input",
                        lambda *a: calls.append(1) or original(*a))
    for _ in range(2):
        x = 3.0 * torch.randn(2, 16, 64, device=device, dtype=dtype)
        dy = torch.randn(2, 16, 128, device=device, dtype=dtype)
        got, want = _run(mod, x, dy, recipe, dtype), _run(ref, x, dy, recipe, dtype)
        for g, w in zip(got, want):
            assert torch.equal(g, w)
    assert len(calls) == (0 if recipe is None else 2)


def test_saves_the_input_not_its_fp8_copy():
    saved = {}
    for flag in (False, True):
        m = te.Linear(64, 64, bias=False, device="cpu", save_original_input=flag)
        x = torch.randn(32, 64, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t: saved.setdefault(flag, []).append(t) or t, lambda t: t):
            with te.autocast(recipe=Float8CurrentScaling()):
                m(x)
        saved[flag] = {t.dtype for t in saved[flag] if t is not None and t.numel() > 1}
    assert torch.float32 not in saved[False] and torch.float32 in saved[True]


def test_delayed_scaling_is_refused():
    m = te.Linear(32, 32, device="cpu", save_original_input=True)
    with pytest.raises(ValueError, match="save_original_input=True does not work with the "
                                         "DelayedScaling"):
        with te.autocast(recipe=DelayedScaling()):
            m(torch.randn(16, 32, requires_grad=True))
    with torch.no_grad(), te.autocast(recipe=DelayedScaling()):
        m(torch.randn(16, 32))      # inference: nothing is saved, nothing to refuse


@pytest.mark.parametrize("single_param", [False, True], ids=["per-gemm", "single-param"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("device", DEVICES)
def test_grouped_linear_equals_the_default_path_bit_for_bit(device, recipe, dtype, single_param,
                                                            monkeypatch):
    """te.GroupedLinear(save_original_input=True): each non-empty GEMM's wgrad input is
    cast again from the saved input, and every result equals the default path's."""
    monkeypatch.setenv("NVTE_GROUPED_LINEAR_SINGLE_PARAM", "1")
    kwargs = dict(params_dtype=dtype, device=device, single_grouped_weight=single_param,
                  single_grouped_bias=single_param)
    ref = te.GroupedLinear(3, 64, 128, **kwargs)
    mod = te.GroupedLinear(3, 64, 128, save_original_input=True, **kwargs)
    mod.load_state_dict(ref.state_dict())
    calls = []
    original = linear_module._requantized_input
    monkeypatch.setattr(linear_module, "_requantized_input",
                        lambda *a: calls.append(1) or original(*a))
    splits = [32, 0, 64]
    for _ in range(2):
        x = 3.0 * torch.randn(96, 64, device=device, dtype=dtype)
        dy = torch.randn(96, 128, device=device, dtype=dtype)
        got = _run(mod, x, dy, recipe, dtype, splits)
        want = _run(ref, x, dy, recipe, dtype, splits)
        for g, w in zip(got, want):
            assert torch.equal(g, w)
    assert len(calls) == (0 if recipe is None else 2 * 2)       # two non-empty GEMMs a step


def test_grouped_linear_delayed_scaling_is_refused():
    m = te.GroupedLinear(2, 32, 32, device="cpu", save_original_input=True)
    with pytest.raises(ValueError, match="save_original_input=True does not work with the "
                                         "DelayedScaling"):
        with te.autocast(recipe=DelayedScaling()):
            m(torch.randn(32, 32, requires_grad=True), [16, 16])
    with torch.no_grad(), te.autocast(recipe=DelayedScaling()):
        m(torch.randn(32, 32), [16, 16])      # inference: nothing is saved, nothing to refuse
