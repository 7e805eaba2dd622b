"""How `make_graphed_callables` captures: the CUDA side (`CudaCapture`: the memory pool,
the capture stream, each callable's graphs), the eager warm-up and the captures in the
schedule's order (NOTE [Pipeline schedule] in graph_schedule.py), the backward they run,
and the error a failed capture becomes (NOTE [Graphed FP8 state] in graph.py)."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Dict, List, Tuple

import torch

from .amax_update import observe_registrations
from .fp8 import FP8GlobalStateManager, graph_warm_up
from .graph_args import API, check_devices
from .graph_rng import GraphRng
from .rng import rng_states_restored
from .scaling import ScalingState
from .utils import flatten_nested

__all__ = ["CudaCapture", "CudaGraphs", "warm_up_and_capture", "graph_backward",
           "weak_alias"]


class CudaGraphs:
    """One graphed callable's CUDA graphs: the forward (in segments, NOTE [Graph-safe
    RNG] in graph_rng.py) and the backward. ``capture_forward(run)`` captures ``run()``
    and returns its outputs; ``capture_backward(run, outputs)`` captures
    ``run(outputs)`` and returns the gradients."""

    def __init__(self, rng: GraphRng):
        self.rng = rng
        self.backward_graph = torch.cuda.CUDAGraph()

    def capture_forward(self, run: Callable):
        with self.rng.capture_forward():
            return run()

    def capture_backward(self, run: Callable, outputs):
        with self.rng.capture_backward(self.backward_graph):
            return run(outputs)

    def replay_forward(self):
        """Replay the forward; returns what the backward replay needs (RNG states)."""
        return self.rng.replay_forward()

    def replay_backward(self, replayed) -> None:
        self.rng.prepare_backward(replayed)
        self.backward_graph.replay()

    def reset(self) -> None:
        for graph in list(self.rng.segments) + [self.backward_graph]:
            graph.reset()


def weak_alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s memory that does not keep it allocated (TE's weak reference
    of a graph's static buffer): once ``t`` is dropped the graph pool may give the memory
    to graphs captured later. ``t`` itself where torch offers no such storage."""
    make = getattr(torch._C, "_construct_storage_from_data_pointer", None)
    if make is None:
        return t
    storage = t.untyped_storage()
    alias = make(storage.data_ptr(), t.device, storage.nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(
        alias, t.storage_offset(), t.size(), t.stride())


class CudaCapture:
    """CUDA graphs in one memory pool (``pool`` or a new one), captured on one side
    stream; the warm-up runs on another side stream and leaves the RNG states as it
    found them."""

    def __init__(self, pool=None):
        if not torch.cuda.is_available():
            raise RuntimeError(f"{API}: CUDA graphs need a CUDA device, and none is available")
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream()

    check = staticmethod(check_devices)
    release = staticmethod(weak_alias)

    def graphs(self) -> CudaGraphs:
        return CudaGraphs(GraphRng(self.pool, self.stream))

    @contextlib.contextmanager
    def warm_up_scope(self):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(stream), \
                    rng_states_restored(torch.device("cuda", torch.cuda.current_device())):
                yield
        finally:
            torch.cuda.current_stream().wait_stream(stream)

    @staticmethod
    def synchronize() -> None:
        torch.cuda.synchronize()

    @staticmethod
    def end_failed_capture() -> None:
        """A capture that failed part way leaves the CUDA generators marked as capturing
        (``capture_end`` raised before releasing them), so every later random op in the
        process would fail with "Offset increment outside graph capture". One empty
        capture begins and ends them again (checked on an H200, torch 2.11)."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                pass


class _StateRestorer:
    """Copies of every FP8 state registered during warm-up, put back in place after."""

    def __init__(self):
        self.saved: Dict[int, List[Tuple[ScalingState, ScalingState]]] = {}

    def observe(self, fp8_meta: dict) -> None:
        if id(fp8_meta) in self.saved:
            return
        self.saved[id(fp8_meta)] = [(s, s.clone()) for s in (fp8_meta.get("scaling_fwd"),
                                                             fp8_meta.get("scaling_bwd"))
                                    if s is not None]

    def restore(self) -> None:
        for pairs in self.saved.values():
            for live, copy in pairs:
                for name in ("scale", "scale_inv", "amax_history"):
                    getattr(live, name).copy_(getattr(copy, name))


def graph_backward(outputs, inputs, grad_outputs, allow_unused: bool, retain_graph: bool):
    """The callable's backward, outside any ``torch.autocast`` (NOTE [Graphed FP8 state])."""
    pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if g is not None]
    wanted = [t for t in inputs if t.requires_grad]
    with torch.autocast("cuda", enabled=False), torch.autocast("cpu", enabled=False):
        grads = torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs],
                                    allow_unused=allow_unused, retain_graph=retain_graph)
    found = iter(grads)
    return tuple(next(found) if t.requires_grad else None for t in inputs)


def _warm_up(graphed: list, schedule, backend, iters: int, allow_unused: bool,
             restorer: _StateRestorer, pre_hook=None, post_hook=None) -> None:
    """Eager iterations in the schedule's order (allocations, autotuning, FP8 state
    creation), observing every FP8 state they register."""
    caching = any(g.setting.weight_caching for g in graphed)
    if caching:         # the warm-up casts afresh and makes the caches the graphs select from
        FP8GlobalStateManager.set_skip_fp8_weight_update_tensor(False)
    with backend.warm_up_scope(), observe_registrations(restorer.observe), \
            (graph_warm_up() if caching else contextlib.nullcontext()):
        if pre_hook is not None:
            pre_hook()
        for _ in range(iters):
            outputs: Dict[int, list] = {}
            for step in schedule.steps:
                g = graphed[step.graph]
                if step.forward:
                    g.hook("forward_pre_hooks")
                    leaves, _ = flatten_nested(g.run_forward())
                    g.hook("forward_hooks")
                    outputs[step.graph] = [t for t in leaves
                                           if torch.is_tensor(t) and t.requires_grad]
                else:
                    outs = outputs.pop(step.graph)
                    g.hook("backward_pre_hooks")
                    graph_backward(outs, g.grad_inputs, [torch.ones_like(o) for o in outs],
                                   allow_unused, False)
                    g.hook("backward_hooks")
        if post_hook is not None:
            post_hook()


def _capture(graphed: list, schedule, backend, allow_unused: bool, retain: bool,
             reuse: bool) -> None:
    """Every capture in the schedule's order; with reused buffers, each buffer's memory
    let go as soon as the schedule no longer reads it (TE's points)."""
    shared_grad_outputs = {} if reuse else None
    chunk_input = None          # the graph that returned the last chunk's input gradient
    for group in schedule.groups:
        previous = None
        for step in group:
            g = graphed[step.graph]
            if step.forward:
                _capturing(backend, g.label, "forward", g.capture_forward)
                continue
            _capturing(backend, g.label, "backward", g.capture_backward, allow_unused, retain,
                       shared_grad_outputs)
            if reuse:
                g.release_outputs(backend.release)
                if previous is not None:
                    previous.release_gradients(backend.release)
                previous = g
        if previous is not None:
            if chunk_input is not None:
                chunk_input.release_gradients(backend.release)
            chunk_input = previous


def warm_up_and_capture(graphed: list, schedule, backend, iters: int, allow_unused: bool,
                        retain: bool, reuse: bool, pre_hook=None, post_hook=None) -> None:
    """Warm up, then capture, all in the schedule's order; the FP8 state the warm-up
    changed (and a capture that runs its work, on a stand-in for CUDA graphs) is put
    back afterwards, in place (the graphs read those tensors), so the first replay
    starts where an eager run would."""
    restorer = _StateRestorer()
    try:
        _warm_up(graphed, schedule, backend, iters, allow_unused, restorer, pre_hook, post_hook)
        backend.synchronize()
        _capture(graphed, schedule, backend, allow_unused, retain, reuse)
        backend.synchronize()
    finally:
        restorer.restore()


def _capturing(backend, label: str, what: str, capture: Callable, *args: Any) -> None:
    try:
        capture(*args)
    except (RuntimeError, TypeError) as err:
        backend.end_failed_capture()
        raise RuntimeError(
            f"{API}: capturing the {what} of {label} failed: {err}. A CUDA graph "
            "cannot hold host work that waits for the GPU (.item(), .cpu(), printing a CUDA "
            "tensor, a data-dependent shape), CPU tensors, or collectives of a non-NCCL "
            "group.") from err
