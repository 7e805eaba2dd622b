"""te.checkpoint keeps its contract for every kind of callable and every output
structure: modules whose TE modules are not registered submodules, plain torch
modules, closures, and outputs in nested lists and dicts. Comparisons are bit for bit
against the same run without checkpointing, after proving the recompute ran and that
the live scales moved between each first forward and its recompute."""

import contextlib

import pytest
import torch

import transformer_engine.pytorch as te
from helpers import (CLEAN, RECIPE, REENTRANT, assert_runs_equal, capture, fwd_scale, global_state,
                     linears, maybe_checkpoint, params, stash_count)


def _inner_autocast(inside: bool):
    return te.autocast(recipe=RECIPE) if inside else contextlib.nullcontext()


class UnregisteredHolder(torch.nn.Module):
    """Reaches its TE modules through a plain list: they are not submodules, so a
    walk of this module's tree finds no TE module."""

    def __init__(self, layers, autocast_inside):
        super().__init__()
        self.layers = list(layers)
        self.autocast_inside = autocast_inside
        self.calls = 0

    def forward(self, h):
        self.calls += 1
        with _inner_autocast(self.autocast_inside):
            for layer in self.layers:
                h = torch.relu(layer(h))
        return h


def _closure_over(layers, autocast_inside):
    calls = [0]

    def fn(h):
        calls[0] += 1
        with _inner_autocast(autocast_inside):
            for layer in layers:
                h = torch.relu(layer(h))
        return h
    fn.calls = calls
    return fn


@pytest.mark.parametrize("kind", ["unregistered-module", "closure"])
@pytest.mark.parametrize("placement", ["inner", "outer"])
@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_te_modules_outside_the_module_tree(use_reentrant, placement, kind):
    def run(checkpointed):
        layers = linears(2)
        inner = placement == "inner"
        fn = (UnregisteredHolder(layers, inner) if kind == "unregistered-module"
              else _closure_over(layers, inner))
        opt = torch.optim.SGD(params(layers), lr=0.5)
        record, scales = [], []
        for step in range(3):
            x = (torch.randn(16, 32) * 4.0 ** step).requires_grad_()
            with te.autocast(enabled=not inner, recipe=RECIPE):
                scales.append(fwd_scale(layers[0]))
                y = maybe_checkpoint(checkpointed, use_reentrant, fn, x)
            scales.append(fwd_scale(layers[0]))
            loss = y.pow(2).mean()
            loss.backward()
            record.append(capture(loss, [x], params(layers), layers))
            opt.step()
            opt.zero_grad()
        calls = fn.calls if kind == "unregistered-module" else fn.calls[0]
        return record, calls, scales

    ref, ref_calls, _ = run(False)
    got, calls, scales = run(True)
    assert ref_calls == 3 and calls == 6                          # the recompute ran
    # the forward scale moved between each first forward and its recompute
    assert all(not torch.equal(scales[2 * s], scales[2 * s + 1]) for s in range(3))
    assert_runs_equal(ref, got)
    assert stash_count() == 0


@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_plain_torch_module_takes_the_same_path(use_reentrant):
    """A module with no TE module at all, with dropout: the recompute draws the same
    mask (te.checkpoint's RNG replay) and the run matches bit for bit."""
    def run(checkpointed):
        torch.manual_seed(3)
        block = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Dropout(0.5),
                                    torch.nn.Linear(32, 32))
        calls = [0]
        block.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        record = []
        for _ in range(2):
            x = torch.randn(16, 32, requires_grad=True)
            loss = maybe_checkpoint(checkpointed, use_reentrant, block, x).pow(2).mean()
            loss.backward()
            record.append(capture(loss, [x], list(block.parameters()), []))
        return record, calls[0]

    ref, ref_calls = run(False)
    got, calls = run(True)
    assert ref_calls == 2 and calls == 4
    assert_runs_equal(ref, got)


@pytest.mark.parametrize("structure", ["list", "dict", "nested"])
@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_nested_outputs_keep_their_gradients(use_reentrant, structure):
    """Outputs returned in a list, a dict or a nested mix stay connected to the graph:
    every weight gets the gradient the un-checkpointed run gives it."""
    def run(checkpointed):
        a, b = linears(2)

        def region(h):
            with te.autocast(recipe=RECIPE):
                u, v = a(h), b(h)
            if structure == "list":
                return [u, v]
            if structure == "dict":
                return {"u": u, "v": v, "note": "kept"}
            return (u, [v, {"w": u * 2}], 3)

        record = []
        for step in range(2):
            x = (torch.randn(16, 32) * 4.0 ** step).requires_grad_()
            out = maybe_checkpoint(checkpointed, use_reentrant, region, x)
            if structure == "list":
                u, v = out
            elif structure == "dict":
                assert out["note"] == "kept"
                u, v = out["u"], out["v"]
            else:
                assert out[2] == 3 and isinstance(out[1], list)
                u, v = out[0] + out[1][1]["w"], out[1][0]
            loss = u.pow(2).mean() + v.pow(3).mean()
            loss.backward()
            record.append(capture(loss, [x], params([a, b]), [a, b]))
        return record

    ref = run(False)
    got = run(True)
    for r in got:
        assert all(g is not None and g.abs().sum() > 0 for g in r.input_grads + r.param_grads)
    assert_runs_equal(ref, got)


@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_context_fn_must_return_a_pair(use_reentrant):
    (layer,) = linears(1)
    x = torch.randn(16, 32, requires_grad=True)
    with pytest.raises(TypeError, match="context_fn must return a pair of context managers"):
        te.checkpoint(layer, x, use_reentrant=use_reentrant,
                      context_fn=lambda: torch.autocast("cpu", enabled=False))
    assert global_state() == CLEAN


@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_context_fn_pair_is_entered_in_each_phase(use_reentrant):
    entered = []

    class Mark:
        def __init__(self, name):
            self.name = name

        def __enter__(self):
            entered.append(self.name)

        def __exit__(self, *exc):
            return False

    (layer,) = linears(1)
    x = torch.randn(16, 32, requires_grad=True)
    y = te.checkpoint(layer, x, use_reentrant=use_reentrant,
                      context_fn=lambda: (Mark("forward"), Mark("recompute")))
    assert entered == ["forward"]
    y.sum().backward()
    assert entered == ["forward", "recompute"]


def test_tp_group_without_distribution_warns_and_is_ignored():
    """tp_group only serves distribute_saved_activations; passing it alone warns, and
    the call runs as without it."""
    dist = torch.distributed
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        (layer,) = linears(1)
        x = torch.randn(16, 32, requires_grad=True)
        with pytest.warns(UserWarning, match="tp_group is used only with "
                                             "distribute_saved_activations"):
            y = te.checkpoint(layer, x, use_reentrant=True, tp_group=dist.group.WORLD)
        y.sum().backward()
        torch.testing.assert_close(x.grad, torch.ones(16, 32) @ layer.weight.detach())
    finally:
        dist.destroy_process_group()
