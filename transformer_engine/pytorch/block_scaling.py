"""Float8BlockScaling: quantization with one scale per block, and its GEMM, emulated
exactly in float32.

NOTE [Block scaling layout]
    A block-scaled tensor [R, C] has one scale per block: a 1D block is 128
    consecutive values of a row (1x128), a 2D block a 128x128 tile. `BlockScaledData`
    holds the FP8 values row-major [R, C] and ``scale_inv`` (float32) of shape
    [ceil(R / block_rows), ceil(C / 128)], ``block_rows`` being 1 or 128: a value is
    ``data * scale_inv`` of its block. When 128 does not divide R or C, the last
    block of a row (or the last tiles) is partial: its amax is taken over the values it
    holds (the padding is zeros, which never raise an amax) and the padding is dropped
    after the cast. TE's kernels need multiples of 128; this emulation takes any shape.

    Blocks run along the K (contraction) dimension of the GEMM an operand feeds. Every
    GEMM here is ``a @ b^T`` with both operands [rows, K] (NOTE [GEMM vocabulary] in
    quantize.py), and K differs per GEMM: the forward takes x [M, in] and W [out, in]
    (K = in features), dgrad dy [M, out] and W^T [in, out] (K = out features), wgrad
    dy^T [out, M] and x^T [in, M] (K = M, the tokens). So each tensor is quantized once
    for the GEMM that reads it as stored ("rowwise") and once for the GEMM that reads
    its transpose ("columnwise"), as TE does. For 1D blocks the columnwise copy is the
    transpose quantized anew from the high-precision tensor, in 1x128 blocks (they
    cover other values than the rowwise blocks, so the scales differ); for 2D blocks it
    is the transpose of the rowwise data and scales (a tile covers the same values
    either way).

    A block's scale is current scaling's (`quantize.current_scale`) of the block's own
    amax, with the role's `QParams` (TE's default here: power-of-2 scales, no epsilon).
    No state and no history: a recompute casts the same values to the same bits, so
    activation recompute needs no stash.

    The GEMM is an exact emulation, the same code on CPU and CUDA: both operands are
    dequantized block by block to float32 and multiplied by one float32 GEMM. An FP8
    value has at most 4 significant bits, so with a power-of-2 scale the dequantized
    value is exact, and so is the product of two of them (8 bits); the sums accumulate
    in float32, as the hardware's block-scaled GEMM does (in another order). Such
    operands are exact in TF32 too, so a CUDA TF32 setting changes nothing; with
    ``power_2_scale=False`` a dequantized value is rounded once to float32 (and to TF32
    if the script allows TF32 matmuls). `MMParams.use_split_accumulator` changes
    nothing here: the accumulation is float32 either way.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F

from . import quantize
from .amax_update import non_finite_counter

__all__ = ["BLOCK", "BlockScaledData", "quantize_blocks", "cast_blocks", "cast_for_role",
           "block_gemm"]

BLOCK = 128
# which recipe field gives the block shape of each role's tensors
_ROLE_DIM_FIELDS = {"fwd_inp": "x_block_scaling_dim", "fwd_weight": "w_block_scaling_dim",
                    "bwd_grad": "grad_block_scaling_dim"}


class BlockScaledData(NamedTuple):
    """A block-scaled FP8 tensor (NOTE [Block scaling layout]): ``data`` [R, C] in an FP8
    dtype, ``scale_inv`` [ceil(R / block_rows), ceil(C / 128)] float32, ``block_rows``
    1 (1x128 blocks) or 128 (128x128 blocks)."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    block_rows: int

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``data * scale_inv`` of each value's block, in float32 (then ``dtype``)."""
        rows, cols = self.data.shape
        rb, cb = self.scale_inv.shape
        values = _padded(self.data.to(torch.float32), rb * self.block_rows, cb * BLOCK)
        values = values.view(rb, self.block_rows, cb, BLOCK).mul_(
            self.scale_inv[:, None, :, None]).view(rb * self.block_rows, cb * BLOCK)
        if values.shape != (rows, cols):
            values = values[:rows, :cols]
        return values.to(dtype)

    def t_contiguous(self) -> "BlockScaledData":
        """The columnwise copy of a 2D-scaled tensor: data and scales transposed. A
        1D-scaled tensor has none (its columnwise copy is quantized anew)."""
        if self.block_rows != BLOCK:
            raise ValueError("BlockScaledData.t_contiguous: a tensor in 1x128 blocks cannot be "
                             "transposed in FP8 (the transposed blocks cover other values); "
                             "quantize the transposed high-precision tensor instead")
        return BlockScaledData(self.data.t().contiguous(), self.scale_inv.t().contiguous(),
                               BLOCK)


def _padded(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``x`` [r, c] zero-padded at the end to [rows, cols], contiguous."""
    if x.shape[0] == rows and x.shape[1] == cols:
        return x.contiguous()
    return F.pad(x, (0, cols - x.shape[1], 0, rows - x.shape[0]))


def _quantize(x: torch.Tensor, dtype: torch.dtype, block_rows: int, power_2_scale: bool,
              amax_epsilon: float) -> Tuple[BlockScaledData, torch.Tensor]:
    """The cast of `quantize_blocks`, and the blocks' amaxes."""
    rows, cols = x.shape
    rb, cb = -(-rows // block_rows), -(-cols // BLOCK)
    tiles = _padded(x.detach().to(torch.float32), rb * block_rows, cb * BLOCK)
    tiles = tiles.view(rb, block_rows, cb, BLOCK)
    block_amax = tiles.abs().amax(dim=(1, 3))
    scale = quantize.current_scale(block_amax, dtype, power_2_scale, amax_epsilon)
    limit = quantize.fp8_max(dtype)
    data = torch.clamp(tiles * scale[:, None, :, None], -limit, limit).to(dtype)
    data = data.view(rb * block_rows, cb * BLOCK)
    if data.shape != (rows, cols):
        data = data[:rows, :cols].contiguous()
    return BlockScaledData(data, torch.reciprocal(scale), block_rows), block_amax


def quantize_blocks(x: torch.Tensor, dtype: torch.dtype, block_rows: int = 1,
                    power_2_scale: bool = True, amax_epsilon: float = 0.0) -> BlockScaledData:
    """Quantize a 2-D ``x`` [R, C] in blocks of ``block_rows`` x 128 (NOTE [Block scaling
    layout]): per block ``scale = fp8_max / max(amax, amax_epsilon)`` (1 for a block of
    zeros or one holding NaN/inf; a power of two, rounded down, with ``power_2_scale``),
    ``data = fp8(clamp(x * scale, -fp8_max, fp8_max))``, ``scale_inv = 1 / scale``.
    Saturating, as every cast here."""
    api = "block_scaling.quantize_blocks"
    if x.dim() != 2:
        raise ValueError(f"{api}: x must be 2-D [rows, cols], got shape {tuple(x.shape)}")
    if dtype not in quantize.FP8_DTYPES:
        raise TypeError(f"{api}: dtype must be one of {quantize.FP8_DTYPES}, got {dtype}")
    if block_rows not in (1, BLOCK):
        raise ValueError(f"{api}: block_rows must be 1 (1x128 blocks) or 128 (128x128 blocks), "
                         f"got {block_rows}")
    return _quantize(x, dtype, block_rows, power_2_scale, amax_epsilon)[0]


def cast_blocks(x: torch.Tensor, dtype: torch.dtype, block_rows: int, power_2_scale: bool,
                amax_epsilon: float, rowwise: bool = True, columnwise: bool = False
                ) -> Tuple[Optional[BlockScaledData], Optional[BlockScaledData]]:
    """``(rowwise, columnwise)`` copies of a 2-D ``x`` [R, C], each None unless asked
    for: ``rowwise`` [R, C] with blocks along C, ``columnwise`` [C, R] with blocks along
    R (NOTE [Block scaling layout]). A NaN or inf in ``x`` is counted once (NOTE
    [Non-finite amaxes] in amax_update.py)."""
    row = col = None
    amaxes = None
    if rowwise or (columnwise and block_rows == BLOCK):
        row, amaxes = _quantize(x, dtype, block_rows, power_2_scale, amax_epsilon)
    if columnwise:
        if block_rows == BLOCK:
            col = row.t_contiguous()
        else:
            col, amaxes = _quantize(x.t(), dtype, 1, power_2_scale, amax_epsilon)
    if amaxes is not None and amaxes.numel() > 0:
        non_finite_counter(amaxes.device).add_(~torch.isfinite(amaxes.amax()))
    return (row if rowwise else None), col


def cast_for_role(recipe, role: str, x: torch.Tensor, dtype: torch.dtype, rowwise: bool,
                  columnwise: bool) -> Tuple[Optional[BlockScaledData], Optional[BlockScaledData]]:
    """`cast_blocks` with the block shape and `QParams` that a Float8BlockScaling
    ``recipe`` gives the tensors of ``role``: "fwd_inp", "fwd_weight" or "bwd_grad"."""
    q = getattr(recipe, "fp8_quant_" + role)
    block_rows = BLOCK if getattr(recipe, _ROLE_DIM_FIELDS[role]) == 2 else 1
    return cast_blocks(x, dtype, block_rows, q.power_2_scale, q.amax_epsilon, rowwise,
                       columnwise)


def block_gemm(a: BlockScaledData, b: BlockScaledData, out_dtype: torch.dtype,
               bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``a @ b^T`` for block-scaled ``a`` [M, K] and ``b`` [N, K] (blocks along K): both
    dequantized to float32, one float32 GEMM, the bias added in float32, rounded once
    to ``out_dtype`` (NOTE [Block scaling layout])."""
    if a.data.shape[1] != b.data.shape[1]:
        raise ValueError(f"block_scaling.block_gemm: inner dimensions differ: a is "
                         f"{tuple(a.data.shape)}, b is {tuple(b.data.shape)} (computing a @ b^T)")
    out = torch.mm(a.dequantize(), b.dequantize().t())
    if bias is not None:
        out.add_(bias)
    return out if out_dtype == torch.float32 else out.to(out_dtype)
