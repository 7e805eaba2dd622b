"""TE's activation operations: ``GELU``, ``QGELU``, ``ReLU``, ``SReLU``, ``SiLU`` and
the gated forms ``GLU``, ``GEGLU``, ``QGEGLU``, ``ReGLU``, ``SReGLU`` (``SwiGLU`` and
``ClampedSwiGLU`` in swiglu.py).

Each computes `module.activations.activate` with te.LayerNormMLP's activation of the
same name, so an activation between two `BasicLinear` operations gives
te.LayerNormMLP's bits, and between two FP8 linears on CUDA it takes the same fused
producers (NOTE [Fused producers] in module/fused_producers.py, through the fused
MLP operation in ops/fused/). A gated form splits the last dimension in halves and
returns ``act(first half) * second half``.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch

from ...module.activations import activate, is_gated
from ...utils import check_bool, check_positive_int
from ..op import BasicOperation

__all__ = ["ActivationOperation", "check_activation_input", "check_interleave_size",
           "deinterleave", "GELU", "GEGLU", "GLU", "QGELU", "QGEGLU", "ReLU", "ReGLU",
           "SReLU", "SReGLU", "SiLU"]


class ActivationOperation(BasicOperation):
    """An elementwise activation named ``activation`` (te.LayerNormMLP's name).

    Parameters
    ----------
    cache_quantized_input : bool, default False
        TE keeps an FP8 copy of the input for backward to save memory. Accepted; the
        input is kept as it is (the gradients are the unquantized input's, as with
        False), with a warning.
    """

    activation = ""
    # TE's block-interleaved layout of a gated activation's halves (see `deinterleave`)
    glu_interleave_size: Optional[int] = None

    def __init__(self, *, cache_quantized_input: bool = False):
        super().__init__()
        api = f"te.ops.{type(self).__name__}"
        self.cache_quantized_input = check_bool(api, "cache_quantized_input",
                                                cache_quantized_input)
        if self.cache_quantized_input:
            warnings.warn(f"{api}: cache_quantized_input=True is accepted but not implemented; "
                          "the high-precision input is kept for backward", UserWarning,
                          stacklevel=2)

    @property
    def activation_params(self):
        """The activation's parameters in `activate`'s form (None: it has none)."""
        return None

    @property
    def gated(self) -> bool:
        """Whether the activation gates one half of its input with the other."""
        return is_gated(self.activation)

    def _activate(self, x):
        """The activation of ``x`` (contiguous halves when gated)."""
        return activate(x, self.activation, self.activation_params)

    def native_forward(self, x, extra_inputs, kwargs):
        api = f"te.ops.{type(self).__name__}"
        check_activation_input(api, x, self.gated, self.glu_interleave_size)
        return self._activate(deinterleave(x, self.glu_interleave_size)), [()]


def check_activation_input(api: str, x, gated: bool, glu_interleave_size) -> None:
    """A floating-point input whose last dimension splits in halves (and in blocks of
    ``glu_interleave_size``) when ``gated``."""
    if not torch.is_tensor(x):
        raise TypeError(f"{api}: input must be a tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{api}: input must be a floating-point tensor, got dtype {x.dtype}")
    block = 2 * (glu_interleave_size or 1)
    if gated and (x.dim() == 0 or x.shape[-1] % block):
        need = "an even last dimension" if glu_interleave_size is None else \
            f"a last dimension divisible by 2 * glu_interleave_size = {block}"
        raise ValueError(f"{api}: a gated activation needs {need}, got input of shape "
                         f"{tuple(x.shape)}")


def check_interleave_size(api: str, glu_interleave_size) -> Optional[int]:
    """TE's ``glu_interleave_size``: None or a positive int."""
    if glu_interleave_size is None:
        return None
    return check_positive_int(api, "glu_interleave_size", glu_interleave_size)


def deinterleave(x: torch.Tensor, size: Optional[int]) -> torch.Tensor:
    """TE's block-interleaved GLU layout (``size`` columns of the gate half, then
    ``size`` of the linear half, and so on) as contiguous halves ``[gate, linear]``;
    ``x`` itself when ``size`` is None. Its gradient interleaves back."""
    if size is None:
        return x
    width = x.shape[-1]
    blocks = x.reshape(-1, width // (2 * size), 2, size).transpose(1, 2)
    return blocks.reshape(x.shape)


def _activation(name: str, activation: str, doc: str):
    return type(name, (ActivationOperation,), {"activation": activation, "__doc__": doc,
                                               "__module__": __name__})


GELU = _activation("GELU", "gelu", "GELU, tanh approximation.")
QGELU = _activation("QGELU", "qgelu", "Quick GELU: ``x * sigmoid(1.702 x)``.")
ReLU = _activation("ReLU", "relu", "ReLU.")
SReLU = _activation("SReLU", "srelu", "Squared ReLU: ``relu(x)**2``.")
SiLU = _activation("SiLU", "silu", "SiLU: ``x * sigmoid(x)``.")
GLU = _activation("GLU", "glu", "``sigmoid(a) * b`` of the halves ``a, b`` of the last dim.")
GEGLU = _activation("GEGLU", "geglu", "``gelu(a) * b`` of the halves ``a, b``.")
QGEGLU = _activation("QGEGLU", "qgeglu", "``qgelu(a) * b`` of the halves ``a, b``.")
ReGLU = _activation("ReGLU", "reglu", "``relu(a) * b`` of the halves ``a, b``.")
SReGLU = _activation("SReGLU", "sreglu", "``srelu(a) * b`` of the halves ``a, b``.")
