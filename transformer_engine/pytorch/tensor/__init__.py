"""``transformer_engine.pytorch.tensor``: TE's quantized tensor classes.

A `QuantizedTensor` is a ``torch.Tensor`` that stores its values quantized and
behaves, to every torch op, as its dequantized value in its nominal ``dtype``
(NOTE [Quantized tensor semantics] in quantized_tensor.py). This package makes two
kinds, the FP8 primary weights of modules built under
``te.quantized_model_init(enabled=True)``: `Float8Tensor` (one scale per tensor:
DelayedScaling, Float8CurrentScaling), `Float8BlockwiseQTensor` (one scale per
block: Float8BlockScaling), `MXFP8Tensor` (MXFP8BlockScaling) and `NVFP4Tensor`
(NVFP4BlockScaling). Clients (Megatron-LM's ``fp8_utils``) import
``QuantizedTensor`` to ask whether a parameter is one.
"""

from __future__ import annotations

from .float8_blockwise_tensor import Float8BlockQuantizer, Float8BlockwiseQTensor
from .float8_tensor import Float8Tensor
from .mx_tensors import MXFP8Quantizer, MXFP8Tensor, NVFP4Quantizer, NVFP4Tensor
from .quantized_tensor import QuantizedTensor, Quantizer

__all__ = ["QuantizedTensor", "Quantizer", "Float8Tensor", "Float8BlockwiseQTensor",
           "Float8BlockQuantizer", "MXFP8Tensor", "MXFP8Quantizer", "NVFP4Tensor",
           "NVFP4Quantizer"]
