"""The eager warm-up of `make_graphed_callables` before its captures, the backward it
runs and captures, and the error a failed capture becomes (NOTE [Graphed FP8 state]
in graph.py)."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Dict, List, Tuple

import torch

from .amax_update import observe_registrations
from .fp8 import FP8GlobalStateManager, graph_warm_up
from .graph_args import API
from .rng import rng_states_restored
from .scaling import ScalingState
from .utils import flatten_nested

__all__ = ["warm_up", "graph_backward", "capturing"]


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


def warm_up(graphed: list, iters: int, allow_unused: bool,
             pre_hook=None, post_hook=None) -> None:
    """Eager iterations on a side stream (allocations, autotuning, FP8 state creation),
    each every forward in order and then the backwards in reverse, as the capture
    runs; then every FP8 state they changed, and the RNG states they drew from, put
    back."""
    restorer = _StateRestorer()
    caching = any(g.setting.weight_caching for g in graphed)
    if caching:         # the warm-up casts afresh and makes the caches the graphs select from
        FP8GlobalStateManager.set_skip_fp8_weight_update_tensor(False)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream), observe_registrations(restorer.observe), \
                rng_states_restored(torch.device("cuda", torch.cuda.current_device())), \
                (graph_warm_up() if caching else contextlib.nullcontext()):
            if pre_hook is not None:
                pre_hook()
            for _ in range(iters):
                outputs = []
                for g in graphed:
                    g.hook("forward_pre_hooks")
                    leaves, _ = flatten_nested(g.run_forward())
                    g.hook("forward_hooks")
                    outputs.append([t for t in leaves if torch.is_tensor(t) and t.requires_grad])
                for g, outs in reversed(list(zip(graphed, outputs))):
                    g.hook("backward_pre_hooks")
                    graph_backward(outs, g.grad_inputs, [torch.ones_like(o) for o in outs],
                              allow_unused, False)
                    g.hook("backward_hooks")
            if post_hook is not None:
                post_hook()
    finally:
        torch.cuda.current_stream().wait_stream(stream)
        restorer.restore()


def capturing(index: int, what: str, capture: Callable, *args: Any) -> None:
    try:
        capture(*args)
    except (RuntimeError, TypeError) as err:
        _end_failed_capture()
        raise RuntimeError(
            f"{API}: capturing the {what} of callable {index} failed: {err}. A CUDA graph "
            "cannot hold host work that waits for the GPU (.item(), .cpu(), printing a CUDA "
            "tensor, a data-dependent shape), CPU tensors, or collectives of a non-NCCL "
            "group.") from err


def _end_failed_capture() -> None:
    """A capture that failed part way leaves the CUDA generators marked as capturing
    (``capture_end`` raised before releasing them), so every later random op in the
    process would fail with "Offset increment outside graph capture". One empty
    capture begins and ends them again (checked on an H200, torch 2.11)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            pass
