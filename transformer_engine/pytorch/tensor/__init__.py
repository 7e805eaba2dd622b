"""``transformer_engine.pytorch.tensor``: TE's quantized tensor classes.

A `QuantizedTensor` is a ``torch.Tensor`` that stores its values quantized and
behaves, to every torch op, as its dequantized value in its nominal ``dtype``
(NOTE [Quantized tensor semantics] in float8_tensor.py). The one kind this package
creates is `Float8Tensor`: the FP8 primary weights that modules built under
``te.quantized_model_init(enabled=True)`` hold. Clients (Megatron-LM's
``fp8_utils``) import ``QuantizedTensor`` to ask whether a parameter is one.
"""

from __future__ import annotations

from .float8_tensor import Float8Tensor, QuantizedTensor

__all__ = ["QuantizedTensor", "Float8Tensor"]
