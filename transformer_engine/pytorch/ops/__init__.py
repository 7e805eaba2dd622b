"""``te.pytorch.ops``: the names of TE's fusible-operations API, all but one unusable.

TE's fusible operations (``te.ops.Sequential`` of ``BasicLinear``, ``Bias``,
activations, norms and collectives, fused at run time) are not implemented by this
package. The names exist because clients reference them when their own modules are
defined: Megatron-LM's class bodies and annotations name ``te.pytorch.ops.Sequential``
and the operations below, and only build them with its op-fuser option on. Every class
here is a real ``torch.nn.Module`` subclass, so ``isinstance`` and annotations work, and
every constructor raises ``NotImplementedError``: nothing can build an operation that
would silently compute something else. The exception is ``L2Normalization``
(``ops.basic.l2normalization``), a parameter-free module that `MultiheadAttention`
builds for ``qk_norm_type="L2Normalization"``.
"""

from __future__ import annotations

import torch

from .basic import L2Normalization

__all__ = ["L2Normalization", "FusibleOperation", "Sequential", "BasicLinear", "Bias", "GELU",
           "GEGLU", "ReLU", "ReGLU", "SiLU", "SwiGLU", "LayerNorm", "RMSNorm", "AllReduce",
           "ReduceScatter", "MakeExtraOutput"]


def _refuse(name: str):
    raise NotImplementedError(
        f"te.ops.{name}: the fusible-operations API is not implemented by this package; "
        "build the model from te.Linear, te.LayerNormLinear, te.LayerNormMLP and the other "
        "te modules instead (in Megatron-LM: leave the op-fuser option, use_te_op_fuser, off)")


class FusibleOperation(torch.nn.Module):
    """TE's base class of fusible operations; not constructible here."""

    def __init__(self, *args, **kwargs):
        _refuse(type(self).__name__)


class Sequential(torch.nn.Module):
    """TE's container that fuses the operations it holds; not constructible here."""

    def __init__(self, *args, **kwargs):
        _refuse("Sequential")


class BasicLinear(FusibleOperation):
    """TE's bias-free linear operation ``y = x W^T``; not constructible here."""


class Bias(FusibleOperation):
    """TE's bias-add operation; not constructible here."""


class GELU(FusibleOperation):
    """TE's GELU operation; not constructible here."""


class GEGLU(FusibleOperation):
    """TE's GELU-gated linear unit operation; not constructible here."""


class ReLU(FusibleOperation):
    """TE's ReLU operation; not constructible here."""


class ReGLU(FusibleOperation):
    """TE's ReLU-gated linear unit operation; not constructible here."""


class SiLU(FusibleOperation):
    """TE's SiLU operation; not constructible here."""


class SwiGLU(FusibleOperation):
    """TE's SiLU-gated linear unit operation; not constructible here."""


class LayerNorm(FusibleOperation):
    """TE's LayerNorm operation; not constructible here (``te.LayerNorm`` is)."""


class RMSNorm(FusibleOperation):
    """TE's RMSNorm operation; not constructible here (``te.RMSNorm`` is)."""


class AllReduce(FusibleOperation):
    """TE's all-reduce operation over a process group; not constructible here."""


class ReduceScatter(FusibleOperation):
    """TE's reduce-scatter operation over a process group; not constructible here."""


class MakeExtraOutput(FusibleOperation):
    """TE's operation that forks its input into an extra output (Megatron-LM's fused
    residual RMSNorm); not constructible here."""
