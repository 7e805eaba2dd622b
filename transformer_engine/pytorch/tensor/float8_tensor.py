"""`Float8Tensor`: FP8 data with one ``scale_inv`` (per-tensor scaling), standing for
``data * scale_inv`` in its nominal dtype; TE's class of per-tensor FP8 parameters
(``te.quantized_model_init`` with DelayedScaling or Float8CurrentScaling). How it
behaves to torch: NOTE [Quantized tensor semantics] in quantized_tensor.py.

Its storage is ``_data`` (an FP8 tensor of its shape) and ``_scale_inv`` (float32, one
element), and, once a GEMM needed it, the transposed bits (NOTE [Cached FP8
transpose]). A write quantizes with the tensor's quantizer: for a module's weight, the
module's delayed-scaling scale (recording the amax) or current scaling
(module/fp8_params.py); for a tensor without one, current scaling from its own amax.
``torch.save`` writes the FP8 bits and ``scale_inv`` (not the quantizer, which may
refer to a module); reading them back needs ``torch.load(..., weights_only=False)`` or
``torch.serialization.safe_globals([rebuild_float8_tensor])``.

NOTE [Cached FP8 transpose]
    A 2-D Float8Tensor keeps the FP8 bits of its transpose once a GEMM needed them (the
    dgrad of a training forward), as TE's does: ``_transpose`` holds them, or None
    when none was made (inference, a forward without grad); ``_transpose_invalid``
    says whether they are stale. They are made from ``_data``, so they are the same
    values. A write through the tensor or an alias of it (``.data``, ``detach()``,
    which share the cache) re-makes them in place; a write into ``_data`` by other
    means is caught by its version counter (or by setting ``_transpose_invalid =
    True``, as TE's clients do) and the next use re-makes them. Both attributes may be
    set, as on TE's tensor: ``_transpose = None`` drops the bits; bits put there count
    once ``_transpose_invalid = False`` says they are current. A forward traced by
    dynamo or captured in a CUDA graph transposes afresh and leaves the cache alone.
    Copies (``clone``, ``.to``, ``deepcopy``, pickling) start without one.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...common.recipe import Float8CurrentScaling
from .. import quantize
from ..fp8_shapes import Float8Data
from .quantized_tensor import NOMINAL_DTYPES, QuantizedTensor, QuantizedView, Quantizer

__all__ = ["QuantizedTensor", "Float8Tensor", "Float8View", "Float8Quantizing",
           "CurrentScalingQuantizer", "rebuild_float8_tensor"]

Float8View = QuantizedView      # the view class's earlier name


class Float8Quantizing(Quantizer):
    """A quantizer whose ``quantize`` gives `Float8Data`: it makes Float8Tensors."""

    fp8_dtype: torch.dtype

    def make_tensor(self, storage: Float8Data, dtype: torch.dtype) -> "Float8Tensor":
        return Float8Tensor(storage.data, storage.scale_inv, dtype, self)


class CurrentScalingQuantizer(Float8Quantizing):
    """Quantizes with the value's own amax: ``scale = fp8_max / max(amax, eps)``
    (`quantize.current_scale`), what a Float8Tensor without a module's quantizer uses."""

    def __init__(self, fp8_dtype: torch.dtype, power_2_scale: bool = False,
                 amax_epsilon: float = 0.0):
        self.fp8_dtype, self.power_2_scale, self.amax_epsilon = (fp8_dtype, power_2_scale,
                                                                 amax_epsilon)

    def quantize(self, x: torch.Tensor, record_amax: bool = True) -> Float8Data:
        """``x`` quantized (``record_amax``: kept for the quantizers that record)."""
        q, _ = quantize.current_scaling_cast(as_matrix(x), self.fp8_dtype, self.power_2_scale,
                                             self.amax_epsilon, self.non_finite(x))
        return Float8Data(q.data.view(x.shape), q.scale_inv)

    def non_finite(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """The counter non-finite amaxes are added to (none here)."""
        return None

    def _get_compatible_recipe(self):
        return Float8CurrentScaling


def as_matrix(x: torch.Tensor) -> torch.Tensor:
    """``x`` detached, contiguous and 2-D (leading dimensions flattened), as the casts
    take it."""
    x = x.detach().contiguous()
    return x.reshape(-1, x.shape[-1]) if x.dim() >= 1 else x.reshape(1, 1)


class _TransposeCache:
    """The FP8 bits of a Float8Tensor's transpose, shared by the tensor and its aliases
    (``detach``, ``.data``: the same ``_data``), so that a write through any of them
    keeps it right. ``version``: ``_data._version`` when the bits were made (None:
    never made, or ``_data`` keeps no version counter, as an inference tensor)."""

    __slots__ = ("data", "version")

    def __init__(self):
        self.data: Optional[torch.Tensor] = None
        self.version: Optional[int] = None


def _data_version(data: torch.Tensor) -> Optional[int]:
    try:
        return data._version
    except RuntimeError:        # an inference tensor has no version counter
        return None


class Float8Tensor(QuantizedTensor):
    """FP8 ``data`` with its ``scale_inv``, standing for ``data * scale_inv`` in the
    nominal ``dtype`` (NOTE [Quantized tensor semantics]). ``quantizer`` (an object
    with ``quantize(x, record_amax=True) -> Float8Data``) says how values written into
    it are quantized; None means current scaling from their own amax."""

    def __new__(cls, data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype,
                quantizer=None, requires_grad: bool = False):
        if not isinstance(data, torch.Tensor) or data.dtype not in quantize.FP8_DTYPES:
            raise TypeError(f"Float8Tensor: data must be a tensor of an FP8 dtype "
                            f"{quantize.FP8_DTYPES}, got "
                            f"{getattr(data, 'dtype', type(data).__name__)}")
        if (not isinstance(scale_inv, torch.Tensor) or scale_inv.dtype != torch.float32
                or scale_inv.numel() != 1 or scale_inv.device != data.device):
            raise TypeError("Float8Tensor: scale_inv must be a one-element float32 tensor on "
                            f"the data's device {data.device}")
        if dtype not in NOMINAL_DTYPES:
            raise TypeError(f"Float8Tensor: dtype (the nominal dtype) must be one of "
                            f"{NOMINAL_DTYPES}, got {dtype}")
        self = torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=dtype,
                                                   device=data.device, requires_grad=requires_grad)
        self._data = data.contiguous()
        self._scale_inv = scale_inv.reshape(1)
        self._quantizer = quantizer
        self._transpose_cache = _TransposeCache()
        return self

    @property
    def fp8_dtype(self) -> torch.dtype:
        return self._data.dtype

    def fp8_operand(self) -> Float8Data:
        """The FP8 GEMM operand: this tensor's own data and ``scale_inv``."""
        return Float8Data(self._data, self._scale_inv)

    # ---- the cached transpose (NOTE [Cached FP8 transpose]) -------------------------
    @property
    def _transpose(self) -> Optional[torch.Tensor]:
        """TE's attribute: the FP8 bits of the 2-D transpose, if one was made (else None)."""
        return self._transpose_cache.data

    @_transpose.setter
    def _transpose(self, bits: Optional[torch.Tensor]) -> None:
        # TE's clients drop it (None, e.g. before offloading) or put their own bits,
        # which count as current once _transpose_invalid is set False
        cache = self._transpose_cache
        cache.data, cache.version = bits, None

    @property
    def _transpose_invalid(self) -> bool:
        """TE's attribute: True when `_transpose` does not hold the transpose of the
        current data (none made, or the data written since)."""
        cache = self._transpose_cache
        return (cache.data is None or cache.version is None
                or cache.version != _data_version(self._data))

    @_transpose_invalid.setter
    def _transpose_invalid(self, invalid: bool) -> None:
        # TE's clients mark the transpose stale after writing _data themselves, or
        # current after writing both
        self._transpose_cache.version = None if invalid else _data_version(self._data)

    def transpose_operand(self, keep: bool = True) -> Float8Data:
        """``fp8_operand()`` transposed (2-D), bit for bit: the cached copy when it is
        current, else made (into the cached buffer when there is one) and, with
        ``keep``, cached."""
        cache = self._transpose_cache
        if not self._transpose_invalid:
            return Float8Data(cache.data, self._scale_inv)
        fresh = quantize.transpose_fp8(self.fp8_operand())
        if not keep:
            return fresh
        version = _data_version(self._data)
        if cache.data is not None and cache.data.shape == fresh.data.shape:
            cache.data.copy_(fresh.data)        # the same buffer: a captured graph reads it
        else:
            cache.data = fresh.data
        cache.version = version
        return Float8Data(cache.data, self._scale_inv)

    def _reset_caches(self) -> None:
        """TE's method: mark the cached transpose stale (its clients call it after
        writing ``_data`` themselves); the next GEMM that needs it makes it again."""
        self._transpose_invalid = True

    def _create_transpose(self) -> None:
        """TE's method: make the cached transpose from ``_data`` now (into its buffer
        when there is one), as after an all-gather wrote ``_data``."""
        if self._data.dim() != 2:
            return
        self._transpose_cache.version = None
        self.transpose_operand()

    def plain(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        with torch.no_grad():
            return Float8Data(self._data, self._scale_inv).dequantize(dtype or self.dtype)

    # ---- the storage (NOTE [Quantized tensor semantics]) ---------------------------
    def _default_quantizer(self) -> Quantizer:
        return CurrentScalingQuantizer(self.fp8_dtype)

    def _same_format(self, src) -> bool:
        return (isinstance(src, Float8Tensor) and src.fp8_dtype == self.fp8_dtype
                and src.shape == self.shape)

    def _stored(self) -> Float8Data:
        return self.fp8_operand()

    def _store(self, q: Float8Data) -> None:
        self._data.copy_(q.data.reshape(self._data.shape))
        self._scale_inv.copy_(q.scale_inv.reshape(1))
        if self._transpose_cache.data is not None and self._data.dim() == 2:
            # a transpose in use is kept current, in place (this write, made below
            # autograd, did not move the version counter)
            self._transpose_cache.version = None
            self.transpose_operand()

    def _own_attributes(self) -> frozenset:
        return super()._own_attributes() | {"_transpose_cache"}

    def _storage(self):
        return {"_data": self._data, "_scale_inv": self._scale_inv}

    def _rebuilt(self, storage, dtype: torch.dtype) -> "Float8Tensor":
        new = Float8Tensor(storage["_data"], storage["_scale_inv"], dtype,
                           self.__dict__.get("_quantizer"))
        if storage["_data"] is self._data:      # an alias (detach, .data): one transpose
            new._transpose_cache = self._transpose_cache
        return new

    # ---- Python protocols -------------------------------------------------------
    def __repr__(self, *, tensor_contents=None) -> str:
        try:
            scale_inv = f"{float(self._scale_inv.item()):.6g}"
            value = self.plain()
        except Exception:      # fake or symbolic (torch.compile tracing, its logs): no values
            return (f"Float8Tensor(fp8_dtype={self.fp8_dtype}, dtype={self.dtype}, "
                    f"shape={tuple(self.shape)})")
        return (f"Float8Tensor(fp8_dtype={self.fp8_dtype}, scale_inv={scale_inv}, "
                f"dtype={self.dtype}, value={value})")

    def __reduce_ex__(self, protocol):
        # the bits as uint8: plain pickle of an FP8-dtype tensor fails in torch 2.13
        return rebuild_float8_tensor, (self._data.view(torch.uint8), self.fp8_dtype,
                                       self._scale_inv, self.dtype, self.requires_grad,
                                       isinstance(self, torch.nn.Parameter))

    def __tensor_flatten__(self):
        # metadata compared by value (torch.compile guards on it): the nominal dtype; the
        # quantizer serves in-place writes, which compiled code does not make
        return ["_data", "_scale_inv"], (self.dtype,)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Float8Tensor(inner["_data"], inner["_scale_inv"], meta[0])


def rebuild_float8_tensor(data: torch.Tensor, fp8_dtype: torch.dtype, scale_inv: torch.Tensor,
                          dtype: torch.dtype, requires_grad: bool,
                          is_param: bool) -> Float8Tensor:
    """A Float8Tensor (a Parameter when ``is_param``) from what pickling wrote: the FP8
    bits (viewed as ``fp8_dtype``), ``scale_inv``, the nominal dtype."""
    t = Float8Tensor(data.view(fp8_dtype), scale_inv, dtype)
    if is_param:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    return t.requires_grad_(requires_grad)
