"""What a recompute leaves behind in the cases a careless change would break: an
exception inside an FP8 module's forward during the recompute, a backward run inside
an FP8 autocast, and a recompute under a calibrating autocast."""

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.pytorch import quantize
from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
from helpers import CLEAN, RECIPE, REENTRANT, global_state, linears, stash_count

SWAP_KEY = "updated_fp8_state_fwd"


class GemmFailure(Exception):
    """A failure injected into the recompute's GEMM."""


@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_exception_in_the_gemm_during_the_recompute(use_reentrant, monkeypatch):
    """The GEMM of the module's recompute raises: its live forward state (not the phase-1
    stash) is back in place, nothing is left under the swap key, the global state is
    clean, and the next step runs."""
    a, b = linears(2)
    calls = [0]

    def region(h):
        calls[0] += 1
        with te.autocast(recipe=RECIPE):
            return b(torch.relu(a(h)))

    x = torch.randn(16, 32, requires_grad=True)
    loss = te.checkpoint(region, x, use_reentrant=use_reentrant).pow(2).mean()
    live = {m: m.fp8_meta["scaling_fwd"] for m in (a, b)}
    real_gemm = quantize.fp8_gemm_unchecked
    gemms = [0]

    def failing(*args, **kwargs):
        gemms[0] += 1
        if gemms[0] == 2:           # b's forward GEMM in the recompute
            raise GemmFailure("the recompute's GEMM failed")
        return real_gemm(*args, **kwargs)

    monkeypatch.setattr(quantize, "fp8_gemm_unchecked", failing)
    with pytest.raises(GemmFailure):
        loss.backward()
    monkeypatch.setattr(quantize, "fp8_gemm_unchecked", real_gemm)
    assert calls[0] == 2
    for m in (a, b):
        assert m.fp8_meta["scaling_fwd"] is live[m]          # the live state, by identity
        assert SWAP_KEY not in m.fp8_meta
    assert global_state() == CLEAN
    del loss
    assert stash_count() == 0
    x2 = torch.randn(16, 32, requires_grad=True)
    te.checkpoint(region, x2, use_reentrant=use_reentrant).sum().backward()
    assert torch.isfinite(x2.grad).all()


@pytest.mark.parametrize("how", ["backward", "autograd.grad"])
@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_backward_inside_an_autocast_keeps_its_state(use_reentrant, how):
    """Micro-batches in one autocast, each backpropagated inside it: after each
    recompute the autocast's own state object is back in force (restored, not reset),
    so the next micro-batch still runs in FP8 in the same session."""
    if how == "autograd.grad" and use_reentrant:
        pytest.skip("the reentrant checkpoint refuses torch.autograd.grad")
    a, b = linears(2)

    def region(h):
        return b(torch.relu(a(h)))

    seen = []
    with te.autocast(recipe=RECIPE):
        state = FP8GlobalStateManager.get_fp8_autocast_state()
        for mb in range(3):
            x = (torch.randn(16, 32) * (mb + 1)).requires_grad_()
            loss = te.checkpoint(region, x, use_reentrant=use_reentrant).pow(2).mean()
            if how == "backward":
                loss.backward()
            else:
                torch.autograd.grad(loss, [x] + list(a.parameters()) + list(b.parameters()))
            seen.append(FP8GlobalStateManager.get_fp8_autocast_state() is state)
            seen.append(FP8GlobalStateManager.is_fp8_enabled())
    assert seen == [True] * 6
    assert global_state() == CLEAN


@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_calibrating_recompute_records_no_amax(use_reentrant):
    """Calibration records amaxes in a training forward; its recompute must not."""
    (layer,) = linears(1)

    def region(h):
        with te.autocast(enabled=False, calibrating=True, recipe=RECIPE):
            return layer(h)

    x = torch.randn(16, 32, requires_grad=True)
    y = te.checkpoint(region, x, use_reentrant=use_reentrant)
    state = layer.fp8_meta["scaling_fwd"]
    assert state.amax_history[-1].gt(0).all()        # phase 1 recorded; the exit rolled it
    history = state.amax_history.clone()
    y.pow(2).mean().backward()
    assert torch.equal(layer.fp8_meta["scaling_fwd"].amax_history, history)
    assert layer.fp8_meta["scaling_fwd"].amax_history[0].eq(0).all()
