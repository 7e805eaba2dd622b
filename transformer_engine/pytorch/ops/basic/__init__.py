"""``te.pytorch.ops.basic``: the basic operations, at TE's import paths."""

from .activation import (GEGLU, GELU, GLU, QGEGLU, QGELU, ActivationOperation, ReGLU, ReLU,
                         SiLU, SReGLU, SReLU)
from .add_extra_input import AddExtraInput
from .basic_linear import BasicLinear
from .bias import Bias
from .collectives import AllGather, AllReduce, ReduceScatter
from .constant_scale import ConstantScale
from .grouped_linear import GroupedLinear
from .identity import Identity
from .l2normalization import L2Normalization
from .layer_norm import LayerNorm
from .make_extra_output import MakeExtraOutput
from .quantize import Quantize
from .reshape import Reshape
from .rmsnorm import RMSNorm
from .scaled_activation import (ScaledActivation, ScaledClampedQGeGLU, ScaledSiTUGLU,
                                ScaledSReLU, ScaledSwiGLU)
from .swiglu import ClampedSwiGLU, SiTUGLU, SwiGLU

__all__ = ["ActivationOperation", "AddExtraInput", "AllGather", "AllReduce", "BasicLinear",
           "Bias", "ClampedSwiGLU", "ConstantScale", "GEGLU", "GELU", "GLU", "GroupedLinear",
           "Identity", "L2Normalization", "LayerNorm", "MakeExtraOutput", "QGEGLU", "QGELU",
           "Quantize", "ReGLU", "ReLU", "ReduceScatter", "Reshape", "RMSNorm", "ScaledActivation",
           "ScaledClampedQGeGLU", "ScaledSiTUGLU", "ScaledSReLU", "ScaledSwiGLU", "SiLU",
           "SiTUGLU", "SReGLU", "SReLU", "SwiGLU"]
