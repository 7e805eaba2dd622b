"""A NaN or infinite amax never enters the amax history: that step keeps its scales,
the event is counted (and warned about once), and the next finite step updates as
usual, for forward and backward tensors, delayed and current scaling."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling
from transformer_engine.pytorch import delayed_scaling
from transformer_engine.pytorch.non_finite import CUDA_CHECK_EVERY
from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
from helpers import cuda_fp8

RECIPE = DelayedScaling(amax_history_len=16)
E4M3_MAX = 448.0


@pytest.fixture(autouse=True)
def fresh_counter():
    FP8GlobalStateManager.reset_non_finite_amax_count()
    yield
    FP8GlobalStateManager.reset_non_finite_amax_count()


def _step(m, x, recipe=RECIPE):
    with te.autocast(recipe=recipe):
        y = m(x)
    y.float().pow(2).mean().backward()
    return y


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_one_bad_input_does_not_freeze_the_scale(bad):
    """Without the fix, a NaN amax stays in the history for amax_history_len steps and
    keeps the input scale from following a x100 growth (relative error 0.97)."""
    torch.manual_seed(0)
    m = te.Linear(32, 32, device="cpu")
    _step(m, torch.randn(16, 32))
    state = m.fp8_meta["scaling_fwd"]
    scale_before = state.scale.clone()
    x_bad = torch.randn(16, 32)
    x_bad[3, 5] = bad
    with pytest.warns(RuntimeWarning, match="a NaN or infinite amax was seen"):
        _step(m, x_bad)
    assert torch.equal(state.scale[0], scale_before[0])            # the input's scale kept
    assert torch.isfinite(state.amax_history).all()                 # never entered
    assert FP8GlobalStateManager.get_non_finite_amax_count() >= 1
    # the input grows x100; after one finite step the scale has followed it
    for _ in range(2):
        x = torch.randn(16, 32) * 100
        _step(m, x)
    x = torch.randn(16, 32) * 100
    with torch.no_grad(), te.autocast(recipe=RECIPE):
        y = m(x)
    ref = F.linear(x.double(), m.weight.double(), m.bias.double())
    rel = (y.double() - ref).norm() / ref.norm()
    assert rel < 0.1, f"relative output error {rel:.3f}"
    expected = E4M3_MAX / state.amax_history[:, 0].max()
    assert torch.equal(state.scale[0], expected)


def test_count_and_warning_once():
    m = te.Linear(32, 32, device="cpu")
    x = torch.randn(16, 32)
    x[0, 0] = float("nan")
    with pytest.warns(RuntimeWarning):
        _step(m, x)
    first = FP8GlobalStateManager.get_non_finite_amax_count()
    with warnings.catch_warnings():
        warnings.simplefilter("error")                                # no second warning
        _step(m, x)
    assert FP8GlobalStateManager.get_non_finite_amax_count() > first
    FP8GlobalStateManager.reset_non_finite_amax_count()
    assert FP8GlobalStateManager.get_non_finite_amax_count() == 0


@cuda_fp8
def test_cuda_warning_comes_within_two_check_periods():
    """On CUDA the counter reaches the host by a copy made at every CUDA_CHECK_EVERY-th
    update: finite steps never warn, and a NaN input warns within two such periods of
    forward updates, without waiting for the GPU."""
    torch.manual_seed(2)
    m = te.Linear(32, 32, device="cuda")
    x = torch.randn(16, 32, device="cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2 * CUDA_CHECK_EVERY + 2):
            _step(m, x)
            torch.cuda.synchronize()
        assert not caught, [str(w.message) for w in caught]
        bad = x.clone()
        bad[0, 0] = float("nan")
        _step(m, bad)
        steps = 0
        while not caught and steps < 2 * CUDA_CHECK_EVERY + 1:
            torch.cuda.synchronize()
            _step(m, x)
            steps += 1
    assert [str(w.message) for w in caught if "NaN or infinite amax" in str(w.message)], steps
    assert FP8GlobalStateManager.get_non_finite_amax_count() >= 1


def test_non_finite_gradient_keeps_the_backward_scale():
    torch.manual_seed(1)
    m = te.Linear(32, 32, device="cpu")
    _step(m, torch.randn(16, 32))
    bwd = m.fp8_meta["scaling_bwd"]
    before = bwd.scale.clone()
    with te.autocast(recipe=RECIPE):
        y = m(torch.randn(16, 32))
    with pytest.warns(RuntimeWarning):
        (y * torch.tensor(float("inf"))).sum().backward()
    assert torch.equal(bwd.scale, before) and torch.isfinite(bwd.amax_history).all()
    assert FP8GlobalStateManager.get_non_finite_amax_count() >= 1
    _step(m, torch.randn(16, 32) * 100)                               # updates as usual
    assert not torch.equal(bwd.scale, before)


def test_current_scaling_counts_non_finite():
    m = te.Linear(32, 32, device="cpu")
    x = torch.randn(16, 32)
    x[1, 1] = float("inf")
    with pytest.warns(RuntimeWarning):
        with te.autocast(recipe=Float8CurrentScaling()):
            y = m(x)
    assert FP8GlobalStateManager.get_non_finite_amax_count() == 1
    assert torch.isfinite(y[0]).all()            # rows without the inf are computed as usual


def test_formulas_keep_the_scale_for_non_finite_live_amaxes():
    history = torch.tensor([[float("nan"), 2.0, float("inf")], [4.0, 1.0, 8.0]])
    scale = torch.tensor([3.0, 5.0, 7.0])
    new_scale, new_inv, new_hist = delayed_scaling.delayed_scaling_update(history, scale, 448.0, 0, "max")
    assert new_scale[0] == 3.0 and new_scale[2] == 7.0               # kept
    assert new_scale[1] == 448.0 / 2.0
    assert torch.equal(new_inv, torch.reciprocal(new_scale))
    assert torch.equal(new_hist, torch.tensor([[0.0, 0.0, 0.0], [0.0, 2.0, 0.0]]))
    counter = torch.zeros((), dtype=torch.int32)
    hists, scales, invs = [history.clone()], [scale.clone()], [torch.empty(3)]
    delayed_scaling.delayed_scaling_update_(hists, scales, invs, 448.0, 0, "max", non_finite=counter)
    assert counter.item() == 2 and torch.equal(scales[0], new_scale)


def test_custom_scaling_algo_sees_the_sanitized_history():
    seen = []

    def algo(amax, scale, fp8_max, recipe):
        seen.append(amax.clone())
        return fp8_max / amax.clamp(min=1e-3)

    recipe = DelayedScaling(amax_history_len=4, scaling_factor_compute_algo=algo)
    m = te.Linear(32, 32, device="cpu")
    x = torch.randn(16, 32)
    x[0, 0] = float("nan")
    with pytest.warns(RuntimeWarning):
        _step(m, x, recipe)
    assert torch.isfinite(seen[0]).all()
    assert m.fp8_meta["scaling_fwd"].scale[0] == 1.0                  # kept
    assert torch.isfinite(m.fp8_meta["scaling_fwd"].amax_history).all()
