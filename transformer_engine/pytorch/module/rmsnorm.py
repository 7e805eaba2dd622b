"""``transformer_engine.pytorch.module.rmsnorm``: TE's module path of te.RMSNorm.

The class lives beside te.LayerNorm in layernorm.py (one normalization concern);
code written against TE imports it from here (TE's ``tests/pytorch/test_qk_norm.py``
does)."""

from .layernorm import RMSNorm

__all__ = ["RMSNorm"]
