"""`QuantizedTensor` and `Float8Tensor`: a tensor stored as FP8 data and a
``scale_inv`` that acts, to torch, as its dequantized value. TE's class of FP8
parameters (``te.quantized_model_init``).

NOTE [Quantized tensor semantics]
    A Float8Tensor has the shape, nominal ``dtype`` and device of the value it stands
    for and holds ``_data`` (an FP8 tensor of that shape) and ``_scale_inv`` (float32,
    one element): value = ``_data * _scale_inv``, in the nominal dtype. To autograd it
    is an ordinary tensor: ops on it are recorded with their usual derivatives, and a
    parameter's gradient is an ordinary tensor of the nominal dtype. Below autograd
    (``__torch_dispatch__``):

    - an op that reads it computes on the dequantized value and returns ordinary
      tensors (``p + 1``, ``torch.zeros_like(p)``, ``torch.cat`` of split weights);
    - an op that writes it in place (an optimizer's ``add_`` / ``mul_`` /
      ``addcdiv_``, ``copy_``, ``fill_``) computes on the dequantized value and
      quantizes the result back into the same ``_data`` and ``_scale_inv``
      (`Float8Tensor.quantize_`) with the tensor's quantizer: for a module's weight,
      the module's delayed-scaling scale (recording the amax) or current scaling
      (module/fp8_params.py); for a tensor without one, current scaling from its own
      amax. ``copy_`` from a Float8Tensor of the same FP8 dtype copies the bits;
    - ``detach`` (and ``.data``) share ``_data`` and ``_scale_inv``, ``clone`` copies
      them, and ``.to`` another device or floating dtype copies them into a
      Float8Tensor of that device and nominal dtype (so ``module.to(torch.bfloat16)``
      keeps FP8 weights). ``dequantize()`` gives an ordinary tensor;
    - any other view (``t()``, ``p[0]``, ``p[:, :8]``, ``view``, ``split``) is a
      `Float8View`: reads see the value through the view, and a write into it
      (``p[:, :8] *= 0``, ``p.data[0] = x``) changes that part of the dequantized
      value, and the whole tensor is quantized again (one scale per tensor: the
      other elements are re-encoded with the scale in force, as after any write).

    An FP8 GEMM takes ``_data`` and ``_scale_inv`` as they are: no cast, no amax.
    ``torch.save`` writes the FP8 bits and ``scale_inv`` (not the quantizer); reading
    them back needs ``torch.load(..., weights_only=False)`` or
    ``torch.serialization.safe_globals([rebuild_float8_tensor])``.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch

from .. import quantize
from ..fp8_shapes import Float8Data

__all__ = ["QuantizedTensor", "Float8Tensor", "Float8View", "CurrentScalingQuantizer",
           "rebuild_float8_tensor"]

_aten = torch.ops.aten
_NOMINAL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# attributes a Float8Tensor keeps for itself (not copied to a deep copy's __dict__)
_OWN_ATTRIBUTES = frozenset({"_data", "_scale_inv", "_quantizer", "_is_param"})


class CurrentScalingQuantizer:
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


def as_matrix(x: torch.Tensor) -> torch.Tensor:
    """``x`` detached, contiguous and 2-D (leading dimensions flattened), as the casts
    take it."""
    x = x.detach().contiguous()
    return x.reshape(-1, x.shape[-1]) if x.dim() >= 1 else x.reshape(1, 1)


class QuantizedTensor(torch.Tensor):
    """Base of the tensors stored quantized (NOTE [Quantized tensor semantics]);
    `Float8Tensor` is the kind this package makes. Not constructible itself."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __new__(cls, *args, **kwargs):
        raise TypeError("transformer_engine.pytorch.tensor.QuantizedTensor is an abstract base "
                        "class; Float8Tensor is the quantized tensor this package makes")

    def plain(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The dequantized value (in ``dtype``, the nominal one when None), outside
        autograd."""
        raise NotImplementedError

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The value as an ordinary tensor (``dtype``: the nominal one when None); a
        gradient flowing into the result reaches this tensor."""
        return _Dequantize.apply(self, dtype or self.dtype)

    def quantize_(self, src: torch.Tensor) -> "QuantizedTensor":
        """Write ``src`` (broadcast to this shape) into this tensor, in place."""
        raise NotImplementedError

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        special = _SPECIAL_OPS.get(func)
        if special is not None and isinstance(args[0], Float8Tensor):
            return special(args, kwargs)
        if func.is_view and args and isinstance(args[0], QuantizedTensor):
            return Float8View.of(args[0], func, args[1:], kwargs)
        return _call_dequantized(func, args, kwargs)


class _Dequantize(torch.autograd.Function):
    """``t.dequantize()`` under autograd: the gradient passes to ``t`` unchanged."""

    @staticmethod
    def forward(ctx, t: QuantizedTensor, dtype: torch.dtype):
        ctx.nominal = t.dtype
        return t.plain(dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.to(ctx.nominal), None


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
        if dtype not in _NOMINAL_DTYPES:
            raise TypeError(f"Float8Tensor: dtype (the nominal dtype) must be one of "
                            f"{_NOMINAL_DTYPES}, got {dtype}")
        self = torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=dtype,
                                                   device=data.device, requires_grad=requires_grad)
        self._data = data.contiguous()
        self._scale_inv = scale_inv.reshape(1)
        self._quantizer = quantizer
        return self

    @property
    def fp8_dtype(self) -> torch.dtype:
        return self._data.dtype

    def fp8_operand(self) -> Float8Data:
        """The FP8 GEMM operand: this tensor's own data and ``scale_inv``."""
        return Float8Data(self._data, self._scale_inv)

    def plain(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        with torch.no_grad():
            return Float8Data(self._data, self._scale_inv).dequantize(dtype or self.dtype)

    def quantize_(self, src: torch.Tensor) -> "Float8Tensor":
        """Write ``src`` (broadcast to this shape) into this tensor, in place: the bits
        of a Float8Tensor of the same FP8 dtype, else ``src`` quantized by this
        tensor's quantizer."""
        with torch.no_grad():
            if isinstance(src, Float8Tensor) and src.fp8_dtype == self.fp8_dtype \
                    and src.shape == self.shape:
                q = src.fp8_operand()
            else:
                value = src.plain() if isinstance(src, QuantizedTensor) else src
                value = value.to(self.device).expand(self.shape)
                quantizer = self._quantizer or CurrentScalingQuantizer(self.fp8_dtype)
                q = quantizer.quantize(value)
            self._data.copy_(q.data)
            self._scale_inv.copy_(q.scale_inv.reshape(1))
        return self

    def _with(self, data: torch.Tensor, scale_inv: torch.Tensor) -> "Float8Tensor":
        return Float8Tensor(data, scale_inv, self.dtype, self._quantizer)

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

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        new = rebuild_float8_tensor(self._data.clone(), self.fp8_dtype, self._scale_inv.clone(),
                                    self.dtype, self.requires_grad,
                                    isinstance(self, torch.nn.Parameter))
        memo[id(self)] = new
        new._quantizer = copy.deepcopy(self._quantizer, memo)
        for key, value in self.__dict__.items():
            if key not in _OWN_ATTRIBUTES:
                setattr(new, key, copy.deepcopy(value, memo))
        return new

    def __tensor_flatten__(self):
        # metadata compared by value (torch.compile guards on it): the nominal dtype; the
        # quantizer serves in-place writes, which compiled code does not make
        return ["_data", "_scale_inv"], (self.dtype,)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Float8Tensor(inner["_data"], inner["_scale_inv"], meta[0])


class Float8View(QuantizedTensor):
    """A view (``t()``, ``p[0]``, a slice, ``view``, ``split``) of a Float8Tensor: it
    reads as that view of the tensor's value, and a write into it goes into the
    tensor (NOTE [Quantized tensor semantics])."""

    def __new__(cls, base: Float8Tensor, chain: tuple, meta: torch.Tensor):
        self = torch.Tensor._make_wrapper_subclass(
            cls, meta.shape, strides=meta.stride(), storage_offset=meta.storage_offset(),
            dtype=base.dtype, device=base.device)
        self._base_fp8, self._chain = base, chain
        return self

    @staticmethod
    def of(source: QuantizedTensor, func, args, kwargs):
        """``func(source, *args, **kwargs)`` as view(s) of ``source``'s base."""
        base = source._base_fp8 if isinstance(source, Float8View) else source
        chain = source._chain if isinstance(source, Float8View) else ()
        meta = _apply((func, args, kwargs, None), _through(chain, torch.empty(
            base.shape, dtype=base.dtype, device="meta")))
        if isinstance(meta, (list, tuple)):
            return type(meta)(Float8View(base, chain + ((func, args, kwargs, i),), m)
                              for i, m in enumerate(meta))
        return Float8View(base, chain + ((func, args, kwargs, None),), meta)

    def plain(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        value = _through(self._chain, self._base_fp8.plain())
        return value if dtype is None else value.to(dtype)

    def quantize_(self, src: torch.Tensor) -> "Float8View":
        """Write ``src`` into this part of the base tensor (which is quantized again)."""
        with torch.no_grad():
            self.copy_(src)
        return self

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"Float8View(of a Float8Tensor, dtype={self.dtype}, value={self.plain()})"


def _apply(step, x):
    func, args, kwargs, index = step
    out = func(x, *args, **kwargs)
    return out if index is None else out[index]


def _through(chain, x):
    for step in chain:
        x = _apply(step, x)
    return x


def rebuild_float8_tensor(data: torch.Tensor, fp8_dtype: torch.dtype, scale_inv: torch.Tensor,
                          dtype: torch.dtype, requires_grad: bool,
                          is_param: bool) -> Float8Tensor:
    """A Float8Tensor (a Parameter when ``is_param``) from what pickling wrote: the FP8
    bits (viewed as ``fp8_dtype``), ``scale_inv``, the nominal dtype."""
    t = Float8Tensor(data.view(fp8_dtype), scale_inv, dtype)
    if is_param:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    return t.requires_grad_(requires_grad)


# ---- ops below autograd (NOTE [Quantized tensor semantics]) ---------------------------
def _map(fn, obj):
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map(fn, o) for o in obj)
    if isinstance(obj, dict):
        return {k: _map(fn, v) for k, v in obj.items()}
    return fn(obj)


def _written(func, args, kwargs, plain_args, plain_kwargs):
    """``(quantized original, plain stand-in)`` for each quantized tensor ``func`` writes."""
    pairs = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        if i < len(args) and not arg.kwarg_only:
            orig, plain = args[i], plain_args[i]
        elif arg.name in kwargs:
            orig, plain = kwargs[arg.name], plain_kwargs[arg.name]
        else:
            continue
        found = list(zip(orig, plain)) if isinstance(orig, (list, tuple)) else [(orig, plain)]
        pairs += [(o, p) for o, p in found if isinstance(o, QuantizedTensor)]
    return pairs


def _call_dequantized(func, args, kwargs):
    # each quantized argument stands in as its dequantized value; a view's stand-in is
    # that view of its whole base's value, which a write then goes back into
    wholes = {}

    def stand_in(x):
        if isinstance(x, Float8View):
            whole = x._base_fp8.plain()
            value = _through(x._chain, whole)
            wholes[id(value)] = (x._base_fp8, whole)
            return value
        if isinstance(x, Float8Tensor):
            value = x.plain()
            wholes[id(value)] = (x, value)
            return value
        return x

    plain_args, plain_kwargs = _map(stand_in, args), _map(stand_in, kwargs)
    out = func(*plain_args, **plain_kwargs)
    written = _written(func, args, kwargs, plain_args, plain_kwargs)
    if not written:
        return out
    for _, plain in written:
        base, whole = wholes[id(plain)]
        base.quantize_(whole)
    # an in-place op returns what it wrote: the quantized tensor, not its stand-in
    stand_ins = {id(plain): orig for orig, plain in written}
    return _map(lambda t: stand_ins.get(id(t), t), out)


def _detach(args, kwargs):
    t = args[0]
    return t._with(t._data, t._scale_inv)


def _clone(args, kwargs):
    t = args[0]
    return t._with(t._data.clone(), t._scale_inv.clone())


def _copy(args, kwargs):
    return args[0].quantize_(args[1])


def _to_copy(args, kwargs):
    t = args[0]
    dtype = kwargs.get("dtype") or t.dtype
    if dtype in _NOMINAL_DTYPES and kwargs.get("layout") in (None, torch.strided) \
            and not kwargs.get("pin_memory"):
        # another device or nominal dtype: a copy of the FP8 data, still FP8 (what
        # module.to(device) and module.to(torch.bfloat16) need)
        device = kwargs.get("device") or t.device
        non_blocking = bool(kwargs.get("non_blocking", False))
        return Float8Tensor(t._data.to(device, non_blocking=non_blocking, copy=True),
                            t._scale_inv.to(device, non_blocking=non_blocking, copy=True),
                            dtype, t._quantizer)
    return _aten._to_copy.default(t.plain(), **kwargs)


# ops on a Float8Tensor itself (as their first argument)
_SPECIAL_OPS = {
    _aten.detach.default: _detach,
    _aten.alias.default: _detach,
    _aten.clone.default: _clone,
    _aten.copy_.default: _copy,
    _aten._to_copy.default: _to_copy,
}
