"""FP8 autocast and the delayed-scaling update, checked against hand computations."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling
from transformer_engine.pytorch import delayed_scaling
from transformer_engine.pytorch.fp8 import FP8GlobalStateManager

E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def _step(module, x, dy, recipe):
    """One training forward+backward with a chosen output gradient ``dy``."""
    with te.autocast(recipe=recipe):
        y = module(x)
    (y * dy).sum().backward()


class HandReference:
    """Delayed scaling of one tensor, written out by hand (row 0 = live)."""

    def __init__(self, length, algo, margin, fp8_max):
        self.hist = [0.0] * length
        self.scale = 1.0
        self.algo, self.margin, self.max = algo, margin, fp8_max

    def step(self, amax):
        self.hist[0] = amax
        if self.algo == "max":
            a = max(self.hist) if not any(v != v for v in self.hist) else float("nan")
        elif self.algo == "most_recent":
            a = self.hist[0]
        else:
            a = self.algo(torch.tensor(self.hist)[:, None]).item()
        if a > 0 and a != float("inf"):
            self.scale = float(torch.tensor(self.max / a, dtype=torch.float32)
                               / torch.tensor(2.0 ** self.margin))
        self.hist = self.hist[1:] + self.hist[:1]
        self.hist[0] = 0.0


@pytest.mark.parametrize("algo", ["max", "most_recent", "callable"])
@pytest.mark.parametrize("margin", [0, 2])
def test_scale_update_matches_hand_computation(algo, margin):
    fn = (lambda h: h.sum(0) / h.shape[0]) if algo == "callable" else algo
    recipe = DelayedScaling(margin=margin, amax_history_len=3, amax_compute_algo=fn)
    m = te.Linear(16, 16, bias=False, device="cpu")
    refs = {"x": HandReference(3, fn, margin, E4M3_MAX), "w": HandReference(3, fn, margin, E4M3_MAX),
            "dy": HandReference(3, fn, margin, E5M2_MAX)}
    for mag in [4.0, 1.0, 0.25, 2.0]:
        x = torch.randn(16, 16) * mag
        dy = torch.randn(16, 16) * mag * 10
        _step(m, x, dy, recipe)
        refs["x"].step(x.abs().max().item())
        refs["w"].step(m.weight.abs().max().item())
        refs["dy"].step(dy.abs().max().item())
        fwd, bwd = m.fp8_meta["scaling_fwd"], m.fp8_meta["scaling_bwd"]
        expect_fwd = torch.tensor([refs["x"].scale, refs["w"].scale])
        torch.testing.assert_close(fwd.scale, expect_fwd, rtol=1e-6, atol=0)
        torch.testing.assert_close(bwd.scale, torch.tensor([refs["dy"].scale]), rtol=1e-6, atol=0)
        torch.testing.assert_close(fwd.amax_history[:, 0], torch.tensor(refs["x"].hist), rtol=0, atol=0)
        torch.testing.assert_close(bwd.amax_history[:, 0], torch.tensor(refs["dy"].hist), rtol=0, atol=0)
        assert torch.equal(fwd.scale_inv, 1 / fwd.scale) and torch.equal(bwd.scale_inv, 1 / bwd.scale)
    assert fwd.scale[0] != 1.0 and bwd.scale[0] != 1.0   # both states moved


@pytest.mark.parametrize("bad", [0.0, float("nan"), float("inf")], ids=["zero", "nan", "inf"])
def test_bad_amax_keeps_old_scale(bad):
    recipe = DelayedScaling(amax_history_len=1)
    m = te.Linear(16, 16, bias=False, device="cpu")
    _step(m, torch.randn(16, 16), torch.randn(16, 16), recipe)
    before = m.fp8_meta["scaling_fwd"].scale.clone()
    x = torch.zeros(16, 16) if bad == 0.0 else torch.randn(16, 16)
    if bad != 0.0:
        x[3, 5] = bad
    with te.autocast(recipe=recipe):
        m(x)
    after = m.fp8_meta["scaling_fwd"].scale
    assert after[0] == before[0]                     # input scale kept
    assert torch.isfinite(after).all()
    assert m.fp8_meta["scaling_fwd"].amax_history[0].eq(0).all()  # live row zeroed after the roll


def test_history_rolls_and_live_slot_zeroed():
    recipe = DelayedScaling(amax_history_len=4)
    m = te.Linear(16, 16, device="cpu")
    amaxes = []
    for mag in [1.0, 3.0, 2.0]:
        x = torch.randn(16, 16) * mag
        amaxes.append(x.abs().max().item())
        _step(m, x, torch.ones(16, 16), recipe)
        h = m.fp8_meta["scaling_fwd"].amax_history[:, 0]
        assert h[0] == 0
    assert sorted(h.tolist()) == sorted([0.0] + amaxes)
    assert h[-1].item() == amaxes[-1]     # the most recent amax went to the end of the buffer


def test_no_update_outside_training():
    recipe = DelayedScaling(amax_history_len=2)
    m = te.Linear(16, 16, device="cpu")
    _step(m, torch.randn(16, 16), torch.ones(16, 16), recipe)
    snapshot = [t.clone() for k in ("scaling_fwd", "scaling_bwd")
                for t in (m.fp8_meta[k].scale, m.fp8_meta[k].amax_history)]
    with torch.no_grad(), te.autocast(recipe=recipe):
        m(torch.randn(16, 16) * 100)
    with te.autocast(enabled=False, recipe=recipe):
        m(torch.randn(16, 16) * 100).sum().backward()
    now = [t for k in ("scaling_fwd", "scaling_bwd")
           for t in (m.fp8_meta[k].scale, m.fp8_meta[k].amax_history)]
    for a, b in zip(snapshot, now):
        assert torch.equal(a, b)


def test_all_modules_update_in_one_concatenated_pass(monkeypatch):
    calls = []
    real = delayed_scaling.scale_from_amax
    monkeypatch.setattr(delayed_scaling, "scale_from_amax",
                        lambda a, *rest: calls.append(a.numel()) or real(a, *rest))
    mods = [te.Linear(16, 16, device="cpu") for _ in range(3)]
    with te.autocast(recipe=DelayedScaling()):
        y = mods[2](mods[1](mods[0](torch.randn(16, 16, requires_grad=True))))
    assert calls == [6]                 # forward: 3 modules x (input, weight), one pass
    y.sum().backward()
    assert calls == [6, 3]              # backward: 3 grad_outputs, one pass, after the last backward


def test_backward_update_runs_when_the_backward_pass_ends():
    mods = [te.Linear(16, 16, device="cpu") for _ in range(2)]
    seen = []
    with te.autocast(recipe=DelayedScaling()):
        x = torch.randn(16, 16, requires_grad=True)
        h = mods[0](x)
        # Fires between module 1's backward and module 0's backward, and after both.
        h.register_hook(lambda g: seen.append(mods[1].fp8_meta["scaling_bwd"].clone()))
        x.register_hook(lambda g: seen.append(mods[1].fp8_meta["scaling_bwd"].clone()))
        y = mods[1](h)
    y.sum().backward()
    for state in seen:        # recorded, not applied, while the pass runs
        assert state.scale.eq(1).all() and state.amax_history[0].ne(0).all()
    assert mods[1].fp8_meta["scaling_bwd"].scale.ne(1).all()   # applied when it ended
    assert mods[1].fp8_meta["scaling_bwd"].amax_history[0].eq(0).all()


def test_nesting_enabled_inside_disabled_and_reverse():
    recipe = DelayedScaling()
    m = te.Linear(16, 16, device="cpu")
    x = torch.randn(16, 16)
    hp = F.linear(x, m.weight, m.bias)
    with te.autocast(enabled=False, recipe=recipe):
        assert not FP8GlobalStateManager.is_fp8_enabled()
        with te.autocast(enabled=True, recipe=recipe):
            assert FP8GlobalStateManager.is_fp8_enabled()
            y_inner = m(x)
        assert not FP8GlobalStateManager.is_fp8_enabled()
        assert m.fp8_meta["scaling_fwd"].scale.eq(1).all()   # not the outermost exit: no update yet
        assert torch.equal(m(x), hp)
    assert m.fp8_meta["scaling_fwd"].scale.ne(1).all()       # outermost exit updated
    assert not torch.equal(y_inner, hp)                      # the inner one ran in FP8
    with te.autocast(enabled=True, recipe=recipe):
        with te.autocast(enabled=False):
            assert not FP8GlobalStateManager.is_fp8_enabled()
            assert torch.equal(m(x), hp)
        assert FP8GlobalStateManager.is_fp8_enabled()
        assert FP8GlobalStateManager.get_fp8_recipe() is recipe
    assert FP8GlobalStateManager.get_autocast_depth() == 0


def test_exception_inside_autocast_restores_state_and_drops_amaxes():
    recipe = DelayedScaling()
    m = te.Linear(16, 16, device="cpu")
    with pytest.raises(RuntimeError, match="boom"):
        with te.autocast(recipe=recipe):
            with te.autocast(recipe=Float8CurrentScaling()):
                m(torch.randn(16, 16))      # current scaling: nothing recorded
            m(torch.randn(16, 16))
            raise RuntimeError("boom")
    assert not FP8GlobalStateManager.is_fp8_enabled() and FP8GlobalStateManager.get_autocast_depth() == 0
    state = m.fp8_meta["scaling_fwd"]
    assert state.scale.eq(1).all() and state.amax_history.eq(0).all()


def test_autocast_queries():
    with te.fp8_autocast(fp8_recipe=DelayedScaling(margin=1), fp8_group=None):
        assert FP8GlobalStateManager.get_fp8_recipe().margin == 1
        assert FP8GlobalStateManager.get_fp8_group() is None
        assert FP8GlobalStateManager.get_autocast_depth() == 1
        assert FP8GlobalStateManager.current_session() is not None
    assert FP8GlobalStateManager.current_session() is None   # outside any autocast


def test_calibration_records_amax_but_computes_in_high_precision():
    m = te.Linear(16, 16, device="cpu")
    x = torch.randn(16, 16) * 5
    with te.autocast(enabled=False, calibrating=True, recipe=DelayedScaling(amax_history_len=1)):
        y = m(x)
    assert torch.equal(y, F.linear(x, m.weight, m.bias))
    expect = E4M3_MAX / x.abs().max()
    torch.testing.assert_close(m.fp8_meta["scaling_fwd"].scale[0], expect, rtol=1e-6, atol=0)


@pytest.mark.parametrize("call, match", [
    (lambda: te.autocast(recipe="DelayedScaling"), "te.autocast: the recipe must be"),
    (lambda: te.fp8_autocast(fp8_recipe=object()), "te.fp8_autocast: the recipe must be"),
    (lambda: te.autocast(enabled=1), "enabled must be a bool"),
    (lambda: te.autocast(amax_reduction_group="world"), "amax_reduction_group must be"),
], ids=["recipe-str", "fp8_recipe-object", "enabled-int", "group-str"])
def test_bad_autocast_arguments(call, match):
    with pytest.raises(TypeError, match=match):
        with call():
            raise AssertionError("the autocast should have refused its arguments")
    assert FP8GlobalStateManager.get_autocast_depth() == 0


def test_is_fp8_available_on_cpu():
    assert te.is_fp8_available(device="cpu") is True
    assert te.is_fp8_available(return_reason=True, device="cpu") == (True, "")


def test_meta_tensor_keys_name_the_scaling_states():
    m = te.Linear(16, 16, device="cpu")
    with te.autocast(recipe=DelayedScaling()):
        m(torch.randn(16, 16)).sum().backward()
    fwd = FP8GlobalStateManager.get_meta_tensor_key(forward=True)
    bwd = FP8GlobalStateManager.get_meta_tensor_key(forward=False)
    assert (fwd, bwd, FP8GlobalStateManager.get_meta_tensor_key()) == \
        ("scaling_fwd", "scaling_bwd", "scaling_fwd")
    assert m.fp8_meta[fwd].amax_history.shape[1] == 2         # input and weight
    assert m.fp8_meta[bwd].amax_history.shape[1] == 1         # grad_output


def test_recipe_type_change_warns_once():
    """TE warns when a module runs under a recipe of another kind than its last one
    (neither class a subclass of the other); the same kind with other settings, or a
    fresh instance of the new kind, is silent."""
    m = te.Linear(16, 16, device="cpu")
    x = torch.randn(16, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for recipe in (DelayedScaling(), DelayedScaling(margin=1)):
            with te.autocast(recipe=recipe):
                m(x)
    with pytest.warns(UserWarning, match="Linear: Recipe type changed from DelayedScaling to "
                                         "Float8CurrentScaling. This may affect model behavior"):
        with te.autocast(recipe=Float8CurrentScaling()):
            m(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with te.autocast(recipe=Float8CurrentScaling()):
            m(x)
    with pytest.warns(UserWarning, match="from Float8CurrentScaling to DelayedScaling"):
        with te.autocast(recipe=DelayedScaling()):
            m(x)
