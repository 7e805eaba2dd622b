"""TE modules inside ``torch.compile``: what the traced path does differently from eager
mode to keep eager's FP8 state semantics with nothing but graph ops at runtime.

NOTE [torch.compile]
    While dynamo traces (`compiling()`), a TE module's forward and ``te.autocast`` are
    traced into the graph with eager's arithmetic. What eager does in Python per call
    becomes graph ops or is decided once, at trace time:

    - Casts, amaxes and the FP8 GEMMs are plain torch ops (quantize.py's reference
      ops; ``torch._scaled_mm`` on CUDA), which Inductor may fuse into their producers,
      giving eager's FP8 bits. A forward reads its scale through an opaque copy
      (`forward_state`, NOTE [Custom ops] in custom_ops.py), so that a backward that
      recomputes the cheap casts instead of saving them casts with the forward's
      scale, not the updated one.
    - The delayed-scaling state is the modules' own tensors (``fp8_meta["scaling_fwd"]``
      / ``["scaling_bwd"]``), which the graph reads and mutates in place: the amax
      recording, and the updates below.
    - Forward update. An autocast entered and exited inside the compiled function
      has a session made in the trace (``AutocastSession(traced=True)``): its modules
      join it as they are traced, and its exit puts their forward update into the
      graph, as eager does at that exit. A module traced under an autocast entered
      outside joins that (eager) session at runtime: the graph hands the module's
      ``fp8_meta`` to the session (a `CompiledRegistration` linked in front of the
      session's previous ones, which dynamo replays after the graph), and the eager
      exit updates it with the others, in the same concatenated update.
    - Backward update. Eager asks for it from each module's backward and runs it once
      at the end of the backward pass; a graph cannot run Python there. Compiled, each
      module's backward state is updated in the backward graph, right after the
      backward of the module's first GEMM, which runs after its other GEMMs and after
      the later calls of the module in the same traced session (`backward_update`).
      The values equal eager's, whose end-of-pass update reads only that module's
      amaxes and scale, except where noted below.
    - Recompute (``te.checkpoint`` around a compiled function, NOTE [Recompute
      stashes]): the first forward's graph copies each module's forward state before
      using it and links the copy to the checkpoint call's frame (`stash_in_frame`);
      when the recompute starts, the frame puts the stashed states on each module's
      ``fp8_meta`` in call order, and the recompute's graph reads them from there
      (`recompute_state`), reading and writing them as the first forward's graph did
      the live ones, so that both graphs save the same tensors for backward (a
      non-reentrant checkpoint hands the recompute's saved tensors to the first
      forward's backward, by position).
    - What dynamo guards on must not change between steps: the traced path writes the
      module's flags and recipe without reading them, and what a graph cannot make (a
      module's delayed-scaling state, the keys of its FP8 weight cache, the counters)
      is made for real before it is read: by the modules when built, or at trace time
      by functions dynamo runs for real (`prepare_pending_modules`,
      `prepare_weight_caches`). Nothing identity-hashed is in the traced path, so a new
      recipe object with equal fields runs the same graph; a changed field compiles
      once more. A recipe with a callable (``amax_compute_algo``,
      ``scaling_factor_compute_algo``) cannot be compiled and says so.

    Where compiled training differs from eager (docs/torch-compile.md): the first traced
    delayed-scaling forward gives every TE module without delayed-scaling state a fresh
    one, also modules that never run in FP8; a module called more than once in one
    compiled function under an autocast entered outside it updates its backward state
    once per call; a module whose forward had no input requiring grad runs no backward
    and keeps its backward state (eager rolls it with its session); a module run by two
    compiled regions whose backwards run in one pass updates its backward state in each
    (eager: once per pass); a recompute runs in the train/eval mode of the moment.
    Non-finite amaxes seen by compiled code are counted in two counters per device
    (forward and backward graphs, shared by threads) and warned about at the next eager
    update.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, List, Optional, Tuple

import torch

from . import amax_update, custom_ops, recompute
from .scaling import ScalingState

__all__ = ["compiling", "check_compilable_recipe", "PENDING", "prepare_pending_modules",
           "MODULES", "prepare_weight_caches", "inside_higher_order_op", "forward_state",
           "join_traced_session",
           "exit_traced_autocast", "CompiledRegistration", "register_in_session",
           "backward_update", "stash_in_frame", "recompute_state", "CompiledStash"]


def compiling() -> bool:
    """Whether dynamo is tracing the code that calls this."""
    return torch.compiler.is_compiling()


def check_compilable_recipe(recipe) -> None:
    """Refuse, while tracing, a delayed-scaling recipe whose algorithm is a callable."""
    if recipe.delayed() and (callable(recipe.amax_compute_algo)
                             or recipe.scaling_factor_compute_algo is not None):
        raise NotImplementedError(
            "torch.compile: DelayedScaling with a callable amax_compute_algo or "
            "scaling_factor_compute_algo cannot be compiled (the callable would run "
            "inside the graph and reads values on the host); use amax_compute_algo='max' "
            "or 'most_recent' and scaling_factor_compute_algo=None, or run this autocast "
            "eagerly")


# ---- FP8 state made before it is traced ------------------------------------------------

# TE modules without delayed-scaling state (added when built, removed when it is made)
PENDING: "weakref.WeakSet" = weakref.WeakSet()
_PENDING_LOCK = threading.Lock()


def prepare_pending_modules(recipe) -> None:
    """While tracing a delayed-scaling forward: give every TE module that has no
    delayed-scaling state yet its fresh state (scale 1, empty history of the recipe's
    length), for real, now, as its first FP8 forward would: a graph cannot create state
    that its backward then updates, and state the graph created would make dynamo
    compile again at the next call (it guards on what it read). Runs at trace time only
    (NOTE [torch.compile])."""
    if recipe.delayed():
        _prepare_pending(recipe.amax_history_len)


class _HistoryLength:
    def __init__(self, amax_history_len: int):
        self.amax_history_len = amax_history_len


def _prepare_pending(amax_history_len: int) -> bool:
    with _PENDING_LOCK:
        modules = list(PENDING)
    for module in modules:
        if module.fp8_meta["scaling_fwd"] is None:
            module.init_fp8_meta_tensors(_HistoryLength(amax_history_len))
    return True


# executed at trace time with its constant argument, its result taken as a constant:
# what torch.compiler.assume_constant_result marks, without importing dynamo here
_prepare_pending._dynamo_marked_constant = True


# every TE module (added when built)
MODULES: "weakref.WeakSet" = weakref.WeakSet()


def prepare_weight_caches() -> None:
    """While tracing a forward with ``is_first_microbatch``: give every TE module (but
    those with FP8 primary weights, which need none) its FP8 weight cache dict with a
    key per GEMM (None: nothing cached), for real, now: dynamo guards on the dict's keys,
    so keys added by the graph would make it compile again at the next call."""
    _prepare_weight_caches()


def _prepare_weight_caches() -> bool:
    with _PENDING_LOCK:
        modules = list(MODULES)
    for module in modules:
        if not module.primary_weights_in_fp8:
            cache = module.fp8_meta.setdefault("fp8_weight_cache", {})
            for gemm in range(module.fp8_meta["num_gemms"]):
                cache.setdefault(gemm, None)        # (the keys dynamo guards on, from the start)
    return True


_prepare_weight_caches._dynamo_marked_constant = True


def inside_higher_order_op() -> bool:
    """While tracing: whether dynamo traces a higher-order op's body now (the body of
    ``torch.utils.checkpoint``, ``torch.cond``, ...), where no side effect is allowed.
    Asks dynamo's tracer (not a public interface: False where it cannot tell)."""
    return _inside_higher_order_op()


def _inside_higher_order_op() -> bool:
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        tx = InstructionTranslator.current_tx()
        return tx is not None and tx.output.current_tracer.parent is not None
    except Exception:       # another torch: fall back to dynamo's own error
        return False


_inside_higher_order_op._dynamo_marked_constant = True


def forward_state(live: ScalingState) -> ScalingState:
    """While tracing: the forward state a module's casts use: the scale through an
    opaque copy (NOTE [Custom ops] in custom_ops.py); amaxes go to the live history."""
    return ScalingState(custom_ops.scale_snapshot(live.scale), live.scale_inv,
                        live.amax_history)


# ---- sessions --------------------------------------------------------------------------

def join_traced_session(session, fp8_meta: dict, recipe, group, register: bool) -> bool:
    """While tracing, a module call under an autocast made in the trace: join its
    session (``register``: for its forward update too); returns whether this is the
    module's first call in the session (the one whose backward updates its backward
    state)."""
    scale = fp8_meta["scaling_bwd"].scale
    for entry in session.entries:
        if entry[0]["scaling_bwd"].scale is scale:
            if register and not entry[3]:
                entry[3] = True
            return False
    session.entries.append([fp8_meta, recipe, group, register])
    return True


def _traced_groups(entries) -> List[Tuple[Any, Any, List[dict]]]:
    """The entries to update forward, by (recipe fields, group), in first-call order."""
    groups: List[Tuple[Any, Any, List[dict]]] = []
    for meta, recipe, group, register in entries:
        if not register:
            continue
        for recipe_, group_, metas in groups:
            if group_ is group and recipe_ == recipe:
                metas.append(meta)
                break
        else:
            groups.append((recipe, group, [meta]))
    return groups


def exit_traced_autocast(session, recomputing: bool) -> None:
    """While tracing, the exit of an outermost autocast made in the trace: its forward
    update, in the graph (none in a recompute)."""
    if recomputing:
        return
    for recipe, group, metas in _traced_groups(session.entries):
        amax_update.update_states(metas, recipe, group, forward=True)


class CompiledRegistration:
    """A module call traced under an autocast entered outside the compiled function,
    for the forward update at that autocast's exit (linked in front of the session's
    previous registrations; dynamo rebuilds it after each run of the graph)."""

    def __init__(self, fp8_meta: dict, recipe, group, previous: Optional["CompiledRegistration"]):
        self.fp8_meta, self.recipe, self.group, self.previous = fp8_meta, recipe, group, previous


def register_in_session(session, fp8_meta: dict, recipe, group) -> None:
    """While tracing: hand ``fp8_meta`` to an eager session for its forward update."""
    session.compiled_head = CompiledRegistration(fp8_meta, recipe, group, session.compiled_head)


def backward_update(fp8_meta: dict, recipe, group) -> None:
    """While tracing a module's backward: update its backward state in the graph."""
    amax_update.update_states([fp8_meta], recipe, group, forward=False)


# ---- recompute stashes -----------------------------------------------------------------

class CompiledStash:
    """One module call's forward state as a compiled first forward used it, linked in
    front of the frame's previous ones (the frame folds them into its stashes when its
    recompute starts, NOTE [Recompute stashes])."""

    def __init__(self, fp8_meta: dict, state: ScalingState, previous: Optional["CompiledStash"]):
        self.fp8_meta, self.state, self.previous = fp8_meta, state, previous


def stash_in_frame(fp8_meta: dict, live: ScalingState) -> None:
    """While tracing the first forward of a checkpoint call: copy the module's forward
    state in the graph and link the copy to the call's frame."""
    frames = recompute.position().frames
    if len(frames) != 1:
        raise NotImplementedError(
            "torch.compile: a delayed-scaling FP8 module compiled inside nested "
            "te.checkpoint calls is not supported; checkpoint the compiled function with "
            "one te.checkpoint")
    frame = frames[0][0]
    copy = ScalingState(live.scale.clone(), live.scale_inv.clone(), live.amax_history.clone())
    frame.compiled_head = CompiledStash(fp8_meta, copy, frame.compiled_head)


def recompute_state(fp8_meta: dict) -> ScalingState:
    """While tracing a recompute: the forward state this module call's first forward
    used (put on ``fp8_meta`` by the checkpoint call, in call order)."""
    states = fp8_meta.get("recompute_states")
    cursor = fp8_meta.get("recompute_cursor", 0)
    if states is None or cursor >= len(states):
        raise recompute.RecomputeStateError(
            "te.checkpoint: the recompute ran a delayed-scaling FP8 forward (call "
            f"#{cursor + 1} of this module) for which the first forward stashed no FP8 "
            "state; the checkpointed function must run the same FP8 modules, under the "
            "same FP8 autocast, in both phases")
    fp8_meta["recompute_cursor"] = cursor + 1
    return states[cursor]
