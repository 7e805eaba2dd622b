"""TE's public module paths and helpers that its users (and its own tests) import:
``transformer_engine.pytorch.quantization`` (TE 2.9's home of the autocast, the
global state manager and the support checks), the availability queries on ``te``,
and the helpers of ``transformer_engine.pytorch.utils``."""

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Format
from transformer_engine.pytorch import fp8, quantization, utils


def test_quantization_module_holds_the_same_objects_as_fp8():
    for name in ("FP8GlobalStateManager", "autocast", "fp8_autocast", "quantized_model_init",
                 "fp8_model_init", "is_fp8_available", "get_default_fp8_recipe",
                 "check_fp8_support", "check_mxfp8_support",
                 "check_fp8_block_scaling_support"):
        assert getattr(quantization, name) is getattr(fp8, name), name
    for name in ("is_mxfp8_available", "is_fp8_block_scaling_available", "is_nvfp4_available",
                 "get_default_recipe", "is_bf16_available", "get_device_compute_capability",
                 "QuantizedTensor", "Float8Tensor"):
        assert name in te.__all__ and hasattr(te, name), name


def test_availability_queries():
    for query, check in ((te.is_mxfp8_available, fp8.check_mxfp8_support),
                         (te.is_fp8_block_scaling_available,
                          fp8.check_fp8_block_scaling_support),
                         (te.is_nvfp4_available, quantization.check_nvfp4_support)):
        assert query(return_reason=True) == check()
        assert query() is check()[0]
    # both are emulated exactly: they run wherever Float8BlockScaling does
    assert te.is_nvfp4_available(return_reason=True) == te.is_fp8_block_scaling_available(
        return_reason=True)
    assert te.is_mxfp8_available() is te.is_fp8_block_scaling_available()
    assert te.get_default_recipe() == DelayedScaling()


@pytest.mark.parametrize("fmt, fwd, bwd", [
    (Format.HYBRID, torch.float8_e4m3fn, torch.float8_e5m2),
    (Format.E4M3, torch.float8_e4m3fn, torch.float8_e4m3fn)])
def test_recipe_fp8_dtypes(fmt, fwd, bwd):
    recipe = DelayedScaling(fp8_format=fmt)
    assert quantization.get_fp8_torch_dtype(recipe, True) is fwd
    assert quantization.get_fp8_torch_dtype(recipe, fprop_tensor=False) is bwd
    assert quantization.get_fp8_max(recipe, False) == (57344.0 if bwd is torch.float8_e5m2
                                                       else 448.0)


def test_initializers_draw_the_stated_spread():
    w = torch.empty(400, 500)
    utils.init_method_normal(0.5)(w)
    assert abs(w.std().item() - 0.5) < 0.01 and abs(w.mean().item()) < 0.01
    utils.scaled_init_method_normal(0.5, num_layers=8)(w)
    assert abs(w.std().item() - 0.125) < 0.0025


def test_attention_mask_func_fills_in_place():
    scores = torch.zeros(2, 3)
    mask = torch.tensor([[True, False, False], [False, False, True]])
    out = utils.attention_mask_func(scores, mask)
    assert out is scores
    assert torch.equal(scores, torch.where(mask, -10000.0, 0.0))


def test_device_queries():
    if torch.cuda.is_available():
        assert te.get_device_compute_capability() == torch.cuda.get_device_capability()
        assert utils.is_non_tn_fp8_gemm_supported() is (
            torch.cuda.get_device_capability() >= (10, 0)
            and not (12, 0) <= torch.cuda.get_device_capability() < (13, 0))
    else:
        assert te.get_device_compute_capability() == (0, 0)
        assert te.is_bf16_available(return_reason=True) == (True, "")
        assert utils.is_non_tn_fp8_gemm_supported() is False
