"""``te.pytorch.ops.basic``: the basic operations, at TE's import paths."""

from .activation import (GEGLU, GELU, GLU, QGEGLU, QGELU, ActivationOperation, ReGLU, ReLU,
                         SiLU, SReGLU, SReLU)
from .add_extra_input import AddExtraInput
from .basic_linear import BasicLinear
from .bias import Bias
from .collectives import AllGather, AllReduce, ReduceScatter
from .constant_scale import ConstantScale
from .identity import Identity
from .l2normalization import L2Normalization
from .layer_norm import LayerNorm
from .make_extra_output import MakeExtraOutput
from .quantize import Quantize
from .reshape import Reshape
from .rmsnorm import RMSNorm
from .swiglu import ClampedSwiGLU, SwiGLU

__all__ = ["ActivationOperation", "AddExtraInput", "AllGather", "AllReduce", "BasicLinear",
           "Bias", "ClampedSwiGLU", "ConstantScale", "GEGLU", "GELU", "GLU", "Identity",
           "L2Normalization", "LayerNorm", "MakeExtraOutput", "QGEGLU", "QGELU", "Quantize",
           "ReGLU", "ReLU", "ReduceScatter", "Reshape", "RMSNorm", "SiLU", "SReGLU", "SReLU",
           "SwiGLU"]
