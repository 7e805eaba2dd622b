"""te.ops under te.checkpoint: a Sequential of operations trained with and without
checkpointing gives bit-identical losses, gradients and FP8 state, reentrant and
non-reentrant, with the FP8 autocast outside or inside the checkpointed function."""

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import (DelayedScaling, Float8BlockScaling,
                                              Float8CurrentScaling)
from transformer_engine.pytorch import ops
from transformer_engine.pytorch.ops.fused import LinearChain

from helpers import DEVICES, REENTRANT, assert_runs_equal, capture, te_modules

RECIPES = [pytest.param(DelayedScaling(amax_history_len=4), id="delayed"),
           pytest.param(Float8CurrentScaling(), id="current"),
           pytest.param(Float8BlockScaling(), id="block")]
HIDDEN = 32


def _model(device):
    torch.manual_seed(0)
    return ops.Sequential(ops.MakeExtraOutput(), ops.RMSNorm(HIDDEN, device=device),
                          ops.Linear(HIDDEN, 2 * HIDDEN, device=device), ops.SwiGLU(),
                          ops.Linear(HIDDEN, HIDDEN, device=device),
                          ops.Quantize(forward=False, backward=True), ops.AddExtraInput())


def _train(device, recipe, checkpointed, use_reentrant, autocast_inside, steps=3):
    model = _model(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def block(x, r):
        y, fork = model(x, r)
        return y * fork.sum(-1, keepdim=True).tanh()

    def fn(x, r):
        if autocast_inside:
            with te.autocast(recipe=recipe):
                return block(x, r)
        return block(x, r)

    record = []
    for step in range(steps):
        g = torch.Generator(device=device).manual_seed(10 + step)
        x = (torch.randn(16, HIDDEN, device=device, generator=g) * (step + 1)).requires_grad_()
        r = torch.randn(16, HIDDEN, device=device, generator=g)
        with te.autocast(enabled=not autocast_inside, recipe=recipe):
            if checkpointed:
                y = te.checkpoint(fn, x, r, use_reentrant=use_reentrant)
            else:
                y = fn(x, r)
        loss = y.float().square().mean()
        loss.backward()
        record.append(capture(loss, [x], list(model.parameters()), te_modules(model)))
        opt.step()
        opt.zero_grad()
    return record


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("use_reentrant", REENTRANT)
@pytest.mark.parametrize("autocast_inside", [False, True], ids=["autocast-outside",
                                                                  "autocast-inside"])
def test_checkpointed_ops_equal_plain_ops(monkeypatch, device, recipe, use_reentrant,
                                          autocast_inside):
    calls = []
    original = LinearChain.native_forward

    def counted(self, *args):
        calls.append(self)
        return original(self, *args)

    monkeypatch.setattr(LinearChain, "native_forward", counted)
    ref = _train(device, recipe, False, use_reentrant, autocast_inside)
    plain_calls = len(calls)
    got = _train(device, recipe, True, use_reentrant, autocast_inside)
    assert len(calls) - plain_calls == 2 * plain_calls     # the recompute ran
    assert_runs_equal(ref, got, "te.ops under te.checkpoint")
