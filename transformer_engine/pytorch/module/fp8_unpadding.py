"""``transformer_engine.pytorch.module.fp8_unpadding``: TE's module path of
te.Fp8Unpadding, which lives beside te.Fp8Padding in fp8_padding.py."""

from .fp8_padding import Fp8Unpadding

__all__ = ["Fp8Unpadding"]
