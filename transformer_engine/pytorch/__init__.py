"""``import transformer_engine.pytorch as te``: the public names, as TE spells them."""

from . import distributed, ops, optimizers, quantization, router, tensor
from .attention import (DotProductAttention, MultiheadAttention, RotaryPositionEmbedding,
                        apply_rotary_pos_emb)
from .distributed import CudaRNGStatesTracker, checkpoint
from .fp8 import (FP8GlobalStateManager, autocast, fp8_autocast, fp8_model_init,
                  get_default_fp8_recipe, is_fp8_available, quantized_model_init)
from .quantization import (get_default_recipe, is_fp8_block_scaling_available,
                           is_mxfp8_available, is_nvfp4_available)
from .module import (Fp8Padding, Fp8Unpadding, GroupedLinear, LayerNorm, LayerNormLinear,
                     LayerNormMLP, Linear, RMSNorm, TransformerEngineBaseModule)
from .graph import make_graphed_callables
from .tensor import Float8Tensor, QuantizedTensor
from .transformer import TransformerLayer
from .utils import get_device_compute_capability, is_bf16_available

__all__ = [
    "distributed", "ops", "optimizers", "quantization", "router", "tensor", "checkpoint",
    "CudaRNGStatesTracker", "FP8GlobalStateManager",
    "autocast", "fp8_autocast", "get_default_fp8_recipe", "get_default_recipe",
    "is_fp8_available", "is_mxfp8_available", "is_fp8_block_scaling_available",
    "is_nvfp4_available", "is_bf16_available", "get_device_compute_capability",
    "quantized_model_init", "fp8_model_init", "make_graphed_callables",
    "GroupedLinear", "Linear", "LayerNorm", "RMSNorm", "LayerNormLinear", "LayerNormMLP",
    "DotProductAttention", "MultiheadAttention", "TransformerLayer", "TransformerEngineBaseModule",
    "RotaryPositionEmbedding", "apply_rotary_pos_emb", "Fp8Padding", "Fp8Unpadding",
    "QuantizedTensor", "Float8Tensor",
]
