"""Activation checkpointing that keeps FP8 delayed-scaling state right (``te.checkpoint``
/ ``te.distributed.checkpoint``), the public recompute queries, and the names TE users
import from ``transformer_engine.pytorch.distributed``.

The checkpoint wrapper here enters and leaves the two phases of a call; where a
thread stands (in a recompute region, in the recompute phase) and what a call keeps
for its recompute live in recompute.py (NOTE [Recompute stashes], NOTE [Module
modes]). Every call takes this path, whatever the function is: a module, a bound
method, a closure, a module whose TE modules are not registered submodules.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, List, Optional, Tuple

import torch

from . import recompute
from .amax_update import collect_backward_updates
from .fp8 import FP8GlobalStateManager
from .recompute import RecomputeFrame, RecomputeStateError
from .rng import CudaRNGStatesTracker, RngSnapshot
from .utils import flatten_nested, rebuild_nested
from .tensor_parallel import (chunk_numel, gather_split_1d_tensor, get_distributed_rank,
                              get_distributed_world_size, set_tensor_model_parallel_attributes,
                              split_tensor_into_1d_equal_chunks)

__all__ = [
    "checkpoint", "is_fp8_activation_recompute_enabled", "in_fp8_activation_recompute_phase",
    "CudaRNGStatesTracker", "recompute_stash_count",
    "split_tensor_into_1d_equal_chunks", "gather_split_1d_tensor",
    "get_distributed_world_size", "get_distributed_rank", "set_tensor_model_parallel_attributes",
]


def is_fp8_activation_recompute_enabled() -> bool:
    """True inside a checkpointed region (either phase) while FP8 is enabled *now*,
    on the calling thread: an FP8 autocast opened inside the checkpointed function
    counts."""
    return recompute.in_region() and FP8GlobalStateManager.is_fp8_enabled()


def in_fp8_activation_recompute_phase() -> bool:
    """True while a checkpointed function is being recomputed for backward (on the
    calling thread)."""
    return recompute.in_phase()


def recompute_stash_count() -> int:
    """Tensors held by live recompute stashes, across all checkpoint calls (for tests
    and leak checks; call ``gc.collect()`` first to drop unreachable graphs)."""
    return recompute.stash_tensor_count()


# ---- the checkpoint call -------------------------------------------------------------

def _autocast_snapshot() -> List[Tuple[str, bool, torch.dtype]]:
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    return [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in devices]


_NO_CONTEXTS = (contextlib.nullcontext(), contextlib.nullcontext())   # stateless


def _user_contexts(context_fn: Optional[Callable]):
    """The (phase-1, recompute) context managers ``context_fn`` returns."""
    if context_fn is None:
        return _NO_CONTEXTS
    pair = context_fn()
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2
            and all(hasattr(c, "__enter__") and hasattr(c, "__exit__") for c in pair)):
        raise TypeError("te.checkpoint: context_fn must return a pair of context managers "
                        "(one around the first forward, one around the recompute), got "
                        f"{type(pair).__name__}")
    return pair


class _CheckpointCall:
    """Everything one checkpoint call carries from phase 1 into its recompute: the
    function, its `RecomputeFrame`, the RNG, ``torch.autocast`` and FP8 autocast
    states of the call site, and whether the call counts as training."""

    def __init__(self, function: Callable, tracker, context_fn):
        self.function = function
        self.frame = RecomputeFrame()
        self.training = recompute.is_training_forward()   # inherited inside a reentrant phase 1
        self.rng = RngSnapshot(tracker)
        self.fp8_state = FP8GlobalStateManager.get_fp8_autocast_state()
        self.autocast = _autocast_snapshot()
        self.user_forward_ctx, self.user_recompute_ctx = _user_contexts(context_fn)

    @contextlib.contextmanager
    def phase1(self, reentrant: bool):
        with recompute.enter(self.frame, recomputing=False,
                             training_under_no_grad=self.training if reentrant else None):
            with self.user_forward_ctx:
                yield

    @contextlib.contextmanager
    def recompute(self):
        """The call site's FP8 autocast state, flags, RNG states (torch's and the
        tracker's), ``torch.autocast`` state and module modes around a recompute."""
        saved_fp8 = FP8GlobalStateManager.get_fp8_autocast_state()
        self.frame.start_recompute()
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.rng.replay())
            for device, enabled, dtype in self.autocast:
                if (torch.is_autocast_enabled(device) != enabled
                        or torch.get_autocast_dtype(device) != dtype):
                    stack.enter_context(torch.autocast(device_type=device, enabled=enabled,
                                                       dtype=dtype))
            stack.enter_context(recompute.enter(self.frame, recomputing=True,
                                                training_under_no_grad=False))
            FP8GlobalStateManager.set_fp8_autocast_state(self.fp8_state)
            try:
                self.frame.replay_modes()
                with self.user_recompute_ctx:
                    yield
            finally:
                FP8GlobalStateManager.set_fp8_autocast_state(saved_fp8)
                self.frame.end_recompute()


def _flatten(args: tuple, kwargs: dict):
    keys = tuple(kwargs)
    return keys, tuple(args) + tuple(kwargs[k] for k in keys)


def _unflatten(flat: tuple, keys: tuple):
    n = len(flat) - len(keys)
    return flat[:n], dict(zip(keys, flat[n:]))


def _no_grad_output_error() -> RuntimeError:
    return RuntimeError(
        "te.checkpoint: no output of the checkpointed function requires grad, so there is "
        "nothing to backpropagate through it; call the function directly instead of "
        "checkpointing it.")


class _ReentrantCheckpointFunction(torch.autograd.Function):
    """Phase 1 under no_grad in forward; recompute + inner backward in backward.
    Outputs in nested tuples, lists and dicts are returned flat and rebuilt by the
    caller, so every output tensor stays connected to the graph."""

    @staticmethod
    def forward(ctx, call: _CheckpointCall, keys: tuple, distribute: Optional[Any],
                out_spec: list, _grad_anchor: torch.Tensor, *flat):
        ctx.call, ctx.keys = call, keys
        args, kwargs = _unflatten(flat, keys)
        first = next((a for a in flat if torch.is_tensor(a)), None)
        if distribute is not None and first is not None:
            chunk_numel(first, distribute)     # fail before phase 1 touches any FP8 state
        with call.phase1(reentrant=True):
            outputs = call.function(*args, **kwargs)
        leaves, spec = flatten_nested(outputs)
        out_spec.append(spec)
        ctx.tensor_positions = [i for i, a in enumerate(flat) if torch.is_tensor(a)]
        ctx.inputs_require_grad = [flat[i].requires_grad for i in ctx.tensor_positions]
        ctx.non_tensors = [None if torch.is_tensor(a) else a for a in flat]
        tensors = [flat[i] for i in ctx.tensor_positions]
        ctx.distributed_shape = None
        if distribute is not None and tensors:
            ctx.distributed_shape = tensors[0].shape
            tensors[0] = split_tensor_into_1d_equal_chunks(tensors[0], distribute, new_buffer=True)
        ctx.distribute = distribute
        ctx.save_for_backward(*tensors)
        return tuple(leaves)

    @staticmethod
    def backward(ctx, *grads):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError(
                "te.checkpoint(use_reentrant=True) does not work with torch.autograd.grad(): "
                "its recompute runs a nested .backward(). Use loss.backward(), or "
                "te.checkpoint(..., use_reentrant=False).")
        call: _CheckpointCall = ctx.call
        tensors = list(ctx.saved_tensors)
        if ctx.distributed_shape is not None:
            tensors[0] = gather_split_1d_tensor(tensors[0], ctx.distribute).view(
                ctx.distributed_shape)
        flat = list(ctx.non_tensors)
        inputs = []
        for pos, tensor, req in zip(ctx.tensor_positions, tensors, ctx.inputs_require_grad):
            t = tensor.detach().requires_grad_(req)
            flat[pos] = t
            inputs.append(t)
        args, kwargs = _unflatten(tuple(flat), ctx.keys)
        with call.recompute(), torch.enable_grad():
            outputs, _ = flatten_nested(call.function(*args, **kwargs))
        pairs = [(o, g) for o, g in zip(outputs, grads)
                 if torch.is_tensor(o) and o.requires_grad and g is not None]
        if not pairs:
            raise _no_grad_output_error()
        # the inner pass's backward updates belong to the enclosing pass
        with collect_backward_updates():
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        input_grads = [t.grad if req else None for t, req in zip(inputs, ctx.inputs_require_grad)]
        grads_out = [None] * len(flat)
        for pos, g in zip(ctx.tensor_positions, input_grads):
            grads_out[pos] = g
        return (None, None, None, None, None, *grads_out)


def _reentrant_checkpoint(function, tracker, context_fn, distribute, args, kwargs):
    call = _CheckpointCall(function, tracker, context_fn)
    keys, flat = _flatten(args, kwargs)
    anchor = torch.empty(0, requires_grad=True) if torch.is_grad_enabled() else torch.empty(0)
    out_spec: list = []
    leaves = _ReentrantCheckpointFunction.apply(call, keys, distribute, out_spec, anchor, *flat)
    return rebuild_nested(list(leaves), out_spec[0])


class _SavedInputs(torch.autograd.Function):
    """Holds a non-reentrant call's tensor arguments for its recompute on a graph node
    of their own. Saving them (rather than keeping references) lets an enclosing
    checkpoint's hooks drop and recompute them like any other activation, and lets
    autograd's version check catch an argument modified in place before backward.
    The node's output is never used in the graph, so the node never runs."""

    @staticmethod
    def forward(ctx, _anchor: torch.Tensor, *tensors: torch.Tensor):
        ctx.save_for_backward(*tensors)
        return _anchor.new_empty(0)

    @staticmethod
    def backward(ctx, _grad):
        raise RuntimeError("te.checkpoint: internal node _SavedInputs must never run backward")


class _NonReentrantCheckpoint:
    """One non-reentrant checkpoint call: saved-tensor hooks that keep no activation in
    phase 1 (each saved tensor is packed as its position) and, at the first unpack of
    a backward pass, recompute the whole function and hand the recomputed tensors out
    by position, each exactly once (so a retained graph's next pass recomputes again).

    The hooks are bound methods of this object, so the phase-1 graph owns it; it holds
    no tensor of that graph (arguments sit on a `_SavedInputs` node, recomputed
    tensors are detached), so no reference cycle keeps a dropped graph alive.
    """

    __slots__ = ("call", "keys", "non_tensors", "tensor_positions", "inputs_holder",
                 "saved_count", "recomputed", "__weakref__")

    def __init__(self, call: _CheckpointCall, keys: tuple, flat: tuple):
        self.call, self.keys = call, keys
        self.tensor_positions = [i for i, a in enumerate(flat) if torch.is_tensor(a)]
        self.non_tensors = [None if torch.is_tensor(a) else a for a in flat]
        # Keep the node's (empty) output, not only the node: some torch releases (2.11)
        # free a custom Function's saved tensors once all its outputs are gone.
        self.inputs_holder = _SavedInputs.apply(torch.empty(0, requires_grad=True),
                                                *(flat[i] for i in self.tensor_positions))
        self.saved_count = 0
        self.recomputed: dict = {}

    def pack_phase1(self, _tensor: torch.Tensor) -> int:
        position = self.saved_count
        self.saved_count = position + 1
        return position

    def unpack(self, position: int) -> torch.Tensor:
        tensor = self.recomputed.pop(position, None)
        if tensor is None:
            self._recompute()
            tensor = self.recomputed.pop(position)
        return tensor

    def _recompute(self) -> None:
        flat = list(self.non_tensors)
        saved_inputs = self.inputs_holder.grad_fn.saved_tensors
        for position, tensor in zip(self.tensor_positions, saved_inputs):
            flat[position] = tensor
        args, kwargs = _unflatten(tuple(flat), self.keys)
        recomputed: dict = {}

        def pack(tensor: torch.Tensor) -> None:
            recomputed[len(recomputed)] = tensor.detach()

        with (self.call.recompute(), torch.enable_grad(),
              torch.autograd.graph.saved_tensors_hooks(pack, _unpack_in_recompute)):
            self.call.function(*args, **kwargs)
        if len(recomputed) != self.saved_count:
            raise RecomputeStateError(
                f"te.checkpoint: the recompute saved {len(recomputed)} tensor(s) for "
                f"backward where the first forward saved {self.saved_count}; the "
                "checkpointed function must run the same operations in both phases")
        self.recomputed = recomputed


def _unpack_in_recompute(_packed) -> torch.Tensor:
    raise RuntimeError("te.checkpoint: a saved tensor of the recompute's own graph was "
                       "used; the recompute graph exists only to produce saved tensors")


def _non_reentrant_checkpoint(function, tracker, context_fn, args, kwargs):
    """Phase 1 under saved-tensor hooks that keep nothing; the recompute at the first
    unpack in backward (`_NonReentrantCheckpoint`). Works with ``torch.autograd.grad``
    and ``retain_graph``; runs the whole function (no early stop)."""
    call = _CheckpointCall(function, tracker, context_fn)
    if not torch.is_grad_enabled():
        with call.phase1(reentrant=False):
            return function(*args, **kwargs)
    keys, flat = _flatten(args, kwargs)
    state = _NonReentrantCheckpoint(call, keys, flat)
    with call.phase1(reentrant=False), torch.autograd.graph.saved_tensors_hooks(
            state.pack_phase1, state.unpack):
        outputs = function(*args, **kwargs)
    leaves, _ = flatten_nested(outputs)
    if not any(torch.is_tensor(t) and t.requires_grad for t in leaves):
        raise _no_grad_output_error()
    return outputs


def _check_checkpoint_args(function, use_reentrant, distribute_saved_activations,
                           get_rng_state_tracker, tp_group, context_fn):
    if not callable(function):
        raise TypeError(f"te.checkpoint: function must be callable, got {type(function).__name__}")
    if not isinstance(use_reentrant, bool):
        raise TypeError(f"te.checkpoint: use_reentrant must be a bool, got {use_reentrant!r}")
    if not isinstance(distribute_saved_activations, bool):
        raise TypeError("te.checkpoint: distribute_saved_activations must be a bool, got "
                        f"{distribute_saved_activations!r}")
    if get_rng_state_tracker is not None and not callable(get_rng_state_tracker):
        raise TypeError("te.checkpoint: get_rng_state_tracker must be a callable returning a "
                        f"CudaRNGStatesTracker, got {type(get_rng_state_tracker).__name__}")
    if context_fn is not None and not callable(context_fn):
        raise TypeError("te.checkpoint: context_fn must be a callable returning two context "
                        f"managers, got {type(context_fn).__name__}")
    dist = torch.distributed
    if tp_group is not None and not (dist.is_available()
                                     and isinstance(tp_group, dist.ProcessGroup)):
        raise TypeError("te.checkpoint: tp_group must be a torch.distributed.ProcessGroup, "
                        f"got {type(tp_group).__name__}")
    if distribute_saved_activations:
        if not use_reentrant:
            raise ValueError("te.checkpoint: distribute_saved_activations=True needs "
                             "use_reentrant=True")
        if not dist.is_initialized():
            raise RuntimeError("te.checkpoint: distribute_saved_activations=True needs an "
                               "initialized torch.distributed process group (tp_group); "
                               "call torch.distributed.init_process_group() first")
    elif tp_group is not None:
        warnings.warn("te.checkpoint: tp_group is used only with "
                      "distribute_saved_activations=True; it is ignored here", stacklevel=3)


def checkpoint(function: Callable, *args, use_reentrant: bool = True,
               distribute_saved_activations: bool = False,
               get_rng_state_tracker: Optional[Callable[[], CudaRNGStatesTracker]] = None,
               tp_group=None, context_fn: Optional[Callable] = None, **kwargs):
    """Activation checkpointing that keeps FP8 delayed-scaling state right.

    Runs ``function(*args, **kwargs)`` without keeping its activations and re-runs it
    during backward. The recompute replays torch's CPU and CUDA RNG states, the
    tracker's states, the ``torch.autocast`` state and the FP8 autocast state of the
    call site, and each module's train/eval mode of the first forward (NOTE [Module
    modes]); FP8 modules recompute with the scales their first forward used (NOTE
    [Recompute stashes]); an FP8 autocast opened inside ``function`` counts.
    With and without checkpointing a training run gives bit-identical results,
    provided ``function`` does not itself branch on recompute state (the recompute
    phase query, live scales).

    Parameters
    ----------
    function : callable
        What to checkpoint: any callable (module, method, closure).
    *args, **kwargs
        Passed to ``function``; non-tensor arguments pass through untouched.
    use_reentrant : bool, default True
        True: an autograd Function that re-runs ``function`` in its backward (not
        usable with ``torch.autograd.grad``; ``retain_graph`` works). False: saved-
        tensor hooks that recompute the whole function at the first unpack.
    distribute_saved_activations : bool, default False
        Reentrant only: keep 1/tp of the first tensor argument per rank of
        ``tp_group`` (needs an initialized process group), gathered for the recompute.
    get_rng_state_tracker : callable, optional
        Returns the `CudaRNGStatesTracker` whose states are replayed.
    tp_group : torch.distributed.ProcessGroup, optional
        Group for ``distribute_saved_activations`` (the default group when None).
    context_fn : callable, optional
        Returns a pair of context managers, entered around phase 1 and around each
        recompute.

    Returns
    -------
    What ``function`` returns (tensors in nested tuples, lists and dicts included).
    """
    _check_checkpoint_args(function, use_reentrant, distribute_saved_activations,
                           get_rng_state_tracker, tp_group, context_fn)
    tracker = get_rng_state_tracker() if get_rng_state_tracker is not None else None
    if use_reentrant:
        distribute = None
        if distribute_saved_activations:
            distribute = tp_group if tp_group is not None else torch.distributed.group.WORLD
        return _reentrant_checkpoint(function, tracker, context_fn, distribute, args, kwargs)
    return _non_reentrant_checkpoint(function, tracker, context_fn, args, kwargs)
