"""Framework-independent pieces: FP8 recipes (``transformer_engine.common.recipe``)."""

from . import recipe

__all__ = ["recipe"]
