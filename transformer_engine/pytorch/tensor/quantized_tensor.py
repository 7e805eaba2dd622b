"""`QuantizedTensor`: a tensor stored quantized that acts, to torch, as its dequantized
value; the dispatch that makes it so, shared by every kind (`Float8Tensor`,
`Float8BlockwiseQTensor`), and the quantizer protocol TE's clients call.

NOTE [Quantized tensor semantics]
    A quantized tensor has the shape, nominal ``dtype`` and device of the value it
    stands for and holds its quantized storage (FP8 data and scales; each kind's file
    says which). To autograd it is an ordinary tensor: ops on it are recorded with
    their usual derivatives, and a parameter's gradient is an ordinary tensor of the
    nominal dtype. Below autograd (``__torch_dispatch__``):

    - an op that reads it computes on the dequantized value and returns ordinary
      tensors (``p + 1``, ``torch.zeros_like(p)``, ``torch.cat`` of split weights);
    - an op that writes it in place (an optimizer's ``add_`` / ``mul_`` /
      ``addcdiv_``, ``copy_``, ``fill_``) computes on the dequantized value and
      quantizes the result back into the same storage (``quantize_``) with the
      tensor's quantizer (for a module's weight, module/fp8_params.py says which);
      ``copy_`` from a tensor of the same kind and format copies the bits;
    - ``detach`` (and ``.data``) share the storage, ``clone`` copies it, and ``.to``
      another device or floating dtype copies it into a tensor of the same kind on
      that device with that nominal dtype (so ``module.to(torch.bfloat16)`` keeps
      quantized weights). ``dequantize()`` gives an ordinary tensor;
    - any other view (``t()``, ``p[0]``, ``p[:, :8]``, ``view``, ``split``) is a
      `QuantizedView`: reads see the value through the view, and a write into it
      (``p[:, :8] *= 0``, ``p.data[0] = x``) changes that part of the dequantized
      value, and the whole tensor is quantized again (its scales cover more than the
      part written: the other elements are re-encoded with the scales the new value
      gets, as after any write).

    An FP8 GEMM takes the storage as it is: no cast. ``torch.save`` writes the
    storage (and, where it holds no module state, the quantizer); reading it back
    needs ``torch.load(..., weights_only=False)`` or ``torch.serialization.
    safe_globals`` with the kind's rebuild function.
"""

from __future__ import annotations

import copy
from typing import Dict, Optional

import torch

__all__ = ["QuantizedTensor", "QuantizedView", "Quantizer", "NOMINAL_DTYPES"]

_aten = torch.ops.aten
NOMINAL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Quantizer:
    """What TE's clients call on ``tensor._get_quantizer()``: ``make_empty`` and
    ``update_quantized``, and the recipe class the tensors it makes belong to. A
    subclass implements ``quantize(x, record_amax=True)`` (its tensor kind's storage
    of ``x``) and ``make_tensor(storage, dtype)``."""

    def quantize(self, x: torch.Tensor, record_amax: bool = True):
        raise NotImplementedError

    def make_tensor(self, storage, dtype: torch.dtype) -> "QuantizedTensor":
        raise NotImplementedError

    def make_empty(self, shape, dtype: torch.dtype = torch.float32, device=None,
                   requires_grad: bool = False) -> "QuantizedTensor":
        """A quantized tensor of ``shape`` holding zeros, quantized by this quantizer
        (TE's signature)."""
        device = torch.device("cuda" if device is None and torch.cuda.is_available()
                              else device or "cpu")
        zeros = torch.zeros(tuple(shape), dtype=torch.float32, device=device)
        return self.make_tensor(self.quantize(zeros, record_amax=False),
                                dtype).requires_grad_(requires_grad)

    def update_quantized(self, src: torch.Tensor, dst: "QuantizedTensor",
                         noop_flag: Optional[torch.Tensor] = None) -> "QuantizedTensor":
        """Quantize ``src`` with this quantizer into ``dst``'s storage, in place.
        ``noop_flag`` (TE's device-side skip) is not implemented."""
        if noop_flag is not None:
            raise NotImplementedError("Quantizer.update_quantized: noop_flag is not implemented")
        value = src.plain() if isinstance(src, QuantizedTensor) else src
        with torch.no_grad():
            dst._store(self.quantize(value.to(dst.device).expand(dst.shape)))
        return dst

    def _get_compatible_recipe(self):
        """The recipe class whose autocast may run GEMMs on these tensors (None: any)."""
        return None


class QuantizedTensor(torch.Tensor):
    """Base of the tensors stored quantized (NOTE [Quantized tensor semantics]). A kind
    implements `plain`, `_store` (write a quantizer's output into its storage),
    `_storage` / `_rebuilt` (its inner tensors, and a tensor of the same kind on other
    ones) and `_default_quantizer`.

    ``QuantizedTensor(shape, dtype, *, requires_grad=False, device=None, stride=None)``
    is TE's constructor of the base itself: a tensor of that shape, nominal dtype and
    device that holds no data (the device defaults to the current CUDA device, or the
    CPU without CUDA). It answers metadata queries; a view of it raises TE's
    ``NotImplementedError`` ("QuantizedTensor class does not support tensor views"),
    and an op that reads its value says it holds none."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __new__(cls, shape=None, dtype=None, *, requires_grad: bool = False, device=None,
                stride=None, **kwargs):
        if cls is not QuantizedTensor:
            raise TypeError(f"{cls.__name__} must define its own constructor")
        if kwargs:
            raise TypeError(f"QuantizedTensor: unexpected keyword arguments {sorted(kwargs)}")
        if isinstance(shape, torch.Tensor) or shape is None or dtype not in NOMINAL_DTYPES:
            raise TypeError("QuantizedTensor(shape, dtype): shape must be a sequence of ints "
                            f"and dtype one of {NOMINAL_DTYPES}, got {type(shape).__name__} and "
                            f"{dtype} (Float8Tensor, Float8BlockwiseQTensor, MXFP8Tensor and "
                            "NVFP4Tensor hold data)")
        shape = torch.Size(shape)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) \
                if torch.cuda.is_available() else torch.device("cpu")
        stride = torch.empty(shape, device="meta").stride() if stride is None else stride
        return torch.Tensor._make_wrapper_subclass(
            cls, shape, strides=tuple(stride), dtype=dtype, device=torch.device(device),
            requires_grad=requires_grad)

    def plain(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The dequantized value (in ``dtype``, the nominal one when None), outside
        autograd."""
        raise NotImplementedError(f"{type(self).__name__} holds no data: only its kinds "
                                  "(Float8Tensor, Float8BlockwiseQTensor) have a value")

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The value as an ordinary tensor (``dtype``: the nominal one when None); a
        gradient flowing into the result reaches this tensor."""
        return _Dequantize.apply(self, dtype or self.dtype)

    def quantize_(self, src: torch.Tensor) -> "QuantizedTensor":
        """Write ``src`` (broadcast to this shape) into this tensor, in place: the bits
        of a tensor of the same kind and format (`_same_format`), else ``src``
        quantized by this tensor's quantizer."""
        with torch.no_grad():
            if self._same_format(src):
                self._store(src._stored())
            else:
                value = src.plain() if isinstance(src, QuantizedTensor) else src
                self._store(self._get_quantizer().quantize(
                    value.to(self.device).expand(self.shape)))
        return self

    def _get_quantizer(self) -> Quantizer:
        """TE's accessor: the quantizer writes into this tensor use."""
        quantizer = self.__dict__.get("_quantizer")
        return quantizer if quantizer is not None else self._default_quantizer()

    # ---- what each kind implements ------------------------------------------------------
    def _default_quantizer(self) -> Quantizer:
        raise NotImplementedError

    def _same_format(self, src) -> bool:
        raise NotImplementedError

    def _stored(self):
        """This tensor's storage in the form its quantizer's ``quantize`` returns."""
        raise NotImplementedError

    def _store(self, storage) -> None:
        raise NotImplementedError

    def _storage(self) -> Dict[str, Optional[torch.Tensor]]:
        raise NotImplementedError

    def _rebuilt(self, storage: Dict[str, Optional[torch.Tensor]],
                 dtype: torch.dtype) -> "QuantizedTensor":
        raise NotImplementedError

    # ---- shared protocols -----------------------------------------------------------------
    def _map_storage(self, fn, dtype: Optional[torch.dtype] = None) -> "QuantizedTensor":
        """A tensor of this kind on ``fn`` of each inner tensor (the quantizer kept)."""
        return self._rebuilt({k: (None if v is None else fn(v))
                              for k, v in self._storage().items()}, dtype or self.dtype)

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        new = self._map_storage(torch.clone)
        if isinstance(self, torch.nn.Parameter) or self.__dict__.get("_is_param"):
            new = torch.nn.Parameter(new, requires_grad=self.requires_grad)
        else:
            new.requires_grad_(self.requires_grad)
        memo[id(self)] = new
        new._quantizer = copy.deepcopy(self.__dict__.get("_quantizer"), memo)
        for key, value in self.__dict__.items():
            if key not in self._own_attributes():
                setattr(new, key, copy.deepcopy(value, memo))
        return new

    def _own_attributes(self) -> frozenset:
        return frozenset(self._storage()) | {"_quantizer", "_is_param"}

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        special = _SPECIAL_OPS.get(func)
        if special is not None and isinstance(args[0], QuantizedTensor) \
                and not isinstance(args[0], QuantizedView):
            return special(args, kwargs)
        if func.is_view and args and isinstance(args[0], QuantizedTensor):
            if type(args[0]) is QuantizedTensor:        # the bare base (TE's message)
                raise NotImplementedError("QuantizedTensor class does not support tensor views")
            return QuantizedView.of(args[0], func, args[1:], kwargs)
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


class QuantizedView(QuantizedTensor):
    """A view (``t()``, ``p[0]``, a slice, ``view``, ``split``) of a quantized tensor:
    it reads as that view of the tensor's value, and a write into it goes into the
    tensor (NOTE [Quantized tensor semantics])."""

    def __new__(cls, base: QuantizedTensor, chain: tuple, meta: torch.Tensor):
        self = torch.Tensor._make_wrapper_subclass(
            cls, meta.shape, strides=meta.stride(), storage_offset=meta.storage_offset(),
            dtype=base.dtype, device=base.device)
        self._base_fp8, self._chain = base, chain
        return self

    @staticmethod
    def of(source: QuantizedTensor, func, args, kwargs):
        """``func(source, *args, **kwargs)`` as view(s) of ``source``'s base."""
        base = source._base_fp8 if isinstance(source, QuantizedView) else source
        chain = source._chain if isinstance(source, QuantizedView) else ()
        meta = _apply((func, args, kwargs, None), _through(chain, torch.empty(
            base.shape, dtype=base.dtype, device="meta")))
        if isinstance(meta, (list, tuple)):
            return type(meta)(QuantizedView(base, chain + ((func, args, kwargs, i),), m)
                              for i, m in enumerate(meta))
        return QuantizedView(base, chain + ((func, args, kwargs, None),), meta)

    def plain(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        value = _through(self._chain, self._base_fp8.plain())
        return value if dtype is None else value.to(dtype)

    def quantize_(self, src: torch.Tensor) -> "QuantizedView":
        """Write ``src`` into this part of the base tensor (which is quantized again)."""
        with torch.no_grad():
            self.copy_(src)
        return self

    def _get_quantizer(self) -> Quantizer:
        return self._base_fp8._get_quantizer()

    def __repr__(self, *, tensor_contents=None) -> str:
        return (f"QuantizedView(of a {type(self._base_fp8).__name__}, dtype={self.dtype}, "
                f"value={self.plain()})")


def _apply(step, x):
    func, args, kwargs, index = step
    out = func(x, *args, **kwargs)
    return out if index is None else out[index]


def _through(chain, x):
    for step in chain:
        x = _apply(step, x)
    return x


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
        if isinstance(x, QuantizedView):
            whole = x._base_fp8.plain()
            value = _through(x._chain, whole)
            wholes[id(value)] = (x._base_fp8, whole)
            return value
        if isinstance(x, QuantizedTensor):
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
    return args[0]._map_storage(lambda t: t)


def _clone(args, kwargs):
    return args[0]._map_storage(torch.clone)


def _copy(args, kwargs):
    return args[0].quantize_(args[1])


def _to_copy(args, kwargs):
    t = args[0]
    dtype = kwargs.get("dtype") or t.dtype
    if dtype in NOMINAL_DTYPES and kwargs.get("layout") in (None, torch.strided) \
            and not kwargs.get("pin_memory"):
        # another device or nominal dtype: a copy of the quantized storage, still
        # quantized (what module.to(device) and module.to(torch.bfloat16) need)
        device = kwargs.get("device") or t.device
        non_blocking = bool(kwargs.get("non_blocking", False))
        return t._map_storage(lambda s: s.to(device, non_blocking=non_blocking, copy=True),
                              dtype)
    return _aten._to_copy.default(t.plain(), **kwargs)


# ops on a quantized tensor itself (as their first argument)
_SPECIAL_OPS = {
    _aten.detach.default: _detach,
    _aten.alias.default: _detach,
    _aten.clone.default: _clone,
    _aten.copy_.default: _copy,
    _aten._to_copy.default: _to_copy,
}
