"""FP8 weight caching across micro-batches (``is_first_microbatch``, NOTE [FP8 weight
cache] in linear.py): the weight is cast once per step and reused, and a checkpoint's
recompute uses the very FP8 weights its first forward used, also when the cache was
refreshed in between; with and without checkpointing a run is bit-identical."""

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling
from transformer_engine.pytorch import quantize
from helpers import (DEVICES, REENTRANT, assert_runs_equal, capture, linears, maybe_checkpoint,
                     params)

RECIPES = [pytest.param(DelayedScaling(amax_history_len=4), id="delayed"),
           pytest.param(Float8CurrentScaling(), id="current")]


def _count_weight_casts(monkeypatch, weights):
    """Count casts whose input is one of ``weights``."""
    calls = []
    real = quantize.cast_transpose_unchecked

    def counting(x, *args, **kwargs):
        if any(x is w for w in weights):
            calls.append(1)
        return real(x, *args, **kwargs)
    monkeypatch.setattr(quantize, "cast_transpose_unchecked", counting)
    return calls


@pytest.mark.parametrize("recipe", [pytest.param(DelayedScaling(amax_history_len=8),
                                                id="delayed"),
                                   pytest.param(Float8CurrentScaling(), id="current")])
def test_weight_cast_once_per_step(recipe, monkeypatch):
    a, b = linears(2)
    calls = _count_weight_casts(monkeypatch, [a.weight, b.weight])
    for mb, first in enumerate([True, False, False, None]):
        with te.autocast(recipe=recipe):
            y = b(a(torch.randn(16, 32) * (mb + 1), is_first_microbatch=first),
                  is_first_microbatch=first)
        y.sum().backward()
    assert len(calls) == 2 + 0 + 0 + 2            # cast on True and None, reused on False
    if recipe.delayed():
        history = a.fp8_meta["scaling_fwd"].amax_history
        # the weight slot (1) saw an amax on the first and the uncached micro-batches only
        assert history[:, 1].count_nonzero() == 2


def _micro_batches(checkpointed, use_reentrant, recipe, refresh_between):
    """Four micro-batches of one step, each in its own autocast (delayed scales move
    between them), the first with is_first_microbatch=True. With ``refresh_between``,
    a first micro-batch of another step runs its forward (refreshing the cache) after
    the forwards and before the backwards."""
    a, b = linears(2)
    modules = [a, b]
    calls = [0]

    def region(h, first):
        calls[0] += 1
        with te.autocast(recipe=recipe):
            return b(torch.relu(a(h, is_first_microbatch=first)), is_first_microbatch=first)

    losses, inputs = [], []
    for mb, first in enumerate([True, False, False, False]):
        x = (torch.randn(16, 32) * 3.0 ** mb).requires_grad_()
        losses.append(maybe_checkpoint(checkpointed, use_reentrant, region, x, first)
                      .pow(2).mean())
        inputs.append(x)
    if refresh_between:
        with torch.no_grad():
            region(torch.randn(16, 32) * 50, True)      # a new cast into the cache
    record = []
    for loss in reversed(losses):
        loss.backward()
        record.append(capture(loss, inputs, params(modules), modules))
    return record, calls[0]


@pytest.mark.parametrize("refresh_between", [False, True], ids=["plain", "cache-refreshed"])
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_checkpointed_micro_batches_match(use_reentrant, recipe, refresh_between):
    ref, ref_calls = _micro_batches(False, use_reentrant, recipe, refresh_between)
    got, calls = _micro_batches(True, use_reentrant, recipe, refresh_between)
    extra = 1 if refresh_between else 0
    assert ref_calls == 4 + extra and calls == 8 + extra       # the recomputes ran
    assert_runs_equal(ref, got)


def test_bad_is_first_microbatch():
    (a,) = linears(1)
    with pytest.raises(TypeError, match="is_first_microbatch must be None, True or False, got 1"):
        a(torch.randn(16, 32), is_first_microbatch=1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_reused_weight_keeps_its_amax_history_and_scale(device, algo):
    """Three steps, ``is_first_microbatch`` True, False, None: the input's history
    rolls every step; the weight's records an amax on True and None and is left
    alone on False (no amax recorded: no roll, same scale), as TE's update does."""
    recipe = DelayedScaling(amax_history_len=4, amax_compute_algo=algo, margin=1)
    (lin,) = linears(1, device=device)
    state = lin.fp8_meta["scaling_fwd"]
    xs = [torch.randn(16, 32, device=device) * m for m in (1.0, 3.0, 0.5)]
    x_amax = [x.abs().max().item() for x in xs]
    w_amax, scales, histories = [], [], []
    for step, first in enumerate([True, False, None]):
        if step == 2:
            with torch.no_grad():
                lin.weight.mul_(2.0)             # the uncached step sees a new amax
        w_amax.append(lin.weight.abs().max().item())
        with te.autocast(recipe=recipe):
            y = lin(xs[step], is_first_microbatch=first)
        y.sum().backward()
        scales.append(state.scale.clone())
        histories.append(state.amax_history.clone())
    expect_x = torch.tensor([0.0, *x_amax], device=device)
    expect_w = torch.tensor([0.0, 0.0, w_amax[0], w_amax[2]], device=device)
    assert torch.equal(histories[-1][:, 0], expect_x)
    assert torch.equal(histories[-1][:, 1], expect_w)
    assert torch.equal(histories[1][:, 1], histories[0][:, 1])       # False: untouched
    assert not torch.equal(histories[1][:, 0], histories[0][:, 0])
    assert scales[1][1] == scales[0][1]                                # False: same scale
    fp8_max = recipe.fp8_format.value.max_fwd
    for step, col, expect in ((0, 1, w_amax[0]), (1, 0, max(x_amax[:2]) if algo == "max"
                                                   else x_amax[1]), (2, 1, w_amax[2])):
        amax = torch.tensor(expect, dtype=torch.float32)
        want = (torch.reciprocal(amax) * fp8_max) / 2
        assert scales[step][col].item() == pytest.approx(want.item(), rel=1e-6), (step, col)
