"""Float64 references for Float8BlockScaling, written from TE's description of the recipe
(a scale per block of 128 values or 128x128 values, ``s = fp8_max / amax`` of the block,
rounded down to a power of two when asked, values multiplied by ``s`` and cast), one
block at a time, with no code shared with ``block_scaling.py``.

Also the bounds tests compare against: the rounding of an FP8 cast, and float32
accumulation.
"""

import math

import torch

BLOCK = 128
FP32_MAX = torch.finfo(torch.float32).max


def varied(rows: int, cols: int, seed: int = 0, spread: int = 12) -> torch.Tensor:
    """Normal values whose magnitude differs by up to ``2**±spread`` from one 128-column
    block to the next and by up to ``2**±(spread // 2)`` from row to row: one scale per
    tensor, or blocks along the wrong dimension, would flush the small ones."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    col_exp = torch.randint(-spread, spread + 1, ((cols + BLOCK - 1) // BLOCK,), generator=g)
    row_exp = torch.randint(-(spread // 2), spread // 2 + 1, (rows,), generator=g)
    exponent = row_exp[:, None] + col_exp.repeat_interleave(BLOCK)[None, :cols]
    return x * torch.exp2(exponent.float())


def block_scale(amax: float, fp8_max: float, power_2: bool, eps: float) -> float:
    """The scale of one block, as a Python float (exactly a float32 value)."""
    amax = max(amax, eps)
    if amax == 0 or not math.isfinite(amax):
        return 1.0
    # the recipe computes the scale in float32: fp8_max / amax, rounded once
    scale = (torch.tensor(fp8_max, dtype=torch.float32)
             / torch.tensor(amax, dtype=torch.float32)).item()
    scale = min(scale, FP32_MAX)
    if power_2:
        mantissa, exponent = math.frexp(scale)       # scale = mantissa * 2**exponent
        scale = 2.0 ** (exponent - 1)
    return scale


def quantize_ref(x: torch.Tensor, dtype: torch.dtype, block_rows: int, power_2: bool = True,
                 eps: float = 0.0):
    """``(values, scale_inv)`` of ``x`` [R, C] quantized in ``block_rows`` x 128 blocks:
    the dequantized float64 values [R, C], and each value's block ``scale_inv`` [R, C]."""
    fp8_max = torch.finfo(dtype).max
    x64 = x.detach().double()
    values = torch.empty_like(x64)
    scale_inv = torch.empty_like(x64)
    rows, cols = x64.shape
    for r0 in range(0, rows, block_rows):
        for c0 in range(0, cols, BLOCK):
            block = x64[r0:r0 + block_rows, c0:c0 + BLOCK]
            scale = block_scale(block.abs().max().item(), fp8_max, power_2, eps)
            # the product in float32, as the recipe computes it (exact for a power of 2)
            scaled = block.float() * torch.tensor(scale, dtype=torch.float32)
            q = scaled.clamp(-fp8_max, fp8_max).to(dtype)
            # real value = q * scale_inv, scale_inv = 1 / scale, both float32 (exact for
            # a power-of-2 scale)
            inv = torch.reciprocal(torch.tensor(scale, dtype=torch.float32))
            values[r0:r0 + block_rows, c0:c0 + BLOCK] = (q.float() * inv).double()
            scale_inv[r0:r0 + block_rows, c0:c0 + BLOCK] = inv.item()
    return values, scale_inv


def rounding_bound(x: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An elementwise bound on ``|fp8 cast - x|`` in real units: half an ulp relative in
    the normal range (2**-4 for E4M3's 3 mantissa bits, 2**-3 for E5M2's 2), and half
    the smallest subnormal spacing times the block's ``scale_inv`` below it."""
    info = torch.finfo(dtype)
    mantissa_bits = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}[dtype]
    half_ulp = 2.0 ** -(mantissa_bits + 1)
    half_subnormal = info.smallest_normal * 2.0 ** -mantissa_bits / 2
    return half_ulp * x.detach().double().abs() + half_subnormal * scale_inv


def accumulation_bound(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A bound on the float32 error of ``a @ b^T`` for exact float64 products
    ``a`` [M, K], ``b`` [N, K]: ``gamma_{K+1} * |a| @ |b|^T`` with the float32 unit
    roundoff (the +1 covers rounding the result)."""
    k = a.shape[1] + 1
    u = 2.0 ** -24
    return (k * u / (1 - k * u)) * (a.abs() @ b.abs().t())


def hopper_gemm_bound(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A bound on the error of Hopper's block-scaled FP8 GEMM of exact operands ``a``
    [M, K], ``b`` [N, K]. Its tensor cores add a block's 128 products with about 14
    significant bits, then the blocks in float32. Bound: each of a block's 128
    products off by ``2**-13`` of the block's largest product, which is at most
    ``max|a_block| * max|b_block|``, plus float32 accumulation. Measured on an H200
    (E4M3 and E5M2 operands whose magnitudes vary by up to ``2**24``): at most
    ``2**-14.8`` of the first term, so the bound leaves a factor 3.5; a wrong scale
    layout misses it by orders of magnitude."""
    k = a.shape[1]
    blocks = -(-k // BLOCK)

    def block_max(t):
        padded = torch.nn.functional.pad(t.abs(), (0, blocks * BLOCK - k))
        return padded.view(t.shape[0], blocks, BLOCK).amax(dim=2)

    return BLOCK * 2.0 ** -13 * (block_max(a) @ block_max(b).t()) + accumulation_bound(a, b)


def fp8_gemm_bound(a, a_q, a_scale_inv, a_dtype, b, b_q, b_scale_inv, b_dtype) -> torch.Tensor:
    """A bound on ``|a_q @ b_q^T - a @ b^T|`` (float32 accumulation of quantized
    operands ``a_q``, ``b_q`` against exact float64 ``a @ b^T``): the cast errors
    ``e_a``, ``e_b`` (`rounding_bound`) through ``|a||e_b| + |e_a||b| + |e_a||e_b|``,
    plus `accumulation_bound`."""
    e_a = rounding_bound(a, a_scale_inv, a_dtype)
    e_b = rounding_bound(b, b_scale_inv, b_dtype)
    a64, b64 = a.detach().double().abs(), b.detach().double().abs()
    return (a64 @ e_b.t() + e_a @ b64.t() + e_a @ e_b.t()
            + accumulation_bound(a_q.double(), b_q.double()))
