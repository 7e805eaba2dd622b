"""``te.ops.SwiGLU``, ``te.ops.SiTUGLU`` and ``te.ops.ClampedSwiGLU`` (GPT-OSS's, NOTE
[Clamped SwiGLU] in module/activations.py). Each gates the first half ``a`` of the last
dimension with the second ``b``, or, with ``glu_interleave_size``, TE's block-interleaved
layout of the two (`deinterleave`)."""

from __future__ import annotations

import math

import torch

from .activation import ActivationOperation, check_interleave_size

__all__ = ["SwiGLU", "SiTUGLU", "ClampedSwiGLU", "situglu", "check_real"]


def check_real(api: str, name: str, value, positive: bool = False) -> float:
    """``value`` as a float: a real number (``TypeError`` otherwise), not NaN, and with
    ``positive`` finite and above 0 (``ValueError`` otherwise)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{api}: {name} must be a float, got {value!r}")
    value = float(value)
    if math.isnan(value) or (positive and not (math.isfinite(value) and value > 0)):
        raise ValueError(f"{api}: {name} must be {'finite and positive' if positive else 'a number'}"
                         f", got {value!r}")
    return value


def situglu(x: torch.Tensor, beta1: float, beta2: float) -> torch.Tensor:
    """Kimi K3's soft-capped SiLU GLU of the halves ``a, b`` of ``x``, in float32 and
    returned in ``x``'s dtype: ``beta1 tanh(a / beta1) sigmoid(a) * beta2 tanh(b / beta2)``."""
    a, b = x.to(torch.float32).chunk(2, dim=-1)
    gate = beta1 * torch.tanh(a / beta1) * torch.sigmoid(a)
    return (gate * (beta2 * torch.tanh(b / beta2))).to(x.dtype)


class SwiGLU(ActivationOperation):
    """``silu(a) * b`` of the halves ``a, b`` of the last dimension.

    Parameters
    ----------
    cache_quantized_input : bool, default False
        See `ActivationOperation`.
    glu_interleave_size : int, optional
        TE's block-interleaved layout: blocks of this many gate columns alternate with
        blocks of as many linear columns (None: contiguous halves).
    """

    activation = "swiglu"

    def __init__(self, *, cache_quantized_input: bool = False, glu_interleave_size=None):
        super().__init__(cache_quantized_input=cache_quantized_input)
        self.glu_interleave_size = check_interleave_size(f"te.ops.{type(self).__name__}",
                                                         glu_interleave_size)


class SiTUGLU(SwiGLU):
    """``beta1 tanh(a / beta1) sigmoid(a) * beta2 tanh(b / beta2)`` (Kimi K3's
    soft-capped SiLU GLU), computed in float32.

    Parameters
    ----------
    beta1, beta2 : float, default 4.0 and 25.0
        The soft caps of the gate and the linear half: finite and positive.
    cache_quantized_input, glu_interleave_size
        As for `SwiGLU`.
    """

    activation = "situglu"

    def __init__(self, *, beta1: float = 4.0, beta2: float = 25.0,
                 cache_quantized_input: bool = False, glu_interleave_size=None):
        super().__init__(cache_quantized_input=cache_quantized_input,
                         glu_interleave_size=glu_interleave_size)
        self.beta1 = check_real("te.ops.SiTUGLU", "beta1", beta1, positive=True)
        self.beta2 = check_real("te.ops.SiTUGLU", "beta2", beta2, positive=True)

    @property
    def gated(self) -> bool:
        return True

    def _activate(self, x):
        return situglu(x, self.beta1, self.beta2)


class ClampedSwiGLU(ActivationOperation):
    """``a * sigmoid(alpha a) * (b + glu_linear_offset)`` with ``a`` clamped above at
    ``limit`` and ``b`` to ``[-limit, limit]`` (te.LayerNormMLP's ``"clamped_swiglu"``).

    Parameters
    ----------
    limit : float, default 7.0
    alpha : float, default 1.702
    glu_linear_offset : float, default 1.0
        Added to the clamped linear half (0.0: none).
    cache_quantized_input : bool, default False
    glu_interleave_size : int, optional
        As for `SwiGLU`.
    """

    activation = "clamped_swiglu"

    def __init__(self, *, limit: float = 7.0, alpha: float = 1.702,
                 glu_linear_offset: float = 1.0, cache_quantized_input: bool = False,
                 glu_interleave_size=None):
        super().__init__(cache_quantized_input=cache_quantized_input)
        api = "te.ops.ClampedSwiGLU"
        self.limit = check_real(api, "limit", limit)
        self.alpha = check_real(api, "alpha", alpha)
        self.glu_linear_offset = check_real(api, "glu_linear_offset", glu_linear_offset)
        self.glu_interleave_size = check_interleave_size(api, glu_interleave_size)

    @property
    def activation_params(self):
        return {"limit": self.limit, "alpha": self.alpha,
                "glu_linear_offset": self.glu_linear_offset}
