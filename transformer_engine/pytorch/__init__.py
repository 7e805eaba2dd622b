"""``import transformer_engine.pytorch as te``: the public names, as TE spells them."""

from . import distributed, ops, router, tensor
from .attention import (DotProductAttention, MultiheadAttention, RotaryPositionEmbedding,
                        apply_rotary_pos_emb)
from .distributed import CudaRNGStatesTracker, checkpoint
from .fp8 import (FP8GlobalStateManager, autocast, fp8_autocast, fp8_model_init,
                  get_default_fp8_recipe, is_fp8_available, quantized_model_init)
from .module import (Fp8Padding, Fp8Unpadding, GroupedLinear, LayerNorm, LayerNormLinear,
                     LayerNormMLP, Linear, RMSNorm, TransformerEngineBaseModule)
from .graph import make_graphed_callables
from .transformer import TransformerLayer

__all__ = [
    "distributed", "ops", "router", "tensor", "checkpoint", "CudaRNGStatesTracker",
    "FP8GlobalStateManager",
    "autocast", "fp8_autocast", "get_default_fp8_recipe", "is_fp8_available",
    "quantized_model_init", "fp8_model_init", "make_graphed_callables",
    "GroupedLinear", "Linear", "LayerNorm", "RMSNorm", "LayerNormLinear", "LayerNormMLP",
    "DotProductAttention", "MultiheadAttention", "TransformerLayer", "TransformerEngineBaseModule",
    "RotaryPositionEmbedding", "apply_rotary_pos_emb", "Fp8Padding", "Fp8Unpadding",
]
