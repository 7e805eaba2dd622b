"""What a recompute replays, and how misuse fails: dropout masks
(default generator and CudaRNGStatesTracker), torch.autocast dtype, repeated backward,
two checkpoint producers with reset()/load_state_dict() between steps, the missing-stash
invariant, and bad use with clean state afterwards.

Comparisons are bit for bit against the same run without checkpointing, after proving
the recompute ran. Training-loop robustness is in
test_checkpoint_robustness.py.
"""

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F

import transformer_engine.pytorch as te
from transformer_engine.pytorch import distributed, recompute
from transformer_engine.pytorch.fp8 import FP8GlobalStateManager, RecomputeStateError
from helpers import (CLEAN, DEVICES, RECIPE, REENTRANT, STASH_KEY, assert_runs_equal, capture,
                     fwd_scale, global_state, linears, maybe_checkpoint, params,
                     record_recompute_scales, stash_count, te_modules)

TRACKER_STATE = "model-parallel-rng"


# ---- randomness -------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rng", ["default-generator", "tracker-fork"])
@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_dropout_masks_are_replayed(use_reentrant, rng, device):
    """Between each forward and its backward every generator moves on (draws from the
    default generator and the tracker, and an in-place overwrite of the tracker's
    generator the checkpoint call saw), so the recompute gets the phase-1 masks only if
    it replays copies of the states saved at the call."""
    def run(checkpointed):
        a, b = linears(2, device=device)
        opt = torch.optim.SGD(params([a, b]), lr=0.1)
        tracker = te.CudaRNGStatesTracker(device=device)
        tracker.add(TRACKER_STATE, 77)
        other_state = torch.Generator(device=device).manual_seed(99).get_state()
        masks, record = [], []

        def region(h):
            with te.autocast(recipe=RECIPE):
                h = a(h)
                with tracker.fork() if rng == "tracker-fork" else contextlib.nullcontext():
                    h = F.dropout(h, p=0.5, training=True)
                masks.append(h != 0)
                return b(h)

        for step in range(3):
            x = (torch.randn(16, 32, device=device) * 4.0 ** step).requires_grad_()
            state_at_call = tracker.states_[TRACKER_STATE]
            if checkpointed:
                y = te.checkpoint(region, x, use_reentrant=use_reentrant,
                                  get_rng_state_tracker=lambda: tracker)
            else:
                y = region(x)
            torch.rand(8, device=device)
            with tracker.fork():
                torch.rand(8, device=device)
            state_at_call.set_state(other_state)
            loss = y.float().pow(2).mean()
            loss.backward()
            record.append(capture(loss, [x], params([a, b]), [a, b]))
            opt.step()
            opt.zero_grad()
        return record, masks

    ref, ref_masks = run(False)
    got, masks = run(True)
    assert len(ref_masks) == 3 and len(masks) == 6
    for step in range(3):
        first, again = masks[2 * step], masks[2 * step + 1]
        assert torch.equal(first, again), f"step {step}: the recompute drew another mask"
        assert torch.equal(first, ref_masks[step]), f"step {step}: phase 1 drew another mask"
    assert not torch.equal(masks[0], masks[2])                  # the masks are random
    assert_runs_equal(ref, got)
    assert stash_count() == 0


@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_tracker_state_saved_as_copy(use_reentrant):
    """The states a checkpoint call saves for its recompute are copies: overwriting the
    tracker's generators in place after the call does not reach the recompute."""
    (layer,) = linears(1)
    tracker = te.CudaRNGStatesTracker(device="cpu")
    tracker.add(TRACKER_STATE, 5)
    masks = []

    def region(h):
        with tracker.fork():
            h = F.dropout(h, p=0.5, training=True)
        masks.append(h != 0)
        return layer(h)

    x = torch.randn(16, 32, requires_grad=True)
    seen_at_call = tracker.states_[TRACKER_STATE]
    y = te.checkpoint(region, x, use_reentrant=use_reentrant, get_rng_state_tracker=lambda: tracker)
    seen_at_call.set_state(torch.Generator().manual_seed(1).get_state())
    for state in tracker.states_.values():
        state.set_state(torch.Generator().manual_seed(2).get_state())
    y.sum().backward()
    assert len(masks) == 2 and torch.equal(masks[0], masks[1])


# ---- torch.autocast ----------------------------------------------------------------------

@pytest.mark.parametrize("where", ["autocast-at-call", "autocast-at-backward"])
@pytest.mark.parametrize("fp8", [pytest.param(True, id="fp8"), pytest.param(False, id="hp")])
@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_torch_autocast_state_of_the_call_governs(use_reentrant, fp8, where):
    """The recompute runs under the torch.autocast state of the checkpoint call, not of
    the backward: bfloat16 when the call was inside ``torch.autocast``, float32 when only
    the backward is."""
    def run(checkpointed):
        a, b = linears(2)
        w = torch.randn(32, 32, requires_grad=True)
        dtypes = []

        def region(h):
            with te.autocast(enabled=fp8, recipe=RECIPE):
                h = a(h)
            h2 = torch.mm(h, w)
            dtypes.append((h.dtype, h2.dtype))
            with te.autocast(enabled=fp8, recipe=RECIPE):
                return b(torch.relu(h2))

        record = []
        for step in range(2):
            x = (torch.randn(16, 32) * 4.0 ** step).requires_grad_()
            at_call = where == "autocast-at-call"
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=at_call):
                y = maybe_checkpoint(checkpointed, use_reentrant, region, x)
            loss = y.float().pow(2).mean()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not at_call):
                loss.backward()
            record.append(capture(loss, [x, w], params([a, b]), [a, b]))
        return record, dtypes

    ref, ref_dtypes = run(False)
    got, dtypes = run(True)
    expect = torch.bfloat16 if where == "autocast-at-call" else torch.float32
    assert ref_dtypes == [(expect, expect)] * 2
    assert dtypes == [(expect, expect)] * 4                     # phase 1 and the recompute
    assert_runs_equal(ref, got)


# ---- repeated backward -------------------------------------------------------------------

@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_retain_graph_second_backward_finds_its_own_stash(use_reentrant, monkeypatch):
    """Calls A and B with different scales; backward A (retain_graph), B, then A again:
    A's second recompute swaps in A's stash again, never B's, and everything matches the
    same backward sequence without checkpointing."""
    def run(checkpointed):
        a, b = linears(2)
        calls, scales, record = [0], [], []

        def region(h):
            calls[0] += 1
            return b(torch.relu(a(h)))

        losses = []
        for mb in range(2):
            x = (torch.randn(16, 32) * 8.0 ** mb).requires_grad_()
            with te.autocast(recipe=RECIPE):
                scales.append((fwd_scale(a), fwd_scale(b)))
                losses.append((maybe_checkpoint(checkpointed, use_reentrant, region, x)
                               .pow(2).mean(), x))
        for mb, retain in ((0, True), (1, False), (0, False)):
            losses[mb][0].backward(retain_graph=retain)
            record.append(capture(losses[mb][0], [x for _, x in losses], params([a, b]),
                                  [a, b]))
        return record, calls[0], scales, (a, b)

    ref, ref_calls, _, _ = run(False)
    used = record_recompute_scales(monkeypatch)
    got, calls, scales, (a, b) = run(True)
    assert ref_calls == 2 and calls == 5                         # A recomputed twice
    assert not torch.equal(scales[0][0], scales[1][0])
    expect = {mb: [(id(a.fp8_meta), tuple(scales[mb][0].tolist())),
                   (id(b.fp8_meta), tuple(scales[mb][1].tolist()))] for mb in (0, 1)}
    assert used == expect[0] + expect[1] + expect[0]
    assert_runs_equal(ref, got)


@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_second_backward_without_retain_graph_fails_clearly(use_reentrant):
    (layer,) = linears(1)

    def region(h):
        with te.autocast(recipe=RECIPE):
            return layer(h)

    x = torch.randn(16, 32, requires_grad=True)
    loss = te.checkpoint(region, x, use_reentrant=use_reentrant).pow(2).mean()
    loss.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()
    assert global_state() == CLEAN and "updated_fp8_state_fwd" not in layer.fp8_meta
    del loss
    assert stash_count() == 0


# ---- two producers, reset() and load_state_dict() between steps ---------------------------

class InnerCheckpointed(torch.nn.Module):
    """A second producer of recompute state: two te.Linear layers that checkpoint
    themselves (reentrant) whenever ``checkpoint`` is set and grad is enabled."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = linears(2, seed=3)
        self.checkpoint = True
        self.body_calls = 0

    def _body(self, h):
        self.body_calls += 1
        return self.fc2(torch.relu(self.fc1(h)))

    def forward(self, h):
        if self.checkpoint and torch.is_grad_enabled():
            return te.checkpoint(self._body, h, use_reentrant=True)
        return self._body(h)


def _layernorm_mlp():
    mlp = te.LayerNormMLP(32, 64, checkpoint=True, device="cpu")
    real = mlp._mlp        # FC1 -> activation -> FC2, checkpointed or not

    def counted(*args, **kwargs):
        mlp.body_calls += 1
        return real(*args, **kwargs)

    mlp.body_calls = 0
    mlp._mlp = counted
    return mlp


PRODUCERS = [pytest.param(_layernorm_mlp, id="LayerNormMLP"),
             pytest.param(InnerCheckpointed, id="inner-checkpointed-linears")]


def _load_fp8_state_only(model, state_dict):
    """Load only the FP8 extra state of ``state_dict`` (parameters untouched, so a
    pending graph's saved parameters stay valid)."""
    fp8_only = {k: v for k, v in state_dict.items() if k.endswith("_extra_state")}
    assert fp8_only
    result = model.load_state_dict(fp8_only, strict=False)
    assert not result.unexpected_keys


@pytest.mark.parametrize("producer", PRODUCERS)
@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_two_producers_survive_reset_and_load_state_dict(use_reentrant, producer):
    """A module that checkpoints internally, inside a te.checkpoint region. Between
    steps: FP8GlobalStateManager.reset() and a load_state_dict() of an earlier state;
    and once between a forward and its backward (reset, and the FP8 state of step 0
    loaded with the current weights) while the pending graph holds recompute state."""
    def run(checkpointed):
        torch.manual_seed(0)
        (pre,) = linears(1, seed=1)
        inner = producer()
        inner.checkpoint = checkpointed
        model = torch.nn.ModuleList([pre, inner])
        modules = te_modules(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        record, step0 = [], None

        def region(h):
            with te.autocast(recipe=RECIPE):
                return inner(h)

        for step in range(4):
            x = (torch.randn(16, 32) * 4.0 ** step).requires_grad_()
            with te.autocast(recipe=RECIPE):
                h = pre(x)
            y = maybe_checkpoint(checkpointed, use_reentrant, region, h)
            loss = y.pow(2).mean()
            if step == 2:
                FP8GlobalStateManager.reset()
                _load_fp8_state_only(model, step0)
            loss.backward()
            record.append(capture(loss, [x], model.parameters(), modules))
            opt.step()
            opt.zero_grad()
            if step == 0:
                step0 = copy.deepcopy(model.state_dict())
            if step == 1:
                FP8GlobalStateManager.reset()
                model.load_state_dict(step0)
            loss = y = None
        return record, inner.body_calls, modules

    ref, ref_calls, _ = run(False)
    got, calls, modules = run(True)
    assert ref_calls == 4
    assert calls == 3 * 4       # phase 1, the outer recompute, the inner recompute
    assert all(STASH_KEY in m.fp8_meta for m in modules[1:])
    assert_runs_equal(ref, got)
    assert stash_count() == 0


# ---- the missing-stash invariant ------------------------------------------------------

@pytest.mark.parametrize("violation", ["fp8-only-in-recompute", "extra-call-in-recompute"])
@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_recompute_without_stash_raises(use_reentrant, violation):
    """A function that branches on the recompute phase (forbidden) makes a recompute run
    an FP8 forward phase 1 never stashed: a RecomputeStateError saying so, and the live
    scales are neither used nor left swapped out."""
    (layer,) = linears(1)

    def fn(h):
        recomputing = distributed.in_fp8_activation_recompute_phase()
        if violation == "fp8-only-in-recompute":
            with te.autocast(enabled=recomputing, recipe=RECIPE):
                return layer(h)
        with te.autocast(recipe=RECIPE):
            h = layer(h)
            return layer(h) if recomputing else h

    x = torch.randn(16, 32, requires_grad=True)
    loss = te.checkpoint(fn, x, use_reentrant=use_reentrant).pow(2).mean()
    live = layer.fp8_meta["scaling_fwd"]
    call = 1 if violation == "fp8-only-in-recompute" else 2
    stashed = 0 if violation == "fp8-only-in-recompute" else 1
    with pytest.raises(RecomputeStateError,
                       match=rf"recompute ran a delayed-scaling FP8 forward \(call #{call} of "
                             rf"this module in the region\) for which the first forward stashed "
                             rf"no FP8 state \({stashed} stash\(es\) recorded\)"):
        loss.backward()
    assert global_state() == CLEAN
    assert layer.fp8_meta["scaling_fwd"] is live and "updated_fp8_state_fwd" not in layer.fp8_meta
    del loss
    assert stash_count() == 0


# ---- bad use ------------------------------------------------------------------------------

NO_GRAD_OUTPUT = "no output of the checkpointed function requires grad"


@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_no_output_requiring_grad(use_reentrant):
    """Non-reentrant raises at the call, reentrant at backward; both leave clean state."""
    (layer,) = linears(1)

    def fn(h):
        with te.autocast(recipe=RECIPE):
            return layer(h).detach()

    x = torch.randn(16, 32, requires_grad=True)
    if use_reentrant:
        y = te.checkpoint(fn, x, use_reentrant=True)
        assert global_state() == CLEAN
        with pytest.raises(RuntimeError, match=NO_GRAD_OUTPUT):
            y.sum().backward()
        del y
    else:
        with pytest.raises(RuntimeError, match=NO_GRAD_OUTPUT):
            te.checkpoint(fn, x, use_reentrant=False)
    assert global_state() == CLEAN and "updated_fp8_state_fwd" not in layer.fp8_meta
    assert stash_count() == 0


@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_autograd_grad(use_reentrant):
    """Reentrant: a clear RuntimeError under torch.autograd.grad, clean state after.
    Non-reentrant: works, and matches the un-checkpointed gradients bit for bit."""
    def run(checkpointed):
        a, b = linears(2)

        def fn(h):
            with te.autocast(recipe=RECIPE):
                return b(torch.relu(a(h)))

        x = torch.randn(16, 32, requires_grad=True)
        loss = maybe_checkpoint(checkpointed, use_reentrant, fn, x).pow(2).mean()
        return torch.autograd.grad(loss, [x, a.weight, b.weight])

    ref = run(False)
    if use_reentrant:
        with pytest.raises(RuntimeError, match=r"use_reentrant=True\) does not work with "
                                               r"torch.autograd.grad\(\)"):
            run(True)
    else:
        got = run(True)
        assert all(torch.equal(r, g) for r, g in zip(ref, got))
    assert global_state() == CLEAN
    assert stash_count() == 0


@pytest.mark.parametrize("use_reentrant, error, message", [
    pytest.param(True, RuntimeError, "needs an initialized torch.distributed process group",
                 id="reentrant"),
])
def test_distribute_saved_activations_without_process_group(use_reentrant, error, message):
    assert not (torch.distributed.is_available() and torch.distributed.is_initialized())
    (layer,) = linears(1)
    calls = []

    def fn(h):
        calls.append(1)
        with te.autocast(recipe=RECIPE):
            return layer(h)

    x = torch.randn(16, 32, requires_grad=True)
    with pytest.raises(error, match=message):
        te.checkpoint(fn, x, use_reentrant=use_reentrant, distribute_saved_activations=True)
    assert calls == [] and global_state() == CLEAN and stash_count() == 0


class Opaque:
    """A non-tensor argument; compared by identity."""


@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_non_tensor_arguments_pass_through(use_reentrant):
    """Non-tensor positional and keyword arguments reach both phases as the very objects
    given; a tensor keyword argument gets its gradient."""
    config, items, opaque = {"act": "relu"}, [1, 2], Opaque()

    def run(checkpointed):
        (layer,) = linears(1)
        seen = []

        def fn(h, n, label, cfg, nothing, *, scale, opaque, bias, items):
            seen.append((n, label, cfg, nothing, scale, opaque, items))
            with te.autocast(recipe=RECIPE):
                return torch.relu(layer(h * scale)) + bias * n

        x = torch.randn(16, 32, requires_grad=True)
        bias = torch.randn(32, requires_grad=True)
        y = maybe_checkpoint(checkpointed, use_reentrant, fn, x, 3, "tag", config, None,
                             scale=0.5, opaque=opaque, bias=bias, items=items)
        y.pow(2).mean().backward()
        return [x.grad, bias.grad, layer.weight.grad], seen

    ref, _ = run(False)
    got, seen = run(True)
    assert len(seen) == 2
    for n, label, cfg, nothing, scale, opq, its in seen:
        assert (n, label, nothing, scale) == (3, "tag", None, 0.5)
        assert cfg is config and opq is opaque and its is items
    assert all(torch.equal(r, g) for r, g in zip(ref, got))


# ---- the stash is copied on write ------------------------------------------------------

@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_stash_is_copied_once_by_the_update_not_by_the_forward(use_reentrant, monkeypatch):
    """Phase 1 copies no FP8 state: each stash reads its module's live state until the
    update at the autocast exit, which first copies every such state in two
    concatenations; the recompute then casts with the phase-1 scales while the live
    scales have moved."""
    layers = linears(3)
    for layer in layers:                    # scales that the update will change
        layer.fp8_meta["scaling_fwd"].amax_history.fill_(2.0)
    clones = []
    real_clone = torch.Tensor.clone
    monkeypatch.setattr(torch.Tensor, "clone", lambda t, *a, **k: clones.append(1) or
                        real_clone(t, *a, **k))
    x = torch.randn(16, 32, requires_grad=True)
    before = [fwd_scale(layer) for layer in layers]
    live_states = [layer.fp8_meta["scaling_fwd"] for layer in layers]

    def fn(h):
        for layer in layers:
            h = layer(h)
        return h

    clones.clear()
    with te.autocast(recipe=RECIPE):
        y = te.checkpoint(fn, x, use_reentrant=use_reentrant)
        clones_in_phase1 = len(clones)
        frames = recompute.live_frames()
        entries = [e for f in frames for es in f.stashes.values() for e in es]
        assert len(entries) == 3
        assert all(e.scaling_fwd is s for e, s in zip(entries, live_states))   # no copy yet
    copies = [e.scaling_fwd for e in entries]
    assert all(c is not s for c, s in zip(copies, live_states))
    # two concatenations hold all three copies: scales with scale_invs, and histories
    assert len({t.untyped_storage().data_ptr() for c in copies
                for t in (c.scale, c.scale_inv)}) == 1
    assert len({c.amax_history.untyped_storage().data_ptr() for c in copies}) == 1
    for copy_, live in zip(copies, live_states):
        assert copy_.amax_history.shape == live.amax_history.shape
    for copy_, scale, layer in zip(copies, before, layers):
        assert torch.equal(copy_.scale, scale)                       # the phase-1 scale
        assert not torch.equal(fwd_scale(layer), scale)              # the live one moved
    assert clones_in_phase1 == 0
    used = record_recompute_scales(monkeypatch)
    y.sum().backward()
    assert [u[1] for u in used] == [tuple(s.tolist()) for s in before]
    del frames, entries, copies, y
    assert stash_count() == 0
