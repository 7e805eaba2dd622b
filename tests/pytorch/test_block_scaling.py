"""Float8BlockScaling's quantization and GEMM (block_scaling.py) against float64
references written block by block (block_references.py): per-block amaxes and scales,
power-of-2 scales, partial last blocks, zeros, NaN, the columnwise copies, and each GEMM
of a linear layer (forward, dgrad, wgrad, each with its own K)."""

import math

import pytest
import torch

from transformer_engine.pytorch import block_scaling
from transformer_engine.pytorch.block_scaling import cast_blocks, quantize_blocks
from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
from transformer_engine.pytorch.kernel_config import kernel_config
from block_references import accumulation_bound, fp8_gemm_bound, hopper_gemm_bound, quantize_ref
from block_references import varied as _varied

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
DTYPES = [pytest.param(E4M3, id="e4m3"), pytest.param(E5M2, id="e5m2")]
BLOCKS = [pytest.param(1, id="1x128"), pytest.param(128, id="128x128")]
# shapes with whole and partial blocks along each dimension
SHAPES = [(256, 384), (130, 257), (3, 300), (1, 1), (200, 128)]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (the emulation runs on any)"))]
hopper = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
    reason="Hopper's block-scaled FP8 GEMM needs an SM 9.0 GPU")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("power_2", [True, False], ids=["pow2", "fp32-scales"])
@pytest.mark.parametrize("block_rows", BLOCKS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_quantize_matches_blockwise_reference(shape, dtype, block_rows, power_2, device):
    x = _varied(*shape)
    q = quantize_blocks(x.to(device), dtype, block_rows, power_2_scale=power_2)
    values, scale_inv = quantize_ref(x, dtype, block_rows, power_2)
    assert q.data.dtype == dtype and q.data.shape == shape
    rb, cb = math.ceil(shape[0] / block_rows), math.ceil(shape[1] / 128)
    assert q.scale_inv.shape == (rb, cb) and q.scale_inv.dtype == torch.float32
    got = q.dequantize(torch.float64).cpu()
    assert torch.equal(got, values)
    expanded = q.scale_inv.cpu().double().repeat_interleave(block_rows, 0)[:shape[0]]
    assert torch.equal(expanded.repeat_interleave(128, 1)[:, :shape[1]], scale_inv)
    if rb * cb > 1:       # the data really has a scale per block
        assert q.scale_inv.unique().numel() > 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_power_2_scale_is_the_largest_that_fits(dtype):
    """Each scale is a power of two, and the largest one with ``amax * scale <=
    fp8_max``: so the block's largest value lands in the top binade, never overflows."""
    x = _varied(64, 1024, seed=3)
    q = quantize_blocks(x, dtype, 1, power_2_scale=True)
    scale = torch.reciprocal(q.scale_inv.double())
    mantissa, _ = torch.frexp(scale)
    assert torch.all(mantissa == 0.5)
    amax = x.double().abs().view(64, 8, 128).amax(-1)
    fp8_max = torch.finfo(dtype).max
    assert torch.all(amax * scale <= fp8_max) and torch.all(amax * scale * 2 > fp8_max)


def test_partial_last_block_scales_from_its_own_values():
    """A row of 130 values has a full block and one of 2 values; the 2 small values get
    their own (large) scale, not the full block's, and the padding never shows."""
    x = torch.full((2, 130), 100.0)
    x[:, 128:] = torch.tensor([[0.01, -0.02], [0.03, 0.0]])
    q = quantize_blocks(x, E4M3, 1, power_2_scale=True)
    assert q.data.shape == (2, 130)
    assert torch.equal(q.scale_inv[:, 0], torch.full((2,), 0.25))        # 448 / 100 -> 4
    assert torch.equal(q.scale_inv[:, 1], torch.tensor([2.0 ** -14, 2.0 ** -13]))
    torch.testing.assert_close(q.dequantize()[:, 128:], x[:, 128:], rtol=2 ** -4, atol=0)


@pytest.mark.parametrize("block_rows", BLOCKS)
def test_zero_blocks_keep_scale_one_and_stay_zero(block_rows):
    x = _varied(256, 256)
    x[:128, :128] = 0.0
    q = quantize_blocks(x, E4M3, block_rows)
    zero_rows = 1 if block_rows == 128 else 128
    assert torch.equal(q.scale_inv[:zero_rows, 0], torch.ones(zero_rows))
    assert torch.equal(q.dequantize()[:128, :128], torch.zeros(128, 128))
    assert torch.equal(q.dequantize(torch.float64), quantize_ref(x, E4M3, block_rows)[0])
    empty = quantize_blocks(torch.zeros(0, 5), E4M3, block_rows)
    assert empty.data.shape == (0, 5) and empty.dequantize().shape == (0, 5)


def test_amax_epsilon_floors_the_block_amax():
    x = torch.full((1, 256), 1e-6)
    x[0, 128:] = 3.0
    q = quantize_blocks(x, E4M3, 1, power_2_scale=False, amax_epsilon=1e-2)
    # the tiny block scales from 1e-2, the other from its own amax 3.0
    expect = torch.tensor([448.0], dtype=torch.float32) / torch.tensor([1e-2, 3.0])
    assert torch.equal(q.scale_inv[0], torch.reciprocal(expect))
    plain = quantize_blocks(x, E4M3, 1, power_2_scale=False)
    assert plain.scale_inv[0, 0] < q.scale_inv[0, 0]


def test_non_finite_block_uses_scale_one_and_is_counted_once():
    FP8GlobalStateManager.reset_non_finite_amax_count()
    x = _varied(4, 384)
    x[1, 5] = float("nan")
    x[2, 300] = float("inf")
    before = quantize_blocks(x, E4M3, 1)
    assert before.scale_inv[1, 0] == 1.0 and before.scale_inv[2, 2] == 1.0
    assert torch.isnan(before.dequantize()[1, 5])
    assert before.dequantize()[2, 300] == 448.0                       # saturated, not inf
    clean = quantize_blocks(x.nan_to_num(0.0, 0.0, 0.0), E4M3, 1)
    assert torch.equal(before.scale_inv[0], clean.scale_inv[0])      # other blocks unaffected
    cast_blocks(x, E4M3, 1, True, 0.0, rowwise=True, columnwise=True)
    assert FP8GlobalStateManager.get_non_finite_amax_count() == 1
    FP8GlobalStateManager.reset_non_finite_amax_count()


def test_columnwise_copy_of_1d_blocks_is_quantized_anew():
    """1x128 blocks: the columnwise copy has blocks along the original columns, so it is
    the transpose quantized from high precision, which differs from transposing the
    rowwise FP8 data."""
    x = _varied(256, 384)
    row, col = cast_blocks(x, E4M3, 1, True, 0.0, rowwise=True, columnwise=True)
    values, _ = quantize_ref(x.t(), E4M3, 1)
    assert col.data.shape == (384, 256) and torch.equal(col.dequantize(torch.float64), values)
    assert not torch.equal(col.dequantize(), row.dequantize().t())
    with pytest.raises(ValueError, match="1x128 blocks cannot be transposed in FP8"):
        row.t_contiguous()


def test_columnwise_copy_of_2d_blocks_is_the_transpose():
    x = _varied(300, 200)
    row, col = cast_blocks(x, E4M3, 128, True, 0.0, rowwise=True, columnwise=True)
    assert torch.equal(col.data.view(torch.uint8), row.data.t().contiguous().view(torch.uint8))
    assert torch.equal(col.scale_inv, row.scale_inv.t())
    values, _ = quantize_ref(x.t(), E4M3, 128)                 # a tile covers the same values
    assert torch.equal(col.dequantize(torch.float64), values)
    only_col = cast_blocks(x, E4M3, 128, True, 0.0, rowwise=False, columnwise=True)
    assert only_col[0] is None and torch.equal(only_col[1].scale_inv, col.scale_inv)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused cast runs on CUDA")
@pytest.mark.parametrize("layout", ["row-major", "transposed-view", "with-nan-inf"])
@pytest.mark.parametrize("eps", [0.0, 0.5], ids=["no-eps", "eps"])
@pytest.mark.parametrize("power_2", [True, False], ids=["pow2", "fp32-scales"])
@pytest.mark.parametrize("block_rows", BLOCKS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_fused_cast_equals_the_torch_path(shape, dtype, block_rows, power_2, eps, layout):
    """On CUDA the block cast is one Triton pass (NOTE [Kernel selection]): the same FP8
    bits, scales and non-finite count as the torch ops, for float32 and bfloat16
    inputs, any strides, partial blocks, NaN and inf."""
    rows, cols = shape
    for hp in (torch.float32, torch.bfloat16):
        x = _varied(rows, cols, rows + cols, spread=8)
        if layout == "transposed-view":
            x = _varied(cols, rows, 1, spread=8).t()
        if layout == "with-nan-inf":
            x = x.clone()
            x.view(-1)[0] = float("nan")
            x.view(-1)[-1] = float("inf")
        x = x.to(device="cuda", dtype=hp)
        before = FP8GlobalStateManager.get_non_finite_amax_count()
        got = cast_blocks(x, dtype, block_rows, power_2, eps, rowwise=True, columnwise=True)
        fused = FP8GlobalStateManager.get_non_finite_amax_count()
        with kernel_config(fused=False):
            ref = cast_blocks(x, dtype, block_rows, power_2, eps, rowwise=True, columnwise=True)
        counted = (fused - before, FP8GlobalStateManager.get_non_finite_amax_count() - fused)
        assert counted == ((1, 1) if layout == "with-nan-inf" else (0, 0))
        for g, r in zip(got, ref):
            assert g.block_rows == r.block_rows and torch.equal(g.scale_inv, r.scale_inv)
            assert g.data.is_contiguous() and g.data.shape == r.data.shape
            assert torch.equal(g.data.view(torch.uint8), r.data.view(torch.uint8))


# ---- the GEMM ----------------------------------------------------------------------------

def _small_integers(rows, cols, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, (rows, cols), generator=g).float()


def test_gemm_of_quantized_operands_is_exact():
    """Operands whose FP8 values are small integers times power-of-2 block scales: every
    product and every partial sum is exact in float32, so the emulated GEMM equals the
    float64 product of the dequantized operands bit for bit."""
    a = _small_integers(64, 384, 0) * torch.exp2(torch.tensor([-3.0, 0.0, 2.0])).repeat_interleave(128)
    b = _small_integers(48, 384, 1) * 0.5
    qa = quantize_blocks(a, E4M3, 1)
    qb = quantize_blocks(b, E4M3, 128)
    assert torch.equal(qa.dequantize(), a) and torch.equal(qb.dequantize(), b)
    assert not block_scaling.hardware_gemm_fits(qa, qb)        # CPU tensors: the emulation
    out = block_scaling.block_gemm(qa, qb, torch.float32)
    assert torch.equal(out.double(), a.double() @ b.double().t())


@pytest.mark.parametrize("device", DEVICES)
def test_emulated_gemm_matches_float64_of_its_operands(device):
    """Random operands: the emulation's float32 GEMM of exact dequantized values is
    within float32 accumulation error of the float64 product; bias and output dtype as
    documented."""
    qa = quantize_blocks(_varied(200, 300, 1).to(device), E4M3, 1)
    qb = quantize_blocks(_varied(136, 300, 2).to(device), E5M2, 128)
    a64, b64 = qa.dequantize(torch.float64).cpu(), qb.dequantize(torch.float64).cpu()
    bias = torch.randn(136)
    out = block_scaling.emulated_block_gemm(qa, qb, torch.float32, bias.to(device)).cpu()
    ref = a64 @ b64.t() + bias.double()
    assert torch.all((out.double() - ref).abs() <= accumulation_bound(a64, b64) + 1e-30)
    bf16 = block_scaling.emulated_block_gemm(qa, qb, torch.bfloat16, bias.to(device)).cpu()
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, out.to(torch.bfloat16))
    with pytest.raises(ValueError, match="inner dimensions differ"):
        block_scaling.block_gemm(qa, quantize_blocks(torch.ones(4, 5), E4M3, 1), torch.float32)


# (M, N, K): K in whole 512s, in 128s but not 512s, in partial blocks; N one block or more
HOPPER_SHAPES = [(256, 384, 512), (128, 256, 256), (64, 256, 384), (200, 384, 320),
                 (8, 16, 16), (24, 48, 272), (136, 208, 300)]


@hopper
@pytest.mark.parametrize("b_rows", BLOCKS)
@pytest.mark.parametrize("dtypes", [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)],
                         ids=["e4m3-e4m3", "e5m2-e4m3", "e4m3-e5m2"])
@pytest.mark.parametrize("shape", HOPPER_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_hopper_gemm_within_its_accumulation_bound(shape, dtypes, b_rows):
    """On Hopper a GEMM that fits runs on torch._scaled_mm's block-scaled path: within
    Hopper's accumulation bound of the float64 product of the dequantized operands,
    with and without bias, in float32 and bfloat16; the emulation setting turns it off."""
    m, n, k = shape
    qa = quantize_blocks(_varied(m, k, 1).cuda(), dtypes[0], 1)
    qb = quantize_blocks(_varied(n, k, 2).cuda(), dtypes[1], b_rows)
    assert block_scaling.hardware_gemm_fits(qa, qb)
    a64, b64 = qa.dequantize(torch.float64).cpu(), qb.dequantize(torch.float64).cpu()
    bias = torch.randn(n)
    product = a64 @ b64.t()
    out = block_scaling.block_gemm(qa, qb, torch.float32, bias.cuda()).cpu().double()
    ref = product + bias.double()
    assert torch.all((out - ref).abs() <= hopper_gemm_bound(a64, b64) + 2 ** -24 * ref.abs())
    bf16 = block_scaling.block_gemm(qa, qb, torch.bfloat16).cpu()
    assert bf16.dtype == torch.bfloat16
    assert torch.all((bf16.double() - product).abs()
                     <= hopper_gemm_bound(a64, b64) + 2 ** -8 * product.abs())
    with kernel_config(block_gemm="emulation"):
        assert not block_scaling.hardware_gemm_fits(qa, qb)
        assert torch.equal(block_scaling.block_gemm(qa, qb, torch.float32),
                           block_scaling.emulated_block_gemm(qa, qb, torch.float32))


@hopper
def test_float16_output_is_emulated():
    """The hardware path was checked with float32 and bfloat16 outputs only: a float16
    output takes the emulation, bit for bit, even where the shapes fit."""
    qa = quantize_blocks(_varied(64, 256, 1).cuda(), E4M3, 1)
    qb = quantize_blocks(_varied(128, 256, 2).cuda(), E4M3, 128)
    assert block_scaling.hardware_gemm_fits(qa, qb)
    assert torch.equal(block_scaling.block_gemm(qa, qb, torch.float16),
                       block_scaling.emulated_block_gemm(qa, qb, torch.float16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("shape, a_rows", [((12, 16, 256), 1), ((16, 136, 256), 1),
                                           ((256, 256, 256), 128)],
                         ids=["M-not-8", "N-not-16", "a-in-128x128"])
def test_gemms_the_hardware_cannot_take_are_emulated(shape, a_rows):
    """M not a multiple of 8, N not of 16, or ``a`` in 128x128 blocks: the emulation,
    bit for bit."""
    m, n, k = shape
    qa = quantize_blocks(_varied(m, k, 1).cuda(), E4M3, a_rows)
    qb = quantize_blocks(_varied(n, k, 2).cuda(), E4M3, 1)
    assert not block_scaling.hardware_gemm_fits(qa, qb)
    assert torch.equal(block_scaling.block_gemm(qa, qb, torch.bfloat16),
                       block_scaling.emulated_block_gemm(qa, qb, torch.bfloat16))


# The three GEMMs of a linear layer y = x W^T, each with its own K (NOTE [GEMM
# vocabulary]): (name, a, b) for a @ b^T, with the recipe's default block shapes (x and
# dy in 1x128 blocks, W in 128x128) and E4M3 throughout, as Float8BlockScaling() has.
M, IN, OUT = 200, 300, 136


def _linear_operands(name):
    x, w, dy = _varied(M, IN, 4), _varied(OUT, IN, 5) / 64, _varied(M, OUT, 6)
    if name == "forward":     # K = in features
        return (x, 1), (w, 128)
    if name == "dgrad":       # K = out features
        return (dy, 1), (w.t(), 128)
    return (dy.t(), 1), (x.t(), 1)    # wgrad: K = tokens, the columnwise copies


@pytest.mark.parametrize("name", ["forward", "dgrad", "wgrad"])
def test_each_gemm_against_float64(name):
    """The GEMM on block-quantized operands is within the FP8 rounding bound of the
    float64 product of the unquantized operands (each operand off by at most half an
    E4M3 ulp, 2**-4 relative, or half a subnormal step times its block's scale_inv;
    plus float32 accumulation), and it equals the GEMM of the reference-quantized
    operands to float32 accumulation."""
    (a, a_rows), (b, b_rows) = _linear_operands(name)
    qa, qb = quantize_blocks(a, E4M3, a_rows), quantize_blocks(b, E4M3, b_rows)
    out = block_scaling.block_gemm(qa, qb, torch.float32).double()
    (a_ref, a_sinv), (b_ref, b_sinv) = quantize_ref(a, E4M3, a_rows), quantize_ref(b, E4M3, b_rows)
    assert torch.all((out - a_ref @ b_ref.t()).abs() <= accumulation_bound(a_ref, b_ref))
    exact = a.double() @ b.double().t()
    bound = fp8_gemm_bound(a, a_ref, a_sinv, E4M3, b, b_ref, b_sinv, E4M3)
    assert torch.all((out - exact).abs() <= bound)
    assert (out - exact).abs().max() > 0                   # it did quantize
