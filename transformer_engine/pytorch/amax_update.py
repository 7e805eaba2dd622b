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
    stashes] in recompute.py).

NOTE [Non-finite amaxes]
    A NaN or infinite amax (from a NaN or inf in an input, a weight or a gradient)
    never enters the history: at the update, such a tensor keeps its scale, its live
    slot enters the history as 0 (no observation), and the event is counted per
    device (`non_finite_amax_count`). The next finite amax updates as usual. Current
    and block scaling count non-finite amaxes at the cast (its cast then uses scale 1);
    an activation recompute's casts count nothing (the first forward did). The
    counters are device tensors, so counting needs no host synchronization; the
    warning (once, again after `reset_non_finite_amax_count`) is checked after each
    update, not on the cast path, over the updating thread's own counters (a thread
    that is gone keeps its count but costs later updates nothing). On CUDA a counter
    is copied to the host at every `CUDA_CHECK_EVERY`-th update of its device and
    thread (the copy, its event and their queries cost host time on every step
    otherwise), and the warning comes at the first check after a copy that saw the
    count has landed.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..common.recipe import DelayedScaling, Recipe
from . import delayed_scaling
from .scaling import copy_before_write

__all__ = ["AutocastSession", "update_sessions", "request_backward_update", "observe_registrations",
           "collect_backward_updates", "non_finite_counter", "non_finite_amax_count",
           "reset_non_finite_amax_count", "compiled_counter", "make_compiled_counter",
           "note_compiled_use", "update_states"]


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
        _NON_FINITE.warn_once_if_seen()
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
    _NON_FINITE.warn_once_if_seen()


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
    counter = compiled_counter(device, not forward) if traced else _NON_FINITE.counter(device)
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
    history, finite = delayed_scaling.sanitize_live_amax(torch.cat(histories, dim=1))
    counter.add_((~finite).sum())
    scale = torch.cat(scales)
    amax_value = delayed_scaling.amax_from_history(history, recipe.amax_compute_algo)
    new_scale = recipe.scaling_factor_compute_algo(
        amax_value, scale, torch.full_like(scale, max_value), recipe)
    checked = delayed_scaling.check_computed_scale(new_scale, scale, amax_value)
    new_scale = torch.where(finite, checked, scale)
    delayed_scaling.copy_all(
        [t for group in (scales, scale_invs, histories) for t in group],
        list(new_scale.split(sizes)) + list(torch.reciprocal(new_scale).split(sizes))
        + list(delayed_scaling.roll_amax_history(history).split(sizes, dim=1)))


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


# ---- non-finite amaxes (NOTE [Non-finite amaxes]) ------------------------------------------

class _NonFiniteCounters:
    """Counts of non-finite amaxes, one device tensor per (device, thread) so that
    threads never add into the same tensor, and the warn-once logic. Compiled code
    adds into one counter per device (``compiled``, made eagerly before it is traced:
    NOTE [torch.compile] in torch_compile.py)."""

    def __init__(self):
        self.counters: Dict[Tuple[torch.device, int], torch.Tensor] = {}
        self.compiled: Dict[Tuple[torch.device, bool], torch.Tensor] = {}
        # whether dynamo has traced a TE module (only then are the compiled-code
        # counters read by the warn-once check, which costs a read each)
        self.compiled_in_use = False
        self.lock = threading.Lock()
        # the calling thread's own counters by device: the casts' fast path, and all that
        # the check after this thread's updates reads (threads that are gone leave
        # their counters, which still count, but no per-update cost)
        self.mine = threading.local()
        self.warned = False
        # CUDA counters: a pinned host copy and the event that says it has landed, and
        # the updates left before the next look
        self.copies: Dict[Tuple[torch.device, int], Tuple[torch.Tensor, Any]] = {}
        self.skips: Dict[Tuple[torch.device, int], int] = {}

    def _mine(self) -> Dict[torch.device, torch.Tensor]:
        mine = getattr(self.mine, "by_device", None)
        if mine is None:
            mine = self.mine.by_device = {}
        return mine

    def counter(self, device: torch.device) -> torch.Tensor:
        mine = self._mine()
        found = mine.get(device)
        if found is None:
            with self.lock:
                found = self.counters.setdefault(
                    (device, threading.get_ident()),
                    torch.zeros((), dtype=torch.int32, device=device))
            mine[device] = found
        return found

    def warn_once_if_seen(self) -> None:
        """Called after each update (not per cast): warn once if one of the calling
        thread's counters (or a compiled-code counter) is non-zero. A CUDA counter is
        read from a host copy made at the previous call, once its event has completed,
        so this never waits for the GPU."""
        if self.warned:
            return
        ident = threading.get_ident()
        mine = [((device, ident), counter) for device, counter in self._mine().items()]
        if self.compiled_in_use:
            mine += [(key + ("compiled",), counter) for key, counter in self.compiled.items()]
        for key, counter in mine:
            if self._seen(key, counter):
                self.warned = True
                warnings.warn("te.autocast: a NaN or infinite amax was seen (an input, "
                              "weight or gradient held NaN/inf); the affected FP8 scales were "
                              "kept for that step and the value kept out of the amax history. "
                              "FP8GlobalStateManager.get_non_finite_amax_count() counts such "
                              "events.", RuntimeWarning, stacklevel=2)
                return

    def _seen(self, key, counter: torch.Tensor) -> bool:
        if counter.device.type != "cuda":
            return counter.item() > 0
        left = self.skips.get(key, 0)
        if left > 0:
            self.skips[key] = left - 1
            return False
        if torch.cuda.is_current_stream_capturing():
            return False
        self.skips[key] = CUDA_CHECK_EVERY - 1
        copy = self.copies.get(key)
        if copy is not None and not copy[1].query():
            return False                        # the last copy is still on its way
        seen = copy is not None and copy[0].item() > 0
        if copy is None:
            copy = self.copies[key] = (torch.empty((), dtype=torch.int32, pin_memory=True),
                                       torch.cuda.Event())
        copy[0].copy_(counter, non_blocking=True)
        copy[1].record()
        return seen


CUDA_CHECK_EVERY = 16
_NON_FINITE = _NonFiniteCounters()


def non_finite_counter(device: torch.device, backward: bool = False) -> torch.Tensor:
    """The calling thread's count of non-finite amaxes on ``device`` (an int32 scalar
    tensor), into which current scaling adds at each cast (`quantize.current_scale`);
    while dynamo traces, the compiled-code counter of ``device`` for a cast in the
    forward or (``backward``) the backward graph."""
    if torch.compiler.is_compiling():
        return compiled_counter(device, backward)
    return _NON_FINITE.counter(device)


def make_compiled_counter(device) -> None:
    """Make the counters that compiled code on ``device`` adds non-finite amaxes to, if
    missing (eagerly: a graph cannot make them; the modules call this when built)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if (device, False) not in _NON_FINITE.compiled:
        with _NON_FINITE.lock:
            for backward in (False, True):
                _NON_FINITE.compiled.setdefault(
                    (device, backward), torch.zeros((), dtype=torch.int32, device=device))


def compiled_counter(device: torch.device, backward: bool = False) -> torch.Tensor:
    """The counter compiled code adds the non-finite amaxes it sees on ``device`` to:
    one for forward graphs and one for backward graphs, so that a graph input is
    written in one of them only (AOTAutograd would otherwise hand the backward the
    forward's value, losing what other graphs added in between)."""
    found = _NON_FINITE.compiled.get((device, backward))
    if found is None:
        raise RuntimeError(
            f"torch.compile: no non-finite amax counter for {device} (TE modules make it "
            "when they are built; build or move the module to this device before compiling)")
    return found


def note_compiled_use() -> bool:
    """Called (for real) while dynamo traces a TE module: from now on the warn-once
    check also reads the compiled-code counters."""
    _NON_FINITE.compiled_in_use = True
    return True


note_compiled_use._dynamo_marked_constant = True     # run at trace time (torch_compile.py)


def _all_counters() -> List[torch.Tensor]:
    return list(_NON_FINITE.counters.values()) + list(_NON_FINITE.compiled.values())


def non_finite_amax_count() -> int:
    """Non-finite amaxes seen so far, all devices (reads the device counters)."""
    return sum(int(c.item()) for c in _all_counters())


def reset_non_finite_amax_count() -> None:
    """Zero the counters and re-arm the warning."""
    for c in _all_counters():
        c.zero_()
    _NON_FINITE.copies.clear()
    _NON_FINITE.skips.clear()
    _NON_FINITE.warned = False
