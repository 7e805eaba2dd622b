"""Checkpointing that survives real training loops: nesting,
exceptions, forwards without backward, train/eval switches, out-of-order gradient
accumulation, and modules shared within and across regions.

Every case compares a checkpointed run against the same run without checkpointing,
bit for bit (losses, gradients, every module's scale / scale_inv / amax history), after
proving that the recompute ran and that the scales moved in between. What a recompute replays
is in test_checkpoint_replay.py.
"""

import contextlib
import gc
import random
from typing import NamedTuple

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.pytorch import recompute
from helpers import (CLEAN, RECIPE, REENTRANT, STASH_KEY, assert_runs_equal, capture, fwd_scale,
                     global_state, linears, maybe_checkpoint, params, queries,
                     record_recompute_scales, stash_count)

# ---- nesting ------------------------------------------------------------------------

class NestLog:
    def __init__(self):
        self.calls = {1: 0, 2: 0, 3: 0}
        self.seen = {1: [], 2: [], 3: []}      # queries() at each call of each level
        self.exits = []                        # (state before, state after) each nested call
        self.scale3 = []                       # level 3's forward scale at each of its calls


def _nested_forward(layers, x, depth, checkpointed, use_reentrant, log):
    """Level k runs layer k, then checkpoints level k+1 (depth 3); the FP8 autocast is
    opened at level ``depth`` (0: around the outermost checkpoint)."""

    def level(k, h):
        log.calls[k] += 1
        with te.autocast(recipe=RECIPE) if depth == k else contextlib.nullcontext():
            log.seen[k].append(queries())
            if k == 3:
                log.scale3.append(fwd_scale(layers[2]))
            h = torch.relu(layers[k - 1](h))
            if k < 3:
                before = global_state()
                h = maybe_checkpoint(checkpointed, use_reentrant, level, k + 1, h)
                after = global_state()
                log.exits.append((before, after))
        return h

    with te.autocast(recipe=RECIPE) if depth == 0 else contextlib.nullcontext():
        before = global_state()
        y = maybe_checkpoint(checkpointed, use_reentrant, level, 1, x)
        log.exits.append((before, global_state()))
    return y


def _nested_run(depth, checkpointed, use_reentrant, steps=3):
    layers = linears(3)
    opt = torch.optim.SGD(params(layers), lr=0.1)
    log, record = NestLog(), []
    for step in range(steps):
        x = (torch.randn(16, 32) * 4.0 ** step).requires_grad_()
        loss = _nested_forward(layers, x, depth, checkpointed, use_reentrant, log).pow(2).mean()
        loss.backward()
        assert global_state() == CLEAN
        record.append(capture(loss, [x], params(layers), layers))
        opt.step()
        opt.zero_grad()
    return record, log


@pytest.mark.parametrize("depth", [0, 1, 2, 3], ids=lambda d: f"autocast-at-depth-{d}")
@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_nested_depth_3(use_reentrant, depth):
    ref, ref_log = _nested_run(depth, False, use_reentrant)
    got, log = _nested_run(depth, True, use_reentrant)
    # Recomputes ran: level k runs once in phase 1, then once per enclosing recompute
    # (level 2: in level 1's recompute and its own; level 3: three more times).
    assert ref_log.calls == {1: 3, 2: 3, 3: 3}
    assert log.calls == {1: 6, 2: 9, 3: 12}
    # Flags at every level: only the first call of each step is not a recompute; FP8
    # recompute is enabled exactly where an autocast is open (level >= depth).
    for k in (1, 2, 3):
        per_step = len(log.seen[k]) // 3
        expect = [(k >= depth, i > 0) for i in range(per_step)] * 3
        assert log.seen[k] == expect, f"level {k}"
    # Every exit (nested and outermost) put back exactly what it found.
    assert len(log.exits) == 3 * (1 + 2 + 3)      # outermost + levels 1 and 2
    for before, after in log.exits:
        assert before == after and before.autocast is after.autocast
    # Level 3's live scale moved between its first forward and its recomputes.
    for step in range(3):
        assert not torch.equal(log.scale3[4 * step], log.scale3[4 * step + 1]), f"step {step}"
    assert_runs_equal(ref, got)
    assert stash_count() == 0


# ---- exceptions ---------------------------------------------------------------------

class Boom(Exception):
    """Raised on purpose inside checkpointed functions."""


def _exception_run(placement, checkpointed, use_reentrant, fail, steps=(0, 1, 2)):
    """pre -> region(a, b), for the given steps of a three-step run; at step 1 the region
    raises after ``a`` ran, in phase 1 (``fail="phase1"``) or in the recompute
    (``fail="recompute"``; the un-checkpointed run drops that step's graph instead).
    ``fail=None``: a clean run."""
    pre, a, b = linears(3)
    modules = [pre, a, b]
    opt = torch.optim.SGD(params(modules), lr=0.1)
    calls, record, observed = [0], [], []
    inputs = [torch.randn(16, 32) * 4.0 ** step for step in range(3)]

    def region(h, raise_now):
        calls[0] += 1
        with te.autocast(recipe=RECIPE) if placement == "inner" else contextlib.nullcontext():
            h = torch.relu(a(h))
            if raise_now():
                raise Boom("raised inside the checkpointed function")
            return b(h)

    for step in steps:
        x = inputs[step].clone().requires_grad_()
        first_call = calls[0]
        fail_here = step == 1 and fail is not None

        def raise_now():
            if not fail_here:
                return False
            return calls[0] == first_call + (1 if fail == "phase1" else 2)

        before = global_state()
        stashes = stash_count() if fail_here else None
        raised = False
        try:
            with te.autocast(recipe=RECIPE) if placement == "outer" else contextlib.nullcontext():
                y = maybe_checkpoint(checkpointed, use_reentrant, region, pre(x), raise_now)
            loss = y.pow(2).mean()
            if fail_here and fail == "recompute" and not checkpointed:
                continue              # the reference drops the graph the failure dropped
            loss.backward()
        except Boom:
            raised = True
        if raised:
            assert fail_here
            y = loss = None           # drop the failed step's graph (and its frame)
            observed.append((global_state() == before, stash_count() == stashes,
                             STASH_KEY in a.fp8_meta,
                             "updated_fp8_state_fwd" not in a.fp8_meta))
            continue
        record.append(capture(loss, [x], params(modules), modules))
        y = loss = None
        opt.step()
        opt.zero_grad()
    return record, calls[0], observed


@pytest.mark.parametrize("placement", ["outer", "inner"], ids=lambda p: f"autocast-{p}")
@pytest.mark.parametrize("fail", ["phase1", "recompute"])
@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_exception_leaves_state_as_before(use_reentrant, fail, placement):
    got, calls, observed = _exception_run(placement, True, use_reentrant, fail)
    # The failure happened once, in the intended phase, and left flags, autocast state
    # and stashes exactly as before the call; the live forward state is swapped back.
    assert observed == [(True, True, True, True)]
    assert calls == (2 + 1 + 2 if fail == "phase1" else 2 + 2 + 2)
    if fail == "phase1":
        # An exception through the autocast discards its amaxes: as if the step never ran.
        clean, _, _ = _exception_run(placement, False, use_reentrant, None, steps=(0, 2))
    else:
        # The recompute failed after phase 1 updated the scales: as a dropped graph.
        clean, _, none = _exception_run(placement, False, use_reentrant, fail)
        assert none == []
    assert len(got) == 2
    assert_runs_equal(clean, got)
    assert stash_count() == 0


@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_exception_inside_enclosing_region_restores_its_state(use_reentrant):
    """A checkpoint that raises inside another checkpoint's function, inside an FP8
    autocast, restores the enclosing region's flags and the very autocast state object
    (restore, not reset); the enclosing region then completes and matches."""
    def run(checkpointed):
        outer_layer, inner_layer = linears(2)
        seen = []

        def inner(h):
            h = inner_layer(h)
            raise Boom("inner")

        def outer(h):
            h = outer_layer(h)
            before = global_state()
            try:
                maybe_checkpoint(checkpointed, use_reentrant, inner, h)
            except Boom:
                after = global_state()
                seen.append(before == after and before.autocast is after.autocast and
                            (not checkpointed or before.region))
            return torch.relu(h)

        x = torch.randn(16, 32, requires_grad=True)
        with te.autocast(recipe=RECIPE):
            y = maybe_checkpoint(checkpointed, use_reentrant, outer, x)
        loss = y.pow(2).mean()
        loss.backward()
        return capture(loss, [x], params([outer_layer]), [outer_layer]), seen

    ref, ref_seen = run(False)
    got, seen = run(True)
    assert ref_seen == [True] and seen == [True, True]        # phase 1 and the recompute
    assert_runs_equal([ref], [got])
    assert stash_count() == 0


# ---- forwards without backward ------------------------------------------------------

class Leftovers(NamedTuple):
    stashes: int
    frames: int
    tensors: int
    meta_keys: list


def _leftovers(layer) -> Leftovers:
    """What dropped forwards could leave behind: stashed tensors, live checkpoint frames,
    live tensors of any kind, and keys in ``layer``'s fp8_meta."""
    stashes = stash_count()
    gc.collect()
    tensors = sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))
    return Leftovers(stashes=stashes, frames=len(recompute.live_frames()), tensors=tensors,
                     meta_keys=sorted(layer.fp8_meta))


@pytest.mark.parametrize("mode", ["no_grad", "grad-dropped"])
@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_thousand_dropped_forwards_leave_nothing(use_reentrant, mode):
    def run(checkpointed, probes):
        (layer,) = linears(1, features=16)
        calls = [0]

        def fn(h):
            calls[0] += 1
            with te.autocast(recipe=RECIPE):
                return layer(h)

        def probe(i):
            x = torch.randn(16, 16) * (1.0 + i % 7)       # scales move in grad mode
            with torch.no_grad() if mode == "no_grad" else contextlib.nullcontext():
                maybe_checkpoint(checkpointed, use_reentrant, fn, x.requires_grad_())

        probe(0)                                          # warm-up (lazy allocations)
        baseline = _leftovers(layer)
        for i in range(1, probes):
            probe(i)
        after = _leftovers(layer)
        x = torch.randn(16, 16, generator=torch.Generator().manual_seed(5)).requires_grad_()
        y = maybe_checkpoint(checkpointed, use_reentrant, fn, x)
        loss = y.pow(2).mean()
        loss.backward()
        return baseline, after, calls[0], capture(loss, [x], params([layer]), [layer])

    base, after, calls, got = run(True, 1000)
    assert calls == 1000 + 2                               # + the normal step's recompute
    assert base.stashes == 0 and base.frames == 0
    assert (after.stashes, after.frames) == (0, 0), "stashes or frames outlived their dropped graphs"
    assert after.tensors <= base.tensors, f"live tensors grew from {base.tensors} to {after.tensors}"
    assert after.meta_keys == base.meta_keys
    if mode == "no_grad":
        ref = run(False, 0)[3]             # no_grad forwards change nothing: a clean run
    else:
        ref = run(False, 1000)[3]          # they update scales, exactly as un-checkpointed
        assert not torch.equal(ref.states[0].fwd.scale, torch.ones(2))
    assert_runs_equal([ref], [got])
    assert stash_count() == 0 and len(recompute.live_frames()) == 0


# ---- train/eval switches between phase 1 and backward --------------------------------

class RecordingDropout(torch.nn.Dropout):
    """Dropout that notes the mode each of its calls ran in."""

    def __init__(self, p):
        super().__init__(p)
        self.modes = []

    def forward(self, x):
        self.modes.append(self.training)
        return super().forward(x)


class DropoutBlock(torch.nn.Module):
    """FP8 linear -> dropout -> FP8 linear: the dropout depends on the mode."""

    def __init__(self):
        super().__init__()
        self.a, self.b = linears(2)
        self.drop = RecordingDropout(0.5)

    def forward(self, h):
        with te.autocast(recipe=RECIPE):
            return self.b(self.drop(self.a(h)))


@pytest.mark.parametrize("function", ["module", "closure"])
@pytest.mark.parametrize("nested", [False, True], ids=["one-region", "nested-regions"])
@pytest.mark.parametrize("switch", ["train-to-eval", "eval-to-train"])
@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_mode_at_phase1_governs(use_reentrant, switch, nested, function):
    """The documented rule: the train/eval mode a module had in phase 1 governs its
    recompute (dropout or not), the FP8 stash is there to take whatever the mode, and
    the switch made before backward is what the modules have afterwards. Both ways of
    recording the modes (NOTE [Module modes]): the module's tree when the checkpointed
    function is the module, a hook on module calls when it is a closure."""
    first_mode = switch == "train-to-eval"

    def run(checkpointed):
        torch.manual_seed(0)
        block = DropoutBlock()
        record = []
        for step in range(2):
            block.train(first_mode)
            x = (torch.randn(16, 32) * 4.0 ** step).requires_grad_()
            fn = block if function == "module" else (lambda h: block(h))
            if nested:
                y = maybe_checkpoint(checkpointed, use_reentrant, lambda h: maybe_checkpoint(
                    checkpointed, use_reentrant, fn, h), x)
            else:
                y = maybe_checkpoint(checkpointed, use_reentrant, fn, x)
            block.train(not first_mode)
            loss = y.pow(2).mean()
            loss.backward()
            assert all(m.training is (not first_mode) for m in block.modules())
            record.append(capture(loss, [x], params([block.a, block.b]), [block.a, block.b]))
            block.zero_grad()
        return record, block

    ref, ref_block = run(False)
    got, block = run(True)
    assert ref_block.drop.modes == [first_mode] * 2
    # Phase 1 and each recompute (nested: the inner region also runs in the outer's).
    assert block.drop.modes == [first_mode] * (6 if nested else 4)
    assert STASH_KEY in block.a.fp8_meta and STASH_KEY in block.b.fp8_meta
    assert_runs_equal(ref, got)
    assert stash_count() == 0


# ---- gradient accumulation, backward out of order -------------------------------------

def _accumulate(order, checkpointed, use_reentrant):
    """Four micro-batches pre -> region(a, b), each in its own autocast (so the scales
    move between them), then backward in ``order``."""
    pre, a, b = linears(3)
    modules = [pre, a, b]
    calls = [0]

    def region(h):
        calls[0] += 1
        return b(torch.relu(a(h)))

    losses, inputs, scales = [], [], []
    for mb in range(4):
        x = (torch.randn(16, 32) * 3.0 ** mb).requires_grad_()
        with te.autocast(recipe=RECIPE):
            scales.append((fwd_scale(a), fwd_scale(b)))       # what this phase 1 casts with
            h = pre(x)
            losses.append(maybe_checkpoint(checkpointed, use_reentrant, region, h).pow(2).mean())
        inputs.append(x)
    record, sequence = [], None
    if order == "sum":
        sum(losses).backward()
        record.append(capture(None, inputs, params(modules), modules))
    else:
        sequence = [3, 2, 1, 0] if order == "reverse" else random.Random(7).sample(range(4), 4)
        assert order == "reverse" or sequence not in ([3, 2, 1, 0], [0, 1, 2, 3])
        for mb in sequence:
            losses[mb].backward()
            record.append(capture(losses[mb], inputs, params(modules), modules))
    return record, calls[0], scales, sequence, (a, b)


@pytest.mark.parametrize("order", ["reverse", "shuffled", "sum"])
@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_out_of_order_accumulation(use_reentrant, order, monkeypatch):
    ref, ref_calls, _, _, _ = _accumulate(order, False, use_reentrant)
    used = record_recompute_scales(monkeypatch)
    got, calls, scales, sequence, (a, b) = _accumulate(order, True, use_reentrant)
    assert ref_calls == 4 and calls == 8
    for i in range(1, 4):
        for m in (0, 1):
            assert not torch.equal(scales[i - 1][m], scales[i][m]), f"micro-batch {i}: no move"
    # Each recompute swapped in the scales its own phase 1 cast with.
    expect = [[(id(a.fp8_meta), tuple(scales[mb][0].tolist())),
               (id(b.fp8_meta), tuple(scales[mb][1].tolist()))] for mb in range(4)]
    if sequence is not None:
        assert used == [e for mb in sequence for e in expect[mb]]
    else:
        assert sorted(used) == sorted(e for pair in expect for e in pair)
    assert_runs_equal(ref, got)
    assert stash_count() == 0


# ---- sharing a module -----------------------------------------------------------------

@pytest.mark.parametrize("sharing", ["twice-in-one-region", "twice-in-one-region-two-autocasts",
                                     "two-regions-one-autocast", "two-regions-two-autocasts"])
@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_shared_module(use_reentrant, sharing):
    def run(checkpointed):
        shared, other = linears(2)
        modules = [shared, other]
        opt = torch.optim.SGD(params(modules), lr=0.1)
        calls, probe, record = [0], [], []

        def twice(h):
            calls[0] += 1
            probe.append(fwd_scale(shared))
            return shared(torch.relu(shared(h)))

        def twice_two_autocasts(h):           # the scale moves between the two calls
            calls[0] += 1
            with te.autocast(recipe=RECIPE):
                probe.append(fwd_scale(shared))
                h = torch.relu(shared(h))
            with te.autocast(recipe=RECIPE):
                probe.append(fwd_scale(shared))
                return shared(h * 8.0)

        def once(h):
            calls[0] += 1
            probe.append(fwd_scale(shared))
            return torch.relu(shared(h))

        for step in range(3):
            x = (torch.randn(16, 32) * 4.0 ** step).requires_grad_()
            if sharing == "twice-in-one-region":
                with te.autocast(recipe=RECIPE):
                    y = other(maybe_checkpoint(checkpointed, use_reentrant, twice, x))
            elif sharing == "twice-in-one-region-two-autocasts":
                h = maybe_checkpoint(checkpointed, use_reentrant, twice_two_autocasts, x)
                with te.autocast(recipe=RECIPE):
                    y = other(h)
            elif sharing == "two-regions-one-autocast":
                with te.autocast(recipe=RECIPE):
                    h = maybe_checkpoint(checkpointed, use_reentrant, once, x)
                    y = maybe_checkpoint(checkpointed, use_reentrant, once, other(h))
            else:
                with te.autocast(recipe=RECIPE):
                    h = maybe_checkpoint(checkpointed, use_reentrant, once, x)
                with te.autocast(recipe=RECIPE):              # the scale moves in between
                    y = maybe_checkpoint(checkpointed, use_reentrant, once, other(h) * 8.0)
            loss = y.pow(2).mean()
            loss.backward()
            record.append(capture(loss, [x], params(modules), modules))
            opt.step()
            opt.zero_grad()
        return record, calls[0], probe

    ref, ref_calls, _ = run(False)
    got, calls, probe = run(True)
    assert calls == 2 * ref_calls
    if sharing.endswith("two-autocasts"):
        # Per step: the first call, the second (the scale moved in between), then the
        # recompute(s) of both.
        for step in range(3):
            first, second = probe[4 * step], probe[4 * step + 1]
            assert not torch.equal(first, second), f"step {step}"
    assert_runs_equal(ref, got)
    assert stash_count() == 0
