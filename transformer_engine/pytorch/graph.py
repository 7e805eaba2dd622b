"""``te.make_graphed_callables``: CUDA graphs of a training forward and backward with
the FP8 delayed-scaling updates captured inside them.

NOTE [Graphed FP8 state]
    Each callable (with ``_order``: each layer at each micro-batch) gets a forward
    graph and a backward graph, all in one memory pool, captured in the order of the
    schedule (NOTE [Pipeline schedule] in graph_schedule.py; without ``_order`` every
    forward in call order, then the backwards in reverse). The forward is captured as an
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
    Warm-up iterations run eagerly before the capture, in the schedule's order, and
    change the FP8 state; every state a module registered during warm-up is put back
    after the captures (in place: the graphs read those tensors), so the first replay
    starts where an eager run would. A graphed callable runs its graphs only in a training forward (grad
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

from typing import Tuple

import torch

from ..common.recipe import Recipe
from .graph_args import (API, UNSET, check_capture_time_hooks, check_group, normalize,
                         resolve)
from .graph_callable import FP8Setting, GraphedCallable, InputLease
from .graph_capture import CudaCapture, warm_up_and_capture
from .graph_schedule import build_schedule, shared_inputs, signature

__all__ = ["make_graphed_callables"]


def _capture_backend(pool):
    """Where the graphs are captured: CUDA graphs (refused with a clear error on a
    machine without CUDA)."""
    return CudaCapture(pool)


def _per_callable_enabled(enabled, count: int) -> Tuple[bool, ...]:
    if isinstance(enabled, bool):
        return (enabled,) * count
    if isinstance(enabled, tuple) and len(enabled) == count \
            and all(isinstance(e, bool) for e in enabled):
        return enabled
    raise TypeError(f"{API}: enabled must be a bool or a tuple of {count} bools (one per "
                    f"callable), got {enabled!r}")


def _share_leases(graphed, owner) -> None:
    """Graphs that take the same graph's sample tensors as static inputs (reused buffers)
    share one `InputLease`. (Tensors the caller shares between samples, such as one
    rotary embedding for all, are constants here, not leased.)"""
    groups = {}
    for g, o in zip(graphed, owner):
        groups.setdefault(o, []).append(g)
    for members in groups.values():
        if len(members) > 1:
            lease = InputLease()
            for g in members:
                g.lease = lease


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
    sample_args : tuple (or list) of tensors, or a tuple of such (one per callable;
        with ``_order`` one per layer and micro-batch, NOTE [Pipeline schedule])
        CUDA tensors of the shapes and dtypes every later call passes.
    num_warmup_iters : int, default 3
        Eager iterations before the capture (at least 1 with FP8 or calibration).
    allow_unused_input : bool, default False
        Passed to ``torch.autograd.grad`` in the captured backward.
    sample_kwargs : dict of tensors, or a tuple of such dicts, optional
    enabled, calibrating, recipe, amax_reduction_group : as ``te.autocast``'s, for
        every forward of the graphed callables (FP8 off by default); ``enabled`` may
        be a tuple of bools, one per callable (Megatron keeps its first and last layers
        out of FP8 so). The older
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
    _order : list of ints, optional
        Megatron's pipeline schedule (NOTE [Pipeline schedule] in graph_schedule.py):
        ``c`` is the forward of model chunk c's next micro-batch, ``-c`` the backward
        of its oldest pending one. The callables are then the layers of all chunks,
        and each layer is captured once per micro-batch. The warm-up and the captures
        follow the schedule, and the calls must too. Weight-gradient entries
        (``-c - 0.5``, TE's ``delay_wgrad_compute``) raise NotImplementedError.
    _num_layers_per_chunk : int or list of ints, optional
        The callables of each model chunk (by default an even split).
    _reuse_graph_input_output_buffers : bool, default False
        With ``_order``: a forward whose inputs match those of a graph whose backward
        ran before it uses that graph's static input buffers, backwards whose outputs
        match share their gradient-output buffers, and static outputs and gradients
        give their memory back to the pool once the schedule no longer reads them, as
        TE does. Results equal those without; an output must be copied if kept past
        its backward (a later graph may overwrite it), and a call out of the
        schedule's order that would overwrite inputs a pending backward reads raises.

    Returns
    -------
    The graphed callable, or a tuple of them in the order given. A graphed module
    keeps its parameters; its ``forward`` replays the graphs in training mode with
    grad enabled, and runs eagerly otherwise. With ``_order``, a tuple of one
    graphed callable per layer and micro-batch, in the order of ``sample_args`` (a
    module's own ``forward`` is left as it was), as TE returns them. A replay's outputs are the graph's
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
    count = len(modules) if isinstance(modules, tuple) else 1
    enabled = _per_callable_enabled(enabled, count)
    for name, value in (("calibrating", calibrating), ("allow_unused_input", allow_unused_input),
                        ("retain_graph_in_backward", retain_graph_in_backward),
                        ("cache_quantized_params", cache),
                        ("clone_param_grads_on_return", clone_param_grads_on_return),
                        ("_reuse_graph_input_output_buffers", _reuse_graph_input_output_buffers)):
        if not isinstance(value, bool):
            raise TypeError(f"{API}: {name} must be a bool, got {value!r}")
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(f"{API}: recipe must be a transformer_engine.common.recipe.Recipe or "
                        f"None, got {type(recipe).__name__}")
    if isinstance(num_warmup_iters, bool) or not isinstance(num_warmup_iters, int) \
            or num_warmup_iters < 0:
        raise ValueError(f"{API}: num_warmup_iters must be an int >= 0, got {num_warmup_iters!r}")
    if (any(enabled) or calibrating) and num_warmup_iters < 1:
        raise ValueError(f"{API}: num_warmup_iters must be >= 1 with FP8 or calibration (the "
                         "FP8 state is created by the first eager forward), got 0")
    if cache and not any(enabled):
        raise ValueError(f"{API}: cache_quantized_params=True caches FP8 weights, so it needs "
                         "enabled=True")
    if _reuse_graph_input_output_buffers and _order is None:
        raise ValueError(f"{API}: _reuse_graph_input_output_buffers=True shares buffers along "
                         "a pipeline schedule, so it needs _order")
    for name, hook in (("pre_warmup_hook", pre_warmup_hook),
                       ("post_warmup_hook", post_warmup_hook)):
        if hook is not None and not callable(hook):
            raise TypeError(f"{API}: {name} must be callable or None, got {hook!r}")
    schedule = build_schedule(_order, _num_layers_per_chunk, count)
    single, callables, args, kwargs = normalize(modules, sample_args, sample_kwargs, schedule)
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
    backend = _capture_backend(pool)
    layers = schedule.layer_of
    backend.check([callables[layer] for layer in layers], args, kwargs)
    if any(enabled) or calibrating:
        check_group(group)
    settings = [FP8Setting(e, calibrating, recipe, group, cache) for e in enabled]
    owner = (shared_inputs(schedule, [signature(a, k) for a, k in zip(args, kwargs)])
             if _reuse_graph_input_output_buffers else range(len(args)))
    graphed = []
    for g, (layer, o) in enumerate(zip(layers, owner)):
        label = (f"graph {g} (callable {layer}, micro-batch {schedule.microbatch_of[g]})"
                 if schedule.ordered else f"callable {layer}")
        graphed.append(GraphedCallable(callables[layer], args[o], kwargs[o], settings[layer],
                                       backend.graphs(), layer, hooks,
                                       clone_param_grads_on_return, g, label))
    if _reuse_graph_input_output_buffers:
        _share_leases(graphed, owner)
    warm_up_and_capture(graphed, schedule, backend, num_warmup_iters, allow_unused_input,
                        retain_graph_in_backward, _reuse_graph_input_output_buffers,
                        pre_warmup_hook, post_warmup_hook)
    if schedule.ordered:            # one callable per layer and micro-batch, as TE's
        return graphed[0] if single else tuple(graphed)
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
