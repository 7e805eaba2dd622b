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

from ...module.activations import activate, is_gated
from ...utils import check_bool
from ..op import BasicOperation

__all__ = ["ActivationOperation", "GELU", "GEGLU", "GLU", "QGELU", "QGEGLU", "ReLU", "ReGLU",
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

    def native_forward(self, x, extra_inputs, kwargs):
        if not x.is_floating_point():
            raise TypeError(f"te.ops.{type(self).__name__}: input must be a floating-point "
                            f"tensor, got dtype {x.dtype}")
        if is_gated(self.activation) and x.shape[-1] % 2:
            raise ValueError(f"te.ops.{type(self).__name__}: a gated activation needs an even "
                             f"last dimension, got input of shape {tuple(x.shape)}")
        return activate(x, self.activation, self.activation_params), [()]


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
