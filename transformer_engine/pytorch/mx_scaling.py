"""MXFP8BlockScaling: FP8 values with one E8M0 (power-of-two) scale per 32 values, and
its GEMM, emulated exactly on every device (CPU, and CUDA through torch ops).

NOTE [MXFP8 layout and rounding]
    An MXFP8 tensor [R, C] (`MXFP8Data`) holds FP8 values ``data`` [R, C] (E4M3, or E5M2
    for the gradients of ``Format.HYBRID``) and ``scale_inv`` [ceil(R / block_rows),
    ceil(C / 32)] as uint8 E8M0 biased exponents: the value of an element is
    ``data * 2**(scale_inv - 127)`` of its block (E8M0 255 is NaN). A 1D block is 32
    consecutive values of a row (``block_rows`` 1); with the recipe's
    ``enable_2d_quantization`` a weight uses 32x32 tiles (``block_rows`` 32). As for
    Float8BlockScaling (NOTE [Block scaling layout] in block_scaling.py) blocks run along
    the contraction dimension of the GEMM that reads the copy: the "rowwise" copy
    serves the forward, the "columnwise" copy is the transpose quantized anew from the
    high-precision tensor (its 1x32 blocks cover other values), except for 32x32 tiles,
    whose columnwise copy is the transpose of the rowwise one. A partial last block
    takes the amax of the values it holds.

    The scale of a block follows TE's kernels (OCP MX with TE's exponent rounding):
      amax   = max |x| over the block in float32, NaNs skipped (``fmaxf``), 0 if none;
      v      = float32(amax * float32(1 / fp8_max));
      e      = the E8M0 exponent of v rounded *up* (``cvt.rp.satfinite.ue8m0``): 0 for
               v <= 2**-127 (zero included), 254 (2**127) for v >= 2**126 or inf;
      data   = fp8(clamp(x * 2**(127 - e), -fp8_max, fp8_max)), round to nearest even.
    Rounding the exponent up keeps every finite scaled value within ``fp8_max`` up to
    the rounding of ``1 / fp8_max``, so the clamp only acts at that rounding and on inf
    (which becomes ±fp8_max, scaled by 2**127: ±inf again when dequantized to float32).
    A NaN stays NaN in its place; it does not touch its block's scale.

    The GEMM is what a block-scaled MX tensor core computes from these operands: each
    operand dequantized to float32 (an FP8 value times a power of two: exact), one
    float32 GEMM (each product exact; float32 accumulation, in the order of torch's
    matmul rather than the hardware's), the bias added in float32, rounded once to the
    output dtype. Since the dequantized operands carry at most 4 significant bits, a
    TF32 setting on CUDA changes nothing. No stored state: a recompute casts the same
    values to the same bits.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F

from .function_results import add_into, cast_to
from .non_finite import non_finite_counter

__all__ = ["MX_BLOCK", "MXFP8Data", "e8m0_round_up", "e8m0_to_float", "mxfp8_quantize",
           "cast_mxfp8", "cast_for_role", "mx_gemm", "FP8_MAX"]

MX_BLOCK = 32
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
_TINY_E8M0 = 2.0 ** -127        # the float32 subnormal 0x00400000


class MXFP8Data(NamedTuple):
    """An MXFP8 tensor (NOTE [MXFP8 layout and rounding]): ``data`` [R, C] FP8,
    ``scale_inv`` uint8 E8M0 exponents [ceil(R / block_rows), ceil(C / 32)],
    ``block_rows`` 1 or 32."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    block_rows: int = 1

    @property
    def cols(self) -> int:
        """The length of a row (K of the GEMM that reads this copy)."""
        return self.data.shape[1]

    def block_dequantize(self) -> torch.Tensor:
        """The float32 value (`mx_gemm`'s operand: MXFP8 has no per-tensor scale)."""
        return self.dequantize()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``data * 2**(scale_inv - 127)`` of each value's block, in float32, then
        ``dtype``."""
        rows, cols = self.data.shape
        rb, cb = self.scale_inv.shape
        scale = e8m0_to_float(self.scale_inv)
        values = _padded(self.data.to(torch.float32), rb * self.block_rows, cb * MX_BLOCK)
        values = values.view(rb, self.block_rows, cb, MX_BLOCK).mul_(
            scale[:, None, :, None]).view(rb * self.block_rows, cb * MX_BLOCK)
        if values.shape != (rows, cols):
            values = values[:rows, :cols]
        return cast_to(values, dtype)      # NOTE [Fresh function results]

    def t_contiguous(self) -> "MXFP8Data":
        """The columnwise copy of a tensor in 32x32 tiles: data and scales transposed."""
        if self.block_rows != MX_BLOCK:
            raise ValueError("MXFP8Data.t_contiguous: a tensor in 1x32 blocks cannot be "
                             "transposed in FP8 (the transposed blocks cover other values); "
                             "quantize the transposed high-precision tensor instead")
        return MXFP8Data(self.data.t().contiguous(), self.scale_inv.t().contiguous(), MX_BLOCK)


def _padded(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``x`` [r, c] zero-padded at the end to [rows, cols], contiguous."""
    if x.shape[0] == rows and x.shape[1] == cols:
        return x.contiguous()
    return F.pad(x, (0, cols - x.shape[1], 0, rows - x.shape[0]))


def e8m0_round_up(v: torch.Tensor) -> torch.Tensor:
    """The E8M0 biased exponent (uint8) of non-negative float32 ``v`` rounded toward
    +inf, saturating: 0 for ``v <= 2**-127``, 254 for ``v > 2**126`` and inf, 255 for
    NaN (``cvt.rp.satfinite.ue8m0x2.f32``)."""
    bits = v.to(torch.float32).contiguous().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    up = (mantissa > 0) & (exponent != 0xFE) & ~((exponent == 0) & (mantissa <= 0x400000))
    e = exponent + up.to(torch.int32)
    e = torch.where(torch.isinf(v), 254, e)
    e = torch.where(torch.isnan(v), 255, e)
    return e.to(torch.uint8)


def e8m0_to_float(e: torch.Tensor) -> torch.Tensor:
    """``2**(e - 127)`` in float32 for uint8 E8M0 exponents ``e`` (255: NaN)."""
    e32 = e.to(torch.int32)
    value = (e32 << 23).view(torch.float32)
    value = torch.where(e32 == 0, _TINY_E8M0, value)
    return torch.where(e32 == 255, float("nan"), value)


def _multiplier(e: torch.Tensor) -> torch.Tensor:
    """``2**(127 - e)`` in float32: what the values of a block with exponent ``e`` are
    multiplied by before the FP8 cast (TE's ``exp2f_rcp``; 255: NaN)."""
    e32 = e.to(torch.int32)
    value = ((254 - e32).clamp(min=1) << 23).view(torch.float32)
    value = torch.where(e32 == 254, _TINY_E8M0, value)
    return torch.where(e32 == 255, float("nan"), value)


def _quantize(x: torch.Tensor, dtype: torch.dtype, block_rows: int
              ) -> Tuple[MXFP8Data, torch.Tensor]:
    """The cast of `mxfp8_quantize`, and whether ``x`` held a NaN or inf."""
    rows, cols = x.shape
    rb, cb = -(-rows // block_rows), -(-cols // MX_BLOCK)
    tiles = _padded(x.detach().to(torch.float32), rb * block_rows, cb * MX_BLOCK)
    tiles = tiles.view(rb, block_rows, cb, MX_BLOCK)
    magnitude = tiles.abs()
    nan = torch.isnan(magnitude)
    block_amax = torch.where(nan, 0.0, magnitude).amax(dim=(1, 3))
    rcp = torch.tensor(1.0 / FP8_MAX[dtype], dtype=torch.float32, device=x.device)
    e = e8m0_round_up(block_amax * rcp)
    limit = FP8_MAX[dtype]
    scaled = tiles * _multiplier(e)[:, None, :, None]
    data = torch.clamp(scaled, -limit, limit).to(dtype).view(rb * block_rows, cb * MX_BLOCK)
    if data.shape != (rows, cols):
        data = data[:rows, :cols].contiguous()
    non_finite = nan.any() | torch.isinf(block_amax).any() if x.numel() else None
    return MXFP8Data(data, e, block_rows), non_finite


def mxfp8_quantize(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn,
                   block_rows: int = 1) -> MXFP8Data:
    """Quantize a 2-D ``x`` [R, C] to MXFP8 in blocks of ``block_rows`` x 32 (NOTE
    [MXFP8 layout and rounding]); ``dtype`` E4M3 or E5M2."""
    api = "mx_scaling.mxfp8_quantize"
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"{api}: x must be a 2-D tensor [rows, cols], got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if dtype not in FP8_MAX:
        raise TypeError(f"{api}: dtype must be one of {tuple(FP8_MAX)}, got {dtype}")
    if block_rows not in (1, MX_BLOCK):
        raise ValueError(f"{api}: block_rows must be 1 (1x32 blocks) or 32 (32x32 blocks), "
                         f"got {block_rows}")
    return _quantize(x, dtype, block_rows)[0]


def cast_mxfp8(x: torch.Tensor, dtype: torch.dtype, block_rows: int, rowwise: bool = True,
               columnwise: bool = False, count_non_finite: bool = True, backward: bool = False,
               count_where: Optional[torch.Tensor] = None
               ) -> Tuple[Optional[MXFP8Data], Optional[MXFP8Data]]:
    """``(rowwise, columnwise)`` MXFP8 copies of a 2-D ``x``, each None unless asked for
    (NOTE [MXFP8 layout and rounding]). A NaN or inf in ``x`` is counted once (NOTE
    [Non-finite amaxes] in amax_update.py), only where ``count_where`` is True when
    given, never with ``count_non_finite=False`` (a recompute's cast)."""
    row = col = None
    flag = None
    if rowwise or (columnwise and block_rows == MX_BLOCK):
        row, flag = _quantize(x, dtype, block_rows)
    if columnwise:
        if block_rows == MX_BLOCK:
            col = row.t_contiguous()
        else:
            col, flag = _quantize(x.t(), dtype, 1)
    if count_non_finite and flag is not None:
        if count_where is not None:
            flag = flag & count_where
        non_finite_counter(x.device, backward).add_(flag)
    return (row if rowwise else None), col


def cast_for_role(recipe, role: str, x: torch.Tensor, dtype: torch.dtype, rowwise: bool,
                  columnwise: bool, count_non_finite: bool = True,
                  count_where: Optional[torch.Tensor] = None
                  ) -> Tuple[Optional[MXFP8Data], Optional[MXFP8Data]]:
    """`cast_mxfp8` with the block shape an MXFP8BlockScaling ``recipe`` gives the
    tensors of ``role`` ("fwd_inp", "fwd_weight", "bwd_grad"): 32x32 tiles for weights
    under ``enable_2d_quantization``, 1x32 blocks otherwise."""
    two_d = role == "fwd_weight" and recipe.enable_2d_quantization
    return cast_mxfp8(x, dtype, MX_BLOCK if two_d else 1, rowwise, columnwise,
                      count_non_finite, backward=role == "bwd_grad", count_where=count_where)


def mx_gemm(a, b, out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``a @ b^T`` for MXFP8 (or NVFP4, nvfp4_scaling.py) operands ``a`` [M, K] and ``b``
    [N, K], blocks along K: both dequantized to float32 (an NVFP4 operand without its
    per-tensor scale, which multiplies the float32 result, as the hardware's epilogue
    does), one float32 GEMM, the bias added in float32, rounded once to ``out_dtype``."""
    if a.cols != b.cols:
        raise ValueError(f"mx_scaling.mx_gemm: inner dimensions differ: a has K={a.cols}, b has "
                         f"K={b.cols} (computing a @ b^T)")
    out = torch.mm(a.block_dequantize(), b.block_dequantize().t())
    alpha = _tensor_scale(a, b)
    if alpha is not None:
        out = out.mul_(alpha)
    if bias is not None:
        out = add_into(out, bias)      # NOTE [Fresh function results]
    return cast_to(out, out_dtype)


def _tensor_scale(a, b) -> Optional[torch.Tensor]:
    """The product of the operands' per-tensor scales (NVFP4), else None."""
    sa, sb = getattr(a, "global_scale_inv", None), getattr(b, "global_scale_inv", None)
    if sa is None and sb is None:
        return None
    one = torch.ones((), dtype=torch.float32, device=a.data.device)
    return (one if sa is None else sa) * (one if sb is None else sb)

