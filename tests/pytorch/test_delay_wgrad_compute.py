"""``delay_wgrad_compute=True`` (NOTE [Delayed wgrad] in module/delayed_wgrad.py): the
backward leaves the weight gradients to ``backward_dw()``, after which every output
and gradient equals the undelayed module's bit for bit."""

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import (DelayedScaling, Float8BlockScaling,
                                              Float8CurrentScaling)
from helpers import DEVICES

RECIPES = [pytest.param(None, id="no-fp8"), pytest.param(DelayedScaling(), id="delayed"),
           pytest.param(Float8CurrentScaling(), id="current"),
           pytest.param(Float8BlockScaling(), id="block"),
           pytest.param(Float8CurrentScaling(backward_override="high_precision"),
                        id="current-hp-backward")]

MODULES = {
    "Linear": lambda **kw: te.Linear(32, 64, **kw),
    "LayerNormLinear": lambda **kw: te.LayerNormLinear(32, 64, **kw),
    "LayerNormMLP": lambda **kw: te.LayerNormMLP(32, 64, **kw),
    "GroupedLinear": lambda **kw: te.GroupedLinear(2, 32, 32, **kw),
}
OUT_FEATURES = {"Linear": 64, "LayerNormLinear": 64, "LayerNormMLP": 32, "GroupedLinear": 32}


def _weights(module):
    return [p for n, p in module.named_parameters() if "weight" in n and "layer_norm" not in n]


def _call(name, module, x, recipe):
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        if name == "GroupedLinear":
            return module(x, [16, x.shape[0] * x.shape[1] - 16])
        return module(x)


def _grads(module):
    return [p.main_grad.clone() if hasattr(p, "main_grad") else
            (None if p.grad is None else p.grad.clone()) for p in module.parameters()]


def _pair(name, recipe, fuse, bias, device, dtype=torch.float32, init_recipe=None):
    torch.manual_seed(0)
    kwargs = dict(bias=bias, params_dtype=dtype, device=device, fuse_wgrad_accumulation=fuse)
    with te.quantized_model_init(enabled=init_recipe is not None, recipe=init_recipe):
        ref = MODULES[name](**kwargs)
        mod = MODULES[name](delay_wgrad_compute=True, **kwargs)
    mod.load_state_dict(ref.state_dict())
    if fuse:
        for a, b in zip(_weights(ref), _weights(mod)):
            a.main_grad = torch.rand(a.shape, device=device)
            b.main_grad = a.main_grad.clone()
    return ref, mod


@pytest.mark.parametrize("fuse", [False, True], ids=["grad", "main_grad"])
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("name", list(MODULES))
def test_gradients_equal_the_undelayed_run(name, recipe, fuse):
    """A micro-batch with ``backward_dw()`` after its backward, then two micro-batches
    whose backwards both run before one ``backward_dw()``: the gradients accumulate
    exactly as without the delay."""
    ref, mod = _pair(name, recipe, fuse, bias=True, device="cpu")
    weights = [i for i, p in enumerate(mod.parameters()) if any(p is w for w in _weights(mod))]
    for micro_batches in (1, 2):
        before = _grads(mod)
        for _ in range(micro_batches):
            x = torch.randn(16, 2, 32)
            dy = torch.randn(16, 2, OUT_FEATURES[name])
            x_ref, x_mod = x.clone().requires_grad_(), x.clone().requires_grad_()
            y_ref = _call(name, ref, x_ref, recipe)
            y_ref.backward(dy)
            y_mod = _call(name, mod, x_mod, recipe)
            y_mod.backward(dy)
            assert torch.equal(y_mod, y_ref) and torch.equal(x_mod.grad, x_ref.grad)
        # the backwards left the weights alone: no gradient, main_grad unchanged
        assert mod.need_backward_dw() and mod.wgrad_store.pending() > 0
        after = _grads(mod)
        for i in weights:
            assert (after[i] is None if before[i] is None
                    else torch.equal(after[i], before[i]))
        mod.backward_dw()
        assert mod.wgrad_store.pending() == 0
        for got, want in zip(_grads(mod), _grads(ref)):
            assert (got is None and want is None) or torch.equal(got, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", [pytest.param(None, id="no-fp8"),
                                    pytest.param(DelayedScaling(), id="delayed"),
                                    pytest.param(Float8CurrentScaling(), id="current")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_linear_under_torch_autocast_and_on_devices(device, recipe, dtype):
    ref, mod = _pair("Linear", recipe, False, bias=True, device=device, dtype=dtype)
    x = torch.randn(32, 2, 32, device=device, dtype=dtype)
    outs = []
    for m in (ref, mod):
        xi = x.clone().requires_grad_()
        with torch.autocast(device, dtype=torch.bfloat16):
            y = _call("Linear", m, xi, recipe)
        y.float().sum().backward()
        m.backward_dw()
        outs.append([y, xi.grad] + _grads(m))
    for got, want in zip(*outs):
        assert torch.equal(got, want)


@pytest.mark.parametrize("recipe", [pytest.param(DelayedScaling(), id="delayed"),
                                    pytest.param(Float8CurrentScaling(), id="current")])
def test_fp8_primary_weights(recipe):
    ref, mod = _pair("Linear", recipe, False, bias=False, device="cpu", init_recipe=recipe)
    x = torch.randn(32, 32)
    outs = []
    for m in (ref, mod):
        xi = x.clone().requires_grad_()
        _call("Linear", m, xi, recipe).sum().backward()
        if m is mod:
            assert m.weight.grad is None
        m.backward_dw()
        outs.append([xi.grad, m.weight.grad])
    for got, want in zip(*outs):
        assert torch.equal(got, want)


def test_megatron_placeholder_and_hooks():
    """With Megatron's ``grad_added_to_main_grad`` the backward returns its zero
    placeholder, as undelayed; the registered hooks run after ``backward_dw()``."""
    _, mod = _pair("Linear", None, True, bias=False, device="cpu")
    mod.weight.grad_added_to_main_grad = False
    seen = []
    mod.register_wgrad_accumulation_and_reduce_hooks(
        lambda: seen.append(mod.weight.main_grad.clone()))
    start = mod.weight.main_grad.clone()
    mod(torch.randn(16, 32, requires_grad=True)).sum().backward()
    assert mod.weight.grad_added_to_main_grad and torch.equal(mod.weight.grad,
                                                              torch.zeros(64, 32))
    assert torch.equal(mod.weight.main_grad, start) and not seen
    mod.backward_dw()
    assert len(seen) == 1 and not torch.equal(seen[0], start)
    mod.backward_dw()                   # nothing pending: no work, the hooks run again
    assert len(seen) == 2 and torch.equal(seen[1], seen[0])
    with pytest.raises(TypeError, match="hook must be callable, got int"):
        mod.register_wgrad_accumulation_and_reduce_hooks(3)


def test_no_grad_and_frozen_weights_defer_nothing():
    mod = te.Linear(32, 32, delay_wgrad_compute=True, device="cpu")
    with torch.no_grad():
        mod(torch.randn(16, 32))
    mod.weight.requires_grad_(False)
    mod(torch.randn(16, 32, requires_grad=True)).sum().backward()
    assert mod.wgrad_store.pending() == 0
    assert not te.Linear(32, 32, device="cpu").need_backward_dw()
    te.Linear(32, 32, device="cpu").backward_dw()       # a no-op


def test_refusals():
    with pytest.raises(NotImplementedError, match="delay_wgrad_compute=True with "
                                                  "parameters_split is not implemented"):
        te.Linear(32, 64, parameters_split=("a", "b"), delay_wgrad_compute=True, device="cpu")
    with pytest.raises(TypeError, match="delay_wgrad_compute"):
        te.Linear(32, 32, delay_wgrad_compute="yes", device="cpu")
    mod = te.Linear(32, 32, delay_wgrad_compute=True, device="cpu")
    with pytest.raises(NotImplementedError, match="delay_wgrad_compute=True .* cannot be graphed"):
        te.make_graphed_callables(mod, (torch.randn(16, 32, requires_grad=True),))


def test_torch_compile_is_refused_clearly():
    mod = te.Linear(32, 32, delay_wgrad_compute=True, device="cpu")
    compiled = torch.compile(mod, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="delay_wgrad_compute=True under torch.compile is not "
                                        "implemented"):
        compiled(torch.randn(16, 32, requires_grad=True))


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("recipe", [pytest.param(None, id="no-fp8"),
                                    pytest.param(DelayedScaling(), id="delayed")])
def test_under_te_checkpoint(recipe, use_reentrant):
    """A checkpointed delaying module: its wgrads are deferred from the recompute's
    backward, and equal the undelayed, uncheckpointed run's."""
    ref, mod = _pair("LayerNormMLP", recipe, False, bias=True, device="cpu")
    x = torch.randn(16, 2, 32)
    outs = []
    for m in (ref, mod):
        xi = x.clone().requires_grad_()
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            y = (m(xi) if m is ref else
                 te.checkpoint(m, xi, use_reentrant=use_reentrant))
        y.sum().backward()
        if m is mod:
            assert mod.wgrad_store.pending() == 2 and mod.fc1_weight.grad is None
        m.backward_dw()
        outs.append([y, xi.grad] + _grads(m))
    for got, want in zip(*outs):
        assert torch.equal(got, want)
