"""`Float8BlockwiseQTensor`: FP8 data with one scale per block (Float8BlockScaling),
standing for its dequantized value in its nominal dtype; TE's class of block-scaled FP8
parameters (``te.quantized_model_init(recipe=Float8BlockScaling())``). How it behaves
to torch: NOTE [Quantized tensor semantics] in quantized_tensor.py.

A 2-D tensor [R, C] stores its rowwise copy (``_rowwise_data`` [R, C] and
``_rowwise_scale_inv``: blocks along C) and, where the quantizer keeps one, its
columnwise copy (``_columnwise_data`` [C, R] and ``_columnwise_scale_inv``: blocks
along R), the two operands a weight gives its forward and dgrad GEMMs (NOTE [Block
scaling layout] in block_scaling.py). With 128x128 blocks (``block_scaling_dim=2``,
the recipe's default for weights) the columnwise copy is the transpose of the rowwise
one, the same values; with 1x128 blocks it is the value quantized anew along the other
dimension, as TE's kernels make it. The value is the rowwise copy's. A write quantizes
the new value into both copies with the tensor's `Float8BlockQuantizer` (the recipe's
``fp8_quant_fwd_weight`` settings: power-of-2 scales, epsilon). ``torch.save`` writes
both copies and the quantizer; reading them back needs ``torch.load(...,
weights_only=False)`` or ``torch.serialization.safe_globals(
[rebuild_float8_blockwise_tensor, Float8BlockQuantizer])``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ...common.recipe import Float8BlockScaling
from .. import block_scaling, quantize
from ..block_scaling import BLOCK, BlockScaledData
from .quantized_tensor import NOMINAL_DTYPES, QuantizedTensor, Quantizer

__all__ = ["Float8BlockwiseQTensor", "Float8BlockQuantizer", "rebuild_float8_blockwise_tensor"]

_BlockCopies = Tuple[BlockScaledData, Optional[BlockScaledData]]


class Float8BlockQuantizer(Quantizer):
    """Block quantization of 2-D tensors (TE's class and keywords): ``block_scaling_dim``
    2 for 128x128 blocks, 1 for 1x128; scales ``fp8_max / max(amax, amax_epsilon)``
    per block, rounded down to a power of two with ``force_pow_2_scales``.
    ``columnwise`` keeps the columnwise copy too; ``rowwise`` must be True (the
    value is read from the rowwise copy)."""

    def __init__(self, fp8_dtype: torch.dtype, *, rowwise: bool = True, columnwise: bool = True,
                 amax_epsilon: float = 0.0, force_pow_2_scales: bool = True,
                 block_scaling_dim: int = 2):
        api = "Float8BlockQuantizer"
        if fp8_dtype not in quantize.FP8_DTYPES:
            raise TypeError(f"{api}: fp8_dtype must be one of {quantize.FP8_DTYPES}, "
                            f"got {fp8_dtype}")
        if block_scaling_dim not in (1, 2):
            raise ValueError(f"{api}: block_scaling_dim must be 1 (1x128 blocks) or 2 (128x128 "
                             f"blocks), got {block_scaling_dim!r}")
        if rowwise is not True:
            raise NotImplementedError(f"{api}: rowwise=False (a tensor kept only columnwise) is "
                                      "not implemented")
        self.dtype, self.columnwise_usage = fp8_dtype, bool(columnwise)
        self.block_scaling_dim, self.amax_epsilon = block_scaling_dim, float(amax_epsilon)
        self.force_pow_2_scales = bool(force_pow_2_scales)

    @classmethod
    def for_weights(cls, recipe: Float8BlockScaling) -> "Float8BlockQuantizer":
        """The quantizer of FP8 primary weights made for ``recipe``."""
        q = recipe.fp8_quant_fwd_weight
        return cls(recipe.fp8_format.value.dtype_fwd, amax_epsilon=q.amax_epsilon,
                   force_pow_2_scales=q.power_2_scale,
                   block_scaling_dim=recipe.w_block_scaling_dim)

    @property
    def block_rows(self) -> int:
        return BLOCK if self.block_scaling_dim == 2 else 1

    def quantize(self, x: torch.Tensor, record_amax: bool = True) -> _BlockCopies:
        """``(rowwise, columnwise or None)`` copies of a 2-D ``x``; a NaN or inf in it
        is counted as the casts' are (NOTE [Non-finite amaxes] in amax_update.py).
        ``record_amax``: block scaling records no amax (kept for the protocol)."""
        if x.dim() != 2:
            raise ValueError(f"Float8BlockQuantizer: block-scaled tensors are 2-D [rows, cols], "
                             f"got shape {tuple(x.shape)}")
        return block_scaling.cast_blocks(x.detach(), self.dtype, self.block_rows,
                                         self.force_pow_2_scales, self.amax_epsilon,
                                         rowwise=True, columnwise=self.columnwise_usage)

    def make_tensor(self, storage: _BlockCopies, dtype: torch.dtype) -> "Float8BlockwiseQTensor":
        return Float8BlockwiseQTensor(storage[0], storage[1], dtype, self)

    def _get_compatible_recipe(self):
        return Float8BlockScaling

    def _key(self):
        return (self.dtype, self.columnwise_usage, self.block_scaling_dim, self.amax_epsilon,
                self.force_pow_2_scales)

    def __eq__(self, other) -> bool:
        return isinstance(other, Float8BlockQuantizer) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


class Float8BlockwiseQTensor(QuantizedTensor):
    """A block-scaled FP8 tensor: ``rowwise`` (and ``columnwise``) `BlockScaledData`
    copies of a 2-D value in the nominal ``dtype`` (module docstring), written with
    ``quantizer``."""

    def __new__(cls, rowwise: BlockScaledData, columnwise: Optional[BlockScaledData],
                dtype: torch.dtype, quantizer: Float8BlockQuantizer,
                requires_grad: bool = False):
        api = "Float8BlockwiseQTensor"
        if not isinstance(rowwise, BlockScaledData) or rowwise.data.dim() != 2 \
                or rowwise.data.dtype not in quantize.FP8_DTYPES:
            raise TypeError(f"{api}: rowwise must be a 2-D BlockScaledData of an FP8 dtype")
        rows, cols = rowwise.data.shape
        if columnwise is not None and (not isinstance(columnwise, BlockScaledData)
                                       or tuple(columnwise.data.shape) != (cols, rows)):
            raise TypeError(f"{api}: columnwise must be None or a BlockScaledData of shape "
                            f"{(cols, rows)} (the transpose)")
        if dtype not in NOMINAL_DTYPES:
            raise TypeError(f"{api}: dtype (the nominal dtype) must be one of "
                            f"{NOMINAL_DTYPES}, got {dtype}")
        if not isinstance(quantizer, Float8BlockQuantizer):
            raise TypeError(f"{api}: quantizer must be a Float8BlockQuantizer, "
                            f"got {type(quantizer).__name__}")
        data = rowwise.data
        self = torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=dtype,
                                                   device=data.device, requires_grad=requires_grad)
        self._rowwise_data, self._rowwise_scale_inv = data.contiguous(), rowwise.scale_inv
        self._columnwise_data = None if columnwise is None else columnwise.data.contiguous()
        self._columnwise_scale_inv = None if columnwise is None else columnwise.scale_inv
        self._quantizer = quantizer
        return self

    @property
    def _fp8_dtype(self) -> torch.dtype:
        return self._rowwise_data.dtype

    fp8_dtype = _fp8_dtype

    @property
    def _is_2D_scaled(self) -> bool:
        return self._quantizer.block_scaling_dim == 2

    def block_operands(self, columnwise: bool) -> _BlockCopies:
        """``(rowwise, columnwise or None)`` GEMM operands: the forward reads the rowwise
        copy, the dgrad the columnwise one (NOTE [GEMM vocabulary] in quantize.py)."""
        row = BlockScaledData(self._rowwise_data, self._rowwise_scale_inv,
                              self._quantizer.block_rows)
        if not columnwise:
            return row, None
        if self._columnwise_data is not None:
            return row, BlockScaledData(self._columnwise_data, self._columnwise_scale_inv, 1
                                        if not self._is_2D_scaled else BLOCK)
        if self._is_2D_scaled:
            return row, row.t_contiguous()
        raise RuntimeError("Float8BlockwiseQTensor: this tensor keeps no columnwise copy "
                           "(its quantizer has columnwise=False) and its 1x128 blocks cannot "
                           "be transposed; a GEMM needs it for the gradient of its input")

    def plain(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        with torch.no_grad():
            return self.block_operands(False)[0].dequantize(dtype or self.dtype)

    # ---- the storage (NOTE [Quantized tensor semantics]) ---------------------------
    def _default_quantizer(self) -> Quantizer:
        return self._quantizer

    def _same_format(self, src) -> bool:
        return (isinstance(src, Float8BlockwiseQTensor) and src.shape == self.shape
                and src._quantizer == self._quantizer)

    def _stored(self) -> _BlockCopies:
        return self.block_operands(self._columnwise_data is not None)

    def _store(self, storage: _BlockCopies) -> None:
        row, col = storage
        self._rowwise_data.copy_(row.data)
        self._rowwise_scale_inv.copy_(row.scale_inv)
        if self._columnwise_data is not None:
            self._columnwise_data.copy_(col.data)
            self._columnwise_scale_inv.copy_(col.scale_inv)

    def _storage(self):
        return {"_rowwise_data": self._rowwise_data, "_rowwise_scale_inv": self._rowwise_scale_inv,
                "_columnwise_data": self._columnwise_data,
                "_columnwise_scale_inv": self._columnwise_scale_inv}

    def _rebuilt(self, storage, dtype: torch.dtype) -> "Float8BlockwiseQTensor":
        q = self._quantizer
        col = None
        if storage["_columnwise_data"] is not None:
            col = BlockScaledData(storage["_columnwise_data"], storage["_columnwise_scale_inv"],
                                  q.block_rows)
        return Float8BlockwiseQTensor(
            BlockScaledData(storage["_rowwise_data"], storage["_rowwise_scale_inv"],
                            q.block_rows), col, dtype, q)

    # ---- Python protocols -------------------------------------------------------
    def __repr__(self, *, tensor_contents=None) -> str:
        blocks = "128x128" if self._is_2D_scaled else "1x128"
        return (f"Float8BlockwiseQTensor(fp8_dtype={self._fp8_dtype}, blocks={blocks}, "
                f"dtype={self.dtype}, value={self.plain()})")

    def __reduce_ex__(self, protocol):
        # the bits as uint8: plain pickle of an FP8-dtype tensor fails in torch 2.13
        col = self._columnwise_data
        return rebuild_float8_blockwise_tensor, (
            self._rowwise_data.view(torch.uint8), self._rowwise_scale_inv,
            None if col is None else col.view(torch.uint8), self._columnwise_scale_inv,
            self._quantizer, self.dtype, self.requires_grad,
            isinstance(self, torch.nn.Parameter))

    def __tensor_flatten__(self):
        names = ["_rowwise_data", "_rowwise_scale_inv"]
        if self._columnwise_data is not None:
            names += ["_columnwise_data", "_columnwise_scale_inv"]
        return names, (self.dtype, self._quantizer)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        dtype, q = meta
        col = None
        if "_columnwise_data" in inner:
            col = BlockScaledData(inner["_columnwise_data"], inner["_columnwise_scale_inv"],
                                  q.block_rows)
        return Float8BlockwiseQTensor(BlockScaledData(inner["_rowwise_data"],
                                                      inner["_rowwise_scale_inv"], q.block_rows),
                                      col, dtype, q)


def rebuild_float8_blockwise_tensor(row_bits, row_scale_inv, col_bits, col_scale_inv, quantizer,
                                    dtype, requires_grad, is_param) -> Float8BlockwiseQTensor:
    """A Float8BlockwiseQTensor (a Parameter when ``is_param``) from what pickling wrote."""
    fp8 = quantizer.dtype
    col = None
    if col_bits is not None:
        col = BlockScaledData(col_bits.view(fp8), col_scale_inv, quantizer.block_rows)
    t = Float8BlockwiseQTensor(BlockScaledData(row_bits.view(fp8), row_scale_inv,
                                               quantizer.block_rows), col, dtype, quantizer)
    if is_param:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    return t.requires_grad_(requires_grad)

