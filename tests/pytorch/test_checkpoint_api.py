"""te.checkpoint takes TE's spellings: the deprecated positional form,
``determinism_check`` and ``debug`` (consumed, never passed to the function), and
``distribute_saved_activations`` with the non-reentrant mode (warned about, ignored)."""

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.pytorch.recompute import RecomputeStateError


def _layer():
    torch.manual_seed(0)
    return te.Linear(32, 32, device="cpu")


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_deprecated_positional_form(use_reentrant):
    layer = _layer()
    seen = []

    def fn(x, scale):
        seen.append(scale)
        return layer(x) * scale

    x = torch.randn(16, 32, requires_grad=True)
    with pytest.warns(DeprecationWarning, match="is deprecated; pass these as keyword"):
        y = te.checkpoint(fn, False, None, None, x, 2.0, use_reentrant=use_reentrant)
    y.sum().backward()
    assert seen == [2.0, 2.0]                         # the function got only its own args
    x2 = x.detach().clone().requires_grad_()
    (layer(x2) * 2.0).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=0, atol=0)


def test_a_bool_first_argument_alone_is_not_the_legacy_form():
    layer = _layer()

    def fn(flag, x, y):
        return layer(x) if flag else layer(y)

    x, y = torch.randn(16, 32, requires_grad=True), torch.randn(16, 32)
    out = te.checkpoint(fn, True, x, y, use_reentrant=False)   # x is no tracker, y no group
    out.sum().backward()
    assert x.grad is not None


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_determinism_check_and_debug_are_taken_by_checkpoint(use_reentrant):
    layer = _layer()
    got = {}

    def fn(x, **kwargs):
        got.update(kwargs)
        return layer(x)

    x = torch.randn(16, 32, requires_grad=True)
    te.checkpoint(fn, x, use_reentrant=use_reentrant, determinism_check="none",
                  debug=False).sum().backward()
    assert got == {}
    with pytest.raises(NotImplementedError, match="debug=True"):
        te.checkpoint(fn, x, use_reentrant=use_reentrant, debug=True)
    with pytest.raises(ValueError, match="determinism_check must be 'default' or 'none'"):
        te.checkpoint(fn, x, use_reentrant=use_reentrant, determinism_check="strict")


def test_determinism_check_compares_saved_tensor_metadata():
    """A recompute that saves tensors of another shape: 'default' refuses with the
    tensor named; 'none' skips the check, and the mismatched tensors reach torch's own
    backward (the count still matches here)."""
    calls = [0]
    w = torch.randn(32, 32, requires_grad=True)

    def fn(x):
        calls[0] += 1
        n = 16 if calls[0] % 2 == 1 else 8             # phase 1 vs recompute
        return torch.mm(x[:n], w).sum() + x.sum() * 0

    x = torch.randn(16, 32, requires_grad=True)
    y = te.checkpoint(fn, x, use_reentrant=False)
    with pytest.raises(RecomputeStateError, match=r"saved tensor #\d+ of the recompute is"):
        y.backward()
    calls[0] = 0
    y = te.checkpoint(fn, x, use_reentrant=False, determinism_check="none")
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied") as caught:
        y.backward()
    assert not isinstance(caught.value, RecomputeStateError) and calls[0] == 2


def test_distribute_saved_activations_with_non_reentrant_warns_and_is_ignored():
    layer = _layer()
    x = torch.randn(16, 32, requires_grad=True)
    with pytest.warns(UserWarning, match="distribute_saved_activations=True is ignored with "
                                         "use_reentrant=False"):
        y = te.checkpoint(layer, x, use_reentrant=False, distribute_saved_activations=True)
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(16, 32) @ layer.weight.detach())


class ClientCheckpoint(torch.autograd.Function):
    """A client's own checkpoint (as Megatron Core's CheckpointFunction does): phase 1
    under no_grad inside activation_recompute_forward(True, False), the recompute
    inside activation_recompute_forward(True, True) with the call's FP8 autocast."""

    @staticmethod
    def forward(ctx, run, recipe, *args):
        ctx.run, ctx.recipe = run, recipe
        with torch.no_grad(), te.distributed.activation_recompute_forward(True, False):
            out = run(*args)
        ctx.save_for_backward(*args)
        return out

    @staticmethod
    def backward(ctx, grad):
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        with torch.enable_grad(), te.distributed.activation_recompute_forward(True, True), \
                te.fp8_autocast(fp8_recipe=ctx.recipe):
            out = ctx.run(*inputs)
        torch.autograd.backward(out, grad)
        return (None, None, *(t.grad for t in inputs))


def test_activation_recompute_forward_for_a_client_checkpoint():
    """Two layers checkpointed by a client's own Function in one FP8 autocast: the
    recompute swaps in each first forward's scales (they moved in between), and the
    run matches the same run without checkpointing bit for bit."""
    from transformer_engine.common.recipe import DelayedScaling
    recipe = DelayedScaling(amax_history_len=4)

    seen = []

    def run(checkpointed):
        torch.manual_seed(0)
        a, b = te.Linear(32, 32, device="cpu"), te.Linear(32, 32, device="cpu")
        opt = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.5)

        def layer(m):
            def fn(h):      # what the recompute machinery says, and the scale in force
                seen.append((te.distributed.is_fp8_activation_recompute_enabled(),
                             te.distributed.in_fp8_activation_recompute_phase()))
                return m(h)
            return fn
        record = []
        for step in range(3):
            x = (torch.randn(16, 32) * 4.0 ** step).requires_grad_()
            with te.fp8_autocast(fp8_recipe=recipe):
                h = ClientCheckpoint.apply(layer(a), recipe, x) if checkpointed else a(x)
                y = ClientCheckpoint.apply(layer(b), recipe, torch.relu(h)) if checkpointed \
                    else b(torch.relu(h))
            loss = y.pow(2).mean()
            loss.backward()
            record.append((loss.detach(), x.grad.clone(), a.weight.grad.clone(),
                           b.weight.grad.clone(), a.fp8_meta["scaling_fwd"].scale.clone(),
                           b.fp8_meta["scaling_bwd"].scale.clone()))
            opt.step()
            opt.zero_grad()
        return record

    ref, got = run(False), run(True)
    # per step: two first forwards in a region, then two recomputes in the phase
    assert seen == [(True, False), (True, False), (True, True), (True, True)] * 3
    for step, (r, g) in enumerate(zip(ref, got)):
        assert all(torch.equal(u, v) for u, v in zip(r, g)), f"step {step}"
    assert not torch.equal(ref[0][4], ref[1][4])          # the scales moved between steps
    assert te.distributed.recompute_stash_count() == 0


def test_recompute_phase_without_a_first_forward_is_refused():
    with pytest.raises(RecomputeStateError, match="no first forward to pair with"):
        with te.distributed.activation_recompute_forward(True, True):
            raise AssertionError("must not be reached")
