"""Recompute is invisible to the FP8 state in the corners a careless change breaks
first: grad turned off (or on) for part of the checkpointed function, non-finite
amaxes under current and block scaling, a frozen layer's backward update, the FP8
weight cache, updates during the recompute, and a backward pass run inside the first
forward of an enclosing checkpoint. Each case is compared bit for bit with the same
run without checkpointing, for both checkpoint modes."""

import contextlib
import warnings

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling
from transformer_engine.pytorch import amax_update, recompute
from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
from helpers import (DEVICES, REENTRANT, assert_runs_equal, assert_states_equal, capture,
                     fp8_state_snapshot, maybe_checkpoint, stash_count)

DELAYED = DelayedScaling(amax_history_len=2)
RECIPES = [pytest.param(DELAYED, id="delayed"), pytest.param(Float8CurrentScaling(), id="current"),
           pytest.param(Float8BlockScaling(), id="block")]


@pytest.fixture
def fresh_non_finite_count():
    FP8GlobalStateManager.reset_non_finite_amax_count()
    yield
    FP8GlobalStateManager.reset_non_finite_amax_count()


def _autocast_if(flag, recipe=DELAYED):
    return te.autocast(recipe=recipe) if flag else contextlib.nullcontext()


# ---- grad mode inside the checkpointed function -------------------------------------------

def _train_with_probe(placement, checkpointed, use_reentrant, device, steps=2):
    """``a`` trains; ``probe`` runs on the same input under ``torch.no_grad()`` inside
    the region (an FP8 module that is no training forward)."""
    torch.manual_seed(0)
    a, probe = te.Linear(32, 32, device=device), te.Linear(32, 32, device=device)
    calls = [0]

    def region(h):
        calls[0] += 1
        with _autocast_if(placement == "inside"):
            with torch.no_grad():
                p = probe(h)
            return a(h) + p

    record = []
    for step in range(steps):
        x = (torch.randn(16, 32, device=device) * 4.0 ** step).requires_grad_()
        with _autocast_if(placement == "outside"):
            y = maybe_checkpoint(checkpointed, use_reentrant, region, x)
        loss = y.pow(2).mean()
        loss.backward()
        record.append(capture(loss, [x], list(a.parameters()), [a, probe]))
        for p in a.parameters():
            p.grad = None
    return record, calls[0], (a, probe)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("placement", ["outside", "inside"])
@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_no_grad_branch_inside_the_function_is_no_training_forward(use_reentrant, placement,
                                                                   device):
    """Under ``no_grad`` inside the function a module records no amax and keeps its
    scales, with checkpointing as without (the reentrant phase 1 must not take its
    own implementation for the function's grad mode)."""
    ref, ref_calls, _ = _train_with_probe(placement, False, use_reentrant, device)
    got, calls, (a, probe) = _train_with_probe(placement, True, use_reentrant, device)
    assert (ref_calls, calls) == (2, 4)
    assert_runs_equal(ref, got)
    fwd = probe.fp8_meta["scaling_fwd"]
    assert fwd.scale.eq(1).all() and fwd.amax_history.eq(0).all()
    assert not a.fp8_meta["scaling_fwd"].scale.eq(1).all()         # the trained one moved


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_grad_enabled_inside_a_no_grad_call_is_a_training_forward(use_reentrant, device):
    """The other way round: a checkpoint called under ``no_grad`` whose function turns
    grad on for a module records that module's amaxes and updates its scale, as the
    call without checkpointing does."""
    def run(checkpointed):
        torch.manual_seed(0)
        a = te.Linear(32, 32, device=device)

        def region(h):
            with torch.enable_grad(), te.autocast(recipe=DELAYED):
                return a(h)

        for step in range(2):
            with torch.no_grad():
                maybe_checkpoint(checkpointed, use_reentrant, region,
                                 torch.randn(16, 32, device=device) * (step + 1))
        return fp8_state_snapshot([a])

    ref, got = run(False), run(True)
    assert not ref[0].fwd.scale.eq(1).all()
    assert_states_equal(ref, got)
    assert stash_count() == 0


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no-grad"])
@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_both_phases_see_grad_mode_and_arguments_as_the_plain_call(use_reentrant, grad):
    """Inside the function, each phase sees the grad mode and its argument's
    ``requires_grad`` that the call without checkpointing sees."""
    seen = []

    def region(h):
        seen.append((torch.is_grad_enabled(), h.requires_grad))
        return h.sin()              # saves h: the non-reentrant recompute runs too

    x = torch.randn(4, requires_grad=True)
    with torch.set_grad_enabled(grad):
        region(x)
        y = te.checkpoint(region, x, use_reentrant=use_reentrant)
    if grad:
        y.sum().backward()
    assert seen == [(grad, True)] * (3 if grad else 2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_no_grad_module_recompute_leaves_its_live_history_alone(use_reentrant, device):
    """A module under ``no_grad`` inside the region is never registered for an update,
    so its stash reads its live state itself: its recompute must write nothing into
    that live amax history."""
    a, probe = te.Linear(32, 32, device=device), te.Linear(32, 32, device=device)
    probe_calls = [0]
    probe.register_forward_pre_hook(lambda *_: probe_calls.__setitem__(0, probe_calls[0] + 1))

    def region(h):
        with te.autocast(recipe=DELAYED):
            with torch.no_grad():
                p = probe(h)
            return a(h) * p

    y = maybe_checkpoint(True, use_reentrant, region,
                         torch.randn(16, 32, device=device).requires_grad_())
    live = probe.fp8_meta["scaling_fwd"]
    history = live.amax_history.clone()
    assert history.eq(0).all()
    y.pow(2).mean().backward()
    assert probe_calls[0] == 2                                      # the recompute ran it
    assert probe.fp8_meta["scaling_fwd"] is live
    assert torch.equal(live.amax_history, history)


# ---- non-finite amaxes ------------------------------------------------------------------------

@pytest.mark.usefixtures("fresh_non_finite_count")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES[1:])
@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_recompute_counts_no_non_finite_amax(use_reentrant, recipe, device):
    """An input holding inf is counted once per step, by its first forward: the
    recompute's cast of the same input counts nothing."""
    def run(checkpointed):
        FP8GlobalStateManager.reset_non_finite_amax_count()
        torch.manual_seed(0)
        a = te.Linear(32, 32, device=device)

        def region(h):
            with te.autocast(recipe=recipe):
                return a(h)

        record, counts = [], []
        for step in range(2):
            x = torch.randn(16, 32, device=device)
            x[step, 3] = float("inf")           # saturates in the cast: outputs stay finite
            x.requires_grad_()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                loss = maybe_checkpoint(checkpointed, use_reentrant, region, x).pow(2).mean()
                loss.backward()
            record.append(capture(loss, [x], list(a.parameters()), [a]))
            counts.append(FP8GlobalStateManager.get_non_finite_amax_count())
            a.zero_grad()
        return record, counts

    (ref, ref_counts), (got, counts) = run(False), run(True)
    assert ref_counts == [1, 2]
    assert counts == ref_counts
    assert_runs_equal(ref, got)


# ---- the backward update of a frozen layer ---------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_frozen_layer_whose_input_needs_grad_gets_its_backward_update(use_reentrant, device):
    """Adapters on a frozen base: a layer whose weights need no gradient but whose
    input does runs a backward (dgrad) and must get its backward scale update, alone
    in its autocast, with checkpointing as without."""
    def run(checkpointed):
        torch.manual_seed(0)
        frozen = te.Linear(32, 32, device=device)
        frozen.requires_grad_(False)

        def region(h):
            with te.autocast(recipe=DELAYED):
                return frozen(h)

        record = []
        for step in range(3):
            x = (torch.randn(16, 32, device=device) * 2.0 ** step).requires_grad_()
            loss = maybe_checkpoint(checkpointed, use_reentrant, region, x).pow(2).sum()
            loss.backward()
            record.append(capture(loss, [x], [], [frozen]))
        return record, frozen

    (ref, _), (got, frozen) = run(False), run(True)
    assert not frozen.fp8_meta["scaling_bwd"].scale.eq(1).all()     # the update ran
    assert_runs_equal(ref, got)


# ---- the FP8 weight cache ----------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_recompute_writes_no_weight_cache_entry(use_reentrant, recipe, device):
    """The weight changes between the forward (``is_first_microbatch=True``, which
    caches its FP8 weight) and the backward: the recompute casts or reads what it
    needs but writes no cache entry, so the next ``is_first_microbatch=False`` call
    reads the entry the first forward made, as without checkpointing."""
    def run(checkpointed):
        torch.manual_seed(0)
        layer = te.Linear(32, 32, device=device)

        def region(h):
            with te.autocast(recipe=recipe):
                return layer(h, is_first_microbatch=True)

        y = maybe_checkpoint(checkpointed, use_reentrant, region,
                             torch.randn(16, 32, device=device).requires_grad_())
        entry = layer.fp8_meta["fp8_weight_cache"][0]
        with torch.no_grad():
            layer.weight.mul_(3.0)
        y.pow(2).mean().backward()
        assert layer.fp8_meta["fp8_weight_cache"][0] is entry
        with torch.no_grad(), te.autocast(recipe=recipe):
            return layer(torch.randn(16, 32, device=device), is_first_microbatch=False)

    ref, got = run(False), run(True)
    assert torch.equal(ref, got)


# ---- no update during a recompute ------------------------------------------------------------

def _count_updates(monkeypatch) -> list:
    """``(forward, in the recompute phase)`` per delayed-scaling update call."""
    calls = []
    real = amax_update.update_sessions

    def counting(sessions, forward):
        calls.append((forward, recompute.in_phase()))
        return real(sessions, forward)

    monkeypatch.setattr(amax_update, "update_sessions", counting)
    return calls


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_no_delayed_scaling_update_runs_during_a_recompute(use_reentrant, device, monkeypatch):
    """The autocast inside the region exits in the recompute too; only its first exit
    updates: the update calls are those of the run without checkpointing."""
    counted = _count_updates(monkeypatch)

    def run(checkpointed):
        torch.manual_seed(0)
        a, b = te.Linear(32, 32, device=device), te.Linear(32, 32, device=device)
        counted.clear()

        def region(h):
            with te.autocast(recipe=DELAYED):
                return b(torch.relu(a(h)))

        for step in range(2):
            x = (torch.randn(16, 32, device=device) * 3.0 ** step).requires_grad_()
            maybe_checkpoint(checkpointed, use_reentrant, region, x).pow(2).mean().backward()
        return list(counted), fp8_state_snapshot([a, b])

    (ref_calls, ref), (calls, got) = run(False), run(True)
    assert ref_calls == [(True, False), (False, False)] * 2
    assert calls == ref_calls
    assert_states_equal(ref, got)


@pytest.mark.usefixtures("fresh_non_finite_count")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_recompute_neither_counts_nor_warns_after_a_counter_reset(use_reentrant, device,
                                                                  monkeypatch):
    """Current scaling, an inf in the input: the forward counts it (and on the CPU warns
    at once); the counter is reset (re-arming the warning) before backward; the
    recompute must not count it again, warn, or run an update. On CUDA the warning
    comes at a later update, once a host copy of the device counter has landed (NOTE
    [Non-finite amaxes]; test_non_finite_amax.py checks that timing), so there the
    forward is not expected to warn; the device count is read directly either way."""
    a = te.Linear(32, 32, device=device)

    def region(h):
        with te.autocast(recipe=Float8CurrentScaling()):
            return a(h)

    calls = _count_updates(monkeypatch)
    x = torch.randn(16, 32, device=device)
    x[0, 0] = float("inf")
    warned = (pytest.warns(RuntimeWarning, match="a NaN or infinite amax was seen")
              if device == "cpu" else contextlib.nullcontext())
    with warned:
        y = te.checkpoint(region, x.requires_grad_(), use_reentrant=use_reentrant)
    assert FP8GlobalStateManager.get_non_finite_amax_count() == 1
    FP8GlobalStateManager.reset_non_finite_amax_count()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        y.pow(2).mean().backward()
    assert torch.isfinite(x.grad).all()                             # the backward ran
    assert [str(w.message) for w in seen] == []
    assert FP8GlobalStateManager.get_non_finite_amax_count() == 0
    assert calls == [(True, False)]                                 # the first exit only


# ---- a backward pass inside an enclosing first forward ----------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_autograd_grad_inside_an_enclosing_reentrant_first_forward(device, monkeypatch):
    """Inside the first forward of an outer reentrant checkpoint, ``torch.autograd.grad``
    runs through an inner (non-reentrant) checkpointed block, whose recompute hands
    its stash to no enclosing call; the block's module is then used again, after its
    scale moved. The outer call holds only its own two stashes, and its recompute
    casts each call with the scale that call's first forward used.

    The backward pass inside the function runs again in the recompute, with the
    backward state its first run cast with and recording nothing (NOTE [Backward inside
    a checkpointed function]): that first run kept one backward state in the stash of
    the call it went through."""
    recipe = DelayedScaling(amax_history_len=4)

    def run(checkpointed):
        torch.manual_seed(0)
        blk = te.Linear(32, 32, device=device)
        stashed, swapped, norms = [], [], []
        if checkpointed:
            stash = FP8GlobalStateManager.copy_forward_fp8_meta_tensors_for_recompute
            swap = FP8GlobalStateManager.get_old_fp8_meta_tensors_for_recompute

            def recording_stash(fp8_meta):
                stash(fp8_meta)
                stashed.append(fp8_meta["scaling_fwd"].scale.clone())

            def recording_swap(fp8_meta):
                swap(fp8_meta)
                swapped.append(fp8_meta["scaling_fwd"].scale.clone())
            monkeypatch.setattr(FP8GlobalStateManager, "copy_forward_fp8_meta_tensors_for_recompute",
                                staticmethod(recording_stash))
            monkeypatch.setattr(FP8GlobalStateManager, "get_old_fp8_meta_tensors_for_recompute",
                                staticmethod(recording_swap))

        def inner(h):
            with te.autocast(recipe=recipe):
                return blk(h)

        def outer(x):
            with torch.enable_grad():
                h = x * 1.0
                y = maybe_checkpoint(checkpointed, False, inner, h)     # the scale moves at exit
                (g,) = torch.autograd.grad(y.pow(2).sum(), h, retain_graph=True)
                norms.append(g.norm())
            with te.autocast(recipe=recipe):
                return blk(torch.tanh(y))

        x = torch.randn(16, 32, device=device).requires_grad_()
        out = maybe_checkpoint(checkpointed, True, outer, x)
        count = stash_count()
        loss = out.pow(2).mean()
        loss.backward()
        monkeypatch.undo()
        return capture(loss, [x], list(blk.parameters()), [blk]), count, stashed, swapped

    ref, _, _, _ = run(False)
    got, count, stashed, swapped = run(True)
    # two stashes of scale, scale_inv and history, and one backward state
    assert count == 3 * 3
    # Phase 1 stashes the inner call and the reuse (the inner recompute in between
    # swaps the first in). The outer recompute swaps in the inner call's, the inner
    # recompute's (the same scale) and the reuse's; the final backward, through the
    # retained inner graph, recomputes the inner block once more.
    assert len(stashed) == 2 and len(swapped) == 5
    assert not torch.equal(stashed[0], stashed[1])                   # the scale did move
    for i, j in ((0, 0), (1, 0), (2, 0), (3, 1), (4, 0)):
        assert torch.equal(swapped[i], stashed[j]), f"swap {i}: {swapped[i]} vs {stashed[j]}"
    assert_runs_equal([ref], [got])


# ---- module modes ---------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_mode_switched_between_calls_inside_the_function(use_reentrant, device):
    """The function puts a dropout in eval mode between two calls of it and back after:
    the recompute starts each module in the mode of its *first* call, so both calls
    draw (or skip) their masks as in the first forward."""
    def run(checkpointed):
        torch.manual_seed(0)
        lin, drop = te.Linear(32, 32, device=device), torch.nn.Dropout(0.5)

        def region(h):
            h = drop(h)
            drop.eval()
            h = drop(h * 2.0)
            drop.train()
            with te.autocast(recipe=DELAYED):
                return lin(h)

        x = torch.randn(16, 32, device=device).requires_grad_()
        loss = maybe_checkpoint(checkpointed, use_reentrant, region, x).pow(2).mean()
        loss.backward()
        return capture(loss, [x], list(lin.parameters()), [lin])

    assert_runs_equal([run(False)], [run(True)])


# ---- outputs ---------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_an_output_viewing_an_intermediate_can_be_changed_in_place(use_reentrant, device):
    """The function returns a view of one of its intermediates, which the caller then
    scales in place: allowed, with the plain call's gradients (the reentrant first
    forward hands back outputs cut from its own graph, not views made in it)."""
    def run(checkpointed):
        torch.manual_seed(0)
        lin = te.Linear(32, 32, device=device)
        x = torch.randn(16, 32, device=device).requires_grad_()
        y = maybe_checkpoint(checkpointed, use_reentrant, lambda h: lin(h)[:, :16], x)
        y.mul_(2.0)
        loss = y.pow(2).mean()
        loss.backward()
        return capture(loss, [x], list(lin.parameters()), [lin])

    assert_runs_equal([run(False)], [run(True)])
