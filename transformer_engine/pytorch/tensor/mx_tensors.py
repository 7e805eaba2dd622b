"""`MXFP8Tensor` and `NVFP4Tensor`: the MX-family primary weights
(``te.quantized_model_init(recipe=MXFP8BlockScaling())`` / ``NVFP4BlockScaling()``),
TE's class names, standing for their dequantized value in their nominal dtype (NOTE
[Quantized tensor semantics] in quantized_tensor.py).

A 2-D tensor [R, C] keeps the two operands a weight gives its GEMMs, as
`Float8BlockwiseQTensor` does: the rowwise copy (blocks along C; the forward's) and,
where its quantizer keeps one, the columnwise copy (the value's transpose [C, R],
blocks along R; the dgrad's). Each is what the recipe's weight cast makes of the same
high-precision value (NOTE [MXFP8 layout and rounding] in mx_scaling.py, NOTE [NVFP4
layout and rounding] in nvfp4_scaling.py): so a forward on the weight reads the very
bits a high-precision weight holding that value is cast to. The value is the rowwise
copy's. A write quantizes the new value into both copies. ``torch.save`` writes both
copies and the quantizer (``torch.load(..., weights_only=False)`` or
``torch.serialization.safe_globals`` with `rebuild_mx_tensor` and the quantizer class
reads them back).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ...common.recipe import MXFP8BlockScaling, NVFP4BlockScaling
from ..mx_scaling import FP8_MAX, MX_BLOCK, MXFP8Data, cast_mxfp8
from ..nvfp4_scaling import NVFP4_BLOCK, NVFP4Data, cast_nvfp4
from .quantized_tensor import NOMINAL_DTYPES, QuantizedTensor, Quantizer

__all__ = ["MXFP8Quantizer", "MXFP8Tensor", "NVFP4Quantizer", "NVFP4Tensor",
           "rebuild_mx_tensor"]

_COPIES = ("rowwise", "columnwise")
# TE's NVFP4Quantizer options about amax reduction and the Hadamard transform's inputs:
# accepted and unused (a weight is neither reduced nor transformed here)
_NVFP4_IGNORED = frozenset(("with_amax_reduction", "amax_reduction_group",
                            "with_post_rht_amax", "with_random_sign_mask"))


def _check_flags(api: str, rowwise, with_2d_quantization) -> None:
    if rowwise is not True:
        raise NotImplementedError(f"{api}: rowwise=False (a tensor kept only columnwise) is "
                                  "not implemented")
    if not isinstance(with_2d_quantization, bool):
        raise TypeError(f"{api}: with_2d_quantization must be a bool, "
                        f"got {with_2d_quantization!r}")


class _MXQuantizer(Quantizer):
    """Shared by the MXFP8 and NVFP4 weight quantizers: ``(rowwise, columnwise or
    None)`` copies of a 2-D tensor; `_data` rebuilds one copy from its tensors."""

    FIELDS: Tuple[str, ...] = ()
    tile: int = 1
    tensor_class: type = QuantizedTensor

    @property
    def block_rows(self) -> int:
        return self.tile if self.with_2d_quantization else 1

    def quantize(self, x: torch.Tensor, record_amax: bool = True):
        """The copies of a 2-D ``x``; a NaN or inf in it is counted as the casts' are
        (NOTE [Non-finite amaxes] in amax_update.py) unless ``record_amax`` is False
        (a weight's initial value: possibly memory never written)."""
        if x.dim() != 2:
            raise ValueError(f"{type(self).__name__}: MX-family tensors are 2-D "
                             f"[rows, cols], got shape {tuple(x.shape)}")
        return self._cast(x.detach(), record_amax)

    def make_tensor(self, storage, dtype: torch.dtype):
        return self.tensor_class(storage[0], storage[1], dtype, self)

    def _data(self, tensors: dict, shape: Tuple[int, int]):
        raise NotImplementedError

    def _key(self):
        raise NotImplementedError

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


class MXFP8Quantizer(_MXQuantizer):
    """MXFP8 quantization of 2-D tensors (TE's class and keywords): E8M0 scales per
    1x32 values, or per 32x32 tile with ``with_2d_quantization``; ``columnwise``
    keeps the columnwise copy too."""

    FIELDS = ("data", "scale_inv")
    tile = MX_BLOCK

    def __init__(self, fp8_dtype: torch.dtype = torch.float8_e4m3fn, *, rowwise: bool = True,
                 columnwise: bool = True, with_2d_quantization: bool = False):
        api = "MXFP8Quantizer"
        if fp8_dtype not in FP8_MAX:
            raise TypeError(f"{api}: fp8_dtype must be one of {tuple(FP8_MAX)}, got {fp8_dtype}")
        _check_flags(api, rowwise, with_2d_quantization)
        self.dtype, self.columnwise_usage = fp8_dtype, bool(columnwise)
        self.with_2d_quantization = with_2d_quantization

    @classmethod
    def for_weights(cls, recipe: MXFP8BlockScaling) -> "MXFP8Quantizer":
        """The quantizer of MXFP8 primary weights made for ``recipe``."""
        return cls(recipe.fp8_format.value.dtype_fwd,
                   with_2d_quantization=recipe.enable_2d_quantization)

    def _cast(self, x, count):
        return cast_mxfp8(x, self.dtype, self.block_rows, True, self.columnwise_usage,
                          count_non_finite=count)

    def _data(self, tensors, shape):
        return MXFP8Data(tensors["data"], tensors["scale_inv"], self.block_rows)

    def _get_compatible_recipe(self):
        return MXFP8BlockScaling

    def _key(self):
        return (self.dtype, self.columnwise_usage, self.with_2d_quantization)


class NVFP4Quantizer(_MXQuantizer):
    """NVFP4 quantization of 2-D weights (TE's class; its keywords for what weights
    use): E2M1 values, E4M3 scales per 1x16 values or per 16x16 tile with
    ``with_2d_quantization``, one float32 scale per copy. A weight's cast has neither
    the Hadamard transform nor stochastic rounding (TE applies them to inputs and
    gradients), so ``with_rht`` and ``stochastic_rounding`` must be False."""

    FIELDS = ("data", "scale_inv", "global_scale_inv")
    tile = NVFP4_BLOCK

    def __init__(self, fp4_dtype=None, rowwise: bool = True, columnwise: bool = True, *,
                 with_rht: bool = False, stochastic_rounding: bool = False,
                 with_2d_quantization: bool = False, **te_options):
        api = "NVFP4Quantizer"
        unknown = set(te_options) - _NVFP4_IGNORED
        if unknown:
            raise TypeError(f"{api}: unexpected keyword arguments {sorted(unknown)}")
        _check_flags(api, rowwise, with_2d_quantization)
        if with_rht or stochastic_rounding:
            raise NotImplementedError(f"{api}: with_rht / stochastic_rounding are for inputs "
                                      "and gradients; a quantized weight takes neither")
        self.columnwise_usage, self.with_2d_quantization = bool(columnwise), with_2d_quantization

    @classmethod
    def for_weights(cls, recipe: NVFP4BlockScaling) -> "NVFP4Quantizer":
        """The quantizer of NVFP4 primary weights made for ``recipe``."""
        return cls(with_2d_quantization=recipe.fp4_quant_fwd_weight.fp4_2d_quantization)

    def _cast(self, x, count):
        return cast_nvfp4(x, self.block_rows, True, self.columnwise_usage,
                          count_non_finite=count)

    def _data(self, tensors, shape):
        return NVFP4Data(tensors["data"], tensors["scale_inv"], tensors["global_scale_inv"],
                         self.block_rows, shape[1])

    def _get_compatible_recipe(self):
        return NVFP4BlockScaling

    def _key(self):
        return (self.columnwise_usage, self.with_2d_quantization)


class _MXTensor(QuantizedTensor):
    """Shared by `MXFP8Tensor` and `NVFP4Tensor`: ``rowwise`` (and ``columnwise``) copies
    of a 2-D value in the nominal ``dtype``, written with ``quantizer``."""

    DATA: type = tuple
    QUANTIZER: type = _MXQuantizer

    def __new__(cls, rowwise, columnwise, dtype: torch.dtype, quantizer,
                requires_grad: bool = False):
        api = cls.__name__
        if not isinstance(quantizer, cls.QUANTIZER):
            raise TypeError(f"{api}: quantizer must be a {cls.QUANTIZER.__name__}, "
                            f"got {type(quantizer).__name__}")
        if not isinstance(rowwise, cls.DATA) or rowwise.data.dim() != 2:
            raise TypeError(f"{api}: rowwise must be a 2-D {cls.DATA.__name__}")
        rows, cols = rowwise.data.shape[0], rowwise.cols
        if columnwise is not None and (not isinstance(columnwise, cls.DATA)
                                       or (columnwise.data.shape[0], columnwise.cols)
                                       != (cols, rows)):
            raise TypeError(f"{api}: columnwise must be None or a {cls.DATA.__name__} of "
                            f"shape {(cols, rows)} (the transpose)")
        if dtype not in NOMINAL_DTYPES:
            raise TypeError(f"{api}: dtype (the nominal dtype) must be one of "
                            f"{NOMINAL_DTYPES}, got {dtype}")
        self = torch.Tensor._make_wrapper_subclass(cls, (rows, cols), dtype=dtype,
                                                   device=rowwise.data.device,
                                                   requires_grad=requires_grad)
        for prefix, copy in zip(_COPIES, (rowwise, columnwise)):
            for name in quantizer.FIELDS:
                value = None if copy is None else getattr(copy, name).contiguous()
                setattr(self, f"_{prefix}_{name}", value)
        self._quantizer = quantizer
        return self

    def _copy(self, prefix: str):
        tensors = {name: getattr(self, f"_{prefix}_{name}") for name in self.QUANTIZER.FIELDS}
        if tensors["data"] is None:
            return None
        rows, cols = self.shape
        return self._quantizer._data(tensors, (rows, cols) if prefix == "rowwise"
                                     else (cols, rows))

    def block_operands(self, columnwise: bool):
        """``(rowwise, columnwise or None)`` GEMM operands: the forward reads the rowwise
        copy, the dgrad the columnwise one (NOTE [GEMM vocabulary] in quantize.py)."""
        row = self._copy("rowwise")
        if not columnwise:
            return row, None
        col = self._copy("columnwise")
        if col is not None:
            return row, col
        if isinstance(row, MXFP8Data) and row.block_rows == MX_BLOCK:
            return row, row.t_contiguous()          # 32x32 tiles: the transpose
        raise RuntimeError(f"{type(self).__name__}: this tensor keeps no columnwise copy "
                           "(its quantizer has columnwise=False); a GEMM needs it for the "
                           "gradient of its input")

    def plain(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        with torch.no_grad():
            return self._copy("rowwise").dequantize(dtype or self.dtype)

    # ---- the storage (NOTE [Quantized tensor semantics]) ---------------------------
    def _default_quantizer(self) -> Quantizer:
        return self._quantizer

    def _same_format(self, src) -> bool:
        return (type(src) is type(self) and src.shape == self.shape
                and src._quantizer == self._quantizer)

    def _stored(self):
        return self.block_operands(self._columnwise_data is not None)

    def _store(self, storage) -> None:
        for prefix, copy in zip(_COPIES, storage):
            for name in self.QUANTIZER.FIELDS:
                mine = getattr(self, f"_{prefix}_{name}")
                if mine is not None:
                    mine.copy_(getattr(copy, name))

    def _storage(self):
        return {f"_{prefix}_{name}": getattr(self, f"_{prefix}_{name}")
                for prefix in _COPIES for name in self.QUANTIZER.FIELDS}

    def _rebuilt(self, storage, dtype: torch.dtype):
        return _from_storage(type(self), storage, dtype, self._quantizer, tuple(self.shape))

    # ---- Python protocols -------------------------------------------------------
    def __repr__(self, *, tensor_contents=None) -> str:
        tiles = self._quantizer.block_rows
        return (f"{type(self).__name__}(blocks={tiles}x{self._quantizer.tile}, "
                f"dtype={self.dtype}, value={self.plain()})")

    def __reduce_ex__(self, protocol):
        # one-byte float dtypes as their bits: plain pickle of an FP8 tensor fails
        storage = {k: None if v is None else (v.view(torch.uint8) if v.dtype.itemsize == 1
                                              else v, v.dtype)
                   for k, v in self._storage().items()}
        return rebuild_mx_tensor, (type(self), storage, self._quantizer, self.dtype,
                                   tuple(self.shape), self.requires_grad,
                                   isinstance(self, torch.nn.Parameter))

    def __tensor_flatten__(self):
        return ([k for k, v in self._storage().items() if v is not None],
                (self.dtype, self._quantizer, tuple(self.shape)))

    @classmethod
    def __tensor_unflatten__(cls, inner, meta, outer_size, outer_stride):
        dtype, quantizer, shape = meta
        storage = {k: inner.get(k) for k in (f"_{p}_{n}" for p in _COPIES
                                             for n in quantizer.FIELDS)}
        return _from_storage(cls, storage, dtype, quantizer, shape)


def _from_storage(cls, storage: dict, dtype, quantizer, shape):
    rows, cols = shape
    copies = []
    for prefix, copy_shape in zip(_COPIES, ((rows, cols), (cols, rows))):
        tensors = {name: storage[f"_{prefix}_{name}"] for name in quantizer.FIELDS}
        copies.append(None if tensors["data"] is None
                      else quantizer._data(tensors, copy_shape))
    return cls(copies[0], copies[1], dtype, quantizer)


class MXFP8Tensor(_MXTensor):
    """An MXFP8 tensor (module docstring): FP8 values with E8M0 block scales."""

    DATA = MXFP8Data
    QUANTIZER = MXFP8Quantizer


class NVFP4Tensor(_MXTensor):
    """An NVFP4 tensor (module docstring): packed E2M1 values with E4M3 block scales
    and a float32 per-tensor scale per copy."""

    DATA = NVFP4Data
    QUANTIZER = NVFP4Quantizer


MXFP8Quantizer.tensor_class = MXFP8Tensor
NVFP4Quantizer.tensor_class = NVFP4Tensor


def rebuild_mx_tensor(cls, storage, quantizer, dtype, shape, requires_grad, is_param):
    """An MXFP8Tensor / NVFP4Tensor (a Parameter when ``is_param``) from what pickling
    wrote."""
    if cls not in (MXFP8Tensor, NVFP4Tensor):
        raise TypeError(f"rebuild_mx_tensor: cls must be MXFP8Tensor or NVFP4Tensor, got {cls!r}")
    tensors = {k: None if v is None else v[0].view(v[1]) for k, v in storage.items()}
    t = _from_storage(cls, tensors, dtype, quantizer, shape)
    if is_param:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    return t.requires_grad_(requires_grad)
