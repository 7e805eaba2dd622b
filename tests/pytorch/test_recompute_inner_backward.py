"""A backward that runs inside the checkpointed function (a gradient penalty's
``torch.autograd.grad``, an inner ``.backward()``, a nested checkpoint's recompute)
runs again in the recompute; with and without checkpointing the run must still give
the same losses, gradients and FP8 state, bit for bit: its amaxes recorded, its
scales updated and its non-finite amaxes counted once (NOTE [Backward inside a
checkpointed function] in recompute.py)."""

import contextlib
import warnings

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import (DelayedScaling, Float8BlockScaling,
                                              Float8CurrentScaling)
from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
from helpers import DEVICES, REENTRANT, assert_runs_equal, capture, stash_count

DELAYED = DelayedScaling(amax_history_len=4)
RECIPES = [pytest.param(DELAYED, id="delayed"), pytest.param(Float8CurrentScaling(), id="current"),
           pytest.param(Float8BlockScaling(), id="block")]
STEPS = 3


class Model:
    """``inner`` and ``outer`` train; ``aux`` (frozen) is the module of an inner
    backward on a graph of its own, whose gradient goes to a local leaf only."""

    def __init__(self, device):
        torch.manual_seed(0)
        self.inner, self.outer, self.aux = (te.Linear(32, 32, device=device) for _ in range(3))
        for p in self.aux.parameters():
            p.requires_grad_(False)
        self.modules = [self.inner, self.outer, self.aux]
        self.parameters = [p for m in (self.inner, self.outer) for p in m.parameters()]


# ---- the function's three parts: a forward, a backward inside it, the rest ----------

def _penalty_grad(m, x, h, create_graph):
    (g,) = torch.autograd.grad(h.square().sum(), x, create_graph=create_graph,
                               retain_graph=True)
    return g


def _grad_twice(m, x, h):
    """Two inner backwards through the same calls; the backward update of the first
    runs before the second casts (with the new scale)."""
    (g1,) = torch.autograd.grad(h.square().sum(), x, retain_graph=True)
    (g2,) = torch.autograd.grad(h.pow(3).sum(), x, create_graph=True)
    return g1 + g2


def _separate_backward(m, x, h, use_reentrant, nested):
    """``.backward()`` on a graph of its own (the frozen ``aux`` on a fresh leaf),
    optionally through a nested checkpoint."""
    z = x.detach().requires_grad_()
    y = te.checkpoint(m.aux, z, use_reentrant=use_reentrant) if nested else m.aux(z)
    (y.square().sum() * 0.01).backward()
    return z.grad


def _forward_part(variant, m, x):
    if variant == "nested_grad":    # (the reentrant mode refuses torch.autograd.grad)
        return te.checkpoint(m.inner, x, use_reentrant=False)
    return m.inner(x)


def _inner_backward(variant, m, x, h, use_reentrant):
    if variant in ("grad_create_graph", "nested_grad"):
        return _penalty_grad(m, x, h, create_graph=True)
    if variant == "grad":
        return _penalty_grad(m, x, h, create_graph=False)
    if variant == "grad_twice":
        return _grad_twice(m, x, h)
    return _separate_backward(m, x, h, use_reentrant, nested=variant == "nested_backward")


def _rest(variant, m, h, extra):
    # (the outer module saves its input for backward: the values the inner backward
    # computed in the recompute reach the gradients)
    return m.outer(h + extra)


def make_function(variant, placement, recipe, model, use_reentrant, calls):
    """The checkpointed function. ``placement``: where the FP8 autocast is:
    "inside" around all of it; "forward_only" around the forward parts, the inner
    backward under none; "own" a separate autocast for each part; "outside" around
    the checkpoint call (none in the function)."""
    def autocast(on=True):
        return te.autocast(recipe=recipe) if on else contextlib.nullcontext()

    def fn(x):
        calls[0] += 1
        if placement == "inside":
            with autocast():
                h = _forward_part(variant, model, x)
                extra = _inner_backward(variant, model, x, h, use_reentrant)
                return _rest(variant, model, h, extra)
        with autocast(placement != "outside"):
            h = _forward_part(variant, model, x)
        with autocast(placement == "own"):
            extra = _inner_backward(variant, model, x, h, use_reentrant)
        with autocast(placement != "outside"):
            return _rest(variant, model, h, extra)
    return fn


def train(variant, placement, recipe, device, use_reentrant, checkpointed):
    """``STEPS`` steps of the function, checkpointed or called; one record per step, and
    how many times the function ran."""
    model = Model(device)
    calls = [0]
    fn = make_function(variant, placement, recipe, model, use_reentrant, calls)
    opt = torch.optim.SGD(model.parameters, lr=0.05)
    record = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(10 + step)
        x = (torch.randn(16, 32, generator=g) * (1 + step)).to(device).requires_grad_()
        with (te.autocast(recipe=recipe) if placement == "outside"
              else contextlib.nullcontext()):
            y = te.checkpoint(fn, x, use_reentrant=use_reentrant) if checkpointed else fn(x)
        loss = y.float().pow(2).mean()
        loss.backward()
        record.append(capture(loss, [x], model.parameters, model.modules))
        opt.step()
        opt.zero_grad()
    return record, calls[0]


CASES = ([("grad_create_graph", p) for p in ("inside", "forward_only", "own", "outside")]
         + [("grad", "forward_only"), ("grad_twice", "inside")]
         + [("separate_backward", p) for p in ("inside", "own")]
         + [("nested_grad", "inside"), ("nested_backward", "inside"), ("nested_backward", "own")])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES[:2])     # (block scaling: in the tests below)
@pytest.mark.parametrize("use_reentrant", REENTRANT)
@pytest.mark.parametrize("variant,placement", CASES)
def test_a_backward_inside_the_function_counts_once(variant, placement, use_reentrant, recipe,
                                                      device):
    """Checkpointed and plain runs give the same losses, input and parameter gradients
    and FP8 state of every module (forward and backward scale, scale_inv, amax
    history) after every step, bit for bit; the recompute ran (the function ran twice
    a step), and no stash outlives the run."""
    ref, ref_calls = train(variant, placement, recipe, device, use_reentrant, False)
    got, got_calls = train(variant, placement, recipe, device, use_reentrant, True)
    assert ref_calls == STEPS and got_calls == 2 * STEPS
    assert_runs_equal(ref, got, f"{variant}/{placement}")
    assert stash_count() == 0


@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_the_gradient_penalty_example(use_reentrant):
    """The reported case: ``te.Linear(32, 32)`` twice, a ``torch.autograd.grad`` with
    ``create_graph=True`` inside one autocast, DelayedScaling(amax_history_len=4),
    three steps. The inner backward ran twice per step (the inner module's backward
    history shows two updates a step), and the checkpointed histories equal the plain
    ones (the recompute used to add its own amax and update: ``[0, 0.88, 0.88, 0.31]``
    against ``[0, 0.31, 0.88, 0.31]``)."""
    histories = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        inner, outer = te.Linear(32, 32, device="cpu"), te.Linear(32, 32, device="cpu")

        def fn(x):
            with te.autocast(enabled=True, recipe=DELAYED):
                h = inner(x)
                (g,) = torch.autograd.grad(h.square().sum(), x, create_graph=True)
                return outer(h) + g

        for step in range(3):
            x = (torch.randn(16, 32) * (step + 1)).requires_grad_()
            y = te.checkpoint(fn, x, use_reentrant=use_reentrant) if checkpointed else fn(x)
            y.float().pow(2).mean().backward()
        histories.append([(m.fp8_meta["scaling_bwd"].amax_history.clone(),
                           m.fp8_meta["scaling_bwd"].scale.clone()) for m in (inner, outer)])
    plain, checkpointed_run = histories
    # two backward updates a step (inner backward, then the outer one): after 3 steps
    # with a history of 4 the 3 older rows of the inner module are all non-zero
    assert bool((plain[0][0][1:, 0] != 0).all())
    for (h1, s1), (h2, s2) in zip(plain, checkpointed_run):
        assert torch.equal(h1, h2), f"{h1[:, 0]} vs {h2[:, 0]}"
        assert torch.equal(s1, s2)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_a_non_finite_inner_gradient_is_counted_once(use_reentrant, recipe):
    """An inner backward whose output gradient holds an inf: the plain and the
    checkpointed runs count the same non-zero number of non-finite amaxes (current and
    block scaling count at the cast, delayed scaling at the update), and end in the
    same FP8 state."""
    counts, states = [], []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        inner, outer = te.Linear(32, 32, device="cpu"), te.Linear(32, 32, device="cpu")
        calls = [0]

        def fn(x):
            calls[0] += 1
            with te.autocast(recipe=recipe):
                h = inner(x)
                v = torch.ones_like(h)
                v[2, 3] = float("inf")
                (g,) = torch.autograd.grad(h, x, grad_outputs=v, retain_graph=True)
                return outer(h) + torch.nan_to_num(g, nan=0.0, posinf=0.0, neginf=0.0)

        FP8GlobalStateManager.reset_non_finite_amax_count()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            for step in range(2):
                x = (torch.randn(16, 32) * (step + 1)).requires_grad_()
                y = te.checkpoint(fn, x, use_reentrant=use_reentrant) if checkpointed else fn(x)
                y.float().pow(2).mean().backward()
        assert calls[0] == (4 if checkpointed else 2)
        counts.append(FP8GlobalStateManager.get_non_finite_amax_count())
        states.append([(m.fp8_meta["scaling_bwd"], m.fp8_meta["scaling_fwd"])
                       for m in (inner, outer)])
        FP8GlobalStateManager.reset_non_finite_amax_count()
    assert counts[0] > 0
    assert counts[0] == counts[1]
    for pair_a, pair_b in zip(*states):
        for a, b in zip(pair_a, pair_b):
            if a is None or b is None:
                assert a is None and b is None
                continue
            for field in ("scale", "scale_inv", "amax_history"):
                assert torch.equal(getattr(a, field), getattr(b, field)), field


@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_a_recompute_whose_inner_backward_differs_is_refused(use_reentrant):
    """A function that runs an inner backward in phase 1 only (it branches on the
    recompute phase, which the contract forbids) has nothing to replay: the recompute
    refuses with an error that says so, rather than cast with a live scale."""
    torch.manual_seed(0)
    inner, outer = te.Linear(32, 32, device="cpu"), te.Linear(32, 32, device="cpu")
    state = {"phase": 0}

    def fn(x):
        state["phase"] += 1
        with te.autocast(recipe=DELAYED):
            h = inner(x)
            if state["phase"] == 2:      # only the recompute backpropagates
                (g,) = torch.autograd.grad(h.square().sum(), x, create_graph=True)
            else:
                g = x * 2.0
            return outer(h) + g

    x = torch.randn(16, 32, requires_grad=True)
    y = te.checkpoint(fn, x, use_reentrant=use_reentrant)
    with pytest.raises(RuntimeError, match="that the first forward did not run"):
        y.sum().backward()
    del y


@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_only_a_backward_inside_phase_1_keeps_a_backward_state(use_reentrant):
    """The inner backward of phase 1 keeps one backward state (three tensors) in the
    stash of the call it went through; the outer backward, which runs after phase 1,
    keeps none, however often a retained graph is backpropagated."""
    torch.manual_seed(0)
    inner, outer = te.Linear(32, 32, device="cpu"), te.Linear(32, 32, device="cpu")

    def fn(x):
        with te.autocast(recipe=DELAYED):
            h = inner(x)
            (g,) = torch.autograd.grad(h.square().sum(), x, create_graph=True)
            return outer(h) + g

    x = torch.randn(16, 32, requires_grad=True)
    y = te.checkpoint(fn, x, use_reentrant=use_reentrant)
    assert stash_count() == 3 * (2 + 1)     # two forward stashes, one backward state
    for _ in range(2):
        y.float().pow(2).mean().backward(retain_graph=True)
        assert stash_count() == 3 * (2 + 1)
    del y
    assert stash_count() == 0


@pytest.mark.parametrize("recipe", RECIPES[1:])
@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_a_non_finite_outer_gradient_through_recomputed_calls_is_counted(use_reentrant, recipe):
    """The real backward of recomputed calls (the reentrant mode's runs on the
    recompute's graph) counts a non-finite output gradient at its cast, as the plain
    run does; only a backward the recompute runs again counts nothing."""
    counts = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        lin = te.Linear(32, 32, device="cpu")

        def fn(x):
            with te.autocast(recipe=recipe):
                return lin(x)

        FP8GlobalStateManager.reset_non_finite_amax_count()
        x = torch.randn(16, 32, requires_grad=True)
        y = te.checkpoint(fn, x, use_reentrant=use_reentrant) if checkpointed else fn(x)
        dy = torch.ones_like(y)
        dy[0, 0] = float("nan")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            y.backward(dy)
        counts.append(FP8GlobalStateManager.get_non_finite_amax_count())
        FP8GlobalStateManager.reset_non_finite_amax_count()
    assert counts[0] > 0
    assert counts[0] == counts[1]


@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_one_module_before_inside_and_after_the_region_updates_once_per_pass(use_reentrant):
    """One te.Linear called before the checkpointed function, inside it (where an inner
    backward runs) and after it: in the outer backward its three gradient amaxes fold
    into one history row, and one backward update follows the pass, with checkpointing
    as without. An update run early (at the end of a reentrant recompute's own backward
    pass, or asked for by the replayed inner backward) would split them over two rows."""
    runs = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        shared = te.Linear(32, 32, device="cpu")
        inner = te.Linear(32, 32, device="cpu")
        calls = [0]

        def fn(a):
            calls[0] += 1
            h = shared(inner(a))
            (g,) = torch.autograd.grad(h.square().sum(), a, create_graph=True)
            return h + 0.5 * g

        for step in range(3):
            x = (torch.randn(16, 32) * (step + 1)).requires_grad_()
            with te.autocast(enabled=True, recipe=DELAYED):
                h = shared(x)
                h = te.checkpoint(fn, h, use_reentrant=use_reentrant) if checkpointed \
                    else fn(h)
                out = shared(h)
            out.float().pow(2).mean().backward()
        assert calls[0] == (6 if checkpointed else 3)
        runs.append([(m.fp8_meta["scaling_bwd"].amax_history.clone(),
                      m.fp8_meta["scaling_bwd"].scale.clone(),
                      m.fp8_meta["scaling_fwd"].amax_history.clone()) for m in (shared, inner)])
    plain, checkpointed_run = runs
    assert bool((plain[0][0][1:, 0] != 0).any()), "no backward amax reached the history"
    for a, b in zip(plain, checkpointed_run):
        for u, v in zip(a, b):
            assert torch.equal(u, v), f"{u} vs {v}"
