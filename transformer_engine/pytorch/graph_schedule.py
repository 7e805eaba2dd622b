"""The schedule of ``te.make_graphed_callables``: which graph each sample belongs to, the
order in which the graphs are warmed up, captured and must be replayed (TE's ``_order``,
Megatron's pipeline schedule), and which graphs share static input and gradient-output
buffers (``_reuse_graph_input_output_buffers``).

NOTE [Pipeline schedule]
    With ``_order`` the callables are the layers of C model chunks, in chunk order
    (chunk c holds ``_num_layers_per_chunk[c]`` consecutive callables, by default the
    callables split evenly), and each layer gets one pair of graphs per micro-batch.
    ``sample_args`` (and ``sample_kwargs``) hold one entry per graph, chunk by chunk,
    then micro-batch by micro-batch, then layer by layer: graph
    ``first_layer(c) * M + m * layers(c) + l`` is layer l of chunk c at micro-batch m,
    of M micro-batches. The returned callables follow the same order. ``_order`` lists
    the schedule: ``c`` (1-based) is the forward of chunk c's next micro-batch, its
    layers in order; ``-c`` the backward of chunk c's oldest micro-batch whose backward
    has not run, its layers in reverse. Each chunk appears M times each way. The
    warm-up and the captures follow the schedule step by step, and so must the calls:
    all graphs share one memory pool, and memory an earlier-captured graph no longer
    needs (a backward's saved activations) is handed to the graphs captured after it.
    Without ``_order`` the schedule is one chunk of every callable and one micro-batch:
    each forward in order, then the backwards in reverse.

    Reused buffers: a forward takes as its static inputs the sample tensors of a graph
    whose backward came earlier in the schedule, when their shapes, dtypes, layouts,
    devices and ``requires_grad`` match (the longest-free such graph; as TE, the
    graphs of one chunk backward free in layer order). A graph's inputs are needed until
    its backward (a weight gradient reads them), so the sharing is exact as long as the
    calls follow the schedule. Backward graphs whose outputs match share their
    gradient-output buffers, which are read only inside a backward.
"""

from __future__ import annotations

import numbers
from collections import defaultdict, deque
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from .graph_args import API

__all__ = ["Step", "Schedule", "build_schedule", "shared_inputs", "signature"]


class Step(NamedTuple):
    """One forward or backward of one graph: ``graph`` indexes the samples and the
    returned callables, ``layer`` the callables."""

    forward: bool
    graph: int
    layer: int


class Schedule(NamedTuple):
    """The steps, grouped as ``_order`` gives them (one group per chunk forward or
    backward), and each graph's layer and micro-batch."""

    groups: Tuple[Tuple[Step, ...], ...]
    layer_of: Tuple[int, ...]
    microbatch_of: Tuple[int, ...]
    ordered: bool                   # whether ``_order`` was given

    @property
    def steps(self) -> List[Step]:
        return [step for group in self.groups for step in group]

    @property
    def num_graphs(self) -> int:
        return len(self.layer_of)


def _chunk_ids(order) -> List[int]:
    if not isinstance(order, (list, tuple)) or not order:
        raise ValueError(f"{API}: _order must be a non-empty list of chunk numbers, got {order!r}")
    ids = []
    for c in order:
        if isinstance(c, numbers.Integral) and not isinstance(c, bool) and c != 0:
            ids.append(int(c))
        elif isinstance(c, numbers.Real) and not isinstance(c, bool) and c < 0 and c % 1 == 0.5:
            raise NotImplementedError(
                f"{API}: _order entry {c!r} is a weight-gradient graph (TE's "
                "delay_wgrad_compute), which is not implemented here; build the modules with "
                "delay_wgrad_compute=False and give _order in whole chunk numbers")
        else:
            raise ValueError(f"{API}: _order entries must be non-zero ints (c: forward of "
                             f"chunk c, -c: its backward), got {c!r} in {order!r}")
    return ids


def _layers_per_chunk(given, chunks: int, count: int) -> List[int]:
    if given is None:
        if count % chunks:
            raise ValueError(f"{API}: _order has {chunks} model chunks, which do not split the "
                             f"{count} callables evenly; pass _num_layers_per_chunk")
        return [count // chunks] * chunks
    if isinstance(given, numbers.Integral) and not isinstance(given, bool):
        layers = [int(given)] * chunks
    elif isinstance(given, (list, tuple)) and len(given) == chunks and all(
            isinstance(n, numbers.Integral) and not isinstance(n, bool) for n in given):
        layers = [int(n) for n in given]
    else:
        raise ValueError(f"{API}: _num_layers_per_chunk must be an int or {chunks} ints (one "
                         f"per model chunk of _order), got {given!r}")
    if min(layers) < 1 or sum(layers) != count:
        raise ValueError(f"{API}: _num_layers_per_chunk={given!r} must be positive and add up "
                         f"to the number of callables ({count}), got {layers}")
    return layers


def build_schedule(order, num_layers_per_chunk, count: int) -> Schedule:
    """The schedule of ``count`` callables under ``_order`` (NOTE [Pipeline schedule])."""
    if order is None:
        if num_layers_per_chunk is not None:
            raise ValueError(f"{API}: _num_layers_per_chunk is only used with _order")
        ids, layers, ordered = [1, -1], [count], False
    else:
        ids, ordered = _chunk_ids(order), True
        chunks = max(abs(c) for c in ids)
        forwards = [ids.count(c) for c in range(1, chunks + 1)]
        backwards = [ids.count(-c) for c in range(1, chunks + 1)]
        if len(set(forwards + backwards)) != 1:
            raise ValueError(f"{API}: _order={list(order)!r} must run every model chunk 1.."
                             f"{chunks} as many times forward as backward, the same number of "
                             f"micro-batches each; got forwards {forwards}, backwards {backwards}")
        layers = _layers_per_chunk(num_layers_per_chunk, chunks, count)
    chunks, micro = len(layers), ids.count(1)
    first = [sum(layers[:c]) for c in range(chunks)]
    layer_of, microbatch_of = [0] * (sum(layers) * micro), [0] * (sum(layers) * micro)
    for c in range(chunks):
        for m in range(micro):
            for lay in range(layers[c]):
                g = first[c] * micro + m * layers[c] + lay
                layer_of[g], microbatch_of[g] = first[c] + lay, m
    done = {1: [0] * chunks, -1: [0] * chunks}          # micro-batches run, each way
    groups = []
    for c in ids:
        chunk, way = abs(c) - 1, 1 if c > 0 else -1
        m = done[way][chunk]
        if way < 0 and m >= done[1][chunk]:
            raise ValueError(f"{API}: _order={list(order)!r} runs backward {m} of chunk "
                             f"{chunk + 1} before its forward {m}")
        done[way][chunk] += 1
        base = first[chunk] * micro + m * layers[chunk]
        lays = range(layers[chunk]) if way > 0 else reversed(range(layers[chunk]))
        groups.append(tuple(Step(way > 0, base + lay, first[chunk] + lay) for lay in lays))
    return Schedule(tuple(groups), tuple(layer_of), tuple(microbatch_of), ordered)


def signature(args: Sequence[torch.Tensor], kwargs: Dict[str, torch.Tensor]) -> tuple:
    """What two graphs' sample tensors must agree on to share static buffers."""
    def sig(t):
        return (tuple(t.shape), t.dtype, t.layout, t.device, t.requires_grad)
    return tuple(sig(t) for t in args) + tuple((k, sig(kwargs[k])) for k in sorted(kwargs))


def shared_inputs(schedule: Schedule, signatures: Sequence[tuple]) -> List[int]:
    """For each graph, the graph whose sample tensors serve as its static inputs (itself,
    or one whose backward ran before its forward: NOTE [Pipeline schedule])."""
    owner = list(range(schedule.num_graphs))
    free: Dict[tuple, deque] = defaultdict(deque)
    for group in schedule.groups:
        if group[0].forward:
            for step in group:
                pool: Optional[deque] = free.get(signatures[step.graph])
                if pool:
                    owner[step.graph] = pool.popleft()
        else:
            for step in sorted(group, key=lambda s: s.layer):
                free[signatures[step.graph]].append(owner[step.graph])
    return owner
