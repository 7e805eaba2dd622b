"""``te.ops.RMSNorm``: te.RMSNorm's normalization as an operation."""

from __future__ import annotations

from .layer_norm import NormOperation

__all__ = ["RMSNorm"]


class RMSNorm(NormOperation):
    """``x / sqrt(mean(x^2) + eps) * gamma`` over ``normalized_shape``, in float32,
    returned in the activation dtype; ``gamma = 1 + weight`` when
    ``zero_centered_gamma``. Parameter ``weight``. TE's signature (``sm_margin`` must
    be 0)."""

    _NORMALIZATION = "RMSNorm"
