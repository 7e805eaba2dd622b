"""One graphed callable of ``te.make_graphed_callables``: its static inputs and outputs,
its forward and backward graphs, and the autograd Function that replays them (NOTE
[Graphed FP8 state] and NOTE [Returned parameter gradients] in graph.py)."""

from __future__ import annotations

import contextlib
from typing import Optional, Sequence, Tuple

import torch

from ..common.recipe import Recipe
from .fp8 import FP8GlobalStateManager, _AutocastState, autocast
from .graph_args import API, run_hooks
from .graph_capture import graph_backward
from .utils import flatten_nested, rebuild_nested

__all__ = ["FP8Setting", "GraphedCallable", "InputLease"]


class FP8Setting:
    """How each forward of a graphed callable runs FP8: as an outermost autocast."""

    def __init__(self, enabled: bool, calibrating: bool, recipe: Optional[Recipe], group,
                 weight_caching: bool = False):
        self.enabled, self.calibrating, self.recipe, self.group = enabled, calibrating, recipe, group
        self.weight_caching = weight_caching

    @contextlib.contextmanager
    def outermost(self):
        saved = FP8GlobalStateManager.get_fp8_autocast_state()
        FP8GlobalStateManager.set_fp8_autocast_state(_AutocastState())
        try:
            if self.enabled or self.calibrating:
                with autocast(enabled=self.enabled, calibrating=self.calibrating,
                              recipe=self.recipe, amax_reduction_group=self.group):
                    yield
            else:
                yield
        finally:
            FP8GlobalStateManager.set_fp8_autocast_state(saved)


class InputLease:
    """Static input tensors that several graphs share (NOTE [Pipeline schedule] in
    graph_schedule.py): the graph whose forward replayed into them last and whose
    backward has not replayed since, if any."""

    __slots__ = ("holder",)

    def __init__(self):
        self.holder: Optional[GraphedCallable] = None


def _grad_inputs(fn, args: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, ...]:
    params = tuple(fn.parameters()) if isinstance(fn, torch.nn.Module) else ()
    return tuple(args) + params


class GraphedCallable:
    """One captured callable (with ``_order``: one layer at one micro-batch): static
    inputs and outputs, its graphs (``graphs``: `graph_capture.CudaGraphs`), and the
    autograd Function that replays them. ``index`` is the callable's position (its
    capture-time hooks), ``graph`` its position among the returned callables."""

    def __init__(self, fn, args, kwargs, setting: FP8Setting, graphs, index: int = 0,
                 hooks=None, clone_param_grads: bool = True, graph: Optional[int] = None,
                 label: str = ""):
        self.fn, self.setting, self.graphs = fn, setting, graphs
        self.index, self.hooks, self.clone_param_grads = index, hooks, clone_param_grads
        self.graph = index if graph is None else graph
        self.label = label or f"callable {index}"
        # the module's own forward, for eager calls once ``forward`` is this object
        self.eager = fn.forward if isinstance(fn, torch.nn.Module) else fn
        self.keys = tuple(kwargs)
        self.static_inputs = tuple(args) + tuple(kwargs[k] for k in self.keys)
        self.grad_inputs = _grad_inputs(fn, self.static_inputs)
        self.lease: Optional[InputLease] = None
        self.out_spec = None
        self.static_outputs: Tuple[torch.Tensor, ...] = ()
        self.static_grad_outputs: Tuple[Optional[torch.Tensor], ...] = ()
        self.static_grad_inputs: Tuple[Optional[torch.Tensor], ...] = ()
        self.cloned: Tuple[bool, ...] = ()        # which gradients a replay returns cloned
        self.replay = None

    def hook(self, name: str) -> None:
        """This callable's capture-time hooks ``name`` (outside any capture)."""
        if self.hooks is not None:
            run_hooks(self.hooks, self.index, name, self.fn)

    def run_forward(self):
        n = len(self.static_inputs) - len(self.keys)
        with self.setting.outermost():
            out = self.fn(*self.static_inputs[:n],
                          **dict(zip(self.keys, self.static_inputs[n:])))
        return out

    def capture_forward(self) -> None:
        self.hook("forward_pre_hooks")
        out = self.graphs.capture_forward(self.run_forward)
        self.hook("forward_hooks")
        leaves, self.out_spec = flatten_nested(out)
        if not all(torch.is_tensor(t) for t in leaves):
            raise TypeError(f"{API}: a graphed callable must return tensors (in tuples, lists "
                            f"or dicts), got {[type(t).__name__ for t in leaves]}")
        self.static_outputs = tuple(leaves)

    def capture_backward(self, allow_unused: bool, retain_graph: bool,
                         shared_grad_outputs: Optional[dict] = None) -> None:
        """Capture the backward; with ``shared_grad_outputs`` (reused buffers), take the
        gradient-output buffers of an earlier graph whose outputs match."""
        key = tuple((tuple(o.shape), o.dtype, o.layout, o.device) if o.requires_grad else None
                    for o in self.static_outputs)
        found = None if shared_grad_outputs is None else shared_grad_outputs.get(key)
        if found is None:       # (zeros: defined values for a capture that runs its work)
            found = tuple(torch.zeros_like(o) if o.requires_grad else None
                          for o in self.static_outputs)
            if shared_grad_outputs is not None:
                shared_grad_outputs[key] = found
        self.static_grad_outputs = found
        self.hook("backward_pre_hooks")
        self.static_grad_inputs = self.graphs.capture_backward(
            lambda outputs: graph_backward(outputs, self.grad_inputs, self.static_grad_outputs,
                                           allow_unused, retain_graph),
            self.static_outputs)
        self.hook("backward_hooks")
        # NOTE [Returned parameter gradients]: the policy is fixed now, at capture
        first_param = len(self.static_inputs)
        self.cloned = tuple(
            self.clone_param_grads and i >= first_param and g is not None
            and not getattr(self.grad_inputs[i], "skip_backward_post_hook", False)
            for i, g in enumerate(self.static_grad_inputs))
        # Drop the captured autograd graph: it would keep the parameters' gradient
        # accumulators of the capture stream alive for every later backward.
        self.static_outputs = tuple(o.detach() for o in self.static_outputs)
        self.replay = self._make_function()

    def release_outputs(self, release) -> None:
        """Reused buffers, after this backward's capture: the static outputs, and the
        parameter gradients a replay returns as copies, no longer keep their memory
        (``release``), which graphs captured later may take."""
        self.static_outputs = tuple(release(o) for o in self.static_outputs)
        self.static_grad_inputs = tuple(release(g) if clone else g for g, clone
                                        in zip(self.static_grad_inputs, self.cloned))

    def release_gradients(self, release) -> None:
        """Reused buffers, once the gradients this backward returns have been consumed
        (by the next layer's backward, or the chunk's input gradient by the next chunk
        backward): they no longer keep their memory either."""
        self.static_grad_inputs = tuple(None if g is None else release(g)
                                        for g in self.static_grad_inputs)

    def _make_function(self):
        """The autograd Function that replays the graphs (NOTE [Returned parameter
        gradients])."""
        graphed = self

        class Graphed(torch.autograd.Function):
            @staticmethod
            def forward(ctx, *inputs):
                for static, given in zip(graphed.static_inputs, inputs):
                    if static.data_ptr() != given.data_ptr():
                        static.copy_(given)
                ctx.replayed = graphed.graphs.replay_forward()
                return tuple(o.detach() for o in graphed.static_outputs)

            @staticmethod
            @torch.autograd.function.once_differentiable
            def backward(ctx, *grads):
                for static, g in zip(graphed.static_grad_outputs, grads):
                    if static is not None:
                        if g is None:
                            static.zero_()
                        elif static.data_ptr() != g.data_ptr():
                            static.copy_(g)
                graphed.graphs.replay_backward(ctx.replayed)
                if graphed.lease is not None and graphed.lease.holder is graphed:
                    graphed.lease.holder = None
                return tuple(g.clone() if clone else g
                             for g, clone in zip(graphed.static_grad_inputs, graphed.cloned))

        return Graphed

    def reset(self) -> None:
        """TE's ``reset()`` of a graphed callable: free its graphs (it cannot replay
        after this)."""
        self.graphs.reset()
        self.replay = None

    def backward_dw(self) -> None:
        """TE's ``backward_dw()``: the deferred weight-gradient graph of modules with
        ``delay_wgrad_compute``, which are not graphed here (refused at capture):
        nothing to run."""

    def _take_inputs(self) -> None:
        """Shared static inputs: refuse a replay that would overwrite the inputs another
        graph's pending backward still reads (calls out of the schedule's order)."""
        holder = self.lease.holder
        if holder is not None and holder is not self:
            raise RuntimeError(
                f"{API}: {self.label} shares its static input buffers with {holder.label}, "
                "whose backward has not run since its forward; call the graphed callables "
                "in the order _order gives (each forward's backward before the forward of "
                "the graph that reuses its buffers)")
        self.lease.holder = self

    def __call__(self, *args, **kwargs):
        first = kwargs.pop("is_first_microbatch", None)
        if self.setting.weight_caching:
            if not isinstance(first, bool):
                raise TypeError(f"{API}: with cache_quantized_params=True a graphed callable "
                                "takes is_first_microbatch=True (the first micro-batch of a "
                                f"step: cast the FP8 weights) or False, got {first!r}")
            FP8GlobalStateManager.set_skip_fp8_weight_update_tensor(not first)
        elif first is not None and not isinstance(first, bool):
            raise TypeError(f"{API}: is_first_microbatch must be a bool or None, got {first!r}")
        training = self.fn.training if isinstance(self.fn, torch.nn.Module) else True
        if not (training and torch.is_grad_enabled()):
            with self.setting.outermost():
                return self.eager(*args, **kwargs)
        # keywords given as None that were not captured are no graph inputs (Megatron passes
        # inference_context=None, ...): left out, as TE leaves every uncaptured keyword out
        kwargs = {k: v for k, v in kwargs.items() if v is not None or k in self.keys}
        if self.replay is None:
            raise RuntimeError(f"{API}: this graphed callable was reset(); its graphs are "
                               "gone (graph the callable again)")
        if tuple(kwargs) != self.keys or len(args) + len(kwargs) != len(self.static_inputs):
            raise TypeError(f"{API}: a graphed callable must be called with the positional "
                            f"and keyword tensor arguments it was captured with "
                            f"({len(self.static_inputs) - len(self.keys)} positional, keywords "
                            f"{list(self.keys)}), got {len(args)} positional and {list(kwargs)}")
        inputs = args + tuple(kwargs[k] for k in self.keys) if kwargs else args
        for static, given in zip(self.static_inputs, inputs):
            if given is static:
                continue
            if not torch.is_tensor(given) or given.shape != static.shape \
                    or given.dtype != static.dtype or given.device != static.device:
                raise ValueError(f"{API}: a graphed callable needs inputs of the captured "
                                 f"shape, dtype and device ({tuple(static.shape)}, {static.dtype},"
                                 f" {static.device}), got {_describe(given)}")
        if self.lease is not None:
            self._take_inputs()
        params = self.grad_inputs[len(self.static_inputs):]
        leaves = self.replay.apply(*inputs, *params)
        return rebuild_nested(list(leaves), self.out_spec)


def _describe(t) -> str:
    if not torch.is_tensor(t):
        return type(t).__name__
    return f"({tuple(t.shape)}, {t.dtype}, {t.device})"
