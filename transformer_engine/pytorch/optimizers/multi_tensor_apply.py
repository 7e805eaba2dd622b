"""`MultiTensorApply`: TE's entry for the multi-tensor operations,
``multi_tensor_applier(op, noop_flag_buffer, tensor_lists, *args)``, as Megatron Core
and TE's fused optimizers call it."""

from __future__ import annotations

from typing import Callable, List, Sequence

import torch

__all__ = ["MultiTensorApply", "multi_tensor_applier"]


def _local(t):
    """A DTensor's local shard (the operations work on local memory), else ``t``."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


class MultiTensorApply:
    """Calls ``op(chunk_size, noop_flag_buffer, tensor_lists, *args)`` on aligned tensor
    lists, leaving out the positions whose tensor in the first list is empty; returns
    what ``op`` returns, or None when nothing is left.

    Parameters
    ----------
    chunk_size : int
        Elements per unit of work of the fused kernels (NOTE [Chunk table] in
        kernels/multi_tensor.py).
    """

    def __init__(self, chunk_size: int):
        if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
            raise ValueError(f"MultiTensorApply: chunk_size must be a positive int, got "
                             f"{chunk_size!r}")
        self.chunk_size = chunk_size

    def __call__(self, op: Callable, noop_flag_buffer: torch.Tensor,
                 tensor_lists: Sequence[Sequence[torch.Tensor]], *args):
        if not callable(op):
            raise TypeError(f"multi_tensor_applier: op must be callable, got {type(op).__name__}")
        if not isinstance(noop_flag_buffer, torch.Tensor):
            raise TypeError("multi_tensor_applier: noop_flag_buffer must be a tensor (an int32 "
                            f"tensor of one element), got {type(noop_flag_buffer).__name__}")
        lists: List[List[torch.Tensor]] = [[_local(t) for t in lst] for lst in tensor_lists]
        if not lists:
            raise ValueError("multi_tensor_applier: tensor_lists is empty")
        if any(len(lst) != len(lists[0]) for lst in lists):
            raise ValueError("multi_tensor_applier: the tensor lists must have the same "
                             f"length, got {[len(lst) for lst in lists]}")
        keep = [t.numel() > 0 for t in lists[0]]
        lists = [[t for t, k in zip(lst, keep) if k] for lst in lists]
        if not lists[0]:
            return None
        return op(self.chunk_size, noop_flag_buffer, lists, *args)


multi_tensor_applier = MultiTensorApply(2048 * 32)
