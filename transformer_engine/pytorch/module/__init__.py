"""TE modules."""

from .base import TransformerEngineBaseModule
from .linear import Linear

__all__ = ["TransformerEngineBaseModule", "Linear"]
