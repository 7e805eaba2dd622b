"""Casts, the FP8 GEMM and the delayed-scaling formulas against hand computations."""

import pytest
import torch

from transformer_engine.pytorch import delayed_scaling, quantize
from transformer_engine.pytorch.kernel_config import kernel_config
from helpers import DEVICES, cuda_fp8

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# Hopper's FP8 tensor cores accumulate with about 14 mantissa bits (DeepSeek-V3 report,
# sec. 3.3.2), not full float32: measured here up to 1.4e-4 of max|ref| at K=64 on an H200.
CUDA_FP8_ACCUM_REL = 2.0 ** -11


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype, rel", [(E4M3, 2.0 ** -4), (E5M2, 2.0 ** -3)], ids=["e4m3", "e5m2"])
def test_cast_round_trip_within_format_precision(device, dtype, rel):
    x = torch.randn(64, 64, device=device) * 3
    scale = quantize.current_scale(quantize.amax(x), dtype)
    q = quantize.cast_to_fp8(x, scale, dtype)
    assert q.data.dtype == dtype
    back = q.dequantize()
    # Round to nearest: relative error at most half an ulp, 2^-(mantissa bits + 1), for normals.
    normal = x.abs() * scale > torch.finfo(dtype).smallest_normal
    err = ((back - x).abs() / x.abs())[normal]
    assert err.max() <= rel + 1e-7
    assert err.max() > rel / 4  # the bound is tight: it would catch a coarser format
    assert torch.equal(q.scale_inv, 1 / scale)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_cast_saturates(device, dtype):
    m = torch.finfo(dtype).max
    x = torch.tensor([1e9, -1e9, float("inf"), float("-inf"), 2 * m, 1.0], device=device)
    q = quantize.cast_to_fp8(x, torch.ones(1, device=device), dtype).data.float()
    assert torch.equal(q, torch.tensor([m, -m, m, -m, m, 1.0], device=device))
    assert torch.isfinite(q).all()


def test_cast_keeps_scale_inv_of_cast_time():
    scale = torch.tensor([4.0])
    q = quantize.cast_to_fp8(torch.ones(16), scale, E4M3)
    scale.fill_(8.0)  # a later scale update must not change the meaning of q
    assert q.scale_inv.item() == 0.25 and q.dequantize().eq(1).all()


def test_amax_before_scaling():
    x = torch.tensor([-7.5, 2.0, 3.0])
    assert quantize.amax(x).item() == 7.5
    assert quantize.amax(torch.empty(0)).item() == 0.0


def test_current_scale_edge_cases():
    s = quantize.current_scale(torch.tensor([2.0, 0.0, float("inf"), float("nan"), 1e-45]), E4M3)
    assert s[0].item() == 224.0 and s[1].item() == 1.0 and s[2].item() == 1.0 and s[3].item() == 1.0
    assert s[4].item() == torch.finfo(torch.float32).max


GEMM_PATHS = [pytest.param("cpu", "upcast", id="cpu-upcast"),
              pytest.param("cpu", "scaled_mm", id="cpu-scaled_mm"),
              pytest.param("cuda", "scaled_mm", id="cuda", marks=cuda_fp8)]
OPERAND_PAIRS = [pytest.param(E4M3, E4M3, id="e4m3xe4m3"), pytest.param(E4M3, E5M2, id="e4m3xe5m2"),
                 pytest.param(E5M2, E4M3, id="e5m2xe4m3")]


@pytest.mark.parametrize("device, cpu_gemm", GEMM_PATHS)
@pytest.mark.parametrize("a_dtype, b_dtype", OPERAND_PAIRS)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_fp8_gemm_matches_float64_on_dequantized_operands(device, cpu_gemm, a_dtype, b_dtype,
                                                         out_dtype):
    with kernel_config(cpu_gemm=cpu_gemm):
        _check_gemm_against_float64(device, a_dtype, b_dtype, out_dtype)


def _check_gemm_against_float64(device, a_dtype, b_dtype, out_dtype):
    a = quantize.cast_to_fp8(torch.randn(32, 64, device=device), torch.tensor([3.0], device=device),
                             a_dtype)
    b = quantize.cast_to_fp8(torch.randn(48, 64, device=device), torch.tensor([0.5], device=device),
                             b_dtype)
    bias = torch.randn(48, device=device)
    y = quantize.fp8_gemm(a, b, out_dtype, bias=bias)
    ref = a.dequantize(torch.float64) @ b.dequantize(torch.float64).t() + bias.to(out_dtype).double()
    assert y.dtype == out_dtype and y.shape == (32, 48)
    # float32 accumulation of exact products: a few float32 ulps of the largest term on CPU
    tol = 2 ** -8 if out_dtype == torch.bfloat16 else (1e-6 if device == "cpu" else CUDA_FP8_ACCUM_REL)
    assert (y.double() - ref).abs().max() <= tol * ref.abs().max()


def test_cpu_upcast_gemm_is_the_exact_product_when_sums_are_exact():
    """Integer-valued FP8 operands with small sums: every partial sum is exact in float32,
    so the upcast GEMM must equal the float64 product bit for bit, with each scale_inv
    applied once (a dropped or doubled scale would show)."""
    a = quantize.Float8Data(torch.randint(-8, 9, (32, 64)).to(E4M3), torch.tensor([0.25]))
    b = quantize.Float8Data(torch.randint(-8, 9, (48, 64)).to(E5M2), torch.tensor([8.0]))
    y = quantize.fp8_gemm(a, b, torch.float32)
    ref = (a.data.double() @ b.data.double().t()) * 2.0
    assert torch.equal(y.double(), ref)


def test_fp8_gemm_rejects_bad_operands():
    a = quantize.cast_to_fp8(torch.randn(32, 64), torch.ones(1), E5M2)
    with pytest.raises(TypeError, match="E5M2 x E5M2"):
        quantize.fp8_gemm(a, a, torch.float32)
    b = quantize.cast_to_fp8(torch.randn(32, 48), torch.ones(1), E4M3)
    with pytest.raises(ValueError, match=r"inner dimensions differ: a is \(32, 64\), b is \(32, 48\)"):
        quantize.fp8_gemm(a, b, torch.float32)
    c = quantize.cast_to_fp8(torch.randn(30, 64), torch.ones(1), E4M3)
    with pytest.raises(ValueError, match=r"fp8_gemm: FP8 execution requires .* height "
                                         r"divisible by 8 .*operand a of a \(30, 64\)"):
        quantize.fp8_gemm(c, a, torch.float32)
    with pytest.raises(TypeError, match="out_dtype must be one of"):
        quantize.fp8_gemm(b, b, torch.float64)


def test_amax_from_history_algorithms():
    h = torch.tensor([[1.0, 5.0], [3.0, 2.0], [2.0, 4.0]])
    assert torch.equal(delayed_scaling.amax_from_history(h, "max"), torch.tensor([3.0, 5.0]))
    assert torch.equal(delayed_scaling.amax_from_history(h, "most_recent"), torch.tensor([1.0, 5.0]))
    assert torch.equal(delayed_scaling.amax_from_history(h, lambda t: t[1:].sum(0)), torch.tensor([5.0, 6.0]))
    with pytest.raises(ValueError, match="must return a tensor of shape"):
        delayed_scaling.amax_from_history(h, lambda t: t.sum())


def test_scale_from_amax_formula_and_edge_cases():
    amax = torch.tensor([2.0, 0.0, float("nan"), float("inf"), 1e-44])
    old = torch.tensor([1.0, 7.0, 8.0, 9.0, 1.0])
    new = delayed_scaling.scale_from_amax(amax, old, 448.0, margin=1)
    assert new[0].item() == 448.0 / 2.0 / 2.0
    assert new[1:4].tolist() == [7.0, 8.0, 9.0]          # 0, NaN, inf keep the old scale
    assert new[4].item() == torch.finfo(torch.float32).max  # infinite scale is clamped


def test_roll_amax_history():
    h = torch.tensor([[9.0], [1.0], [2.0]])
    rolled = delayed_scaling.roll_amax_history(h)
    assert rolled.flatten().tolist() == [0.0, 2.0, 9.0]
    assert h.flatten().tolist() == [9.0, 1.0, 2.0]  # input untouched
