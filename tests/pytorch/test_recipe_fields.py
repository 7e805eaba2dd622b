"""The recipe fields TE documents for current and block scaling (QParams, MMParams,
block shapes, fp8_dpa / fp8_mha): defaults, bad values named in the error, and what they
do; and fields set after construction, checked again at te.autocast entry (NOTE [Recipe
validation] in common/recipe.py)."""

import dataclasses

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import (DelayedScaling, Float8BlockScaling,
                                              Float8CurrentScaling, Format, MMParams, QParams)
from transformer_engine.pytorch import quantize
from references import deq

E4M3 = torch.float8_e4m3fn


def _case(fn, exc, match, id):
    return pytest.param(fn, exc, match, id=id)


CONSTRUCTION_CASES = [
    _case(lambda: QParams(power_2_scale=1), TypeError,
          "QParams: power_2_scale must be a bool, got 1", "qparams-power-2-int"),
    _case(lambda: QParams(amax_epsilon=-1e-3), ValueError,
          r"QParams: amax_epsilon must be in \[0, .*got -0.001", "qparams-epsilon-negative"),
    _case(lambda: QParams(amax_epsilon=float("inf")), ValueError,
          r"QParams: amax_epsilon must be in \[0, .*got inf", "qparams-epsilon-inf"),
    _case(lambda: QParams(amax_epsilon="0"), TypeError,
          "QParams: amax_epsilon must be a float, got '0'", "qparams-epsilon-str"),
    _case(lambda: MMParams(use_split_accumulator=None), TypeError,
          "MMParams: use_split_accumulator must be a bool, got None", "mmparams-none"),
    _case(lambda: Float8CurrentScaling(fp8_quant_fwd_inp=0.5), TypeError,
          "Float8CurrentScaling: fp8_quant_fwd_inp must be a "
          "transformer_engine.common.recipe.QParams, got 0.5", "current-qparams-float"),
    _case(lambda: Float8CurrentScaling(fp8_gemm_dgrad=QParams()), TypeError,
          "Float8CurrentScaling: fp8_gemm_dgrad must be a "
          "transformer_engine.common.recipe.MMParams", "current-mmparams-wrong-class"),
    _case(lambda: Float8CurrentScaling(fp8_mha="no"), TypeError,
          "Float8CurrentScaling: fp8_mha must be a bool, got 'no'", "current-fp8-mha-str"),
    _case(lambda: Float8BlockScaling(x_block_scaling_dim=3), ValueError,
          r"Float8BlockScaling: x_block_scaling_dim must be 1 \(1x128 blocks\) or 2 "
          r"\(128x128 blocks\), got 3", "block-x-dim-3"),
    _case(lambda: Float8BlockScaling(w_block_scaling_dim=2.0), TypeError,
          r"Float8BlockScaling: w_block_scaling_dim must be an int \(1 or 2\), got 2.0",
          "block-w-dim-float"),
    _case(lambda: Float8BlockScaling(x_block_scaling_dim=2), ValueError,
          "Float8BlockScaling: x_block_scaling_dim=2 with w_block_scaling_dim=2 would make the "
          "forward GEMM take two 2D-scaled operands", "block-forward-2d-by-2d"),
    _case(lambda: Float8BlockScaling(grad_block_scaling_dim=2), ValueError,
          "grad_block_scaling_dim=2 with w_block_scaling_dim=2 would make the dgrad GEMM",
          "block-dgrad-2d-by-2d"),
    _case(lambda: Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1,
                                     grad_block_scaling_dim=2), ValueError,
          "grad_block_scaling_dim=2 with x_block_scaling_dim=2 would make the wgrad GEMM",
          "block-wgrad-2d-by-2d"),
    _case(lambda: Float8BlockScaling(fp8_format=Format.E5M2), ValueError,
          "Float8BlockScaling: fp8_format=Format.E5M2 is not supported", "block-format-e5m2"),
    _case(lambda: Float8BlockScaling(fp8_quant_bwd_grad=MMParams()), TypeError,
          "Float8BlockScaling: fp8_quant_bwd_grad must be a "
          "transformer_engine.common.recipe.QParams", "block-qparams-wrong-class"),
]


@pytest.mark.parametrize("fn, exc, match", CONSTRUCTION_CASES)
def test_bad_values_are_refused_at_construction(fn, exc, match):
    with pytest.raises(exc, match=match):
        fn()


def test_current_scaling_defaults_are_tes():
    r = Float8CurrentScaling()
    assert r.fp8_format is Format.HYBRID
    for name in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad"):
        assert getattr(r, name) == QParams(power_2_scale=False, amax_epsilon=0.0)
    assert r.fp8_gemm_fprop == MMParams(use_split_accumulator=False)
    assert r.fp8_gemm_dgrad == r.fp8_gemm_wgrad == MMParams(use_split_accumulator=True)
    assert (r.fp8_dpa, r.fp8_mha) == (False, False)
    other = Float8CurrentScaling()
    other.fp8_quant_fwd_inp.amax_epsilon = 1.0        # each recipe has its own QParams
    assert r.fp8_quant_fwd_inp.amax_epsilon == 0.0


def test_block_scaling_defaults_are_tes(monkeypatch):
    r = Float8BlockScaling()
    assert r.fp8_format is Format.E4M3
    assert (r.x_block_scaling_dim, r.w_block_scaling_dim, r.grad_block_scaling_dim) == (1, 2, 1)
    for name in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad"):
        assert getattr(r, name) == QParams(power_2_scale=True, amax_epsilon=0.0)
    for name in ("fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad"):
        assert getattr(r, name) == MMParams(use_split_accumulator=True)
    monkeypatch.setenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "1")
    assert Float8BlockScaling().fp8_quant_fwd_weight.power_2_scale is False


# ---- fields set after construction --------------------------------------------------

def _amax_step(m, recipe, x):
    with te.autocast(recipe=recipe):
        m(x)
    return m.fp8_meta["scaling_fwd"]


def test_margin_set_later_takes_effect_at_the_next_entry():
    """``recipe.margin = 1`` between steps: the next update halves the scale."""
    m = te.Linear(16, 16, bias=False, device="cpu")
    x = torch.randn(16, 16)
    recipe = DelayedScaling(amax_history_len=1)
    state = _amax_step(m, recipe, x)
    amax_x = x.abs().max()
    assert state.scale[0] == torch.tensor(448.0) / amax_x
    recipe.margin = 1
    state = _amax_step(m, recipe, x)
    assert state.scale[0] == torch.tensor(448.0) / amax_x / 2
    assert m.fp8_meta["recipe"].margin == 1


def test_history_length_set_later_resizes_the_history():
    m = te.Linear(16, 16, device="cpu")
    recipe = DelayedScaling(amax_history_len=4)
    _amax_step(m, recipe, torch.randn(16, 16))
    recipe.amax_history_len = 2
    assert _amax_step(m, recipe, torch.randn(16, 16)).amax_history.shape == (2, 2)


def test_a_change_inside_an_autocast_waits_for_the_next_entry():
    """The running autocast works on the values it found at entry; its scale update
    too."""
    m = te.Linear(16, 16, bias=False, device="cpu")
    x = torch.randn(16, 16)
    recipe = DelayedScaling(amax_history_len=1)
    with te.autocast(recipe=recipe):
        m(x)
        recipe.margin = 2
        with pytest.raises(AttributeError, match="read-only copy te.autocast took"):
            m.fp8_meta["recipe"].margin = 2
    assert m.fp8_meta["scaling_fwd"].scale[0] == torch.tensor(448.0) / x.abs().max()
    assert m.fp8_meta["recipe"] is not recipe and m.fp8_meta["recipe"].margin == 0
    state = _amax_step(m, recipe, x)
    assert state.scale[0] == torch.tensor(448.0) / x.abs().max() / 4


def _set(obj_of, name, value):
    def change(recipe):
        setattr(obj_of(recipe), name, value)
    return change


LATER_CASES = [
    _case((DelayedScaling, _set(lambda r: r, "margin", 99)), ValueError,
          "te.autocast: DelayedScaling: margin must be <= 6 for fp8_format=Format.HYBRID, got 99",
          "delayed-margin"),
    _case((DelayedScaling, _set(lambda r: r, "amax_history_len", "8")), TypeError,
          "te.autocast: DelayedScaling: amax_history_len must be an int, got '8'",
          "delayed-history-len"),
    _case((DelayedScaling, _set(lambda r: r, "fp8_format", Format.E5M2)), ValueError,
          "te.autocast: DelayedScaling: fp8_format=Format.E5M2 is not supported",
          "delayed-format"),
    _case((Float8CurrentScaling, _set(lambda r: r.fp8_quant_bwd_grad, "amax_epsilon", -1.0)),
          ValueError, r"te.autocast: Float8CurrentScaling: fp8_quant_bwd_grad.amax_epsilon must "
          r"be in \[0, ", "current-nested-epsilon"),
    _case((Float8CurrentScaling, _set(lambda r: r, "fp8_gemm_wgrad", True)), TypeError,
          "te.autocast: Float8CurrentScaling: fp8_gemm_wgrad must be a "
          "transformer_engine.common.recipe.MMParams, got True", "current-mmparams"),
    _case((Float8BlockScaling, _set(lambda r: r, "x_block_scaling_dim", 2)), ValueError,
          "te.autocast: Float8BlockScaling: x_block_scaling_dim=2 with w_block_scaling_dim=2",
          "block-2d-by-2d"),
    _case((Float8BlockScaling, _set(lambda r: r.fp8_quant_fwd_inp, "power_2_scale", "yes")),
          TypeError, "te.autocast: Float8BlockScaling: fp8_quant_fwd_inp.power_2_scale must be "
          "a bool, got 'yes'", "block-nested-power-2"),
]


@pytest.mark.parametrize("recipe_and_change, exc, match", LATER_CASES)
def test_bad_value_set_later_is_refused_at_autocast_entry(recipe_and_change, exc, match):
    cls, change = recipe_and_change
    recipe = cls()
    m = te.Linear(16, 16, device="cpu")
    with te.autocast(recipe=recipe):
        m(torch.randn(16, 16))
    change(recipe)
    with pytest.raises(exc, match=match):
        with te.autocast(recipe=recipe):
            raise AssertionError("the autocast must refuse the recipe")
    with pytest.raises(exc, match=match.replace("te.autocast", "te.fp8_autocast")):
        with te.fp8_autocast(fp8_recipe=recipe):
            raise AssertionError("the autocast must refuse the recipe")
    assert not te.FP8GlobalStateManager.is_fp8_enabled()


@pytest.mark.parametrize("cls", [DelayedScaling, Float8CurrentScaling, Float8BlockScaling],
                         ids=lambda c: c.__name__)
@pytest.mark.parametrize("flag", ["fp8_dpa", "fp8_mha"])
def test_fp8_attention_flags_are_refused_when_enabled(flag, cls):
    recipe = cls(**{flag: True})                 # constructs, as in TE
    with pytest.raises(NotImplementedError,
                       match=f"te.autocast: {cls.__name__}.{flag}=True \\(FP8 attention\\) is not "
                             f"implemented .*set {flag}=False"):
        with te.autocast(recipe=recipe):
            raise AssertionError("the autocast must refuse the recipe")
    with te.autocast(enabled=False, recipe=recipe):     # FP8 off: nothing runs it
        assert not te.FP8GlobalStateManager.is_fp8_enabled()
    setattr(recipe, flag, False)
    with te.autocast(recipe=recipe):
        assert te.FP8GlobalStateManager.is_fp8_enabled()


# ---- what QParams do ---------------------------------------------------------------

def test_current_scale_power_2_and_epsilon():
    amax = torch.tensor([3.0, 1e-6, 0.0, 448.0])
    plain = quantize.current_scale(amax, E4M3)
    assert torch.equal(plain[:2], torch.tensor([448.0]) / torch.tensor([3.0, 1e-6]))
    pow2 = quantize.current_scale(amax, E4M3, power_2_scale=True)
    assert torch.equal(pow2, torch.tensor([128.0, 2.0 ** 28, 1.0, 1.0]))
    floored = quantize.current_scale(amax, E4M3, amax_epsilon=1e-2)
    assert torch.equal(floored[1:3], torch.full((2,), 448.0) / torch.tensor(1e-2))
    assert floored[0] == plain[0] and floored[3] == plain[3]


def _record_qparams(monkeypatch) -> list:
    seen = []
    real = quantize.current_scale

    def recording(amax_value, dtype, power_2_scale=False, amax_epsilon=0.0, **kwargs):
        seen.append((power_2_scale, amax_epsilon))
        return real(amax_value, dtype, power_2_scale, amax_epsilon, **kwargs)

    monkeypatch.setattr(quantize, "current_scale", recording)
    return seen


def test_each_role_casts_with_its_own_qparams(monkeypatch):
    seen = _record_qparams(monkeypatch)
    recipe = Float8CurrentScaling(fp8_quant_fwd_inp=QParams(True, 0.5),
                                  fp8_quant_fwd_weight=QParams(False, 0.25),
                                  fp8_quant_bwd_grad=QParams(True, 0.125))
    m = te.Linear(16, 16, device="cpu")
    x = torch.randn(16, 16, requires_grad=True)
    with te.autocast(recipe=recipe):
        y = m(x)
    y.sum().backward()
    assert seen == [(True, 0.5), (False, 0.25), (True, 0.125)]       # x, W, then dy


def test_power_2_input_scale_is_used_by_the_forward():
    torch.manual_seed(0)
    m = te.Linear(32, 16, bias=False, device="cpu")
    x = torch.randn(16, 32) * 3.3
    ref_scale = quantize.current_scale(quantize.amax(x), E4M3, power_2_scale=True)
    mantissa, _ = torch.frexp(ref_scale)
    assert mantissa.item() == 0.5
    w_scale = quantize.current_scale(quantize.amax(m.weight), E4M3)
    expect = deq(x, ref_scale, E4M3) @ deq(m.weight, w_scale, E4M3).t()
    recipe = Float8CurrentScaling(fp8_quant_fwd_inp=QParams(power_2_scale=True))
    with te.autocast(recipe=recipe), torch.no_grad():
        y = m(x)
    torch.testing.assert_close(y.double(), expect, rtol=1e-6, atol=1e-6)
    with te.autocast(recipe=Float8CurrentScaling()), torch.no_grad():
        plain = m(x)
    assert not torch.equal(y, plain)


def test_amax_epsilon_floors_the_input_amax():
    """Inputs of at most 1e-4 with ``amax_epsilon=1.0``: the cast scale is 448 / 1.0,
    so the FP8 inputs use a small part of the range (values the plain scale keeps
    round to zero or to few bits), as the float64 reference with that scale says."""
    torch.manual_seed(1)
    m = te.Linear(32, 16, bias=False, device="cpu")
    x = torch.rand(16, 32) * 1e-4
    w_scale = quantize.current_scale(quantize.amax(m.weight), E4M3)
    expect = deq(x, torch.tensor([448.0]), E4M3) @ deq(m.weight, w_scale, E4M3).t()
    recipe = Float8CurrentScaling(fp8_quant_fwd_inp=QParams(amax_epsilon=1.0))
    with te.autocast(recipe=recipe), torch.no_grad():
        y = m(x)
    torch.testing.assert_close(y.double(), expect, rtol=1e-6, atol=1e-12)
    with te.autocast(recipe=Float8CurrentScaling()), torch.no_grad():
        plain = m(x)
    assert not torch.equal(y, plain)


# ---- what MMParams do ----------------------------------------------------------------

def _record_fast_accum(monkeypatch) -> list:
    seen = []
    real = quantize.fp8_gemm_unchecked

    def recording(a, b, out_dtype, bias=None, use_fast_accum=False):
        seen.append(use_fast_accum)
        return real(a, b, out_dtype, bias, use_fast_accum)

    monkeypatch.setattr(quantize, "fp8_gemm_unchecked", recording)
    return seen


@pytest.mark.parametrize("recipe, fast", [
    pytest.param(DelayedScaling(), [True, False, False], id="delayed-tes-defaults"),
    pytest.param(Float8CurrentScaling(), [True, False, False], id="current-defaults"),
    pytest.param(Float8CurrentScaling(fp8_gemm_fprop=MMParams(True),
                                      fp8_gemm_dgrad=MMParams(False),
                                      fp8_gemm_wgrad=MMParams(True)),
                 [False, True, False], id="current-flipped")])
def test_split_accumulator_is_scaled_mms_fast_accum(monkeypatch, recipe, fast):
    """``use_fast_accum = not use_split_accumulator`` for the forward, dgrad and wgrad
    GEMMs; on the CPU (float32 accumulation) the results are the same bits either way."""
    seen = _record_fast_accum(monkeypatch)
    torch.manual_seed(2)
    m = te.Linear(16, 16, device="cpu")
    x = torch.randn(16, 16, requires_grad=True)
    with te.autocast(recipe=recipe):
        y = m(x)
    y.sum().backward()
    assert seen == fast
    if recipe.float8_current_scaling():
        m2 = te.Linear(16, 16, device="cpu")
        m2.load_state_dict(m.state_dict())
        x2 = x.detach().clone().requires_grad_()
        with te.autocast(recipe=Float8CurrentScaling()):
            y2 = m2(x2)
        y2.sum().backward()
        assert torch.equal(y, y2) and torch.equal(x.grad, x2.grad)
        assert torch.equal(m.weight.grad, m2.weight.grad)


def test_recipes_compare_by_value_and_copy_independently():
    a = Float8BlockScaling()
    b = dataclasses.replace(a, fp8_quant_fwd_inp=QParams(power_2_scale=False))
    assert a != b and a == Float8BlockScaling() and hash(a) == hash(Float8BlockScaling())
