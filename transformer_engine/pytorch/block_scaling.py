"""Float8BlockScaling: quantization with one scale per block, and its GEMM (Hopper's
block-scaled FP8 GEMM, or an exact float32 emulation).

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
    activation recompute needs no stash. On CUDA the cast is one Triton pass
    (`kernels.casts.block_cast`; the columnwise 1D copy reads a transposed view),
    elsewhere (and with ``NVTE_FUSED_FP8_KERNELS=0``) torch ops: the same bits.

    The GEMM runs on Hopper GPUs through ``torch._scaled_mm``'s blockwise scales (x and dy
    in 1x128 blocks, M a multiple of 8 and N of 16, NOTE [Block-scaled GEMM routing]; its
    accumulation is the hardware's, see `_hardware_gemm`). Everywhere else (and with
    ``NVTE_BLOCK_FP8_GEMM=emulation``) it is an exact emulation, the same code on CPU and
    CUDA: both operands are dequantized block by block to float32 and multiplied by one
    float32 GEMM. An FP8 value has at most 4 significant bits, so with a power-of-2 scale
    the dequantized value is exact, and so is the product of two of them (8 bits); the
    sums accumulate in float32, as the hardware's block-scaled GEMM does (in another
    order). Such operands are exact in TF32 too, so a CUDA TF32 setting changes nothing;
    with ``power_2_scale=False`` a dequantized value is rounded once to float32 (and to
    TF32 if the script allows TF32 matmuls). `MMParams.use_split_accumulator` changes
    nothing here: the accumulation is float32 either way.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F

from . import quantize
from .non_finite import non_finite_counter
from .function_results import add_into, cast_to
from .kernel_config import get_kernel_config

__all__ = ["BLOCK", "BlockScaledData", "quantize_blocks", "cast_blocks", "cast_for_role",
           "block_gemm", "emulated_block_gemm", "hardware_gemm_fits", "hardware_route",
           "hardware_operands", "padded_k"]

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
        return cast_to(values, dtype)      # NOTE [Fresh function results]

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
    """The cast of `quantize_blocks`, and the blocks' amaxes: one Triton pass on CUDA
    (the fused kernels, NOTE [Kernel selection]), else torch ops; the same bits."""
    kernels = quantize.fused_kernels(x)
    out = None if kernels is None else quantize.fused_or_none(
        kernels.block_cast, x.detach(), dtype, block_rows, power_2_scale, amax_epsilon)
    if out is not None:
        data, scale_inv, block_amax = out
        return BlockScaledData(data, scale_inv, block_rows), block_amax
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
                amax_epsilon: float, rowwise: bool = True, columnwise: bool = False,
                count_where: Optional[torch.Tensor] = None, count_non_finite: bool = True,
                backward: bool = False
                ) -> Tuple[Optional[BlockScaledData], Optional[BlockScaledData]]:
    """``(rowwise, columnwise)`` copies of a 2-D ``x`` [R, C], each None unless asked
    for: ``rowwise`` [R, C] with blocks along C, ``columnwise`` [C, R] with blocks along
    R (NOTE [Block scaling layout]). A NaN or inf in ``x`` is counted once (NOTE
    [Non-finite amaxes] in amax_update.py); with ``count_where`` (a bool scalar
    tensor) only where it is True (a cast the device may discard); not at all with
    ``count_non_finite=False`` (a recompute's cast). ``backward``: a cast of the
    backward pass (which counter compiled code adds to, NOTE [torch.compile])."""
    row = col = None
    amaxes = None
    if rowwise or (columnwise and block_rows == BLOCK):
        row, amaxes = _quantize(x, dtype, block_rows, power_2_scale, amax_epsilon)
    if columnwise:
        if block_rows == BLOCK:
            col = row.t_contiguous()
        else:
            col, amaxes = _quantize(x.t(), dtype, 1, power_2_scale, amax_epsilon)
    if count_non_finite and amaxes is not None and amaxes.numel() > 0:
        non_finite = ~torch.isfinite(amaxes.amax())
        if count_where is not None:
            non_finite = non_finite & count_where
        non_finite_counter(amaxes.device, backward).add_(non_finite)
    return (row if rowwise else None), col


def cast_for_role(recipe, role: str, x: torch.Tensor, dtype: torch.dtype, rowwise: bool,
                  columnwise: bool, count_where: Optional[torch.Tensor] = None,
                  count_non_finite: bool = True
                  ) -> Tuple[Optional[BlockScaledData], Optional[BlockScaledData]]:
    """`cast_blocks` with the block shape and `QParams` that a Float8BlockScaling
    ``recipe`` gives the tensors of ``role``: "fwd_inp", "fwd_weight" or "bwd_grad"."""
    q = getattr(recipe, "fp8_quant_" + role)
    block_rows = BLOCK if getattr(recipe, _ROLE_DIM_FIELDS[role]) == 2 else 1
    return cast_blocks(x, dtype, block_rows, q.power_2_scale, q.amax_epsilon, rowwise,
                       columnwise, count_where, count_non_finite, backward=role == "bwd_grad")


def block_gemm(a: BlockScaledData, b: BlockScaledData, out_dtype: torch.dtype,
               bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``a @ b^T`` for block-scaled ``a`` [M, K] and ``b`` [N, K] (blocks along K), the
    bias added in float32 and the result rounded once to ``out_dtype``: on Hopper
    through ``torch._scaled_mm``'s blockwise scales where `hardware_gemm_fits`, else
    `emulated_block_gemm` (NOTE [Block scaling layout], NOTE [Block-scaled GEMM
    routing])."""
    if a.data.shape[1] != b.data.shape[1]:
        raise ValueError(f"block_scaling.block_gemm: inner dimensions differ: a is "
                         f"{tuple(a.data.shape)}, b is {tuple(b.data.shape)} (computing a @ b^T)")
    if hardware_gemm_fits(a, b, out_dtype):
        return _hardware_gemm(a, b, out_dtype, bias)
    return emulated_block_gemm(a, b, out_dtype, bias)


def emulated_block_gemm(a: BlockScaledData, b: BlockScaledData, out_dtype: torch.dtype,
                        bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`block_gemm` emulated on any device: both operands dequantized to float32, one
    float32 GEMM, the bias added in float32, rounded once to ``out_dtype``."""
    out = torch.mm(a.dequantize(), b.dequantize().t())
    if bias is not None:
        out = add_into(out, bias)      # NOTE [Fresh function results]
    return cast_to(out, out_dtype)


# NOTE [Block-scaled GEMM routing]
#     ``torch._scaled_mm`` (aten/src/ATen/native/cuda/ScaledBlas.cpp) reads the scaling
#     scheme off the scale tensors' shapes and strides, trying in order: tensorwise
#     (one-element scales), row-wise (``scale_a`` [M, 1] and ``scale_b`` [1, N],
#     contiguous), then the blockwise pairs; a GEMM that matches none raises "Invalid
#     scaling configuration". The blockwise forms, with ``kb = ceil(K / 128)``:
#
#       a in 1x128 blocks     ``scale_a`` [M, kb], strides (1, M): column-major
#       b in 1x128 blocks     ``scale_b`` [kb, N], strides (N, 1)
#       b in 128x128 blocks   ``scale_b`` [kb, ceil(N / 128)], strides (1, s) with s =
#                             kb in some torch versions, kb rounded up to a multiple of
#                             4 in others
#
#     and a stride is not checked along a dimension of size 1 or less. So an empty M
#     cannot be described (stride 0 is required along kb, the tensor has 1), a GEMM with
#     kb = 1 reads as row-wise or tensorwise scaling (the same arithmetic, but another
#     kernel: CUTLASS with bfloat16 output only where cuBLAS is older than 12.9), and M
#     = 1 or N <= 1 make the 128x128 forms ambiguous. The hardware path therefore takes
#     only GEMMs with ``a`` in 1x128 blocks, M a positive multiple of 8 (the shapes it
#     was checked with) and N of 16 (``_scaled_mm``'s rule), K > 0, not both operands
#     E5M2 (cuBLASLt has no such GEMM), and a float32 or bfloat16 output (float16 was
#     not checked on the hardware); and it pads K with zero values of scale 1 to a
#     multiple of 128 and at least 256 (kb >= 2), a multiple of 512 for a 128x128 ``b``
#     (kb a multiple of 4, which satisfies both versions' stride rule). Everything else
#     is emulated: the routing refuses up front, it never waits for ``_scaled_mm`` to
#     raise. ``tests/pytorch/test_block_gemm_routing.py`` sweeps shapes, dtypes and
#     layouts through both paths on Hopper; ``benchmarks/probe_block_scaled_mm.py`` asks
#     ``_scaled_mm`` itself about the configurations the routing refuses.

_HOPPER: dict = {}     # device index -> whether it is a Hopper GPU (SM 9.0)
# the output dtypes the hardware path was checked with on an H200 (float16 is emulated)
_HARDWARE_OUT_DTYPES = (torch.float32, torch.bfloat16)


def hardware_route(m: int, k: int, n: int, a_block_rows: int, a_dtype: torch.dtype,
                   b_dtype: torch.dtype, out_dtype: torch.dtype) -> Optional[str]:
    """None when a GEMM of ``a`` [m, k] and ``b`` [n, k] of these block shapes and dtypes
    can go to Hopper's block-scaled GEMM (NOTE [Block-scaled GEMM routing]), else why it
    is emulated. Shapes and dtypes only: `hardware_gemm_fits` adds the device and the
    kernel configuration."""
    if a_block_rows != 1:
        return "a is in 128x128 blocks (the hardware takes a in 1x128 blocks)"
    if m == 0 or n == 0 or k == 0:
        return f"an empty dimension (M={m}, K={k}, N={n})"
    if m % 8:
        return f"M={m} is not a multiple of 8"
    if n % 16:
        return f"N={n} is not a multiple of 16"
    if a_dtype == torch.float8_e5m2 and b_dtype == torch.float8_e5m2:
        return "both operands are E5M2"
    if out_dtype not in _HARDWARE_OUT_DTYPES:
        return f"the output dtype {out_dtype} (the hardware path takes float32 or bfloat16)"
    return None


def hardware_gemm_fits(a: BlockScaledData, b: BlockScaledData,
                       out_dtype: torch.dtype = torch.float32) -> bool:
    """Whether `block_gemm` runs on the GPU's block-scaled FP8 GEMM: a Hopper device,
    ``KernelConfig.block_gemm`` "hardware", and `hardware_route` finds nothing against
    the shapes and dtypes; other GEMMs are emulated."""
    data = a.data
    if not data.is_cuda or hardware_route(data.shape[0], data.shape[1], b.data.shape[0],
                                          a.block_rows, data.dtype, b.data.dtype,
                                          out_dtype) is not None:
        return False
    index = data.device.index
    if torch.compiler.is_compiling():       # no cache written by a graph
        hopper = torch.cuda.get_device_capability(data.device) == (9, 0)
    else:
        if index not in _HOPPER:
            _HOPPER[index] = torch.cuda.get_device_capability(data.device) == (9, 0)
        hopper = _HOPPER[index]
    return hopper and get_kernel_config().block_gemm == "hardware"


def padded_k(k: int, b_block_rows: int) -> int:
    """K as the hardware GEMM takes it (NOTE [Block-scaled GEMM routing]): a multiple
    of 128 and at least 256, of 512 for a ``b`` in 128x128 blocks."""
    if b_block_rows == BLOCK:
        return max(-(-k // (4 * BLOCK)), 1) * 4 * BLOCK
    return max(-(-k // BLOCK), 2) * BLOCK


def _pad_k(t: torch.Tensor, cols: int, value) -> torch.Tensor:
    return t if t.shape[1] == cols else F.pad(t, (0, cols - t.shape[1]), value=value)


def hardware_operands(a: BlockScaledData, b: BlockScaledData):
    """``(a_data, b_data, scale_a, scale_b)`` as `_hardware_gemm` hands them to
    ``torch._scaled_mm``: ``a_data`` [M, Kp] row-major, ``b_data`` [Kp, N] column-major
    (the transpose of ``b``'s data padded), the scales in the layouts of NOTE
    [Block-scaled GEMM routing], K zero-padded to `padded_k` (scales 1 there)."""
    k_padded = padded_k(a.data.shape[1], b.block_rows)
    blocks = k_padded // BLOCK
    a_data = _pad_k(a.data.view(torch.uint8), k_padded, 0).view(a.data.dtype).contiguous()
    b_data = _pad_k(b.data.view(torch.uint8), k_padded, 0).view(b.data.dtype).contiguous()
    scale_a = _pad_k(a.scale_inv, blocks, 1.0).t().contiguous().t()
    scale_b = _pad_k(b.scale_inv, blocks, 1.0).contiguous()
    scale_b = scale_b.t() if b.block_rows == BLOCK else scale_b.t().contiguous()
    return a_data, b_data.t(), scale_a, scale_b


def _hardware_gemm(a: BlockScaledData, b: BlockScaledData, out_dtype: torch.dtype,
                   bias: Optional[torch.Tensor]) -> torch.Tensor:
    """`block_gemm` by ``torch._scaled_mm`` with blockwise scales (`hardware_operands`;
    checked on an H200, torch 2.11). Hopper adds each 128-long block's products in its
    tensor cores (about 14 significant bits) and the blocks in float32: each product
    may be off by up to ``2**-13`` of its block's largest (measured on an H200:
    ``2**-14.8`` at most), not the exact emulation's result."""
    a_data, b_data, scale_a, scale_b = hardware_operands(a, b)
    direct = bias is None
    out = torch._scaled_mm(a_data, b_data, scale_a, scale_b,
                           out_dtype=out_dtype if direct else torch.float32)
    if direct:
        return out
    out = add_into(out, bias)          # NOTE [Fresh function results]
    return cast_to(out, out_dtype)
