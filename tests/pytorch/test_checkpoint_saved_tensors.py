"""What a checkpoint keeps between its two phases, and how the non-reentrant one hands
recomputed tensors to backward: phase 1 keeps no activation (also those of a nested
checkpoint's arguments), an argument changed in place before backward is caught,
a recompute that saves different tensors is refused, and a partial
``torch.autograd.grad`` followed by a full backward still matches bit for bit.
"""

import weakref

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.pytorch import distributed, quantize
from transformer_engine.pytorch.fp8 import RecomputeStateError
from helpers import (CLEAN, RECIPE, REENTRANT, assert_runs_equal, capture, global_state, linears,
                     maybe_checkpoint, params, stash_count)


class _Tracked:
    """Weak references to the activations a forward makes: the intermediate results of
    the function and, in FP8, the transposed copies that the FP8 linears save for
    backward (their other FP8 copies die after the forward GEMM anyway)."""

    def __init__(self, monkeypatch):
        self.refs = []
        real = quantize.cast_transpose_unchecked

        def cast_transpose(*args, **kwargs):
            out = real(*args, **kwargs)
            if not distributed.in_fp8_activation_recompute_phase():
                transposed = out[1]
                if transposed is not None:
                    self.refs.append(weakref.ref(transposed.data))
            return out
        monkeypatch.setattr(quantize, "cast_transpose_unchecked", cast_transpose)

    def track(self, tensor):
        self.refs.append(weakref.ref(tensor))
        return tensor

    def alive(self):
        return sum(ref() is not None for ref in self.refs)


@pytest.mark.parametrize("nested", [False, True], ids=["flat", "nested"])
@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "fp32"])
@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_phase1_keeps_no_activation(use_reentrant, fp8, nested, monkeypatch):
    """After phase 1 returns, none of the region's activations is alive (the same forward
    without checkpointing keeps them, so the check can fail); with a nested checkpoint,
    the outer one drops the inner one's argument too. Backward then matches the
    un-checkpointed run bit for bit."""
    def run(checkpointed):
        a, b, c = linears(3)
        tracked = _Tracked(monkeypatch)

        # Tracked: tensors that a later op saves as its input (sin does), so that autograd
        # keeps the very tensor objects alive when nothing drops them.
        def inner(h):
            return c(torch.sin(tracked.track(b(torch.sin(h)))))

        def region(h):
            with te.autocast(enabled=fp8, recipe=RECIPE):
                h = tracked.track(torch.sin(tracked.track(a(h))))   # nested: inner's argument
                if nested:
                    return maybe_checkpoint(checkpointed, use_reentrant, inner, h)
                return inner(h)

        x = torch.randn(16, 32, requires_grad=True)
        out = maybe_checkpoint(checkpointed, use_reentrant, region, x)
        alive, made = tracked.alive(), len(tracked.refs)
        loss = out.pow(2).mean()
        loss.backward()
        return alive, made, capture(loss, [x], params([a, b, c]), [a, b, c])

    ref_alive, ref_made, ref = run(False)
    alive, made, got = run(True)
    # without checkpointing all are kept: 3 intermediates, x^T and W^T of 3 FP8 linears
    assert ref_alive == ref_made == (9 if fp8 else 3)
    assert made >= 3 and alive == 0
    assert_runs_equal([ref], [got])
    assert global_state() == CLEAN and stash_count() == 0


@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_argument_modified_in_place_before_backward(use_reentrant):
    """The recompute needs the arguments as phase 1 saw them: changing one in place
    before backward raises autograd's in-place error, and the state stays clean."""
    (layer,) = linears(1)

    def fn(h):
        with te.autocast(recipe=RECIPE):
            return layer(h)

    h = torch.randn(16, 32, requires_grad=True) * 1.0
    loss = te.checkpoint(fn, h, use_reentrant=use_reentrant).pow(2).mean()
    with torch.no_grad():
        h.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    assert global_state() == CLEAN
    del loss
    assert stash_count() == 0


def test_recompute_saving_other_tensors_is_refused():
    """Non-reentrant: a recompute that saves a different number of tensors than phase 1
    (a function branching on the recompute phase) raises, with clean state after."""
    (layer,) = linears(1)

    def fn(h):
        with te.autocast(recipe=RECIPE):
            h = layer(h)
        return h * h if distributed.in_fp8_activation_recompute_phase() else h + 1.0

    x = torch.randn(16, 32, requires_grad=True)
    loss = te.checkpoint(fn, x, use_reentrant=False).pow(2).mean()
    with pytest.raises(RecomputeStateError, match=r"the recompute saved \d+ tensor\(s\) for "
                                                  r"backward where the first forward saved \d+"):
        loss.backward()
    assert global_state() == CLEAN
    del loss
    assert stash_count() == 0


def test_partial_autograd_grad_then_backward():
    """Non-reentrant: ``torch.autograd.grad`` for the input only (retaining the graph),
    then a full backward: both recompute, and the results match the same two calls
    without checkpointing bit for bit."""
    def run(checkpointed):
        a, b = linears(2)
        calls = [0]

        def fn(h):
            calls[0] += 1
            with te.autocast(recipe=RECIPE):
                return b(torch.relu(a(h)))

        x = torch.randn(16, 32, requires_grad=True)
        loss = maybe_checkpoint(checkpointed, False, fn, x).pow(2).mean()
        dx, = torch.autograd.grad(loss, [x], retain_graph=True)
        loss.backward()
        return calls[0], dx, capture(loss, [x], params([a, b]), [a, b])

    ref_calls, ref_dx, ref = run(False)
    calls, dx, got = run(True)
    assert (ref_calls, calls) == (1, 3)
    assert torch.equal(ref_dx, dx)
    assert_runs_equal([ref], [got])
    assert global_state() == CLEAN and stash_count() == 0
