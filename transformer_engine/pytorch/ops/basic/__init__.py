"""``te.pytorch.ops.basic``: the basic operations this package implements, at TE's
import paths (``...ops.basic.l2normalization``)."""

from .l2normalization import L2Normalization

__all__ = ["L2Normalization"]
