"""Parameters of TE modules: how each one is initialized, deferred initialization
(``device="meta"`` then ``reset_parameters()``), and TE's ``parameters_split``
naming.

NOTE [Parameter initialization]
    Every module registers each parameter together with its initializer
    (`ParameterInitMixin.register_initialized`). ``reset_parameters()`` runs those
    initializers in registration order, which is also TE's parameter order, so that
    ``state_dict()`` keys and ``parameters()`` pair one to one with TE's. A
    parameter still on the ``meta`` device is first materialized (on CUDA when
    available, else on the CPU) as a new ``Parameter`` that keeps the attributes set
    on the old one (tensor-parallel marks, ``sequence_parallel``); any other
    parameter is initialized in place. Weights are drawn under
    ``get_rng_state_tracker().fork(rng_tracker_name)`` when a tracker is given, as
    TE does, so that tensor-parallel shards draw from the rank's stream; constant
    initializers (biases, norm gains) use no RNG. A module built on ``meta``
    defers all of this to the caller's ``reset_parameters()``. A GEMM weight of a
    module built under ``te.quantized_model_init`` is initialized in high precision,
    drawing what the high-precision weight would draw, and then quantized into a
    `Float8Tensor` (NOTE [FP8 primary weights] in fp8_params.py); a reset writes the
    new value into the same Float8Tensor.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ..tensor import QuantizedTensor

__all__ = ["ParamInit", "ParameterInitMixin", "normal_init", "constant_init",
           "split_parameters", "materialize_device", "register_linear_params",
           "joined_parameter"]

_DEFAULT_STD = 0.023


def normal_init(weight: torch.Tensor) -> None:
    """TE's default weight init: normal with mean 0 and std 0.023."""
    torch.nn.init.normal_(weight, mean=0.0, std=_DEFAULT_STD)


class constant_init:
    """An initializer that fills with ``value`` (biases 0, norm gains 1 or 0); a class,
    not a closure, so that modules stay picklable."""

    def __init__(self, value: float):
        self.constant = float(value)

    def __call__(self, t: torch.Tensor) -> None:
        with torch.no_grad():
            t.fill_(self.constant)


@dataclass(frozen=True)
class ParamInit:
    """How one parameter is initialized: ``init_fn(param)``, under the RNG tracker's
    ``fork(rng_tracker_name)`` when ``get_rng_state_tracker`` is given.
    ``fp8_weight_index``: for a GEMM weight, its slot among the module's forward FP8
    tensors (what an FP8 primary weight is quantized with), else None."""

    init_fn: Callable[[torch.Tensor], object]
    get_rng_state_tracker: Optional[Callable] = None
    rng_tracker_name: Optional[str] = None
    fp8_weight_index: Optional[int] = None

    def rng_context(self):
        if self.get_rng_state_tracker is None:
            return contextlib.nullcontext()
        tracker = self.get_rng_state_tracker()
        if self.rng_tracker_name is not None:
            return tracker.fork(self.rng_tracker_name)
        return tracker.fork()


def materialize_device() -> torch.device:
    """Where a ``meta`` parameter is materialized: CUDA when available, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class ParameterInitMixin(torch.nn.Module):
    """``register_initialized`` and ``reset_parameters`` (NOTE [Parameter initialization])."""

    def _init_table(self) -> Dict[str, ParamInit]:
        table = self.__dict__.get("param_init_meta")
        if table is None:
            table = {}
            self.__dict__["param_init_meta"] = table
        return table

    def register_initialized(self, name: str, tensor: torch.Tensor, init: ParamInit) -> None:
        """Register ``tensor`` as parameter ``name`` with its initializer (not run yet)."""
        self.register_parameter(name, torch.nn.Parameter(tensor))
        self._init_table()[name] = init

    def reset_parameters(self, defer_init: bool = False) -> None:
        """(Re)initialize every registered parameter, materializing ``meta`` ones.

        ``defer_init=True`` does nothing (what a module built on ``meta`` calls)."""
        if defer_init:
            return
        fp8_weights = []
        for name, init in self._init_table().items():
            param = getattr(self, name)
            if param is None:
                continue
            if param.is_meta:
                fresh = torch.nn.Parameter(torch.empty_like(param, device=materialize_device()),
                                           requires_grad=param.requires_grad)
                fresh.__dict__.update(param.__dict__)
                setattr(self, name, fresh)
                param = fresh
            target = param
            if init.fp8_weight_index is not None and self._builds_fp8_weights():
                if isinstance(param, QuantizedTensor):    # a fresh value, quantized in place
                    target = torch.empty(param.shape, dtype=param.dtype, device=param.device)
                fp8_weights.append((name, target, init.fp8_weight_index))
            with torch.no_grad(), init.rng_context():
                init.init_fn(target)
        self._after_reset_parameters(fp8_weights)

    def _builds_fp8_weights(self) -> bool:
        """Whether GEMM weights are FP8 primary weights (a module built under
        ``te.quantized_model_init``)."""
        return False

    def _after_reset_parameters(self, fp8_weights: List[Tuple[str, torch.Tensor, int]]
                                ) -> None:
        """Hook run after every parameter is initialized: ``fp8_weights`` are the
        ``(name, initialized high-precision value, FP8 slot)`` of the GEMM weights to
        quantize (empty unless `_builds_fp8_weights`)."""


def split_parameters(api: str, parameters_split, out_features: int
                     ) -> List[Tuple[str, int]]:
    """TE's ``parameters_split``: ``(name prefix, rows)`` pairs along dim 0.

    A tuple or list of names splits ``out_features`` into equal parts; a dict maps
    names to sizes that must add up to ``out_features``. Trailing underscores are
    stripped, so ``"query_"`` and ``"query"`` both name ``query_weight`` /
    ``query_bias``. None: one part, named ``weight`` / ``bias``.
    """
    if parameters_split is None:
        return [("", out_features)]
    if isinstance(parameters_split, dict):
        items = list(parameters_split.items())
    elif isinstance(parameters_split, (tuple, list)):
        n = len(parameters_split)
        if n == 0 or out_features % n != 0:
            raise ValueError(f"{api}: parameters_split={parameters_split!r} must name parts that "
                             f"split out_features={out_features} evenly")
        items = [(name, out_features // n) for name in parameters_split]
    else:
        raise TypeError(f"{api}: parameters_split must be None, a tuple of names or a dict of "
                        f"name -> size, got {type(parameters_split).__name__}")
    names = []
    for name, size in items:
        if not isinstance(name, str) or not name.rstrip("_"):
            raise ValueError(f"{api}: parameters_split names must be non-empty strings, "
                             f"got {name!r}")
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"{api}: parameters_split size of {name!r} must be a positive int, "
                             f"got {size!r}")
        names.append(name.rstrip("_") + "_")
    if len(set(names)) != len(names):
        raise ValueError(f"{api}: parameters_split names must be distinct, got {parameters_split!r}")
    sizes = [size for _, size in items]
    if sum(sizes) != out_features:
        raise ValueError(f"{api}: parameters_split sizes {sizes} must add up to "
                         f"out_features={out_features}")
    return list(zip(names, sizes))


def register_linear_params(module: ParameterInitMixin, parts: List[Tuple[str, int]],
                           in_features: int, use_bias: bool, dtype: torch.dtype,
                           device: torch.device, weight_init: ParamInit, fp8_weight_index: int = 1
                           ) -> Tuple[List[str], List[str]]:
    """Register a linear layer's weights (``[rows, in_features]`` per part) and then
    its biases, in TE's order: all weights first, then all biases. ``parts`` are the
    ``(name prefix, rows)`` pairs of `split_parameters` (rows already local to this
    tensor-parallel rank). Without bias the bias names hold None. The weights are
    the forward FP8 tensor ``fp8_weight_index`` of the module. Returns the weight
    and bias names."""
    weight_init = dataclasses.replace(weight_init, fp8_weight_index=fp8_weight_index)
    weight_names = [f"{prefix}weight" for prefix, _ in parts]
    bias_names = [f"{prefix}bias" for prefix, _ in parts]
    for (_, rows), name in zip(parts, weight_names):
        module.register_initialized(
            name, torch.empty(rows, in_features, dtype=dtype, device=device), weight_init)
    for (_, rows), name in zip(parts, bias_names):
        if use_bias:
            module.register_initialized(name, torch.empty(rows, dtype=dtype, device=device),
                                        ParamInit(constant_init(0.0)))
        else:
            module.register_parameter(name, None)
    return weight_names, bias_names


def joined_parameter(module: torch.nn.Module, names: List[str]) -> Optional[torch.Tensor]:
    """The parameter ``names[0]``, or the split parts concatenated along dim 0 (a copy
    each forward, through which autograd routes each part's gradient)."""
    first = getattr(module, names[0])
    if first is None or len(names) == 1:
        return first
    return torch.cat([getattr(module, n) for n in names], dim=0)
