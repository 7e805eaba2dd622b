"""MXFP8 and NVFP4 quantization, bit for bit against an independent reference written
here with exact rationals (`fractions.Fraction`): the float32 steps of the scale
computations rounded exactly, every E4M3 / E5M2 / E2M1 value and every tie between two
of them, subnormals, zeros, NaN and inf; and the emulated GEMMs against float64 sums of
the dequantized operands."""

import math
from fractions import Fraction

import pytest
import torch

from helpers import DEVICES
from transformer_engine.pytorch import mx_scaling, nvfp4_scaling

# ---- the reference ---------------------------------------------------------------------------


def round_binary(q: Fraction, mant_bits: int, min_exp: int, max_value=None):
    """``q`` rounded to nearest even on a binary grid with ``mant_bits`` fraction bits
    and smallest normal exponent ``min_exp`` (subnormals below it); above
    ``max_value``: ``inf`` (None) is not checked here, the caller saturates."""
    if q == 0:
        return Fraction(0)
    sign = -1 if q < 0 else 1
    q = abs(q)
    e = q.numerator.bit_length() - q.denominator.bit_length()
    if Fraction(2) ** e > q:
        e -= 1
    e = max(e, min_exp)
    unit = Fraction(2) ** (e - mant_bits)
    n, rem = divmod(q, unit)
    n = int(n)
    if rem * 2 > unit or (rem * 2 == unit and n % 2 == 1):
        n += 1
    return sign * n * unit


def f32(q) -> float:
    """Exact rational ``q`` rounded to the nearest float32 (inf past the largest)."""
    r = round_binary(Fraction(q), 23, -126)
    if abs(r) > Fraction(2) ** 128 - Fraction(2) ** 104:
        return math.copysign(math.inf, r)
    return float(r)


def grid(kind):
    """(mantissa bits, smallest normal exponent, largest finite value) of a format."""
    return {"e4m3": (3, -6, 448), "e5m2": (2, -14, 57344), "e2m1": (1, 0, 6)}[kind]


def to_format(x: float, kind: str) -> float:
    """``x`` cast to an FP8 / FP4 format: round to nearest even, saturating at the
    largest finite value (NaN stays NaN)."""
    if math.isnan(x):
        return math.nan
    m, emin, top = grid(kind)
    if math.isinf(x):
        return math.copysign(top, x)
    r = round_binary(Fraction(x), m, emin)
    r = max(min(r, top), -top)
    return math.copysign(float(r), x) if r == 0 else float(r)


def all_values(kind: str):
    """Every non-negative finite value of a format."""
    m, emin, top = grid(kind)
    values = {0.0}
    for e in range(emin, 17):
        for k in range(2 ** m):
            v = (1 + k / 2 ** m) * 2.0 ** e
            if v <= top:
                values.add(v)
    for k in range(1, 2 ** m):
        values.add(k / 2 ** m * 2.0 ** emin)
    return sorted(values)


def ref_mxfp8(x: torch.Tensor, kind: str):
    """Reference MXFP8 of a 2-D float32 ``x`` in 1x32 blocks: (values, E8M0 exponents)."""
    fp8_max = grid(kind)[2]
    rows, cols = x.shape
    values = [[0.0] * cols for _ in range(rows)]
    exps = []
    rcp = f32(Fraction(1, fp8_max))
    for r in range(rows):
        row_exps = []
        for c0 in range(0, cols, 32):
            block = [float(v) for v in x[r, c0:c0 + 32].tolist()]
            amax = max((abs(v) for v in block if not math.isnan(v)), default=0.0)
            v = math.inf if math.isinf(amax) else f32(Fraction(amax) * Fraction(rcp))
            if math.isinf(v):
                e = 254
            elif v == 0:
                e = 0
            else:       # the least e with 2**(e - 127) >= v, within [0, 254]
                e = 0
                while Fraction(2) ** (e - 127) < Fraction(v) and e < 254:
                    e += 1
            row_exps.append(e)
            for i, xv in enumerate(block):
                scaled = xv * 2.0 ** (127 - e) if not math.isinf(xv) else xv
                values[r][c0 + i] = to_format(scaled, kind)
        exps.append(row_exps)
    return values, exps


def assert_values(got: torch.Tensor, expected):
    exp = torch.tensor(expected, dtype=torch.float64)
    got = got.to(torch.float64).cpu()
    nan = torch.isnan(exp)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan], exp[~nan])
    assert torch.equal(torch.signbit(got[~nan]), torch.signbit(exp[~nan]))


def mx_inputs(kind: str) -> torch.Tensor:
    """Rows of 32 (and a partial block): every value of the format at scale 1 and at
    other powers of two, every tie between neighbours, subnormal float32 inputs,
    zeros, random magnitudes over many octaves, NaN and inf."""
    values = all_values(kind)
    top = values[-1]
    ties = [(a + b) / 2 for a, b in zip(values, values[1:])]
    rows = []
    for seq in (values, [-v for v in values], ties, [-t for t in ties]):
        for i in range(0, len(seq), 31):
            chunk = seq[i:i + 31]
            for shift in (0, -20, 37):
                row = [v * 2.0 ** shift for v in chunk] + [top * 2.0 ** shift]
                rows.append(row + [0.0] * (32 - len(row)))
    g = torch.Generator().manual_seed(0)
    rnd = torch.randn(24, 32, generator=g) * torch.exp2(torch.randint(-40, 40, (24, 1),
                                                                      generator=g).float())
    rows += rnd.tolist()
    rows.append([1e-45 * (i + 1) for i in range(32)])         # float32 subnormals
    rows.append([0.0] * 32)
    rows.append([1.0, math.nan] + [0.25] * 30)
    rows.append([math.inf, 1.0] + [-2.0] * 30)
    rows.append([3.0e38, -1.0] + [5.0] * 30)
    x = torch.tensor(rows, dtype=torch.float32)
    return torch.cat((x, x[:, :7] * 3.0), dim=1)                # a partial last block


# ---- MXFP8 -----------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["e4m3", "e5m2"])
def test_mxfp8_quantize_matches_reference(device, kind):
    dtype = torch.float8_e4m3fn if kind == "e4m3" else torch.float8_e5m2
    x = mx_inputs(kind)
    q = mx_scaling.mxfp8_quantize(x.to(device), dtype)
    values, exps = ref_mxfp8(x, kind)
    assert q.data.dtype == dtype and q.scale_inv.dtype == torch.uint8
    assert q.scale_inv.tolist() == exps
    assert_values(q.data, values)
    # the value is data * 2**(e - 127): exact
    deq = q.dequantize().double().cpu()
    scale = torch.tensor([[2.0 ** (e - 127) for e in row for _ in range(32)][:x.shape[1]]
                          for row in exps], dtype=torch.float64)
    expected = torch.tensor(values, dtype=torch.float64) * scale
    expected = expected.float().double()        # float32 overflow of 448 * 2**127: inf
    finite = ~torch.isnan(expected)
    assert torch.equal(deq[finite], expected[finite])


@pytest.mark.parametrize("device", DEVICES)
def test_mxfp8_bf16_input_and_columnwise_copy(device):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(40, 70, generator=g) * 3).to(torch.bfloat16)
    row, col = mx_scaling.cast_mxfp8(x.to(device), torch.float8_e4m3fn, 1, True, True)
    values, exps = ref_mxfp8(x.float(), "e4m3")
    assert row.scale_inv.tolist() == exps
    assert_values(row.data, values)
    values_t, exps_t = ref_mxfp8(x.float().t().contiguous(), "e4m3")
    assert col.scale_inv.tolist() == exps_t and tuple(col.data.shape) == (70, 40)
    assert_values(col.data, values_t)


@pytest.mark.parametrize("device", DEVICES)
def test_mxfp8_2d_tiles_share_one_scale(device):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 96, generator=g)
    row, col = mx_scaling.cast_mxfp8(x.to(device), torch.float8_e4m3fn, 32, True, True)
    assert tuple(row.scale_inv.shape) == (2, 3)
    for i in range(2):
        for j in range(3):
            amax = x[32 * i:32 * i + 32, 32 * j:32 * j + 32].abs().max().item()
            e = 0
            while 2.0 ** (e - 127) < f32(Fraction(amax) * Fraction(f32(Fraction(1, 448)))):
                e += 1
            assert row.scale_inv[i, j].item() == e
    assert torch.equal(col.dequantize(), row.dequantize().t())


def test_e8m0_rounds_up_and_saturates():
    tiny = 2.0 ** -127
    v = torch.tensor([0.0, tiny, tiny * 1.5, 1.0, 1.0000001, 0.75, 2.0 ** 126 * 1.5, math.inf,
                      math.nan, 1e-45], dtype=torch.float32)
    assert mx_scaling.e8m0_round_up(v).tolist() == [0, 0, 1, 127, 128, 127, 254, 254, 255, 0]
    e = torch.tensor([0, 1, 127, 254, 255], dtype=torch.uint8)
    got = mx_scaling.e8m0_to_float(e).tolist()
    assert got[:4] == [tiny, 2.0 ** -126, 1.0, 2.0 ** 127] and math.isnan(got[4])


# ---- NVFP4 -----------------------------------------------------------------------------------

def ref_e2m1_stochastic(v: float, u: float) -> float:
    mag = abs(v)
    if math.isnan(v):
        return 6.0
    grid_ = all_values("e2m1")
    if mag >= 6:
        return math.copysign(6.0, v)
    lo = max(g for g in grid_ if g <= mag)
    hi = min(g for g in grid_ if g > mag)
    out = hi if Fraction(u) < (Fraction(mag) - Fraction(lo)) / (Fraction(hi) - Fraction(lo)) \
        else lo
    return math.copysign(out, v)


def ref_nvfp4(x: torch.Tensor, block_rows: int = 1, uniform=None):
    """Reference NVFP4 of a 2-D float32 ``x``: (values, block scales, global decode)."""
    rows, cols = x.shape
    xs = x.tolist()
    finite = [abs(v) for row in xs for v in row if not math.isnan(v)]
    amax = max(finite, default=0.0)
    if amax == 0 or math.isinf(amax):
        s_enc = 1.0
    else:
        s_enc = min(f32(Fraction(2688) / Fraction(amax)), torch.finfo(torch.float32).max)
        s_enc = 1.0 if s_enc == 0 else s_enc
    s_dec = f32(Fraction(float(1.0 / s_enc)))       # float32(float64(1 / S_enc))
    sixth = f32(Fraction(1, 6))
    k = f32(Fraction(s_enc) * Fraction(sixth))
    values = [[0.0] * cols for _ in range(rows)]
    scales = []
    for r0 in range(0, rows, block_rows):
        srow = []
        for c0 in range(0, cols, 16):
            block = [xs[r][c] for r in range(r0, min(r0 + block_rows, rows))
                     for c in range(c0, min(c0 + 16, cols))]
            bamax = max((abs(v) for v in block if not math.isnan(v)), default=0.0)
            sb = math.inf if math.isinf(bamax) else f32(Fraction(bamax) * Fraction(k))
            sb = to_format(min(sb, 448.0), "e4m3")
            srow.append(sb)
            prod = f32(Fraction(sb) * Fraction(s_dec))
            enc = torch.finfo(torch.float32).max if prod == 0 else min(
                f32(1 / Fraction(prod)), torch.finfo(torch.float32).max)
            for r in range(r0, min(r0 + block_rows, rows)):
                for c in range(c0, min(c0 + 16, cols)):
                    xv = xs[r][c]
                    scaled = xv if math.isnan(xv) or math.isinf(xv) else math.copysign(
                        f32(Fraction(xv) * Fraction(enc)), xv)      # (-0 stays -0)
                    if uniform is None:
                        out = 6.0 if math.isnan(scaled) else to_format(scaled, "e2m1")
                    else:
                        out = ref_e2m1_stochastic(scaled, uniform[r][c])
                    values[r][c] = out
        scales.append(srow)
    return values, scales, s_dec


def nvfp4_inputs() -> torch.Tensor:
    values = all_values("e2m1")
    ties = [(a + b) / 2 for a, b in zip(values, values[1:])]
    # amax 448 * 6: the global scale is 1, and a block of amax 6 * 2**s has the block
    # scale 2**s, so the values and ties of each block below land on E2M1 values and ties
    rows = [[2688.0] + [0.0] * 31]
    for seq in (values + ties, [-v for v in values + ties]):
        for shift in (0, -3, 5):
            rows.append([v * 2.0 ** shift for v in seq + [6.0]] + [0.0] * 16)
    g = torch.Generator().manual_seed(3)
    rows += (torch.randn(12, 32, generator=g) * torch.exp2(
        torch.randint(-12, 6, (12, 1), generator=g).float())).tolist()
    rows.append([0.0] * 32)
    rows.append([1e-40] + [0.0] * 31)
    rows.append([1.0, math.nan] + [0.25] * 30)
    x = torch.tensor(rows, dtype=torch.float32)
    return torch.cat((x, x[:, :5]), dim=1)      # a partial block, odd column count


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_rows", [1, 16])
def test_nvfp4_quantize_matches_reference(device, block_rows):
    x = nvfp4_inputs()
    q = nvfp4_scaling.nvfp4_quantize(x.to(device), block_rows)
    values, scales, s_dec = ref_nvfp4(x, block_rows)
    assert q.global_scale_inv.item() == s_dec
    assert q.scale_inv.dtype == torch.float8_e4m3fn
    assert q.scale_inv.float().cpu().tolist() == scales
    assert_values(nvfp4_scaling.e2m1_codes_to_float(q.codes()), values)
    # dequantize: (e2m1 * block scale) * global decode scale, float32
    expected = torch.tensor(values) * torch.tensor(scales).repeat_interleave(
        block_rows, 0)[:x.shape[0]].repeat_interleave(16, 1)[:, :x.shape[1]]
    assert torch.equal(q.dequantize().cpu(), expected * torch.tensor(s_dec))


@pytest.mark.parametrize("device", DEVICES)
def test_nvfp4_stochastic_rounding_matches_reference_and_is_unbiased(device):
    x = nvfp4_inputs()[:, :32]
    g = torch.Generator().manual_seed(4)
    u = torch.rand(x.shape, generator=g)
    q = nvfp4_scaling.nvfp4_quantize(x.to(device), 1, stochastic=True, uniform=u.to(device))
    values, _, _ = ref_nvfp4(x, 1, uniform=u.tolist())
    assert_values(nvfp4_scaling.e2m1_codes_to_float(q.codes()), values)
    # the mean over many draws approaches the value (round to nearest would not)
    v = torch.full((256, 16), 0.7, device=device)
    v[:, 0] = 6.0                                   # scale 1 for the rest of each block
    torch.manual_seed(0)
    got = nvfp4_scaling.nvfp4_quantize(v, 1, stochastic=True).dequantize()[:, 1:]
    mean = got.double().mean().item()
    assert abs(mean - v[0, 1].item() * 1.0) < 0.03 and set(got.unique().tolist()) <= {0.5, 1.0}


@pytest.mark.parametrize("device", DEVICES)
def test_hadamard_transform_is_orthogonal_and_matches_definition(device):
    m = nvfp4_scaling.rht_matrix()
    assert torch.equal(m @ m.t(), torch.eye(16, dtype=torch.float64))
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 40, generator=g)
    got = nvfp4_scaling.random_hadamard_transform(x.to(device)).cpu()
    assert got.shape == (3, 48)
    padded = torch.cat((x.double(), torch.zeros(3, 8, dtype=torch.float64)), 1)
    h = [[(-1) ** bin(i & j).count("1") for j in range(16)] for i in range(16)]
    signs = nvfp4_scaling.RHT_SIGNS
    for r in range(3):
        for b in range(3):
            for j in range(16):
                exact = sum(Fraction(padded[r, 16 * b + i].item()) * signs[i] * h[i][j]
                            for i in range(16)) / 4
                assert got[r, 16 * b + j].item() == f32(exact)


# ---- the GEMMs -------------------------------------------------------------------------------

def _exact_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.double() @ b.double().t()


@pytest.mark.parametrize("device", DEVICES)
def test_mx_gemm_is_float32_sum_of_exact_products(device):
    g = torch.Generator().manual_seed(6)
    a, b = torch.randn(8, 96, generator=g), torch.randn(12, 96, generator=g)
    qa = mx_scaling.mxfp8_quantize(a.to(device))
    qb = mx_scaling.mxfp8_quantize(b.to(device), torch.float8_e5m2)
    out = mx_scaling.mx_gemm(qa, qb, torch.float32).cpu()
    exact = _exact_mm(qa.dequantize().cpu(), qb.dequantize().cpu())
    assert (out.double() - exact).abs().max() <= 96 * 2.0 ** -23 * exact.abs().max()
    na, nb = nvfp4_scaling.nvfp4_quantize(a.to(device)), nvfp4_scaling.nvfp4_quantize(b.to(device))
    out4 = mx_scaling.mx_gemm(na, nb, torch.float32, bias=torch.ones(12, device=device)).cpu()
    exact4 = _exact_mm(na.block_dequantize().cpu(), nb.block_dequantize().cpu())
    exact4 = exact4 * (na.global_scale_inv * nb.global_scale_inv).item() + 1
    assert (out4.double() - exact4).abs().max() <= 96 * 2.0 ** -22 * exact4.abs().max()
    with pytest.raises(ValueError, match="inner dimensions differ"):
        mx_scaling.mx_gemm(qa, mx_scaling.mxfp8_quantize(b[:, :64].to(device)), torch.float32)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="x must be a 2-D tensor"):
        mx_scaling.mxfp8_quantize(torch.ones(3))
    with pytest.raises(TypeError, match="dtype must be one of"):
        mx_scaling.mxfp8_quantize(torch.ones(2, 2), torch.float16)
    with pytest.raises(ValueError, match="block_rows must be 1"):
        nvfp4_scaling.nvfp4_quantize(torch.ones(2, 2), block_rows=4)
