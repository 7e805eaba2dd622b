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
