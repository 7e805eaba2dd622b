"""The regression matrix of the seed: activation checkpointing keeps FP8 delayed-scaling
state when the FP8 autocast is opened inside the checkpointed callable.

Every case runs for reentrant and non-reentrant checkpointing. "Invariance" compares a
three-step training run with checkpointing against the same run without it, bit for bit.
"""

import contextlib
import dataclasses

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling
from transformer_engine.pytorch import distributed, recompute
from transformer_engine.pytorch.fp8 import FP8GlobalStateManager, RecomputeStateError
from helpers import DEVICES, REENTRANT, STASH_KEY, assert_runs_equal, capture, fwd_scale, queries


# ---- the seed's three cases ------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_inner_fp8_autocast(use_reentrant, device):
    layer = te.Linear(32, 32, device=device)
    seen = []

    def fn(x):
        seen.append(("outside", queries()))
        with te.autocast(recipe=DelayedScaling()):
            seen.append(("inside", queries()))
            y = layer(x)
        seen.append(("outside", queries()))
        return y

    x = torch.randn(16, 32, device=device, requires_grad=True)
    y = te.checkpoint(fn, x, use_reentrant=use_reentrant)
    assert queries() == (False, False)
    loss = y.float().pow(2).sum()
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(t.grad).all() for t in (x, layer.weight, layer.bias))
    assert STASH_KEY in layer.fp8_meta
    assert seen == [("outside", (False, False)), ("inside", (True, False)), ("outside", (False, False)),
                    ("outside", (False, True)), ("inside", (True, True)), ("outside", (False, True))]
    assert queries() == (False, False)


@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_fully_non_fp8(use_reentrant):
    l1, l2 = te.Linear(32, 32, device="cpu"), te.Linear(32, 16, device="cpu")
    seen = []

    def fn(x):
        seen.append(queries())
        return l2(torch.relu(l1(x)))

    x = torch.randn(16, 32, requires_grad=True)
    loss = te.checkpoint(fn, x, use_reentrant=use_reentrant).pow(2).sum()
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(x.grad).all() and torch.isfinite(l1.weight.grad).all()
    assert STASH_KEY not in l1.fp8_meta and STASH_KEY not in l2.fp8_meta
    assert l1.fp8_meta["scaling_fwd"] is None
    assert seen == [(False, False), (False, True)]
    assert distributed.recompute_stash_count() == 0


def _two_layer_run(fn_of, checkpointed, use_reentrant, steps=2):
    """Train ``fn_of(plain, fp8)`` (a region over two te.Linear) ``steps`` steps, with or
    without checkpointing; returns the per-step record and how often the region ran."""
    torch.manual_seed(0)
    plain, fp8 = te.Linear(32, 32, device="cpu"), te.Linear(32, 16, device="cpu")
    fn, calls = fn_of(plain, fp8)
    record = []
    for step in range(steps):
        x = (torch.randn(16, 32) * 3.0 ** step).requires_grad_()
        y = te.checkpoint(fn, x, use_reentrant=use_reentrant) if checkpointed else fn(x)
        loss = y.pow(2).sum()
        loss.backward()
        record.append(capture(loss, [x], [*plain.parameters(), *fp8.parameters()], [plain, fp8]))
        for p in (*plain.parameters(), *fp8.parameters()):
            p.grad = None
    return record, calls[0], (plain, fp8)


@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_mixed_fp8_and_non_fp8(use_reentrant):
    def fn_of(plain, fp8):
        calls = [0]

        def fn(x):
            calls[0] += 1
            h = torch.relu(plain(x))
            with te.autocast(recipe=DelayedScaling()):
                return fp8(h)
        return fn, calls

    ref, ref_calls, _ = _two_layer_run(fn_of, False, use_reentrant)
    got, calls, (plain, fp8) = _two_layer_run(fn_of, True, use_reentrant)
    assert ref_calls == 2 and calls == 4                      # the recompute ran
    assert_runs_equal(ref, got)
    assert STASH_KEY in fp8.fp8_meta and STASH_KEY not in plain.fp8_meta
    assert plain.fp8_meta["scaling_fwd"] is None


@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_current_scaling_stashes_nothing(use_reentrant):
    def fn_of(plain, fp8):
        calls = [0]

        def fn(x):
            calls[0] += 1
            with te.autocast(recipe=Float8CurrentScaling()):
                return fp8(torch.relu(plain(x)))
        return fn, calls

    ref, ref_calls, _ = _two_layer_run(fn_of, False, use_reentrant)
    got, calls, (plain, fp8) = _two_layer_run(fn_of, True, use_reentrant)
    assert ref_calls == 2 and calls == 4
    assert_runs_equal(ref, got)
    for m in (plain, fp8):
        assert STASH_KEY not in m.fp8_meta and m.fp8_meta["scaling_fwd"] is None
    assert distributed.recompute_stash_count() == 0


# ---- invariance: with and without checkpointing, bit for bit -----------------------------

class Net(torch.nn.Module):
    """pre -> region(a, b) -> post, with the FP8 autocast where ``placement`` says."""

    def __init__(self, device):
        super().__init__()
        self.pre, self.a, self.b, self.post = (te.Linear(32, 32, device=device) for _ in range(4))

    def forward(self, x, recipe, placement, checkpoint, use_reentrant, probe):
        def region(h):
            probe.append(fwd_scale(self.a))
            if placement == "outer":
                return self.b(torch.relu(self.a(h)))
            if placement == "inner":
                with te.autocast(recipe=recipe):
                    return self.b(torch.relu(self.a(h)))
            h = torch.relu(self.a(h))            # mixed: a in high precision, b in FP8
            with te.autocast(recipe=recipe):
                return self.b(h)

        outer = te.autocast(recipe=recipe) if placement == "outer" else contextlib.nullcontext()
        with outer:
            h = self.pre(x)
            h = te.checkpoint(region, h, use_reentrant=use_reentrant) if checkpoint else region(h)
            return self.post(torch.tanh(h))


def _train(device, recipe, placement, checkpoint, use_reentrant, steps=3):
    torch.manual_seed(0)
    net = Net(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    modules = [net.pre, net.a, net.b, net.post]
    record, probe = [], []
    for step in range(steps):
        x = (torch.randn(16, 32, device=device) * (2.0 ** step)).requires_grad_()
        loss = net(x, recipe, placement, checkpoint, use_reentrant, probe).float().pow(2).mean()
        loss.backward()
        record.append(capture(loss, [x], net.parameters(), modules))
        opt.step()
        opt.zero_grad()
    return record, probe


RECIPES = [pytest.param(DelayedScaling(amax_history_len=3), id="delayed"),
           pytest.param(DelayedScaling(amax_history_len=1, amax_compute_algo="most_recent", margin=1),
                        id="delayed-most-recent"),
           pytest.param(Float8CurrentScaling(), id="current")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("placement", ["outer", "inner", "mixed"])
@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_invariance(use_reentrant, placement, recipe, device):
    ref, ref_probe = _train(device, recipe, placement, False, use_reentrant)
    got, probe = _train(device, recipe, placement, True, use_reentrant)
    assert len(ref_probe) == 3 and len(probe) == 6      # the recompute ran once per step
    assert_runs_equal(ref, got)
    if recipe.delayed() and placement != "mixed":
        # Between each first forward and its recompute the live forward scale moved, so
        # equality proves the recompute used the stashed scale.
        for step in range(3):
            first, at_recompute = probe[2 * step], probe[2 * step + 1]
            if first is not None:
                assert not torch.equal(first, at_recompute), f"step {step}: scale did not move"
        assert probe[1] is not None
    assert distributed.recompute_stash_count() == 0


# ---- the behaviour before the seed's change --------------------------------------------

@contextlib.contextmanager
def _region_sampled_at_entry(monkeypatch):
    """Make the region flag what it was before the seed: 'FP8 enabled at checkpoint entry'."""
    real = recompute.enter

    @contextlib.contextmanager
    def sampled(frame, recomputing, training_under_no_grad=None):
        fp8_at_entry = FP8GlobalStateManager.is_fp8_enabled()
        with real(frame, recomputing, training_under_no_grad):
            entered = recompute.position()
            recompute._THREAD.position = dataclasses.replace(entered, region=fp8_at_entry)
            try:
                yield
            finally:
                recompute._THREAD.position = entered

    monkeypatch.setattr(recompute, "enter", sampled)
    yield


@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_old_behaviour_fails_for_inner_autocast(use_reentrant, monkeypatch):
    """Sampling the FP8 state at checkpoint entry (the pre-seed code) loses the stash of an
    inner-autocast region: its recompute finds no FP8 state. The outer case still works."""
    with _region_sampled_at_entry(monkeypatch):
        ref, _ = _train("cpu", DelayedScaling(), "outer", False, use_reentrant, steps=2)
        got, _ = _train("cpu", DelayedScaling(), "outer", True, use_reentrant, steps=2)
        assert_runs_equal(ref, got)
        with pytest.raises(RecomputeStateError, match="the first forward stashed no FP8 state"):
            _train("cpu", DelayedScaling(), "inner", True, use_reentrant, steps=1)
    # ... and with the seed's change the same inner case passes (test_invariance).
