"""``te.ops.SwiGLU`` and ``te.ops.ClampedSwiGLU`` (GPT-OSS's, NOTE [Clamped SwiGLU] in
module/activations.py)."""

from __future__ import annotations

import math

from .activation import ActivationOperation

__all__ = ["SwiGLU", "ClampedSwiGLU"]


class SwiGLU(ActivationOperation):
    """``silu(a) * b`` of the halves ``a, b`` of the last dimension.

    Parameters
    ----------
    cache_quantized_input : bool, default False
        See `ActivationOperation`.
    glu_interleave_size : int, optional
        TE's interleaved layout of the halves; only None (contiguous halves) is
        implemented.
    """

    activation = "swiglu"

    def __init__(self, *, cache_quantized_input: bool = False, glu_interleave_size=None):
        if glu_interleave_size is not None:
            raise NotImplementedError(f"te.ops.{type(self).__name__}: glu_interleave_size="
                                      f"{glu_interleave_size!r} is not implemented; use None")
        super().__init__(cache_quantized_input=cache_quantized_input)


class ClampedSwiGLU(ActivationOperation):
    """``a * sigmoid(alpha a) * (b + 1)`` with ``a`` clamped above at ``limit`` and
    ``b`` to ``[-limit, limit]`` (te.LayerNormMLP's ``"clamped_swiglu"``).

    Parameters
    ----------
    limit : float, default 7.0
    alpha : float, default 1.702
    cache_quantized_input : bool, default False
    """

    activation = "clamped_swiglu"

    def __init__(self, *, limit: float = 7.0, alpha: float = 1.702,
                 cache_quantized_input: bool = False):
        super().__init__(cache_quantized_input=cache_quantized_input)
        for name, value in (("limit", limit), ("alpha", alpha)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
                raise TypeError(f"te.ops.ClampedSwiGLU: {name} must be a float, got {value!r}")
        self.limit, self.alpha = float(limit), float(alpha)

    @property
    def activation_params(self):
        return {"limit": self.limit, "alpha": self.alpha, "glu_linear_offset": 1.0}
