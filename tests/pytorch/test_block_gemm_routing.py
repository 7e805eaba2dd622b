"""Which Float8BlockScaling GEMMs go to Hopper's block-scaled ``torch._scaled_mm`` and
which are emulated (NOTE [Block-scaled GEMM routing] in block_scaling.py): the routing
decision and the operand layouts on the CPU; on Hopper, sweeps of GEMM shapes, dtypes
and block shapes, and of te.Linear's forward, dgrad and wgrad GEMMs, through the
hardware path or the emulation, never to an error."""

import itertools
import re

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import Float8BlockScaling, Format, QParams
from transformer_engine.pytorch import block_scaling
from transformer_engine.pytorch.block_scaling import (BLOCK, BlockScaledData, hardware_operands,
                                                      hardware_route, padded_k, quantize_blocks)
from transformer_engine.pytorch.kernel_config import kernel_config
from block_references import hopper_gemm_bound
from block_references import varied as _varied

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP32, BF16, FP16 = torch.float32, torch.bfloat16, torch.float16
hopper = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
    reason="Hopper's block-scaled FP8 GEMM needs an SM 9.0 GPU")


# ---- the decision, on the CPU ----------------------------------------------------------------

@pytest.mark.parametrize("m, k, n, a_rows, dtypes, out, reason", [
    (0, 256, 256, 1, (E4M3, E4M3), BF16, r"an empty dimension \(M=0, K=256, N=256\)"),
    (64, 0, 256, 1, (E4M3, E4M3), FP32, r"an empty dimension"),
    (64, 256, 0, 1, (E4M3, E4M3), FP32, r"an empty dimension"),
    (1, 256, 256, 1, (E4M3, E4M3), BF16, r"M=1 is not a multiple of 8"),
    (12, 256, 256, 1, (E4M3, E4M3), BF16, r"M=12 is not a multiple of 8"),
    (64, 256, 136, 1, (E4M3, E4M3), BF16, r"N=136 is not a multiple of 16"),
    (128, 256, 256, 128, (E4M3, E4M3), BF16, r"a is in 128x128 blocks"),
    (64, 256, 256, 1, (E5M2, E5M2), BF16, r"both operands are E5M2"),
    (64, 256, 256, 1, (E4M3, E4M3), FP16, r"the output dtype torch.float16"),
])
def test_route_refuses_up_front(m, k, n, a_rows, dtypes, out, reason):
    """Each configuration ``_scaled_mm`` cannot be given (or was not checked with) is
    refused by shape and dtype alone, before any call, with the reason."""
    found = hardware_route(m, k, n, a_rows, *dtypes, out)
    assert found is not None
    assert re.search(reason, found), found


def test_route_takes_the_rest():
    for (m, k, n), dtypes, out in itertools.product(
            [(8, 1, 16), (8, 16, 16), (24, 130, 48), (136, 4096, 144), (4096, 64, 4096)],
            [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)], [FP32, BF16]):
        assert hardware_route(m, k, n, 1, *dtypes, out) is None, (m, k, n, dtypes, out)


def test_cpu_operands_are_emulated():
    qa = quantize_blocks(_varied(64, 256, 1), E4M3, 1)
    qb = quantize_blocks(_varied(128, 256, 2), E4M3, 128)
    assert not block_scaling.hardware_gemm_fits(qa, qb, BF16)


def test_padded_k():
    """K padded to a multiple of 128 and at least 256 (two blocks: one block's scales
    would read as row-wise scaling), to a multiple of 512 for 128x128 ``b`` (its
    scales' leading stride a multiple of 4); no more than that."""
    for k in [1, 16, 128, 129, 256, 300, 512, 513, 1100]:
        one, two = padded_k(k, 1), padded_k(k, BLOCK)
        assert one % 128 == 0 and one >= max(k, 256) and (one == 256 or one - 128 < k)
        assert two % 512 == 0 and two >= k and (two == 512 or two - 512 < k)


def _scaled_mm_reference(a_data, b_data, scale_a, scale_b, b_rows):
    """What a block-scaled ``_scaled_mm`` computes from these tensors, in float64, read
    by its documented layouts: ``scale_a[i, j]`` scales row ``i`` of ``a``'s K-block
    ``j``; ``scale_b[j, c]`` column ``c`` (1x128) or column block ``c`` (128x128) of
    ``b``'s K-block ``j``."""
    m, k = a_data.shape
    n = b_data.shape[1]
    a64, b64 = a_data.double(), b_data.double()
    sa, sb = scale_a.double(), scale_b.double()
    if b_rows == BLOCK:
        sb = sb.repeat_interleave(BLOCK, dim=1)[:, :n]
    out = torch.zeros(m, n, dtype=torch.float64)
    for j in range(k // BLOCK):
        cols = slice(j * BLOCK, (j + 1) * BLOCK)
        out += sa[:, j:j + 1] * (a64[:, cols] @ b64[cols, :]) * sb[j:j + 1, :]
    return out


@pytest.mark.parametrize("b_rows", [1, BLOCK], ids=["b-1x128", "b-128x128"])
@pytest.mark.parametrize("m, k, n", [(8, 16, 16), (24, 300, 48), (136, 513, 144), (16, 128, 272)])
def test_hardware_operands_have_torchs_blockwise_layouts(m, k, n, b_rows):
    """The tensors handed to ``_scaled_mm`` have the shapes and strides of NOTE
    [Block-scaled GEMM routing], and read by those layouts they give the emulation's
    product (so no scale is transposed or misplaced); built on the CPU, from operands
    whose data is not contiguous."""
    qa = quantize_blocks(_varied(m, k, 1), E4M3, 1)
    qb = quantize_blocks(_varied(n, k, 2), E5M2, b_rows)
    qa = BlockScaledData(qa.data.t().contiguous().t(), qa.scale_inv, 1)     # a strided view
    assert not qa.data.is_contiguous() or m == 1
    a_data, b_data, scale_a, scale_b = hardware_operands(qa, qb)
    kp = padded_k(k, b_rows)
    kb = kp // BLOCK
    assert a_data.shape == (m, kp) and a_data.stride() == (kp, 1)
    assert b_data.shape == (kp, n) and b_data.stride() == (1, kp)
    assert scale_a.shape == (m, kb) and scale_a.stride() == (1, m)
    if b_rows == 1:
        assert scale_b.shape == (kb, n) and scale_b.stride() == (n, 1)
    else:
        assert scale_b.shape == (kb, -(-n // BLOCK)) and scale_b.stride() == (1, kb)
        assert kb % 4 == 0
    assert kb >= 2 and scale_a.dtype == scale_b.dtype == torch.float32
    assert torch.all(a_data[:, k:].view(torch.uint8) == 0)
    assert torch.all(scale_a[:, -(-k // BLOCK):] == 1)
    got = _scaled_mm_reference(a_data, b_data, scale_a, scale_b, b_rows)
    want = qa.dequantize(torch.float64) @ qb.dequantize(torch.float64).t()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


# ---- on Hopper: sweeps -----------------------------------------------------------------------

SWEEP_M = [0, 1, 8, 12, 24, 120, 128, 136]
SWEEP_K = [16, 64, 128, 144, 256, 640]
SWEEP_N = [16, 48, 128, 136, 144]


@hopper
@pytest.mark.parametrize("out", [FP32, BF16, FP16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("dtypes", [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2), (E5M2, E5M2)],
                         ids=["e4m3-e4m3", "e5m2-e4m3", "e4m3-e5m2", "e5m2-e5m2"])
@pytest.mark.parametrize("rows", [(1, 1), (1, BLOCK), (BLOCK, 1)],
                         ids=["1x128-1x128", "1x128-128x128", "128x128-1x128"])
def test_block_gemm_sweep(rows, dtypes, out):
    """Every shape, with and without bias: the GEMM never raises; one the routing
    takes is within Hopper's accumulation bound of the float64 product (then rounded
    to ``out``), one it refuses equals the emulation bit for bit."""
    taken = refused = 0
    for m, k, n in itertools.product(SWEEP_M, SWEEP_K, SWEEP_N):
        qa = quantize_blocks(_varied(m, k, 1).cuda(), dtypes[0], rows[0])
        qb = quantize_blocks(_varied(n, k, 2).cuda(), dtypes[1], rows[1])
        bias = torch.randn(n, generator=torch.Generator().manual_seed(m + k + n)).cuda()
        fits = block_scaling.hardware_gemm_fits(qa, qb, out)
        assert fits == (hardware_route(m, k, n, rows[0], *dtypes, out) is None)
        for b in (None, bias):
            try:
                got = block_scaling.block_gemm(qa, qb, out, b)
            except RuntimeError as err:
                pytest.fail(f"M={m} K={k} N={n} bias={b is not None}: {err}")
            assert got.shape == (m, n) and got.dtype == out
            if not fits:
                assert torch.equal(got, block_scaling.emulated_block_gemm(qa, qb, out, b))
                refused += 1
                continue
            taken += 1
            a64, b64 = qa.dequantize(torch.float64).cpu(), qb.dequantize(torch.float64).cpu()
            ref = a64 @ b64.t() + (0 if b is None else b.cpu().double())
            bound = hopper_gemm_bound(a64, b64) + torch.finfo(out).eps * ref.abs()
            assert torch.all((got.cpu().double() - ref).abs() <= bound), (m, k, n)
    assert refused > 0
    assert taken > 0 or rows[0] == BLOCK or out == FP16 or dtypes == (E5M2, E5M2)


def _linear_run(recipe, tokens, in_f, out_f, dtype, bias, seed=0):
    torch.manual_seed(seed)
    lin = te.Linear(in_f, out_f, bias=bias, params_dtype=dtype, device="cuda")
    x = torch.randn(tokens, in_f, dtype=dtype, device="cuda", requires_grad=True)
    with te.autocast(recipe=recipe):
        y = lin(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    return [y.detach(), x.grad] + [p.grad for p in lin.parameters()]


RECIPE_VARIANTS = {
    "default": Float8BlockScaling(),
    "hybrid": Float8BlockScaling(fp8_format=Format.HYBRID),
    "x2d": Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1),
    "w1d": Float8BlockScaling(w_block_scaling_dim=1),
    "fp32-scales": Float8BlockScaling(fp8_quant_fwd_inp=QParams(power_2_scale=False),
                                      fp8_quant_fwd_weight=QParams(power_2_scale=False),
                                      fp8_quant_bwd_grad=QParams(power_2_scale=False)),
}


@hopper
@pytest.mark.parametrize("dtype", [FP32, BF16, FP16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("variant", list(RECIPE_VARIANTS))
def test_linear_sweep_never_errors(variant, dtype):
    """te.Linear's forward, dgrad and wgrad GEMMs (each with its own M, K and N, and
    with the zero and one token inputs TE's tests use) on the hardware path: no error,
    and the results close to the same run emulated."""
    recipe = RECIPE_VARIANTS[variant]
    for tokens, (in_f, out_f), bias in itertools.product(
            [0, 1, 8, 24, 136], [(64, 256), (96, 48), (160, 144), (256, 64)], [False, True]):
        try:
            hw = _linear_run(recipe, tokens, in_f, out_f, dtype, bias)
        except RuntimeError as err:
            pytest.fail(f"tokens={tokens} in={in_f} out={out_f} bias={bias}: {err}")
        with kernel_config(block_gemm="emulation"):
            emu = _linear_run(recipe, tokens, in_f, out_f, dtype, bias)
        for got, want in zip(hw, emu):
            scale = want.abs().max().item() if want.numel() else 0.0
            torch.testing.assert_close(got, want, rtol=2 ** -5, atol=2 ** -6 * scale + 1e-6)
