"""``transformer_engine.pytorch.tensor.mxfp8_tensor``: TE's module path of `MXFP8Tensor`
and `MXFP8Quantizer` (defined in mx_tensors.py). Clients import the class from here:
Megatron-LM's ``fp8_utils.is_mxfp8tensor`` finds MXFP8 primary weights only when this
path imports."""

from .mx_tensors import MXFP8Quantizer, MXFP8Tensor

__all__ = ["MXFP8Tensor", "MXFP8Quantizer"]
