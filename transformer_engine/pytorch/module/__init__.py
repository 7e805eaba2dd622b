"""TE modules."""

from .base import TransformerEngineBaseModule
from .fp8_padding import Fp8Padding, Fp8Unpadding
from .grouped_linear import GroupedLinear
from .layernorm import LayerNorm, RMSNorm
from .layernorm_linear import LayerNormLinear
from .layernorm_mlp import LayerNormMLP
from .linear import Linear

__all__ = ["TransformerEngineBaseModule", "GroupedLinear", "Linear", "LayerNorm", "RMSNorm",
           "LayerNormLinear", "LayerNormMLP", "Fp8Padding", "Fp8Unpadding"]
