"""Recipes: defaults as TE has them, formats, and validation that names the field."""

import dataclasses

import pytest
import torch

from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling, Format


def test_format_maxima_and_dtypes():
    assert Format.E4M3.value.max_fwd == 448 and Format.E4M3.value.max_bwd == 448
    assert Format.E5M2.value.max_fwd == 57344 and Format.E5M2.value.max_bwd == 57344
    assert Format.HYBRID.value.max_fwd == 448 and Format.HYBRID.value.max_bwd == 57344
    assert Format.HYBRID.value.dtype_fwd == torch.float8_e4m3fn
    assert Format.HYBRID.value.dtype_bwd == torch.float8_e5m2
    assert Format.E4M3.value.dtype_bwd == torch.float8_e4m3fn
    for fmt in Format:
        assert torch.finfo(fmt.value.dtype_fwd).max == fmt.value.max_fwd
        assert torch.finfo(fmt.value.dtype_bwd).max == fmt.value.max_bwd


def test_delayed_scaling_defaults():
    r = DelayedScaling()
    assert (r.margin, r.fp8_format, r.amax_history_len, r.amax_compute_algo,
            r.scaling_factor_compute_algo, r.reduce_amax) == (0, Format.HYBRID, 1024, "max", None, True)
    assert r.delayed() and not r.float8_current_scaling()
    c = Float8CurrentScaling()
    assert c.fp8_format is Format.HYBRID and c.float8_current_scaling() and not c.delayed()


def test_recipes_are_frozen_and_hashable():
    r = DelayedScaling(margin=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.margin = 2
    assert hash(r) == hash(DelayedScaling(margin=1)) and r == DelayedScaling(margin=1)


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"margin": -1}, ValueError, "margin must be >= 0, got -1"),
    ({"margin": 1.5}, TypeError, "margin must be an int"),
    ({"amax_history_len": 0}, ValueError, "amax_history_len must be >= 1, got 0"),
    ({"amax_history_len": "8"}, TypeError, "amax_history_len must be an int"),
    ({"amax_compute_algo": "mean"}, ValueError, "amax_compute_algo must be one of"),
    ({"scaling_factor_compute_algo": 3}, TypeError, "scaling_factor_compute_algo must be callable"),
    ({"fp8_format": "HYBRID"}, TypeError, "fp8_format must be"),
    ({"fp8_format": Format.E5M2}, ValueError, "E5M2 is not supported for training"),
    ({"reduce_amax": 1}, TypeError, "reduce_amax must be a bool"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_delayed_scaling_validation(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        DelayedScaling(**kwargs)


def test_current_scaling_validation():
    with pytest.raises(ValueError, match="Float8CurrentScaling: fp8_format=Format.E5M2"):
        Float8CurrentScaling(fp8_format=Format.E5M2)


def test_callable_amax_algo_accepted():
    r = DelayedScaling(amax_compute_algo=lambda h: h.mean(0))
    assert callable(r.amax_compute_algo)
