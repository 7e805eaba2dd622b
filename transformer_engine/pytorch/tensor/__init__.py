"""``transformer_engine.pytorch.tensor``: TE's quantized tensor base class, by name.

In TE, FP8 parameters and FP8 activations handed between modules are instances of
subclasses of ``QuantizedTensor``. This package keeps no such tensors: parameters stay
in high precision and the FP8 copies a GEMM needs live inside the module's autograd
function (DESIGN.md, "Linear in FP8"). So ``QuantizedTensor`` is a real
``torch.Tensor`` subclass that no tensor of this package is an instance of, and
``isinstance(p, QuantizedTensor)`` is False for every parameter, which is the truth.
Clients (Megatron-LM's ``fp8_utils``) import it to ask exactly that question.
"""

from __future__ import annotations

import torch

__all__ = ["QuantizedTensor"]


class QuantizedTensor(torch.Tensor):
    """TE's base class of quantized tensors; this package creates none, and refuses
    to create one."""

    def __new__(cls, *args, **kwargs):
        raise NotImplementedError(
            "transformer_engine.pytorch.tensor.QuantizedTensor: quantized (FP8) tensors "
            "are not implemented by this package; parameters stay in high precision and "
            "FP8 copies live only inside the modules' GEMMs")
