"""The activations of te.LayerNormMLP (and te.TransformerLayer), by TE's names, applied
in float32, and the check of their ``activation_params``.

A gated activation splits FC1's output into halves ``[a, b]`` along the last dimension
and returns ``f(a) * b`` (TE gates the first half; torch's ``F.glu`` gates the second),
so FC1 has ``2 * ffn_hidden_size`` outputs.

NOTE [Clamped SwiGLU]
    TE's "clamped_swiglu" (GPT-OSS's activation, on TE's chunked halves rather than
    GPT-OSS's interleaved ones) with ``activation_params`` ``limit`` (default 7.0),
    ``alpha`` (1.702) and ``glu_linear_offset`` (1.0)::

        a' = min(a, limit)                      the activated half: clamped above only
        b' = clamp(b, -limit, limit) + offset   the linear half: clamped both ways
        y  = a' * sigmoid(alpha * a') * b'

    Its gradient is zero where a clamp is active: ``dy/da`` is ``0`` for ``a > limit``,
    ``dy/db`` is ``0`` for ``|b| > limit`` (a value exactly at the limit keeps its
    gradient). ``torch.clamp``'s autograd masks with the same inclusive bounds, so the
    autograd of the formula below is TE's backward.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F

__all__ = ["ACTIVATIONS", "ACTIVATION_PARAMS", "activation_names", "is_gated", "fusable",
           "check_activation", "activate", "clamped_swiglu"]


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")      # TE's "gelu" is the tanh approximation


def _qgelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)       # "quick GELU"


def _srelu(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))            # squared ReLU


# The activations without parameters: name -> (elementwise function, gated). "glu" is the
# sigmoid-gated linear unit. These are the ones the fused Triton producers implement.
ACTIVATIONS: Dict[str, Tuple[Callable[[torch.Tensor], torch.Tensor], bool]] = {
    "gelu": (_gelu, False), "geglu": (_gelu, True), "glu": (torch.sigmoid, True),
    "qgelu": (_qgelu, False), "qgeglu": (_qgelu, True),
    "relu": (F.relu, False), "reglu": (F.relu, True),
    "srelu": (_srelu, False), "sreglu": (_srelu, True),
    "silu": (F.silu, False), "swiglu": (F.silu, True),
}

# The activations that take ``activation_params``: name -> TE's defaults (all gated).
ACTIVATION_PARAMS: Dict[str, Dict[str, float]] = {
    "clamped_swiglu": {"limit": 7.0, "alpha": 1.702, "glu_linear_offset": 1.0},
}

# Activations that are one torch op, which computes in float32 for 16-bit inputs and
# rounds once: applied to a 16-bit input directly they give the float32 result bit for
# bit (forward and backward), without a float32 copy of FC1's output (the widest
# activation of the layer) and two extra passes over it.
_ONE_OP_IN_FLOAT32 = frozenset(("gelu", "relu", "silu"))


def activation_names() -> Tuple[str, ...]:
    """Every activation name this package takes, sorted."""
    return tuple(sorted((*ACTIVATIONS, *ACTIVATION_PARAMS)))


def is_gated(activation: str) -> bool:
    """Whether ``activation`` gates one half of its input with the other."""
    return activation in ACTIVATION_PARAMS or ACTIVATIONS[activation][1]


def fusable(activation: str) -> bool:
    """Whether the fused FP8 producers (kernels/act_cast.py, dact_cast.py) implement
    ``activation``; the others run unfused (`activate` and autograd), then cast."""
    return activation in ACTIVATIONS


def check_activation(api: str, activation, activation_params) -> Optional[Dict[str, float]]:
    """Validate ``activation`` and its ``activation_params`` as TE takes them; returns
    the parameters with TE's defaults filled in (None for an activation without any).

    As in TE, ``None`` or an empty dict is fine for every activation; keys other than
    the activation's own, values that are not real numbers, or parameters for an
    activation that takes none raise ``TypeError``; a NaN raises ``ValueError``."""
    if not isinstance(activation, str) or activation not in activation_names():
        raise ValueError(f"{api}: activation must be one of {list(activation_names())}, "
                         f"got {activation!r}")
    if activation_params is not None and not isinstance(activation_params, Mapping):
        raise TypeError(f"{api}: activation_params must be a dict or None, got "
                        f"{type(activation_params).__name__} {activation_params!r}")
    given = dict(activation_params or {})
    defaults = ACTIVATION_PARAMS.get(activation)
    if defaults is None:
        if given:
            raise TypeError(
                f"{api}: activation={activation!r} takes no activation_params, got {given!r} "
                f"(only {sorted(ACTIVATION_PARAMS)} take them)")
        return None
    unknown = sorted(map(repr, set(given) - set(defaults)))
    if unknown:
        raise TypeError(f"{api}: activation_params for activation={activation!r} takes the "
                        f"keys {sorted(defaults)}, got unknown key(s) {', '.join(unknown)}")
    params = dict(defaults)
    for key, value in given.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{api}: activation_params[{key!r}] must be a float, got "
                            f"{type(value).__name__} {value!r}")
        if math.isnan(value):
            raise ValueError(f"{api}: activation_params[{key!r}] must not be NaN")
        params[key] = float(value)
    return params


def clamped_swiglu(x: torch.Tensor, limit: float, alpha: float,
                   glu_linear_offset: float) -> torch.Tensor:
    """TE's clamped SwiGLU of ``x`` (NOTE [Clamped SwiGLU]), in ``x``'s dtype."""
    a, b = x.chunk(2, dim=-1)
    a = a.clamp(max=limit)
    b = b.clamp(min=-limit, max=limit)
    return a * torch.sigmoid(alpha * a) * (b + glu_linear_offset)


def activate(x: torch.Tensor, activation: str,
             params: Optional[Dict[str, float]] = None) -> torch.Tensor:
    """Apply ``activation`` in float32 and return ``x.dtype``; ``params``: what
    `check_activation` returned (TE's defaults when None)."""
    if activation == "clamped_swiglu":
        params = ACTIVATION_PARAMS[activation] if params is None else params
        return clamped_swiglu(x.to(torch.float32), **params).to(x.dtype)
    fn, gated = ACTIVATIONS[activation]
    if activation in _ONE_OP_IN_FLOAT32:
        return fn(x)
    x32 = x.to(torch.float32)
    if gated:
        a, b = x32.chunk(2, dim=-1)
        return (fn(a) * b).to(x.dtype)
    return fn(x32).to(x.dtype)
