"""Attention: ``DotProductAttention`` (the core), ``MultiheadAttention`` (with its
projections) and rotary position embeddings, at TE's import paths
(``transformer_engine.pytorch.attention`` and ``...attention.rope``)."""

from .dot_product_attention import BIAS_TYPES, QKV_FORMATS, DotProductAttention
from .masks import MASK_TYPES
from .multi_head_attention import MultiheadAttention
from .rope import RotaryPositionEmbedding, apply_rotary_pos_emb

__all__ = ["DotProductAttention", "MultiheadAttention", "RotaryPositionEmbedding",
           "apply_rotary_pos_emb", "MASK_TYPES", "QKV_FORMATS", "BIAS_TYPES"]
