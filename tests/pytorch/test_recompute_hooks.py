"""The recompute hooks as TE's callers and tests see them: ``(fp8_meta) -> None``,
reached through the class attribute. A wrapper of TE's shape (one argument, calls the
original, returns nothing) counts every stash, swap and restore, and the checkpointed
run stays bit-identical to the same run without checkpointing."""

import collections
import contextlib
import inspect
import pathlib
import re

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling
from transformer_engine.pytorch.fp8 import FP8GlobalStateManager, RecomputeStateError
from transformer_engine.pytorch.scaling import ScalingState
from helpers import (CLEAN, DEVICES, REENTRANT, STASH_KEY, assert_runs_equal, capture,
                     global_state, stash_count)

HOOKS = ("copy_forward_fp8_meta_tensors_for_recompute", "get_old_fp8_meta_tensors_for_recompute",
         "restore_fp8_meta_tensors")
RECIPE = DelayedScaling(amax_history_len=2)
STEPS = 2


class Counted:
    """One-argument wrappers of the three hooks, installed on the class as TE's test
    installs its own: each calls the original and returns None. Counts calls per
    ``fp8_meta`` (a stash only when the module then carries the stash key) and notes a
    swap of a module that never stashed."""

    def __init__(self, monkeypatch):
        self.stashes, self.swaps, self.restores = (collections.Counter() for _ in range(3))
        self.unpaired = []
        originals = [getattr(FP8GlobalStateManager, name) for name in HOOKS]
        stash, swap, restore = originals

        def counting_stash(fp8_meta):
            stash(fp8_meta)
            if STASH_KEY in fp8_meta:
                self.stashes[id(fp8_meta)] += 1

        def counting_swap(fp8_meta):
            if id(fp8_meta) not in self.stashes:
                self.unpaired.append(id(fp8_meta))
            self.swaps[id(fp8_meta)] += 1
            swap(fp8_meta)

        def counting_restore(fp8_meta):
            self.restores[id(fp8_meta)] += 1
            restore(fp8_meta)

        for name, wrapper in zip(HOOKS, (counting_stash, counting_swap, counting_restore)):
            monkeypatch.setattr(FP8GlobalStateManager, name, staticmethod(wrapper))


def _train(placement, checkpointed, use_reentrant, device):
    """pre -> region -> post, the region running ``a`` twice and ``b`` once, the FP8
    autocast around everything ("outside") or opened inside the region ("inside").
    Returns the step records, the modules and how often the region ran."""
    torch.manual_seed(0)
    pre, a, b, post = (te.Linear(32, 32, device=device) for _ in range(4))
    modules = [pre, a, b, post]
    calls = [0]

    def region(h):
        calls[0] += 1
        inner = te.autocast(recipe=RECIPE) if placement == "inside" else contextlib.nullcontext()
        with inner:
            return a(torch.tanh(b(torch.relu(a(h)))))

    opt = torch.optim.SGD([p for m in modules for p in m.parameters()], lr=0.5)
    record = []
    for step in range(STEPS):
        x = (torch.randn(16, 32, device=device) * 4.0 ** step).requires_grad_()
        outer = te.autocast(recipe=RECIPE) if placement == "outside" else contextlib.nullcontext()
        with outer:
            h = pre(x)
            h = te.checkpoint(region, h, use_reentrant=use_reentrant) if checkpointed else region(h)
            y = post(h)
        loss = y.pow(2).mean()
        loss.backward()
        record.append(capture(loss, [x], opt.param_groups[0]["params"], modules))
        opt.step()
        opt.zero_grad()
    return record, modules, calls[0]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("placement", ["outside", "inside"])
@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_te_shaped_wrappers_count_and_the_run_is_unchanged(use_reentrant, placement, device,
                                                            monkeypatch):
    ref, _, ref_calls = _train(placement, False, use_reentrant, device)
    counted = Counted(monkeypatch)
    got, (pre, a, b, post), calls = _train(placement, True, use_reentrant, device)
    assert (ref_calls, calls) == (STEPS, 2 * STEPS)             # the recompute ran
    assert_runs_equal(ref, got)
    expected = {id(a.fp8_meta): 2 * STEPS, id(b.fp8_meta): STEPS}
    assert dict(counted.stashes) == expected
    assert dict(counted.swaps) == expected and dict(counted.restores) == expected
    assert counted.unpaired == []
    # a module that stashed carries the key; one that never did (outside the region) does not
    assert STASH_KEY in a.fp8_meta and STASH_KEY in b.fp8_meta
    assert STASH_KEY not in pre.fp8_meta and STASH_KEY not in post.fp8_meta
    # nothing of a running call is left in fp8_meta, nothing stashed is left alive
    for m in (pre, a, b, post):
        assert set(m.fp8_meta) - {STASH_KEY} == {"recipe", "scaling_fwd", "scaling_bwd",
                                                 "num_gemms", "fp8_checkpoint"}
    assert stash_count() == 0


def test_hooks_have_te_signatures():
    for name in HOOKS:
        params = list(inspect.signature(getattr(FP8GlobalStateManager, name)).parameters)
        assert params == ["fp8_meta"], f"{name}{params}"


@pytest.mark.parametrize("recipe, state", [(None, False), (Float8CurrentScaling(), False),
                                           (Float8CurrentScaling(), True)],
                         ids=["no-recipe", "current", "current-after-delayed"])
def test_hooks_are_no_ops_without_delayed_scaling_state(recipe, state):
    """As TE's: a module whose recipe keeps no delayed-scaling state (also one that
    ran delayed scaling before, so still holds its scales) has nothing to stash or
    swap, inside a checkpoint as outside."""
    fwd = ScalingState.new(2, 2, "cpu") if state else None
    meta = {"recipe": recipe, "scaling_fwd": fwd, "scaling_bwd": None}

    def region(h):
        for name in HOOKS:
            assert getattr(FP8GlobalStateManager, name)(meta) is None
        return h * 2

    with te.autocast(recipe=Float8CurrentScaling()):
        te.checkpoint(region, torch.ones(2, requires_grad=True)).sum().backward()
    assert meta == {"recipe": recipe, "scaling_fwd": fwd, "scaling_bwd": None}
    assert stash_count() == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_a_swap_wrapper_that_skips_the_original_is_refused(use_reentrant, device, monkeypatch):
    """The module relies on the hook's effect, not on a return value: a wrapper that
    does not call the original leaves no stash in fp8_meta, and the recompute refuses
    to run on the live (updated) scales; the live state is back in place after."""
    layer = te.Linear(32, 32, device=device)

    def region(h):
        with te.autocast(recipe=RECIPE):
            return layer(h)

    loss = te.checkpoint(region, torch.randn(16, 32, device=device, requires_grad=True),
                         use_reentrant=use_reentrant).pow(2).mean()
    live = layer.fp8_meta["scaling_fwd"]
    monkeypatch.setattr(FP8GlobalStateManager, "get_old_fp8_meta_tensors_for_recompute",
                        staticmethod(lambda fp8_meta: None))
    with pytest.raises(RecomputeStateError, match=r"te.Linear: the recompute found no FP8 stash "
                                                  r"in fp8_meta after FP8GlobalStateManager"):
        loss.backward()
    assert layer.fp8_meta["scaling_fwd"] is live
    assert global_state() == CLEAN


def test_the_documented_example_runs():
    """docs/recompute_hooks.md: its code block runs as printed."""
    text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "recompute_hooks.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 1
    exec(compile(blocks[0], "recompute_hooks.md", "exec"), {"__name__": "recompute_hooks_doc"})
    assert inspect.getattr_static(FP8GlobalStateManager, HOOKS[0]).__class__ is classmethod
