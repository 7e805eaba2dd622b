"""``te.make_graphed_callables``: CUDA graphs of a training forward and backward with
the FP8 delayed-scaling updates captured inside them.

NOTE [Graphed FP8 state]
    Each callable gets a forward graph and a backward graph (one memory pool for all,
    captured in call order, backwards in reverse). The forward is captured as an
    outermost FP8 autocast with the given recipe (or, with FP8 off, with no autocast
    around it, so that autocasts the callable opens itself are outermost): its amax
    recording, and the forward update at the autocast's exit (all-reduce, new scales,
    history roll), are device work inside the forward graph. The backward graph is
    one ``torch.autograd.grad`` pass, at whose end the backward update runs (NOTE
    [Delayed-scaling update order] in amax_update.py), so it is inside the backward
    graph too. A replay therefore does what an eager training step of the callable
    does, in place on the same state tensors, with no host work per module. The
    backward is captured with ``torch.autocast`` off, as a ``loss.backward()`` called
    after leaving the autocast runs (torch's advice): captured inside it, the backward
    ops would be recast to 16 bits and the gradients would differ from eager ones.
    Warm-up iterations run eagerly before the capture and change the FP8 state;
    every state a module registered during warm-up is put back afterwards (in place:
    the graphs read those tensors), so the first replay starts where an eager run
    would. A graphed callable runs its graphs only in a training forward (grad
    enabled, module in training mode); otherwise it runs eagerly under the same FP8
    setting. ``te.checkpoint(use_reentrant=False)`` inside a graphed callable has its
    recompute captured in the backward graph; the reentrant checkpoint cannot be
    captured (its recompute runs a nested backward, which ``torch.autograd.grad``
    refuses). Random numbers (dropout, also in checkpointed regions, from torch's
    default generator or a `CudaRNGStatesTracker`) are drawn graph-safe (NOTE
    [Graph-safe RNG] in graph_rng.py): the forward is captured in segments split at
    each checkpoint call, and every replay draws the masks an eager step from the same
    generator states draws. The RNG states the warm-up used are put back too. With
    ``cache_quantized_params`` the captured forwards select between the cached and a
    fresh FP8 weight on the device (NOTE [Skip-update flag] in module/fp8_operands.py),
    by the ``is_first_microbatch`` each call passes; the warm-up runs as the capture
    will (`graph_warm_up`), so that the caches exist when the capture starts.

NOTE [Returned parameter gradients]
    A replay's gradients live in the graph's static buffers, which the next replay
    overwrites. As in TE, a parameter's gradient is returned as a fresh copy of its
    buffer (``clone_param_grads_on_return=True``, the default): what autograd hands a
    gradient hook, or installs as ``.grad``, stays the caller's. Parameters marked
    ``skip_backward_post_hook`` when the graph is captured (TE's delayed-wgrad mark),
    and every parameter with ``clone_param_grads_on_return=False``, get the buffer
    itself: a hook sees the same tensor at every replay. Autograd still copies such a
    buffer into an empty ``.grad`` (the graph holds a reference to it, so it is not
    adopted) and adds it to an existing one. Inputs' gradients are the buffers.
    The outputs are the graph's static output buffers too, as TE's and torch's
    graphed callables return them: every call returns the same tensors, which the
    next call overwrites, so an output kept past the next call must be copied
    (``out.detach().clone()``). Each call copies its input tensors, by position and
    then by keyword, into the static inputs the graphs read.
"""

from __future__ import annotations

import contextlib
from typing import Optional, Sequence, Tuple

import torch

from ..common.recipe import Recipe
from .fp8 import FP8GlobalStateManager, _AutocastState, autocast
from .graph_args import (API, UNSET, check_capture_time_hooks, check_devices, check_group,
                         default_order, normalize, resolve, run_hooks)
from .graph_rng import GraphRng
from .graph_capture import capturing, graph_backward, warm_up
from .utils import flatten_nested, rebuild_nested

__all__ = ["make_graphed_callables"]

class _FP8Setting:
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


def _grad_inputs(fn, args: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, ...]:
    params = tuple(fn.parameters()) if isinstance(fn, torch.nn.Module) else ()
    return tuple(args) + params


class _GraphedCallable:
    """One captured callable: static inputs and outputs, its two graphs, and the
    autograd Function that replays them."""

    def __init__(self, fn, args, kwargs, setting: _FP8Setting, rng: GraphRng, index: int = 0,
                 hooks=None, clone_param_grads: bool = True):
        self.fn, self.setting, self.rng = fn, setting, rng
        self.index, self.hooks, self.clone_param_grads = index, hooks, clone_param_grads
        # the module's own forward, for eager calls once ``forward`` is this object
        self.eager = fn.forward if isinstance(fn, torch.nn.Module) else fn
        self.keys = tuple(kwargs)
        self.static_inputs = tuple(args) + tuple(kwargs[k] for k in self.keys)
        self.grad_inputs = _grad_inputs(fn, self.static_inputs)
        self.bwd_graph = torch.cuda.CUDAGraph()     # the forward graphs are self.rng.segments
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
        with self.rng.capture_forward():
            out = self.run_forward()
        self.hook("forward_hooks")
        leaves, self.out_spec = flatten_nested(out)
        if not all(torch.is_tensor(t) for t in leaves):
            raise TypeError(f"{API}: a graphed callable must return tensors (in tuples, lists "
                            f"or dicts), got {[type(t).__name__ for t in leaves]}")
        self.static_outputs = tuple(leaves)

    def capture_backward(self, allow_unused: bool, retain_graph: bool) -> None:
        self.static_grad_outputs = tuple(torch.empty_like(o) if o.requires_grad else None
                                         for o in self.static_outputs)
        self.hook("backward_pre_hooks")
        with self.rng.capture_backward(self.bwd_graph):
            self.static_grad_inputs = graph_backward(self.static_outputs, self.grad_inputs,
                                                self.static_grad_outputs, allow_unused,
                                                retain_graph)
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

    def _make_function(self):
        """The autograd Function that replays the two graphs (NOTE [Returned parameter
        gradients])."""
        graphed = self

        class Graphed(torch.autograd.Function):
            @staticmethod
            def forward(ctx, *inputs):
                for static, given in zip(graphed.static_inputs, inputs):
                    if static.data_ptr() != given.data_ptr():
                        static.copy_(given)
                ctx.rng_states = graphed.rng.replay_forward()
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
                graphed.rng.prepare_backward(ctx.rng_states)
                graphed.bwd_graph.replay()
                return tuple(g.clone() if clone else g
                             for g, clone in zip(graphed.static_grad_inputs, graphed.cloned))

        return Graphed

    def reset(self) -> None:
        """TE's ``reset()`` of a graphed callable: free its graphs (it cannot replay
        after this)."""
        for graph in list(self.rng.segments) + [self.bwd_graph]:
            graph.reset()
        self.replay = None

    def backward_dw(self) -> None:
        """TE's ``backward_dw()``: the deferred weight-gradient graph of modules with
        ``delay_wgrad_compute``, which are not graphed here (refused at capture):
        nothing to run."""

    def __call__(self, *args, **kwargs):
        if self.setting.weight_caching:
            first = kwargs.pop("is_first_microbatch", None)
            if not isinstance(first, bool):
                raise TypeError(f"{API}: with cache_quantized_params=True a graphed callable "
                                "takes is_first_microbatch=True (the first micro-batch of a "
                                f"step: cast the FP8 weights) or False, got {first!r}")
            FP8GlobalStateManager.set_skip_fp8_weight_update_tensor(not first)
        training = self.fn.training if isinstance(self.fn, torch.nn.Module) else True
        if not (training and torch.is_grad_enabled()):
            with self.setting.outermost():
                return self.eager(*args, **kwargs)
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
        params = self.grad_inputs[len(self.static_inputs):]
        leaves = self.replay.apply(*inputs, *params)
        return rebuild_nested(list(leaves), self.out_spec)


def _describe(t) -> str:
    if not torch.is_tensor(t):
        return type(t).__name__
    return f"({tuple(t.shape)}, {t.dtype}, {t.device})"


def make_graphed_callables(modules, sample_args, num_warmup_iters: int = 3,
                           allow_unused_input: bool = False, sample_kwargs=None,
                           fp8_enabled=UNSET, fp8_calibrating=UNSET, fp8_recipe=UNSET,
                           fp8_group=UNSET, fp8_weight_caching=UNSET, _order=None, pool=None,
                           retain_graph_in_backward: bool = False, *, enabled=UNSET,
                           calibrating=UNSET, recipe=UNSET, amax_reduction_group=UNSET,
                           cache_quantized_params=UNSET, _num_layers_per_chunk=None,
                           _reuse_graph_input_output_buffers: bool = False,
                           clone_param_grads_on_return: bool = True, pre_warmup_hook=None,
                           post_warmup_hook=None, capture_time_hooks=None):
    """Capture callables' training forward and backward as CUDA graphs, with FP8 state
    updates inside the graphs (NOTE [Graphed FP8 state]) and graph-safe dropout: each
    replay draws fresh masks from torch's default CUDA generator and the states of
    every `CudaRNGStatesTracker` alive at the call, as an eager step would, also in
    non-reentrant ``te.checkpoint`` regions (NOTE [Graph-safe RNG]).

    Parameters
    ----------
    modules : callable or tuple of callables
        ``nn.Module``\\ s or functions; a tuple shares one memory pool and must be in
        the order the callables run. A module's parameters get gradients as usual; a
        function's tensors other than its arguments do not.
    sample_args : tuple (or list) of tensors, or a tuple of such (one per callable)
        CUDA tensors of the shapes and dtypes every later call passes.
    num_warmup_iters : int, default 3
        Eager iterations before the capture (at least 1 with FP8 or calibration).
    allow_unused_input : bool, default False
        Passed to ``torch.autograd.grad`` in the captured backward.
    sample_kwargs : dict of tensors, or a tuple of such dicts, optional
    enabled, calibrating, recipe, amax_reduction_group : as ``te.autocast``'s, for
        every forward of the graphed callables (FP8 off by default). The older
        ``fp8_enabled``, ``fp8_calibrating``, ``fp8_recipe``, ``fp8_group`` still work,
        with a ``DeprecationWarning``.
    cache_quantized_params (``fp8_weight_caching``) : bool, default False
        Cache FP8 weights across micro-batches, as ``is_first_microbatch`` does
        eagerly: each call of a graphed callable then takes ``is_first_microbatch=True``
        (cast the weights afresh; the first micro-batch of a step) or ``False`` (use
        the FP8 weights cast then), passed to the replay through the skip-update
        tensor (NOTE [Skip-update flag] in module/fp8_operands.py). Needs
        ``enabled=True``. The warm-up makes the caches.
    pool : optional
        A memory pool handle (``torch.cuda.graph_pool_handle()``) to capture into.
    retain_graph_in_backward : bool, default False
        Keep the captured autograd graph for a second backward inside the capture.
    clone_param_grads_on_return : bool, default True
        Return each parameter's gradient as a fresh copy of the graph's buffer (not
        for parameters marked ``skip_backward_post_hook`` at capture); False returns
        the buffers themselves (NOTE [Returned parameter gradients]).
    pre_warmup_hook, post_warmup_hook : callable, optional
        Called (no arguments) once before and once after the warm-up iterations.
    capture_time_hooks : list, optional
        One entry per callable: None or a dict with some of the keys
        "forward_pre_hooks", "forward_hooks", "backward_pre_hooks", "backward_hooks",
        each a dict ``{hook_id: hook(module)}``. They run around every warm-up
        forward / backward of their callable and around its captures, always outside
        the capture (nothing of them is replayed); a hook must return None.
    _order, _num_layers_per_chunk : optional
        Megatron's pipeline schedule: taken when it is the default one
        (``[1, ..., C, -C, ..., -1]``, one micro-batch); others raise
        NotImplementedError. ``_reuse_graph_input_output_buffers=True`` also does.

    Returns
    -------
    The graphed callable, or a tuple of them in the order given. A graphed module
    keeps its parameters; its ``forward`` replays the graphs in training mode with
    grad enabled, and runs eagerly otherwise. A replay's outputs are the graph's
    static buffers, overwritten by the next call (NOTE [Returned parameter
    gradients]). Each has TE's ``reset()`` (free its graphs) and ``backward_dw()``
    (nothing to run here).
    """
    enabled = resolve("enabled", enabled, "fp8_enabled", fp8_enabled, False)
    calibrating = resolve("calibrating", calibrating, "fp8_calibrating", fp8_calibrating, False)
    recipe = resolve("recipe", recipe, "fp8_recipe", fp8_recipe, None)
    group = resolve("amax_reduction_group", amax_reduction_group, "fp8_group", fp8_group, None)
    cache = resolve("cache_quantized_params", cache_quantized_params, "fp8_weight_caching",
                     fp8_weight_caching, False)
    for name, value in (("enabled", enabled), ("calibrating", calibrating),
                        ("allow_unused_input", allow_unused_input),
                        ("retain_graph_in_backward", retain_graph_in_backward),
                        ("cache_quantized_params", cache)):
        if not isinstance(value, bool):
            raise TypeError(f"{API}: {name} must be a bool, got {value!r}")
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(f"{API}: recipe must be a transformer_engine.common.recipe.Recipe or "
                        f"None, got {type(recipe).__name__}")
    if isinstance(num_warmup_iters, bool) or not isinstance(num_warmup_iters, int) \
            or num_warmup_iters < 0:
        raise ValueError(f"{API}: num_warmup_iters must be an int >= 0, got {num_warmup_iters!r}")
    if (enabled or calibrating) and num_warmup_iters < 1:
        raise ValueError(f"{API}: num_warmup_iters must be >= 1 with FP8 or calibration (the "
                         "FP8 state is created by the first eager forward), got 0")
    if cache and not enabled:
        raise ValueError(f"{API}: cache_quantized_params=True caches FP8 weights, so it needs "
                         "enabled=True")
    for name, value in (("clone_param_grads_on_return", clone_param_grads_on_return),
                        ("_reuse_graph_input_output_buffers", _reuse_graph_input_output_buffers)):
        if not isinstance(value, bool):
            raise TypeError(f"{API}: {name} must be a bool, got {value!r}")
    if _reuse_graph_input_output_buffers:
        raise NotImplementedError(f"{API}: _reuse_graph_input_output_buffers=True (buffers shared "
                                  "across a pipeline schedule) is not implemented")
    for name, hook in (("pre_warmup_hook", pre_warmup_hook),
                       ("post_warmup_hook", post_warmup_hook)):
        if hook is not None and not callable(hook):
            raise TypeError(f"{API}: {name} must be callable or None, got {hook!r}")
    single, callables, args, kwargs = normalize(modules, sample_args, sample_kwargs)
    default_order(_order, _num_layers_per_chunk, len(callables))
    hooks = check_capture_time_hooks(capture_time_hooks, len(callables))
    for fn in callables:
        delaying = [m for m in (fn.modules() if isinstance(fn, torch.nn.Module) else ())
                    if getattr(m, "need_backward_dw", None) is not None and m.need_backward_dw()]
        if delaying:
            raise NotImplementedError(
                f"{API}: a module built with delay_wgrad_compute=True "
                f"({type(delaying[0]).__name__}) cannot be graphed here: its deferred wgrad "
                "GEMMs would have to be captured in a graph of their own; build it with "
                "delay_wgrad_compute=False or run it eagerly")
    if not torch.cuda.is_available():
        raise RuntimeError(f"{API}: CUDA graphs need a CUDA device, and none is available")
    check_devices(callables, args, kwargs)
    if enabled or calibrating:
        check_group(group)
    setting = _FP8Setting(enabled, calibrating, recipe, group, cache)
    pool = pool if pool is not None else torch.cuda.graph_pool_handle()
    stream = torch.cuda.Stream()                  # one capture stream for the shared pool
    graphed = [_GraphedCallable(fn, a, k, setting, GraphRng(pool, stream), i, hooks,
                                clone_param_grads_on_return)
               for i, (fn, a, k) in enumerate(zip(callables, args, kwargs))]
    warm_up(graphed, num_warmup_iters, allow_unused_input, pre_warmup_hook, post_warmup_hook)
    torch.cuda.synchronize()
    for i, g in enumerate(graphed):
        capturing(i, "forward", g.capture_forward)
    for i, g in reversed(list(enumerate(graphed))):
        capturing(i, "backward", g.capture_backward, allow_unused_input,
                   retain_graph_in_backward)
    torch.cuda.synchronize()
    results = []
    for g in graphed:
        if isinstance(g.fn, torch.nn.Module):
            g.fn.forward = g
            # TE's attributes of a graphed callable (instance attributes, as TE sets them)
            g.fn.reset, g.fn.backward_dw = g.reset, g.backward_dw
            results.append(g.fn)
        else:
            results.append(g)
    return results[0] if single else tuple(results)
