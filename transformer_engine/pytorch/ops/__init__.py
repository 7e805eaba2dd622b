"""``te.pytorch.ops``: TE's fusible-operations API.

Operations (``basic/``) are ``torch.nn.Module`` s that `Sequential` groups and runs
through an `OperationFuser` (fuser.py), which replaces runs of them with fused
operations (``fused/``, then the registered fusions: NOTE [Fusion passes]). The
FP8 operations (`BasicLinear`, `GroupedLinear`, `Quantize`) carry the FP8 state of
te.Linear (te.GroupedLinear) and take ``te.autocast`` and ``te.checkpoint`` as the
modules do (NOTE [Two ways an operation
runs] in op.py).
"""

from . import fused
from .basic import (GEGLU, GELU, GLU, QGEGLU, QGELU, AddExtraInput, AllGather, AllReduce,
                    BasicLinear, Bias, ClampedSwiGLU, ConstantScale, GroupedLinear, Identity,
                    L2Normalization, LayerNorm, MakeExtraOutput, Quantize, ReduceScatter, ReGLU,
                    ReLU, Reshape, RMSNorm, ScaledClampedQGeGLU, ScaledSiTUGLU, ScaledSReLU,
                    ScaledSwiGLU, SiLU, SiTUGLU, SReGLU, SReLU, SwiGLU)
from .fuser import (OperationFuser, register_backward_fusion, register_forward_backward_fusion,
                    register_forward_fusion)
from .linear import Linear
from .op import BasicOperation, FusedOperation, FusibleOperation, OperationContext
from .sequential import Sequential

__all__ = ["fused", "Sequential", "OperationFuser", "FusibleOperation", "BasicOperation",
           "FusedOperation", "OperationContext", "register_forward_fusion",
           "register_backward_fusion", "register_forward_backward_fusion", "Linear",
           "BasicLinear", "Bias", "Identity", "Reshape", "ConstantScale", "AddExtraInput",
           "MakeExtraOutput", "Quantize", "LayerNorm", "RMSNorm", "L2Normalization", "GELU",
           "GEGLU", "GLU", "QGELU", "QGEGLU", "ReLU", "ReGLU", "SReLU", "SReGLU", "SiLU",
           "SwiGLU", "ClampedSwiGLU", "SiTUGLU", "GroupedLinear", "ScaledSwiGLU",
           "ScaledSiTUGLU", "ScaledClampedQGeGLU", "ScaledSReLU", "AllGather", "AllReduce",
           "ReduceScatter"]
