"""The backward delayed-scaling update runs once per backward pass for every autocast
session whose FP8 modules ran a backward, whichever modules those were: a frozen or
unused first layer does not stop it, and micro-batches backpropagated in one pass
update each shared module once."""

import pytest
import torch

import transformer_engine.pytorch as te
from helpers import RECIPE, REENTRANT, linears, maybe_checkpoint, params


def _bwd(m):
    return m.fp8_meta["scaling_bwd"]


@pytest.mark.parametrize("first", ["frozen", "unused"])
def test_backward_scales_update_without_the_first_module(first):
    """Gradients scaled by 1e-6 flush to zero in E5M2 at scale 1; once the backward
    scales update they do not. With the first FP8 module frozen (no backward runs for
    it) or its output unused, the head's weight gradient must become non-zero and
    close to the float64 one."""
    frozen, body, head = linears(3)
    if first == "frozen":
        for p in frozen.parameters():
            p.requires_grad_(False)
    grads = []
    for step in range(3):
        x = torch.randn(16, 32)
        with te.autocast(recipe=RECIPE):
            h = frozen(x)
            if first == "unused":
                h = x.clone()
            y = head(torch.relu(body(h)))
        (y.double().pow(2).mean() * 1e-6).backward()
        grads.append(head.weight.grad.clone())
        # float64 reference of the head's weight gradient for this step
        with torch.no_grad():
            h64 = x.double() if first == "unused" else torch.nn.functional.linear(
                x.double(), frozen.weight.double(), frozen.bias.double())
            a64 = torch.relu(torch.nn.functional.linear(h64, body.weight.double(),
                                                        body.bias.double()))
            y64 = torch.nn.functional.linear(a64, head.weight.double(), head.bias.double())
            dy64 = 2 * y64 / y64.numel() * 1e-6
            ref = dy64.t() @ a64
        if step > 0:
            # E4M3 operands, E5M2 gradients cast with the previous step's scale (values
            # above it saturate): off by up to ~15% in norm; flushed to zero it is 100%.
            rel = (grads[-1].double() - ref).norm() / ref.norm()
            assert rel < 0.25, f"step {step}: head weight gradient off by {rel:.3g}"
        for p in params([body, head]):
            p.grad = None
    assert torch.equal(grads[0], torch.zeros_like(grads[0]))   # scale 1: flushed to zero
    assert grads[1].abs().sum() > 0
    assert _bwd(head).scale.gt(1e3).all() and _bwd(body).scale.gt(1e3).all()
    if first == "frozen":                                       # it never ran a backward
        assert _bwd(frozen).amax_history.eq(0).all()


def test_micro_batches_in_one_pass_update_each_module_once():
    """Two micro-batches, each in its own autocast (two sessions holding the same
    modules), backpropagated by one ``sum(losses).backward()``: one update, so the
    history holds one completed row (the max of both micro-batches) and the live row."""
    a, b = linears(2)
    losses = []
    for mb in range(2):
        with te.autocast(recipe=RECIPE):
            losses.append(b(torch.relu(a(torch.randn(16, 32) * (mb + 1)))).pow(2).mean())
    seen = []
    losses[1].register_hook(lambda g: seen.append(_bwd(b).amax_history[0].clone()))
    sum(losses).backward()
    hist = _bwd(b).amax_history
    assert hist[0].eq(0).all()                       # live row zeroed by the one roll
    assert hist[-1].gt(0).all() and hist[1:-1].eq(0).all()
    assert _bwd(b).scale.ne(1).all()


def test_separate_passes_update_once_each():
    a, b = linears(2)
    for mb in range(2):
        with te.autocast(recipe=RECIPE):
            loss = b(torch.relu(a(torch.randn(16, 32) * (mb + 1)))).pow(2).mean()
        loss.backward()
    hist = _bwd(b).amax_history
    assert hist[0].eq(0).all() and hist[-2:].gt(0).all() and hist[1:-2].eq(0).all()


def test_one_forward_backpropagated_twice_updates_once_per_pass():
    """``backward(retain_graph=True)`` then ``backward()`` on one forward: two passes of
    one session, so two updates (each pass asks for the session's update again, though
    every module of the second pass asks for the session the first pass already had)."""
    a, b = linears(2)
    with te.autocast(recipe=RECIPE):
        loss = b(torch.relu(a(torch.randn(16, 32)))).pow(2).mean()
    loss.backward(retain_graph=True)
    loss.backward()
    for m in (a, b):
        hist = _bwd(m).amax_history
        assert hist[0].eq(0).all() and hist[-2:].gt(0).all() and hist[1:-2].eq(0).all()


@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_update_waits_for_the_end_of_the_enclosing_pass(use_reentrant):
    """A module before a checkpointed region runs its backward after the region's: it
    must still cast its gradient with the scale in force before this pass's update, as
    without checkpointing (the reentrant recompute's backward is a nested pass)."""
    def run(checkpointed):
        pre, a, b = linears(3)
        seen = []

        def region(h):
            with te.autocast(recipe=RECIPE):
                return b(torch.relu(a(h)))

        for step in range(2):
            x = (torch.randn(16, 32) * 3.0 ** step).requires_grad_()
            with te.autocast(recipe=RECIPE):        # one session: pre, a and b
                h = pre(x)
                h.register_hook(lambda g: seen.append(_bwd(pre).scale.clone()))
                y = maybe_checkpoint(checkpointed, use_reentrant, region, h)
            y.pow(2).mean().backward()
        return seen, [_bwd(m).scale.clone() for m in (pre, a, b)]

    ref_seen, ref_scales = run(False)
    seen, scales = run(True)
    assert len(seen) == 2 and all(torch.equal(u, v) for u, v in zip(ref_seen, seen))
    assert all(torch.equal(u, v) for u, v in zip(ref_scales, scales))
    assert not torch.equal(ref_seen[0], ref_scales[0])      # it did update, after the pass
