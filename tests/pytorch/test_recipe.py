"""Recipes: defaults as TE has them, formats, the margin bound, and callable algorithms
in the update (bad values of every field: test_bad_input.py)."""

import dataclasses

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import (MAX_AMAX_HISTORY_LEN, DelayedScaling,
                                              Float8BlockScaling, Float8CurrentScaling, Format,
                                              MXFP8BlockScaling, NVFP4BlockScaling, QParams,
                                              max_margin)
from transformer_engine.pytorch import delayed_scaling


def test_format_maxima_and_dtypes():
    assert Format.E4M3.value.max_fwd == 448 and Format.E4M3.value.max_bwd == 448
    assert Format.E5M2.value.max_fwd == 57344 and Format.E5M2.value.max_bwd == 57344
    assert Format.HYBRID.value.max_fwd == 448 and Format.HYBRID.value.max_bwd == 57344
    assert Format.HYBRID.value.dtype_fwd == torch.float8_e4m3fn
    assert Format.HYBRID.value.dtype_bwd == torch.float8_e5m2
    assert Format.E4M3.value.dtype_bwd == torch.float8_e4m3fn
    assert Format.E2M1.value.max_fwd == 6 and Format.E2M1.value.dtype_fwd == torch.float4_e2m1fn_x2
    for fmt in (Format.E4M3, Format.E5M2, Format.HYBRID):
        assert torch.finfo(fmt.value.dtype_fwd).max == fmt.value.max_fwd
        assert torch.finfo(fmt.value.dtype_bwd).max == fmt.value.max_bwd


def test_delayed_scaling_defaults():
    r = DelayedScaling()
    assert (r.margin, r.fp8_format, r.amax_history_len, r.amax_compute_algo,
            r.scaling_factor_compute_algo, r.reduce_amax) == (0, Format.HYBRID, 1024, "max", None, True)
    assert r.delayed() and not r.float8_current_scaling()
    c = Float8CurrentScaling()
    assert c.fp8_format is Format.HYBRID and c.float8_current_scaling() and not c.delayed()


def test_recipes_are_mutable_and_compare_by_value():
    """As in TE, fields can be set after construction (te.autocast checks them again:
    test_recipe_fields.py); equal recipes compare and hash equal, so they share one
    scale update."""
    r = DelayedScaling(margin=1)
    r.margin = 2
    assert r.margin == 2
    assert hash(r) == hash(DelayedScaling(margin=2)) and r == DelayedScaling(margin=2)
    assert r != DelayedScaling(margin=1)


# Bad values for every recipe field: tests/pytorch/test_bad_input.py.

@pytest.mark.parametrize("fmt, bound", [(Format.HYBRID, 6), (Format.E4M3, 6), (Format.E5M2, 13)],
                         ids=lambda v: v.name if isinstance(v, Format) else None)
def test_max_margin_is_the_tight_bound(fmt, bound):
    """At the bound the update's scale for the largest float32 amax is a positive normal
    float32 (and so is finite after 1 / scale); one more and it is not, for the
    tighter of the format's two FP8 types."""
    assert max_margin(fmt) == bound
    amax = torch.tensor([torch.finfo(torch.float32).max])
    tiny = torch.finfo(torch.float32).tiny
    spec = fmt.value
    for fp8_max in (spec.max_fwd, spec.max_bwd):
        scale = delayed_scaling.scale_from_amax(amax, torch.ones(1), fp8_max, bound)
        assert scale.item() >= tiny and torch.isfinite(torch.reciprocal(scale)).all()
    tighter = min(spec.max_fwd, spec.max_bwd)
    assert delayed_scaling.scale_from_amax(amax, torch.ones(1), tighter, bound + 1).item() < tiny
    if fmt is not Format.E5M2:
        DelayedScaling(fp8_format=fmt, margin=bound)         # the bound itself is accepted


def test_history_length_bound_is_accepted():
    assert DelayedScaling(amax_history_len=MAX_AMAX_HISTORY_LEN).amax_history_len == 65536


def _one_step(recipe, x):
    m = te.Linear(16, 16, bias=False, device="cpu")
    with te.autocast(recipe=recipe):
        m(x)
    return m


def test_callable_amax_algo_is_used_in_the_update():
    """The new scale comes from the callable's amax: 4 x max|x| gives a scale 4 times
    smaller than "max" would, per tensor, as float64 computes it."""
    x = torch.randn(16, 16)
    m = _one_step(DelayedScaling(amax_history_len=2, amax_compute_algo=lambda h: 4 * h.amax(0)), x)
    amaxes = torch.stack([x.abs().max(), m.weight.detach().abs().max()]).double()
    expect = (448.0 / (4 * amaxes)).float()
    torch.testing.assert_close(m.fp8_meta["scaling_fwd"].scale, expect, rtol=2 ** -23, atol=0)
    plain = _one_step(DelayedScaling(amax_history_len=2), x).fp8_meta["scaling_fwd"].scale
    assert not torch.equal(m.fp8_meta["scaling_fwd"].scale, plain)


def test_scaling_factor_callable_result_is_converted_to_float32():
    """A valid result of another real dtype is used, as float32, with 1 / scale."""
    recipe = DelayedScaling(amax_history_len=2, scaling_factor_compute_algo=lambda amax, scale, mx, r:
                            torch.full(amax.shape, 0.25, dtype=torch.float64))
    state = _one_step(recipe, torch.randn(16, 16)).fp8_meta["scaling_fwd"]
    assert state.scale.dtype == torch.float32
    assert torch.equal(state.scale, torch.full((2,), 0.25))
    assert torch.equal(state.scale_inv, torch.full((2,), 4.0))


@pytest.mark.parametrize("cls", [MXFP8BlockScaling, NVFP4BlockScaling],
                         ids=lambda c: c.__name__)
def test_mx_recipes_run_in_autocast(cls):
    recipe = cls()
    assert recipe.implemented() and not recipe.delayed()
    assert recipe.mxfp8() is (cls is MXFP8BlockScaling)
    assert not recipe.float8_block_scaling() and not recipe.float8_per_tensor_scaling()
    assert recipe.nvfp4() is (cls is NVFP4BlockScaling)
    with te.autocast(recipe=recipe):
        assert te.FP8GlobalStateManager.get_fp8_recipe() is not None
    with te.autocast(enabled=False, recipe=recipe):     # FP8 off: nothing runs it
        assert not te.FP8GlobalStateManager.is_fp8_enabled()


def test_mx_recipe_fields_as_te_defines_them(monkeypatch):
    r = MXFP8BlockScaling()
    assert (r.fp8_format, r.margin, r.enable_2d_quantization) == (Format.E4M3, 0, False)
    with pytest.raises(ValueError, match="fp8_format=Format.E5M2"):
        MXFP8BlockScaling(fp8_format=Format.E5M2)
    with pytest.raises(TypeError, match="enable_2d_quantization must be a bool"):
        MXFP8BlockScaling(enable_2d_quantization=1)
    n = NVFP4BlockScaling()
    assert (n.fp4_format, n.fp8_format) == (Format.E2M1, Format.E4M3)
    assert (n.fp4_quant_fwd_inp.random_hadamard_transform, n.fp4_quant_fwd_inp.stochastic_rounding,
            n.fp4_quant_fwd_inp.fp4_2d_quantization) == (True, False, False)
    assert (n.fp4_quant_fwd_weight.random_hadamard_transform,
            n.fp4_quant_fwd_weight.fp4_2d_quantization) == (False, True)
    assert n.fp4_quant_bwd_grad.stochastic_rounding and n.fp4_quant_bwd_grad.random_hadamard_transform
    off = NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True,
                            disable_2d_quantization=True)
    assert not any(off.fp4_quant_bwd_grad) and not off.fp4_quant_fwd_weight.fp4_2d_quantization
    monkeypatch.setenv("NVTE_NVFP4_DISABLE_RHT", "1")
    assert NVFP4BlockScaling().disable_rht
    with pytest.raises(ValueError, match="fp8_format .* must be Format.E4M3"):
        NVFP4BlockScaling(fp8_format=Format.HYBRID)
    # TE's tests build a 4over6 recipe at import: it constructs, and its first cast refuses
    four_over_six = NVFP4BlockScaling(nvfp4_4over6="all")
    with pytest.raises(NotImplementedError, match="nvfp4_4over6='all' .* not implemented"):
        with te.autocast(recipe=four_over_six):
            te.Linear(32, 32, device="cpu")(torch.randn(16, 32))
    row_scaled = NVFP4BlockScaling(row_scaled_activation=True)
    with pytest.raises(NotImplementedError, match="row_scaled_activation=True .* not impl"):
        with te.autocast(recipe=row_scaled):
            te.Linear(32, 32, device="cpu")(torch.randn(16, 32))
    # TE's tests set the role QParams: the recipe keeps them
    custom = NVFP4BlockScaling()
    custom.fp4_quant_fwd_inp = QParams(random_hadamard_transform=True)
    assert custom.fp4_quant_fwd_inp.random_hadamard_transform
    assert custom.fp4_quant_fwd_weight.fp4_2d_quantization      # still derived
    with pytest.raises(TypeError, match="fp4_quant_bwd_grad must be a"):
        custom.fp4_quant_bwd_grad = "rht"
    with pytest.raises(ValueError, match="fp8_format=Format.E2M1 is an FP4 format"):
        Float8CurrentScaling(fp8_format=Format.E2M1)


@pytest.mark.parametrize("recipe, per_tensor", [(DelayedScaling(), True),
                                                (Float8CurrentScaling(), True),
                                                (Float8BlockScaling(), False)],
                         ids=["delayed", "current", "block"])
def test_recipe_predicates(recipe, per_tensor):
    assert recipe.float8_per_tensor_scaling() is per_tensor and recipe.implemented()
    assert recipe.float8_block_scaling() is isinstance(recipe, Float8BlockScaling)
    assert not (recipe.mxfp8() or recipe.nvfp4() or recipe.custom())
    assert recipe.delayed() is isinstance(recipe, DelayedScaling)
    assert recipe.float8_current_scaling() is isinstance(recipe, Float8CurrentScaling)


def test_replace_makes_a_checked_new_recipe():
    recipe = DelayedScaling()
    assert dataclasses.replace(recipe, margin=1).margin == 1 and recipe.margin == 0
    with pytest.raises(ValueError, match="DelayedScaling: margin must be >= 0, got -1"):
        dataclasses.replace(recipe, margin=-1)


def test_delayed_scaling_takes_megatrons_arguments():
    """Megatron Core's TEDelayedScaling passes override_linear_precision and its module
    arguments (params_dtype, device) to the recipe: accepted; a GEMM in high precision
    (any True) is refused."""
    recipe = DelayedScaling(margin=0, fp8_format=Format.HYBRID, amax_compute_algo="max",
                            amax_history_len=16, override_linear_precision=(False, False, False),
                            params_dtype=torch.bfloat16, device="cpu", fp8_dpa=False,
                            fp8_mha=False)
    assert recipe == DelayedScaling(amax_history_len=16)
    with pytest.raises(NotImplementedError, match=r"override_linear_precision=\(False, False, "
                                                  r"True\)"):
        DelayedScaling(override_linear_precision=(False, False, True))
    with pytest.raises(TypeError, match="override_linear_precision must be a tuple of three"):
        DelayedScaling(override_linear_precision=[False, False, False])
