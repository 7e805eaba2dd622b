"""NVFP4BlockScaling: E2M1 values with one E4M3 scale per 16 values and a per-tensor
float32 scale, and its GEMM, emulated exactly on every device (CPU, and CUDA through
torch ops).

NOTE [NVFP4 layout and rounding]
    An NVFP4 tensor [R, C] (`NVFP4Data`) holds E2M1 codes packed two to a byte
    (``data`` uint8 [R, ceil(C / 2)], the even column in the low nibble), ``scale_inv``
    [ceil(R / block_rows), ceil(C / 16)] in E4M3 (one per block of 16 values of a row,
    or per 16x16 tile for weights, ``block_rows`` 16) and ``global_scale_inv``, a
    float32 scalar. A value is ``e2m1 * scale_inv`` of its block times
    ``global_scale_inv``. E2M1 holds 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives
    (code bit 3 is the sign). The numbers follow TE's kernels, in float32:
      amax     = max |x| over the tensor (NaNs skipped); S_enc = 448 * 6 / amax, at
                 most FLT_MAX, 1 when amax is 0 or inf; ``global_scale_inv`` =
                 float32(float64(1 / S_enc));
      block    s_b = e4m3(min(block_amax * (S_enc * float32(1 / 6)), 448)) (round to
                 nearest even; ``scale_inv``);
      values   q = e2m1(x * min(1 / (s_b * global_scale_inv), FLT_MAX)): round to
                 nearest even, saturating at ±6; a NaN becomes +6 (E2M1 has no NaN);
                 with stochastic rounding, rounded up to the next E2M1 magnitude with
                 probability (|v| - lo) / (hi - lo) (a uniform float32 draw from torch's
                 generator of the device: unbiased, but not TE's Philox stream).
    As in TE, the rowwise and the columnwise copy (the transpose, quantized anew) each
    take their own amax. The recipe applies: 16x16 tiles to weights (unless
    ``disable_2d_quantization``), stochastic rounding to output gradients (unless
    ``disable_stochastic_rounding``), and the random Hadamard transform (unless
    ``disable_rht``) to the columnwise copies of inputs and output gradients, the two
    operands of the wgrad GEMM: each run of 16 values along K is multiplied by
    ``diag(signs) @ H16 / 4`` (TE's fixed sign vector; computed in float64, rounded
    once to float32; K zero-padded to a multiple of 16). That matrix is orthogonal and
    both wgrad operands get it, so ``dy^T x`` is unchanged up to quantization.

    The GEMM computes what an NVFP4 tensor core does with these operands: each
    operand's ``e2m1 * scale_inv`` in float32 (at most 6 significant bits: exact, in
    TF32 too), one float32 GEMM (exact products, float32 sums), then the product of
    the two per-tensor scales applied to the float32 result (the epilogue's alpha),
    the bias added in float32, rounded once to the output dtype (`mx_scaling.mx_gemm`).
    No stored state: a recompute casts the same values to the same bits (stochastic
    rounding is only used in backward, which is not recomputed).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F

from .non_finite import non_finite_counter

__all__ = ["NVFP4_BLOCK", "E2M1_VALUES", "NVFP4Data", "nvfp4_quantize", "round_to_e2m1",
           "e2m1_codes_to_float", "random_hadamard_transform", "rht_matrix", "cast_nvfp4",
           "cast_for_role", "RHT_SIGNS"]

NVFP4_BLOCK = 16
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# TE's fixed signs of the random Hadamard transform of the wgrad operands
RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
_E4M3_MAX = 448.0
_FLT_MAX = torch.finfo(torch.float32).max
# the midpoints between neighbouring E2M1 magnitudes; a tie rounds to the even code
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


class NVFP4Data(NamedTuple):
    """An NVFP4 tensor (NOTE [NVFP4 layout and rounding]): packed E2M1 ``data`` uint8
    [R, ceil(C / 2)], E4M3 ``scale_inv`` [ceil(R / block_rows), ceil(C / 16)], float32
    ``global_scale_inv`` (0-dim), ``block_rows`` 1 or 16, ``cols`` C."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    global_scale_inv: torch.Tensor
    block_rows: int
    cols: int

    def codes(self) -> torch.Tensor:
        """The E2M1 codes, one uint8 per value, [R, C]."""
        low, high = self.data & 0xF, self.data >> 4
        both = torch.stack((low, high), dim=-1).view(self.data.shape[0], -1)
        return both[:, :self.cols]

    def block_dequantize(self) -> torch.Tensor:
        """``e2m1 * scale_inv`` of each value in float32 (exact), without the per-tensor
        scale: the operand the GEMM multiplies."""
        rows = self.data.shape[0]
        rb, cb = self.scale_inv.shape
        values = _padded(e2m1_codes_to_float(self.codes()), rb * self.block_rows,
                         cb * NVFP4_BLOCK)
        values = values.view(rb, self.block_rows, cb, NVFP4_BLOCK).mul_(
            self.scale_inv.to(torch.float32)[:, None, :, None])
        values = values.view(rb * self.block_rows, cb * NVFP4_BLOCK)
        return values[:rows, :self.cols]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The value: ``(e2m1 * scale_inv) * global_scale_inv`` in float32, then ``dtype``."""
        return (self.block_dequantize() * self.global_scale_inv).to(dtype)


def _padded(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    if x.shape[0] == rows and x.shape[1] == cols:
        return x.contiguous()
    return F.pad(x, (0, cols - x.shape[1], 0, rows - x.shape[0]))


def e2m1_codes_to_float(codes: torch.Tensor) -> torch.Tensor:
    """The float32 values of E2M1 codes (uint8, bit 3 the sign)."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32,
                         device=codes.device)
    return table[codes.to(torch.int64)]


def round_to_e2m1(v: torch.Tensor, uniform: Optional[torch.Tensor] = None) -> torch.Tensor:
    """E2M1 codes (uint8) of float32 ``v``: round to nearest even, or stochastically
    with ``uniform`` (draws in [0, 1) of ``v``'s shape); saturating at ±6; NaN -> +6."""
    magnitude = v.abs()
    if uniform is None:
        code = torch.zeros(v.shape, dtype=torch.int32, device=v.device)
        for i, mid in enumerate(_MIDPOINTS):
            up = magnitude > mid
            if (i + 1) % 2 == 0:        # a tie goes to the even code
                up = up | (magnitude == mid)
            code += up.to(torch.int32)
    else:
        grid = torch.tensor(E2M1_VALUES + (E2M1_VALUES[-1],), dtype=torch.float32,
                            device=v.device)
        low = torch.zeros(v.shape, dtype=torch.int64, device=v.device)
        for value in E2M1_VALUES[1:]:
            low += (magnitude >= value).to(torch.int64)
        below, above = grid[low], grid[low + 1]
        step = torch.where(above > below, above - below, 1.0)
        frac = (magnitude.clamp(max=E2M1_VALUES[-1]) - below) / step
        code = (low + (uniform < frac).to(torch.int64)).to(torch.int32)
    sign = torch.signbit(v) & ~torch.isnan(v)
    code = torch.where(torch.isnan(v), 7, code) + sign.to(torch.int32) * 8
    return code.to(torch.uint8)


def _nan_skipping_amax(x: torch.Tensor, dim=None) -> torch.Tensor:
    magnitude = x.abs()
    magnitude = torch.where(torch.isnan(magnitude), 0.0, magnitude)
    return magnitude.amax() if dim is None else magnitude.amax(dim=dim)


def _global_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """``S_enc`` of NOTE [NVFP4 layout and rounding], float32."""
    s_enc = torch.clamp(torch.tensor(_E4M3_MAX * 6.0, device=amax.device) / amax, max=_FLT_MAX)
    return torch.where((amax == 0) | (s_enc == 0), 1.0, s_enc)


def nvfp4_quantize(x: torch.Tensor, block_rows: int = 1, stochastic: bool = False,
                   uniform: Optional[torch.Tensor] = None) -> NVFP4Data:
    """Quantize a 2-D ``x`` [R, C] to NVFP4 in blocks of ``block_rows`` x 16 (NOTE
    [NVFP4 layout and rounding]); ``stochastic`` rounds stochastically, with the
    draws ``uniform`` [R, C] when given (else from torch's generator)."""
    api = "nvfp4_scaling.nvfp4_quantize"
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"{api}: x must be a 2-D tensor [rows, cols], got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if block_rows not in (1, NVFP4_BLOCK):
        raise ValueError(f"{api}: block_rows must be 1 (1x16 blocks) or 16 (16x16 blocks), "
                         f"got {block_rows}")
    if uniform is not None and tuple(uniform.shape) != tuple(x.shape):
        raise ValueError(f"{api}: uniform must have x's shape {tuple(x.shape)}, "
                         f"got {tuple(uniform.shape)}")
    return _quantize(x, block_rows, stochastic, uniform)


def _quantize(x: torch.Tensor, block_rows: int, stochastic: bool,
              uniform: Optional[torch.Tensor] = None) -> NVFP4Data:
    rows, cols = x.shape
    rb, cb = -(-rows // block_rows), -(-cols // NVFP4_BLOCK)
    xf = x.detach().to(torch.float32)
    s_enc = _global_encode_scale(_nan_skipping_amax(xf) if xf.numel()
                                 else torch.zeros((), device=x.device))
    s_dec = (1.0 / s_enc.to(torch.float64)).to(torch.float32)
    tiles = _padded(xf, rb * block_rows, cb * NVFP4_BLOCK).view(rb, block_rows, cb, NVFP4_BLOCK)
    block_amax = _nan_skipping_amax(tiles, dim=(1, 3))
    sixth = torch.tensor(1.0 / 6.0, dtype=torch.float32, device=x.device)
    s_b = torch.clamp(block_amax * (s_enc * sixth), max=_E4M3_MAX).to(torch.float8_e4m3fn)
    encode = torch.clamp(1.0 / (s_b.to(torch.float32) * s_dec), max=_FLT_MAX)
    scaled = (tiles * encode[:, None, :, None]).view(rb * block_rows, cb * NVFP4_BLOCK)
    scaled = scaled[:rows, :cols]
    if stochastic and uniform is None:
        uniform = torch.rand(scaled.shape, dtype=torch.float32, device=x.device)
    codes = round_to_e2m1(scaled, uniform if stochastic else None)
    if cols % 2:
        codes = F.pad(codes, (0, 1))
    data = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
    return NVFP4Data(data, s_b, s_dec, block_rows, cols)


def rht_matrix(device=None) -> torch.Tensor:
    """``diag(RHT_SIGNS) @ H16 / 4`` in float64: TE's random Hadamard transform matrix
    (Sylvester's 16x16 Hadamard matrix with TE's fixed signs), orthogonal."""
    h = torch.ones((1, 1), dtype=torch.float64, device=device)
    while h.shape[0] < NVFP4_BLOCK:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    signs = torch.tensor(RHT_SIGNS, dtype=torch.float64, device=device)
    return signs[:, None] * h / 4.0


def random_hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """``x`` [R, K] with each run of 16 values of a row multiplied by `rht_matrix`
    (row vector times matrix), in float64, rounded once to float32; K zero-padded to a
    multiple of 16 first."""
    rows, k = x.shape
    kp = -(-k // NVFP4_BLOCK) * NVFP4_BLOCK
    runs = _padded(x.detach().to(torch.float64), rows, kp).view(rows, kp // NVFP4_BLOCK,
                                                                  NVFP4_BLOCK)
    return torch.matmul(runs, rht_matrix(x.device)).view(rows, kp).to(torch.float32)


def cast_nvfp4(x: torch.Tensor, block_rows: int = 1, rowwise: bool = True,
               columnwise: bool = False, stochastic: bool = False, rht: bool = False,
               count_non_finite: bool = True, backward: bool = False,
               count_where: Optional[torch.Tensor] = None
               ) -> Tuple[Optional[NVFP4Data], Optional[NVFP4Data]]:
    """``(rowwise, columnwise)`` NVFP4 copies of a 2-D ``x``, each None unless asked for:
    the columnwise copy is ``x^T`` quantized anew (after the Hadamard transform with
    ``rht``). A NaN or inf in ``x`` is counted once (NOTE [Non-finite amaxes] in
    amax_update.py), only where ``count_where`` is True when given, never with
    ``count_non_finite=False`` (a recompute's cast)."""
    row = _quantize(x, block_rows, stochastic) if rowwise else None
    col = None
    if columnwise:
        xt = x.t()
        col = _quantize(random_hadamard_transform(xt) if rht else xt, block_rows, stochastic)
    if count_non_finite and x.numel() and (rowwise or columnwise):
        flag = ~torch.isfinite(x.detach()).all()
        if count_where is not None:
            flag = flag & count_where
        non_finite_counter(x.device, backward).add_(flag)
    return row, col


def cast_for_role(recipe, role: str, x: torch.Tensor, rowwise: bool, columnwise: bool,
                  count_non_finite: bool = True, count_where: Optional[torch.Tensor] = None
                  ) -> Tuple[Optional[NVFP4Data], Optional[NVFP4Data]]:
    """`cast_nvfp4` with what an NVFP4BlockScaling ``recipe`` gives the tensors of
    ``role`` ("fwd_inp", "fwd_weight", "bwd_grad"): its ``fp4_quant_<role>`` QParams
    (16x16 tiles, stochastic rounding, the Hadamard transform of the columnwise copy)."""
    if recipe.nvfp4_4over6 != "none":
        raise NotImplementedError(f"NVFP4BlockScaling: nvfp4_4over6={recipe.nvfp4_4over6!r} "
                                  "(4over6 block scaling) is not implemented; use 'none'")
    if recipe.row_scaled_activation:
        raise NotImplementedError("NVFP4BlockScaling: row_scaled_activation=True (per-row "
                                  "amaxes) is not implemented")
    q = getattr(recipe, "fp4_quant_" + role)
    return cast_nvfp4(x, NVFP4_BLOCK if q.fp4_2d_quantization else 1, rowwise, columnwise,
                      q.stochastic_rounding, q.random_hadamard_transform, count_non_finite,
                      backward=role == "bwd_grad", count_where=count_where)
