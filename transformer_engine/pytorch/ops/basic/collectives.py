"""TE's tensor-parallel collective operations (``AllGather``, ``AllReduce``,
``ReduceScatter``): named, so that clients' class bodies and annotations resolve, but
not implemented; constructing one raises ``NotImplementedError``."""

from __future__ import annotations

from ..op import BasicOperation

__all__ = ["AllGather", "AllReduce", "ReduceScatter"]


class _Collective(BasicOperation):
    def __init__(self, *args, **kwargs):
        raise NotImplementedError(
            f"te.ops.{type(self).__name__}: tensor-parallel collectives are not implemented for "
            "operations; use the te modules with tp_group for tensor parallelism (in "
            "Megatron-LM: leave use_te_op_fuser off when tensor_model_parallel_size > 1)")


class AllGather(_Collective):
    """TE's all-gather over a process group (not implemented)."""


class AllReduce(_Collective):
    """TE's all-reduce over a process group (not implemented)."""


class ReduceScatter(_Collective):
    """TE's reduce-scatter over a process group (not implemented)."""
