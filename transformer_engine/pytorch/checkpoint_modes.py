"""The two checkpoint implementations behind ``te.checkpoint`` (distributed.py), one
per mode, and the `CheckpointCall` both carry from phase 1 into the recompute.

Reentrant: an autograd Function runs phase 1 in its forward and the recompute plus an
inner backward in its backward. Non-reentrant: saved-tensor hooks keep no activation
in phase 1 and recompute the whole function at the first unpack. Where a thread
stands and what a call keeps for its recompute live in recompute.py (NOTE [Recompute
stashes], NOTE [Module modes]).

NOTE [Reentrant phase 1]
    A forward counts as training (records amaxes, updates scales) when grad is
    enabled where it runs, and the function may turn grad off for part of itself
    (``torch.no_grad()`` around a probe). Phase 1 must see that as the un-checkpointed
    forward does, so it does not run under ``no_grad`` (torch's reentrant checkpoint
    does): it runs under the call site's grad mode, on arguments cut from the caller's
    graph (new leaves on the same storage, as the recompute's), and its outputs are
    detached, so the graph it builds is dropped when it returns. Its saved tensors
    live until then: the peak of phase 1 is that of the recompute, not more. A call
    made with grad disabled runs phase 1 under ``no_grad`` and counts as no training.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, List, Optional, Tuple

import torch

from . import recompute
from .amax_update import collect_backward_updates
from .fp8 import FP8GlobalStateManager
from .recompute import RecomputeFrame, RecomputeStateError
from .rng import RngSnapshot
from .tensor_parallel import (chunk_numel, gather_split_1d_tensor,
                              split_tensor_into_1d_equal_chunks)
from .utils import flatten_nested, rebuild_nested

__all__ = ["reentrant_checkpoint", "non_reentrant_checkpoint"]


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
        self.training = recompute.is_training_forward()   # a client's no_grad first forward too
        self.rng = RngSnapshot(tracker)
        self.frame.rng_graph_safe = self.rng.graph_safe
        self.fp8_state = FP8GlobalStateManager.get_fp8_autocast_state()
        self.autocast = _autocast_snapshot()
        self.user_forward_ctx, self.user_recompute_ctx = _user_contexts(context_fn)

    @contextlib.contextmanager
    def phase1(self, reentrant: bool):
        # A reentrant phase 1 runs under the call site's grad mode (NOTE [Reentrant
        # phase 1]), so the grad mode alone says what a forward inside it is.
        with recompute.enter(self.frame, recomputing=False,
                             training_under_no_grad=False if reentrant else None):
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


def _cut_from_graph(a):
    """A tensor argument as phase 1 and the recompute see it: a new leaf on the same
    storage, requiring grad as the argument does."""
    return a.detach().requires_grad_(a.requires_grad) if torch.is_tensor(a) else a


class _ReentrantCheckpointFunction(torch.autograd.Function):
    """Phase 1 in forward, a training forward whose graph is dropped (NOTE [Reentrant
    phase 1]); recompute + inner backward in backward.
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
        if call.training:
            # Phase 1 is a training forward whose graph is dropped (NOTE [Reentrant
            # phase 1]): on inputs cut from the caller's graph, as the recompute's are.
            args, kwargs = _unflatten(tuple(_cut_from_graph(a) for a in flat), keys)
        with call.phase1(reentrant=True), torch.set_grad_enabled(call.training):
            outputs = call.function(*args, **kwargs)
        leaves, spec = flatten_nested(outputs)
        leaves = [t.detach() if torch.is_tensor(t) else t for t in leaves]
        del outputs                 # (the phase-1 graph goes with the last reference)
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
        # (read now: the inner backward below runs a graph task of its own)
        keep_graph = torch._C._autograd._get_current_graph_task_keep_graph()
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
        if not keep_graph:
            # No second backward can come: let go of the checkpoint frame at the end of
            # this pass (after the backward updates, whose sessions it keeps alive), not
            # when this node dies. Something may keep the node alive: torch 2.11's
            # AOTAutograd traces a graph compiled during the recompute in anomaly mode,
            # whose nodes name this one as their parent and stay alive in a reference
            # cycle the garbage collector cannot see.
            torch.autograd.Variable._execution_engine.queue_callback(
                functools.partial(_drop_frame, call))
        return (None, None, None, None, None, *grads_out)


def _drop_frame(call: _CheckpointCall) -> None:
    call.frame = None


def reentrant_checkpoint(function, tracker, context_fn, distribute, args, kwargs):
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
    """One non-reentrant checkpoint call: saved-tensor hooks that keep no activation
    once phase 1 returns (each saved tensor is packed as its position) and, at the
    first unpack of a backward pass, recompute the whole function and hand the
    recomputed tensors out by position, each exactly once (so a retained graph's next
    pass recomputes again). A backward inside the function (NOTE [Backward inside a
    checkpointed function] in recompute.py) reads what it saved: in phase 1 the saved
    tensors are held until the function returns (the peak of phase 1 is that of the
    recompute, as in reentrant mode), in the recompute the recomputed ones.

    The hooks are bound methods of this object, so the phase-1 graph owns it; it holds
    no tensor of that graph (arguments sit on a `_SavedInputs` node, recomputed
    tensors are detached), so no reference cycle keeps a dropped graph alive.
    """

    __slots__ = ("call", "keys", "non_tensors", "tensor_positions", "inputs_holder",
                 "saved_count", "metadata", "recomputed", "held", "__weakref__")

    def __init__(self, call: _CheckpointCall, keys: tuple, flat: tuple, check_metadata: bool):
        self.call, self.keys = call, keys
        # determinism_check="default": shape, dtype and device of each saved tensor
        self.metadata: Optional[list] = [] if check_metadata else None
        self.tensor_positions = [i for i, a in enumerate(flat) if torch.is_tensor(a)]
        self.non_tensors = [None if torch.is_tensor(a) else a for a in flat]
        # Keep the node's (empty) output, not only the node: some torch releases (2.11)
        # free a custom Function's saved tensors once all its outputs are gone.
        self.inputs_holder = _SavedInputs.apply(torch.empty(0, requires_grad=True),
                                                *(flat[i] for i in self.tensor_positions))
        self.saved_count = 0
        self.recomputed: dict = {}
        # what phase 1 saved, while it runs (None outside it)
        self.held: Optional[dict] = None

    def pack_phase1(self, tensor: torch.Tensor) -> int:
        position = self.saved_count
        self.saved_count = position + 1
        if self.metadata is not None:
            self.metadata.append((tensor.shape, tensor.dtype, tensor.device))
        if self.held is not None:
            self.held[position] = tensor.detach()
        return position

    def unpack(self, position: int) -> torch.Tensor:
        if self.held is not None:       # a backward inside the function, in phase 1
            return self.held[position]
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

        def pack(tensor: torch.Tensor) -> int:
            position = len(recomputed)
            recomputed[position] = tensor.detach()
            return position

        def unpack(position: int) -> torch.Tensor:
            # a backward inside the function, run again by the recompute
            return recomputed[position]

        with (self.call.recompute(), torch.enable_grad(),
              torch.autograd.graph.saved_tensors_hooks(pack, unpack)):
            self.call.function(*args, **kwargs)
        if len(recomputed) != self.saved_count:
            raise RecomputeStateError(
                f"te.checkpoint: the recompute saved {len(recomputed)} tensor(s) for "
                f"backward where the first forward saved {self.saved_count}; the "
                "checkpointed function must run the same operations in both phases")
        if self.metadata is not None:
            for i, expected in enumerate(self.metadata):
                t = recomputed[i]
                if (t.shape, t.dtype, t.device) != expected:
                    raise RecomputeStateError(
                        f"te.checkpoint: saved tensor #{i} of the recompute is "
                        f"{tuple(t.shape)} {t.dtype} on {t.device} where the first forward "
                        f"saved {tuple(expected[0])} {expected[1]} on {expected[2]}; the "
                        "checkpointed function must run the same operations in both phases "
                        "(determinism_check='none' skips this check)")
        self.recomputed = recomputed


def non_reentrant_checkpoint(function, tracker, context_fn, check_metadata, args, kwargs):
    """Phase 1 under saved-tensor hooks that keep nothing; the recompute at the first
    unpack in backward (`_NonReentrantCheckpoint`). Works with ``torch.autograd.grad``
    and ``retain_graph``; runs the whole function (no early stop)."""
    call = _CheckpointCall(function, tracker, context_fn)
    if not torch.is_grad_enabled():
        with call.phase1(reentrant=False):
            return function(*args, **kwargs)
    keys, flat = _flatten(args, kwargs)
    state = _NonReentrantCheckpoint(call, keys, flat, check_metadata)
    state.held = {}
    try:
        with call.phase1(reentrant=False), torch.autograd.graph.saved_tensors_hooks(
                state.pack_phase1, state.unpack):
            outputs = function(*args, **kwargs)
    finally:
        state.held = None
    leaves, _ = flatten_nested(outputs)
    if not any(torch.is_tensor(t) and t.requires_grad for t in leaves):
        raise _no_grad_output_error()
    return outputs
