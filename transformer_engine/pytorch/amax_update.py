"""The delayed-scaling update: which modules' states update when, on concatenated
buffers, with non-finite amaxes kept out of the history.

NOTE [Delayed-scaling update order]
    A module's forward inside an enabled autocast casts with the *current* scale of
    its ``fp8_meta["scaling_fwd"]`` and, in a training forward (grad enabled at the
    call site), records each tensor's amax into the live row (row 0) of its amax
    history and registers itself with the running `AutocastSession` (one per outermost
    autocast, per thread). When that outermost autocast exits, every registered
    module's forward state is updated at once, per (recipe, group): one concatenated
    buffer, one optional MAX all-reduce, new scales from the history, history rolled.
    A tensor whose live amax is 0 at the update (none recorded: the cached FP8 weight
    of an ``is_first_microbatch=False`` forward, NOTE [FP8 weight cache]) keeps its
    history and its scale, as TE's update kernel does (`delayed_scaling.idle_columns`).
    Each FP8 module call carries its session into its autograd context; its backward
    asks for the session's backward update (`request_backward_update`), which runs
    once per backward pass, when the pass ends (an autograd final callback), for
    every session whose modules ran a backward in it, whichever module that was
    (a frozen first layer does not stop it). Sessions updated in one pass are merged,
    so a module shared by micro-batches of one pass updates once. The reentrant
    checkpoint runs its recompute's backward as a nested pass; the requests made there
    are collected and handed to the enclosing pass (`collect_backward_updates`), so
    the update runs at the end of the same pass as without checkpointing.
    The activation recompute records nothing and updates nothing (NOTE [Recompute
    stashes] in recompute.py), nor does a backward it runs inside the checkpointed
    function (NOTE [Backward inside a checkpointed function]).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..common.recipe import DelayedScaling, Recipe
from . import delayed_scaling
from .non_finite import NON_FINITE, compiled_counter
from .scaling import copy_before_write

__all__ = ["AutocastSession", "update_sessions", "request_backward_update", "observe_registrations",
           "collect_backward_updates", "update_states"]


class _Observer(threading.local):
    on_register: Optional[Callable[[dict], None]] = None


_OBSERVER = _Observer()


@contextlib.contextmanager
def observe_registrations(callback: Callable[[dict], None]):
    """Call ``callback(fp8_meta)`` whenever a module registers with a session on this
    thread inside the block (before the module's first cast: CUDA graph warm-up uses
    it to put back the FP8 state its iterations changed)."""
    saved = _OBSERVER.on_register
    _OBSERVER.on_register = callback
    try:
        yield
    finally:
        _OBSERVER.on_register = saved


class _UpdateGroup:
    """Modules of one session that share a recipe and an amax-reduction group."""

    __slots__ = ("recipe", "group", "metas")

    def __init__(self, recipe: DelayedScaling, group):
        self.recipe = recipe
        self.group = group
        self.metas: Dict[int, dict] = {}


class AutocastSession:
    """What one outermost autocast collected: the modules to update, by (recipe,
    amax-reduction group). While dynamo traces, a session made in the trace
    (``traced``) collects its module calls in ``entries`` for the graph's update at
    the autocast's exit; an eager session also takes the calls of compiled functions
    (``compiled_head``), for its forward update only (NOTE [torch.compile] in
    torch_compile.py)."""

    __slots__ = ("groups", "last", "requested_in", "traced", "entries", "compiled_head",
                 "__weakref__")

    def __init__(self, traced: bool = False):
        self.traced = traced
        self.entries: List[list] = []
        self.compiled_head = None
        self.groups: Dict[Tuple[Recipe, Any], _UpdateGroup] = {}
        # the group the last registration went to (the recipe object and the group
        # are almost always the same ones for a whole autocast)
        self.last: Optional[_UpdateGroup] = None
        # the backward pass that last asked for this session's update (every FP8
        # module's backward asks; only the first ask of a pass needs the lock)
        self.requested_in: Optional[int] = None

    def register(self, fp8_meta: dict, recipe: DelayedScaling, group) -> None:
        observer = _OBSERVER.on_register
        if observer is not None:
            observer(fp8_meta)
        last = self.last
        if last is not None and last.recipe is recipe and last.group is group:
            found = last        # the common case: no hash of the recipe's fields per call
        else:
            key = (recipe, group)
            found = self.groups.get(key)
            if found is None:
                found = self.groups[key] = _UpdateGroup(recipe, group)
            self.last = found
        found.metas.setdefault(id(fp8_meta), fp8_meta)

    def forward_groups(self) -> List[_UpdateGroup]:
        """The groups to update forward: the registered modules and those of compiled
        calls (each module once)."""
        head = self.compiled_head
        if head is None:
            return list(self.groups.values())
        registrations = []
        while head is not None:
            registrations.append(head)
            head = head.previous
        merged = {key: _UpdateGroup(g.recipe, g.group) for key, g in self.groups.items()}
        for key, g in self.groups.items():
            merged[key].metas.update(g.metas)
        for r in reversed(registrations):
            key = (r.recipe, r.group)
            target = merged.get(key)
            if target is None:
                target = merged[key] = _UpdateGroup(r.recipe, r.group)
            target.metas.setdefault(id(r.fp8_meta), r.fp8_meta)
        return list(merged.values())

    def discard_forward_amaxes(self) -> None:
        """Forget the live forward amaxes of an autocast that raised."""
        for g in self.forward_groups():
            states = [meta["scaling_fwd"] for meta in g.metas.values()]
            copy_before_write(states)
            for state in states:
                state.amax_history[0].zero_()


def update_sessions(sessions: Sequence[AutocastSession], forward: bool) -> None:
    """Update the forward (or backward) states of the sessions' modules: one update
    per (recipe, group), each module once even when several sessions hold it."""
    if len(sessions) == 1:         # nothing to merge (no hash of the recipes' fields)
        session = sessions[0]
        groups = session.forward_groups() if forward else session.groups.values()
        for g in groups:
            update_states(list(g.metas.values()), g.recipe, g.group, forward)
        NON_FINITE.warn_once_if_seen()
        return
    merged: Dict[Tuple[Recipe, Any], _UpdateGroup] = {}
    for session in sessions:
        groups = session.forward_groups() if forward else session.groups.values()
        for g in groups:
            key = (g.recipe, g.group)
            target = merged.get(key)
            if target is None:
                merged[key] = target = _UpdateGroup(g.recipe, g.group)
            target.metas.update(g.metas)
    for g in merged.values():
        update_states(list(g.metas.values()), g.recipe, g.group, forward)
    NON_FINITE.warn_once_if_seen()


def _group_size(group) -> int:
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def update_states(metas: List[dict], recipe: DelayedScaling, group, forward: bool) -> None:
    """One delayed-scaling update of many modules' states, on concatenated buffers."""
    key = "scaling_fwd" if forward else "scaling_bwd"
    states = [m[key] for m in metas if m.get(key) is not None]
    if not states:
        return
    traced = torch.compiler.is_compiling()
    if not traced:
        # recompute stashes keep the values they saw (a compiled first forward stashes
        # copies instead, NOTE [torch.compile] in torch_compile.py)
        copy_before_write(states)
    if recipe.reduce_amax and _group_size(group) > 1:
        # one MAX all-reduce of every live row, copied back before the update
        lives = [s.amax_history[0] for s in states]
        live = torch.cat(lives)
        torch.distributed.all_reduce(live, op=torch.distributed.ReduceOp.MAX, group=group)
        delayed_scaling.copy_all(lives, live.split([t.numel() for t in lives]))
    spec = recipe.fp8_format.value
    max_value = spec.max_fwd if forward else spec.max_bwd
    device = states[0].scale.device
    counter = compiled_counter(device, not forward) if traced else NON_FINITE.counter(device)
    histories = [s.amax_history for s in states]
    scales = [s.scale for s in states]
    scale_invs = [s.scale_inv for s in states]
    if recipe.scaling_factor_compute_algo is None:
        # one launch on CUDA (NOTE [Fused casts] in quantize.py)
        delayed_scaling.delayed_scaling_update_(histories, scales, scale_invs, max_value,
                                                recipe.margin, recipe.amax_compute_algo,
                                                non_finite=counter)
    else:
        _custom_update(histories, scales, scale_invs, max_value, recipe, counter)


def _custom_update(histories, scales, scale_invs, max_value: float, recipe: DelayedScaling,
                   counter: torch.Tensor) -> None:
    """The update with the recipe's ``scaling_factor_compute_algo``, on the same
    sanitized history (NOTE [Non-finite amaxes])."""
    sizes = [s.numel() for s in scales]
    history = torch.cat(histories, dim=1)
    idle = delayed_scaling.idle_columns(history)
    history, finite = delayed_scaling.sanitize_live_amax(history)
    counter.add_((~finite).sum())
    scale = torch.cat(scales)
    amax_value = delayed_scaling.amax_from_history(history, recipe.amax_compute_algo)
    new_scale = recipe.scaling_factor_compute_algo(
        amax_value, scale, torch.full_like(scale, max_value), recipe)
    checked = delayed_scaling.check_computed_scale(new_scale, scale, amax_value)
    new_scale = torch.where(finite & ~idle, checked, scale)
    new_history = torch.where(idle, history, delayed_scaling.roll_amax_history(history))
    delayed_scaling.copy_all(
        [t for group in (scales, scale_invs, histories) for t in group],
        list(new_scale.split(sizes)) + list(torch.reciprocal(new_scale).split(sizes))
        + list(new_history.split(sizes, dim=1)))


# ---- backward updates, once per backward pass ------------------------------------------

_PENDING: Dict[int, "weakref.WeakValueDictionary[int, AutocastSession]"] = {}
_PENDING_LOCK = threading.Lock()


class _Collectors(threading.local):
    stack: Tuple[Dict[int, AutocastSession], ...] = ()


_COLLECTORS = _Collectors()


def request_backward_update(session: AutocastSession) -> None:
    """Ask for ``session``'s backward update at the end of the running backward pass
    (NOTE [Delayed-scaling update order]); asking again in the same pass is a no-op."""
    stack = _COLLECTORS.stack
    if stack:
        stack[-1].setdefault(id(session), session)
        return
    task = torch._C._current_graph_task_id()
    if task < 0:            # not inside a backward pass: nothing to wait for
        update_sessions([session], forward=False)
        return
    if session.requested_in == task:        # graph task ids are never reused
        return
    with _PENDING_LOCK:
        sessions = _PENDING.get(task)
        first = sessions is None
        if first:
            sessions = _PENDING[task] = weakref.WeakValueDictionary()
        sessions.setdefault(id(session), session)
    session.requested_in = task
    if first:
        torch.autograd.Variable._execution_engine.queue_callback(
            functools.partial(_run_backward_updates, task))


def _run_backward_updates(task: int) -> None:
    with _PENDING_LOCK:
        sessions = _PENDING.pop(task, None)
        # passes that raised never ran their callback; drop what they left, if dead
        for stale in [t for t, s in _PENDING.items() if len(s) == 0]:
            del _PENDING[stale]
    if sessions:
        update_sessions(list(sessions.values()), forward=False)


class collect_backward_updates:
    """Around a nested backward pass (the reentrant checkpoint's): collect the
    backward updates asked for inside it and ask for them again, on exit, in the
    enclosing pass. On an exception nothing is asked for."""

    def __enter__(self) -> None:
        self.sessions: Dict[int, AutocastSession] = {}
        self.saved = _COLLECTORS.stack
        _COLLECTORS.stack = self.saved + (self.sessions,)

    def __exit__(self, exc_type, exc, tb) -> None:
        _COLLECTORS.stack = self.saved
        if exc_type is None:
            for session in self.sessions.values():
                request_backward_update(session)
