"""Tensor parallelism: the collectives of column- and row-parallel layers as autograd
functions, and the argument handling that TE modules share (``sequence_parallel``,
``tp_group``, ``tp_size``, ``parallel_mode``).

NOTE [Tensor-parallel layouts]
    Over a TP group of ``tp`` ranks, a layer ``y = x W^T + b`` (W: [N, K]) is split
    one of two ways (``parallel_mode``):

    column  Each rank holds N/tp rows of W and of b. The input is replicated over the
            group; the output is this rank's N/tp output features (not gathered, as
            in TE). Backward: the input gradient is summed over the group.
    row     Each rank holds K/tp columns of W and the whole b. The input is this
            rank's K/tp features; the partial products are summed over the group
            (all-reduce) and b is added once, after the sum. Backward: identity.

    With ``sequence_parallel`` the activations outside a column -> row pair are split
    along dim 0 (the sequence): column all-gathers its input along dim 0 first (its
    backward reduce-scatters), row reduce-scatters its output along dim 0 instead of
    all-reducing (its backward all-gathers). A row layer's bias then only sees this
    rank's tokens: its gradient is partial and must be summed over the group, which
    the bias is marked for (``bias.sequence_parallel = True``, as Megatron-LM does).

    FP8: each rank's amaxes differ (weight shards, activation and gradient shards),
    so the delayed-scaling amax reduction must span the TP group: pass the group that
    spans TP (x DP) as ``te.autocast(amax_reduction_group=...)`` (the default, None,
    is the whole world). Then every TP rank casts with the scale a single process
    holding the full tensors would use. The sequence-parallel all-gather moves the
    high-precision input, which is then cast once (TE gathers FP8 data instead).
"""

from __future__ import annotations

import warnings
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from .utils import check_process_group

__all__ = [
    "PARALLEL_MODES", "get_distributed_world_size", "get_distributed_rank",
    "set_tensor_model_parallel_attributes", "copy_to_tensor_parallel_region",
    "reduce_from_tensor_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region", "TensorParallelConfig", "mark_sequence_parallel",
    "chunk_numel", "split_tensor_into_1d_equal_chunks", "gather_split_1d_tensor",
]

PARALLEL_MODES = (None, "column", "row")


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_distributed_world_size(group=None) -> int:
    """Ranks in ``group`` (the default group when None); 1 without torch.distributed."""
    return dist.get_world_size(group) if _initialized() else 1


def get_distributed_rank(group=None) -> int:
    """This process's rank in ``group``; 0 without torch.distributed."""
    return dist.get_rank(group) if _initialized() else 0


def set_tensor_model_parallel_attributes(tensor: torch.Tensor, is_parallel: bool, dim: int,
                                         stride: int) -> None:
    """Mark a parameter as split over the TP group along ``dim`` (the attributes
    Megatron-LM and TE set: ``tensor_model_parallel``, ``partition_dim``,
    ``partition_stride``), for checkpoint and optimizer code that gathers shards."""
    tensor.tensor_model_parallel = is_parallel
    tensor.partition_dim = dim
    tensor.partition_stride = stride


# ---- the collectives (out of place; work on gloo and NCCL) -------------------------

def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if torch.compiler.is_compiling():
        # a new tensor, not one reduced in place: an autograd function returns it (NOTE
        # [Fresh function results] in function_results.py)
        from torch.distributed import _functional_collectives as collectives
        return collectives.all_reduce(x.contiguous(), "sum", group)
    out = x.contiguous().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


def _all_gather_dim0(x: torch.Tensor, group) -> torch.Tensor:
    world = dist.get_world_size(group)
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=0)


def _reduce_scatter_dim0(x: torch.Tensor, group, api: str) -> torch.Tensor:
    world = dist.get_world_size(group)
    if x.shape[0] % world != 0:
        raise ValueError(f"{api}: a sequence-parallel reduce-scatter splits dim 0 over the "
                         f"{world} TP ranks, but got a tensor of shape {tuple(x.shape)}; "
                         f"make the sequence length divisible by tp_size={world}")
    parts = [p.contiguous() for p in x.chunk(world, dim=0)]
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts, op=dist.ReduceOp.SUM, group=group)
    return out


class _CopyToRegion(torch.autograd.Function):
    """Forward identity; backward sums the gradient over the group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    """Forward sums over the group; backward identity."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromSequence(torch.autograd.Function):
    """Forward all-gathers along dim 0; backward reduce-scatters along dim 0."""

    @staticmethod
    def forward(ctx, x, group, api):
        ctx.group, ctx.api = group, api
        return _all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_dim0(grad, ctx.group, ctx.api), None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    """Forward reduce-scatters along dim 0; backward all-gathers along dim 0."""

    @staticmethod
    def forward(ctx, x, group, api):
        ctx.group = group
        return _reduce_scatter_dim0(x, group, api)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_dim0(grad, ctx.group), None, None


def copy_to_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """The input of a column-parallel layer: unchanged, its gradient summed over ``group``."""
    return _CopyToRegion.apply(x, group) if get_distributed_world_size(group) > 1 else x


def reduce_from_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """The output of a row-parallel layer: summed over ``group``."""
    return _ReduceFromRegion.apply(x, group) if get_distributed_world_size(group) > 1 else x


def gather_from_sequence_parallel_region(x: torch.Tensor, group,
                                         api: str = "gather_from_sequence_parallel_region"):
    """Sequence-parallel input of a column-parallel layer: all-gathered along dim 0."""
    if get_distributed_world_size(group) == 1:
        return x
    return _GatherFromSequence.apply(x, group, api)


def reduce_scatter_to_sequence_parallel_region(
        x: torch.Tensor, group, api: str = "reduce_scatter_to_sequence_parallel_region"):
    """Sequence-parallel output of a row-parallel layer: summed over ``group``, each
    rank keeping its 1/tp slice of dim 0."""
    if get_distributed_world_size(group) == 1:
        return x
    return _ReduceScatterToSequence.apply(x, group, api)


# ---- module arguments ----------------------------------------------------------------

def mark_sequence_parallel(*params: Optional[torch.Tensor]) -> None:
    """Mark parameters that only see this rank's tokens under sequence parallelism:
    their gradients are partial and must be summed over the TP group."""
    for p in params:
        if p is not None:
            p.sequence_parallel = True



class TensorParallelConfig:
    """How one TE module is split over a TP group (NOTE [Tensor-parallel layouts]).

    ``tp_size`` is the group's size when ``tp_group`` is given, else the value passed
    (TE's convention for groups formed after the module: call
    ``set_tensor_parallel_group`` before the first forward).

    ``tp_size > 1`` without a parallel mode splits nothing. TE accepts it (its
    MultiheadAttention passes ``tp_size`` to unsplit layers), so a script written for
    TE must run: it gets a ``UserWarning`` that says how to split the layer.
    ``split_by`` names the argument that does it in the message; None: no warning
    (a second config of the same module).
    """

    def __init__(self, api: str, parallel_mode: Optional[str], tp_group, tp_size: int,
                 sequence_parallel: bool,
                 split_by: Optional[str] = "parallel_mode='column' or 'row'"):
        if parallel_mode not in PARALLEL_MODES:
            raise ValueError(f"{api}: parallel_mode must be one of {PARALLEL_MODES}, "
                             f"got {parallel_mode!r}")
        if not isinstance(sequence_parallel, bool):
            raise TypeError(f"{api}: sequence_parallel must be a bool, got {sequence_parallel!r}")
        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"{api}: tp_size must be a positive int, got {tp_size!r}")
        if parallel_mode is None and tp_size > 1 and split_by is not None:
            warnings.warn(f"{api}: tp_size={tp_size} has no effect without {split_by}: the "
                          "layer is not split and does no tensor-parallel communication; pass "
                          f"{split_by} to split it, or leave tp_size at 1", UserWarning,
                          stacklevel=3)
        check_process_group(api, "tp_group", tp_group)
        if tp_group is not None:
            group_size = dist.get_world_size(tp_group)
            if tp_size not in (1, group_size):
                raise ValueError(f"{api}: tp_size={tp_size} does not match the size of "
                                 f"tp_group ({group_size}); pass one or make them agree")
            tp_size = group_size
        self.api, self.parallel_mode, self.sequence_parallel = api, parallel_mode, sequence_parallel
        self.tp_group, self.tp_size = tp_group, tp_size

    @property
    def size(self) -> int:
        """Ranks the layer is split over (1 when not tensor parallel)."""
        return self.tp_size if self.parallel_mode is not None else 1

    def local_features(self, name: str, features: int) -> int:
        """``features`` / tp_size, checked to divide evenly."""
        if features % self.size != 0:
            raise ValueError(f"{self.api}: {name}={features} must be divisible by "
                             f"tp_size={self.size} for parallel_mode={self.parallel_mode!r}")
        return features // self.size

    def set_group(self, tp_group) -> None:
        """Attach the TP group of a module built with ``tp_size`` only."""
        check_process_group(self.api, "tp_group", tp_group)
        size = get_distributed_world_size(tp_group)
        if self.parallel_mode is not None and size != self.tp_size:
            raise ValueError(f"{self.api}.set_tensor_parallel_group: the module was split for "
                             f"tp_size={self.tp_size}, but the group has {size} ranks")
        self.tp_group = tp_group
        if self.parallel_mode is None:
            self.tp_size = size

    def _group(self):
        if self.tp_group is None:
            raise ValueError(f"{self.api}: parallel_mode={self.parallel_mode!r} with "
                             f"tp_size={self.tp_size} but no tp_group; pass tp_group= or call "
                             "set_tensor_parallel_group(group) before the forward")
        return self.tp_group

    def column_input(self, x: torch.Tensor) -> torch.Tensor:
        """Column layer: gather the sequence-parallel input, or mark the replicated
        input for a gradient sum."""
        if self.parallel_mode != "column" or self.size == 1:
            return x
        if self.sequence_parallel:
            return gather_from_sequence_parallel_region(x, self._group(), self.api)
        return copy_to_tensor_parallel_region(x, self._group())

    def row_output(self, y: torch.Tensor) -> torch.Tensor:
        """Row layer: sum the partial outputs (reduce-scatter with sequence parallelism)."""
        if self.parallel_mode != "row" or self.size == 1:
            return y
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(y, self._group(), self.api)
        return reduce_from_tensor_parallel_region(y, self._group())

    def mark_params(self, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        """Set the TP attributes on ``weight`` ([N, K]) and ``bias`` ([N])."""
        split = self.size > 1
        dim = 1 if self.parallel_mode == "row" else 0
        set_tensor_model_parallel_attributes(weight, split, dim, 1)
        if bias is not None:
            set_tensor_model_parallel_attributes(bias, split and self.parallel_mode == "column",
                                                 0, 1)
            if self.parallel_mode == "row" and self.sequence_parallel and split:
                mark_sequence_parallel(bias)

    def describe(self) -> Tuple[str, ...]:
        if self.parallel_mode is None:
            return ()
        return (f"parallel_mode={self.parallel_mode!r}", f"tp_size={self.tp_size}",
                f"sequence_parallel={self.sequence_parallel}")


# ---- saved activations split over the group (te.checkpoint's distribute_saved_activations)

def chunk_numel(tensor: torch.Tensor, group) -> int:
    world = torch.distributed.get_world_size(group)
    numel = tensor.numel()
    if numel % world != 0:
        raise ValueError(f"te.checkpoint: distribute_saved_activations needs the first "
                         f"tensor argument's numel ({numel}, shape {tuple(tensor.shape)}) "
                         f"divisible by the tensor-parallel size {world}")
    return numel // world


def split_tensor_into_1d_equal_chunks(tensor: torch.Tensor, group, new_buffer: bool = False):
    """This rank's 1/world_size slice of ``tensor`` flattened (a copy of just that
    slice when ``new_buffer``, so the whole can be freed)."""
    part = chunk_numel(tensor, group)
    rank = torch.distributed.get_rank(group)
    chunk = tensor.detach().reshape(-1)[rank * part:(rank + 1) * part]
    return chunk.clone() if new_buffer else chunk


def gather_split_1d_tensor(tensor: torch.Tensor, group) -> torch.Tensor:
    """Inverse of `split_tensor_into_1d_equal_chunks`: the flattened whole, in rank
    order. Uses the list form of all_gather, which gloo and NCCL both take."""
    dist = torch.distributed
    world = dist.get_world_size(group)
    out = torch.empty(world * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    dist.all_gather(list(out.chunk(world)), tensor.contiguous(), group=group)
    return out
