"""``transformer_engine.pytorch.tensor.nvfp4_tensor``: TE's module path of `NVFP4Tensor`
and `NVFP4Quantizer` (defined in mx_tensors.py), for clients that import the class
from where TE defines it."""

from .mx_tensors import NVFP4Quantizer, NVFP4Tensor

__all__ = ["NVFP4Tensor", "NVFP4Quantizer"]
