"""Where a thread stands in activation recompute, and what each checkpoint call keeps
for its recompute: the FP8 stashes and the modules' train/eval modes.

This module imports neither fp8.py nor distributed.py: the checkpoint wrapper
(distributed.py) enters and leaves the phases, the FP8 hooks (fp8.py) stash and take,
and the modules (module/base.py) ask where they are.

NOTE [Recompute stashes]
    `checkpoint(fn, *args)` runs ``fn`` once without keeping its activations (phase
    1) and again during backward (phase 2, the recompute). Between the two an FP8
    autocast may have updated every scale, so a delayed-scaling module must recompute
    with the scale its phase-1 forward used.

    Each thread has a `RecomputePosition`: *in a recompute region* (set on entry to
    either phase, whatever the FP8 state is then), *in the recompute phase*, and the
    stack of checkpoint calls (frames) it is inside. `enter` replaces it whole and
    puts back exactly what it found. `is_fp8_activation_recompute_enabled()`
    (distributed.py) is the region flag AND the *live* FP8 state, so an autocast opened
    inside the checkpointed function counts.

    One `RecomputeFrame` per checkpoint call holds that call's stashes, keyed by
    module, in call order; it is owned by the call's autograd graph (the reentrant
    Function's ctx, or the non-reentrant call's saved-tensor hooks), so a dropped graph
    drops it and nothing global grows. In phase 1 each delayed-scaling FP8 module
    appends a `RecomputeStash` (a copy-on-write snapshot of its forward scale, scale_inv
    and amax history, scaling.py, and the autocast session of the call) to every frame
    that is recording; in phase 2 it takes its stashes back in call order. A checkpoint
    nested inside a recompute records the stashes its enclosing recompute hands out,
    so nested regions see the phase-1 state too. The recompute records no amax,
    registers nothing for an update: the stash says what phase 1 did.

    Invariance assumes ``fn`` runs the same FP8 modules in both phases (it must not
    branch on the recompute phase or on live scales).

NOTE [Backward inside a checkpointed function]
    ``fn`` may itself run a backward (``torch.autograd.grad`` for a gradient penalty,
    an inner ``.backward()``, a nested checkpoint's recompute). Phase 1 runs it as a
    plain call would: it casts with the live backward scales, records its gradient
    amaxes, asks for its backward update and counts non-finite amaxes. The recompute
    runs it again; that second run is suppressed, not replayed: it records no amax,
    asks for no update and counts nothing, and it casts with the backward scale that
    the same backward of phase 1 used. So each phase-1 backward of a delayed-scaling
    call that runs while a phase 1 holding the call's stash is still running (the
    stash's ``owners`` say which; `PhaseFlags.recording`) appends a snapshot of the
    live backward state to ``stash.backward[slot]``, and the recompute's backward of
    that call takes them back in order (the call's `ForwardPlan` counts). A backward
    counts as inside the recompute while the outermost recompute running when its
    module call was made is still running (`replay_flags`, `PhaseFlags.replaying`):
    flags, not the thread's position, because autograd runs CUDA backwards in threads
    of its own. The backward after the recompute (reentrant mode's, of the same
    recomputed calls) is the real one and records as usual.

NOTE [Module modes]
    The recompute runs every module in the train/eval mode it had in phase 1: a model
    switched to ``eval()`` between forward and backward still recomputes its dropout
    masks as phase 1 drew them. While any thread runs a phase 1, a global module
    forward pre-hook is registered (counted, so threads and nested calls share it);
    it records each module's ``training`` flag at its first call into the recording
    frames of the calling thread. The recompute sets the recorded flags at its start
    and puts back the flags it changed at its end; for a deterministic function that
    equals setting each flag at the module's first call. The hook puts module calls of
    phase 1 on torch's general hook path (a few microseconds a call), only while a
    phase 1 runs.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch

from .scaling import ScalingSnapshot, ScalingState

__all__ = ["RecomputeStateError", "RecomputeStash", "RecomputeFrame", "RecomputePosition",
           "PhaseFlags", "position", "enter", "in_region", "in_phase", "is_training_forward",
           "stash", "take", "recording_flags", "replay_flags", "stash_tensor_count",
           "live_frames", "mode_hook_users", "reset_position"]


class RecomputeStateError(RuntimeError):
    """An activation recompute could not find the FP8 state its forward stashed."""


class PhaseFlags:
    """Whether one checkpoint call is running its phase 1 (``recording``) or its
    recompute (``replaying``) now, on any thread: what a backward reads (NOTE
    [Backward inside a checkpointed function]). Apart from its frame, so that the
    stashes and module calls that hold it keep no frame alive."""

    __slots__ = ("recording", "replaying")

    def __init__(self):
        self.recording = False
        self.replaying = False


class RecomputeStash(NamedTuple):
    """What one FP8 module call stashed in phase 1 for its recompute: its forward
    scaling state as phase 1 saw it (copied on write), the autocast session the call
    belonged to (None outside a training forward), the FP8 weights it used, by
    GEMM (filled during the call; the recompute uses these, not a later cache), the
    `PhaseFlags` of the calls that recorded it, and the backward states that
    backwards inside those phase-1 runs cast with, by backward slot, in order (NOTE
    [Backward inside a checkpointed function])."""

    snapshot: ScalingSnapshot
    session: Any
    weights: dict
    owners: Tuple[PhaseFlags, ...]
    backward: Dict[int, List[ScalingSnapshot]]

    @property
    def scaling_fwd(self) -> ScalingState:
        return self.snapshot.state


class _FixedSnapshot:
    """A stash's forward state that is already a copy (made by a compiled forward)."""

    __slots__ = ("state",)

    def __init__(self, state: ScalingState):
        self.state = state


_LIVE_FRAMES: "weakref.WeakSet[RecomputeFrame]" = weakref.WeakSet()


class RecomputeFrame:
    """The stashes and module modes of one checkpoint call (NOTE [Recompute stashes])."""

    __slots__ = ("stashes", "metas", "cursor", "modes", "replaced_modes", "rng_graph_safe",
                 "compiled_head", "installed", "flags", "__weakref__")

    def __init__(self):
        self.flags = PhaseFlags()
        # stashes a compiled first forward linked here (NOTE [torch.compile]), newest first
        self.compiled_head = None
        self.installed: List[dict] = []
        self.stashes: Dict[int, List[RecomputeStash]] = {}
        self.metas: Dict[int, dict] = {}     # keeps each keyed fp8_meta (so its id) alive
        self.cursor: Dict[int, int] = {}
        # id(module) -> (module, its training flag at its first phase-1 call)
        self.modes: Dict[int, Tuple[torch.nn.Module, bool]] = {}
        # id(module) -> (module, the flag it had before this recompute set it)
        self.replaced_modes: Dict[int, Tuple[torch.nn.Module, bool]] = {}
        # whether the call's recompute can replay its RNG states inside a CUDA graph (rng.py)
        self.rng_graph_safe = True
        _LIVE_FRAMES.add(self)

    def add(self, fp8_meta: dict, entry: RecomputeStash) -> int:
        if self.compiled_head is not None:
            self._fold_compiled()
        key = id(fp8_meta)
        entries = self.stashes.get(key)
        if entries is None:
            entries = self.stashes[key] = []
            self.metas[key] = fp8_meta
        entries.append(entry)
        return len(entries) - 1

    def _fold_compiled(self) -> None:
        """Take in, in call order, the stashes compiled forwards linked to this frame."""
        linked = []
        head, self.compiled_head = self.compiled_head, None
        while head is not None:
            linked.append(head)
            head = head.previous
        for stash in reversed(linked):
            self.add(stash.fp8_meta,
                     RecomputeStash(_FixedSnapshot(stash.state), None, {}, (), {}))

    def start_recompute(self) -> None:
        """Rewind the stashes for a recompute, and put each module's stashed forward
        states, in call order, on its ``fp8_meta``, where a compiled recompute reads them
        (``"recompute_states"``, ``"recompute_cursor"``: NOTE [torch.compile])."""
        if self.compiled_head is not None:
            self._fold_compiled()
        self.cursor = {}
        for key, entries in self.stashes.items():
            meta = self.metas[key]
            meta["recompute_states"] = [e.snapshot.state for e in entries]
            meta["recompute_cursor"] = 0
            self.installed.append(meta)

    def take(self, fp8_meta: dict) -> RecomputeStash:
        if self.compiled_head is not None:
            self._fold_compiled()
        key = id(fp8_meta)
        entries = self.stashes.get(key, [])
        position_ = self.cursor.get(key, 0)
        if position_ >= len(entries):
            raise RecomputeStateError(
                "te.checkpoint: the recompute ran a delayed-scaling FP8 forward "
                f"(call #{position_ + 1} of this module in the region) for which the first "
                f"forward stashed no FP8 state ({len(entries)} stash(es) recorded). The "
                "checkpointed function must run the same FP8 modules, under the same FP8 "
                "autocast, in both phases; it must not branch on "
                "in_fp8_activation_recompute_phase() or on live scales. Refusing to "
                "recompute with the live (already updated) scales.")
        self.cursor[key] = position_ + 1
        return entries[position_]

    def record_mode(self, module: torch.nn.Module) -> None:
        if id(module) not in self.modes:
            self.modes[id(module)] = (module, module.training)

    def replay_modes(self) -> None:
        """Give every recorded module its phase-1 training flag for the recompute."""
        for key, (module, training) in self.modes.items():
            if module.training != training and key not in self.replaced_modes:
                self.replaced_modes[key] = (module, module.training)
                module.training = training

    def end_recompute(self) -> None:
        """Put back the training flags this recompute changed; take the stashed states
        off the modules."""
        for module, training in self.replaced_modes.values():
            module.training = training
        self.replaced_modes = {}
        for meta in self.installed:
            meta.pop("recompute_states", None)
            meta.pop("recompute_cursor", None)
        self.installed = []

    def tensor_count(self) -> int:
        if self.compiled_head is not None:
            self._fold_compiled()
        # a forward state per stash, and the backward states inner backwards used
        return 3 * sum(1 + sum(len(b) for b in e.backward.values())
                       for v in self.stashes.values() for e in v)


@dataclass(frozen=True)
class RecomputePosition:
    """Where one thread stands: in a recompute region (either phase), in the
    recompute phase, the checkpoint calls it is inside (``(frame, recomputing)``,
    innermost last), and whether a forward under ``no_grad`` still counts as training
    (the first forward of a client checkpoint, which runs it under ``no_grad``:
    ``activation_recompute_forward`` in distributed.py)."""

    region: bool = False
    phase: bool = False
    frames: Tuple[Tuple[RecomputeFrame, bool], ...] = ()
    training_under_no_grad: bool = False


class _ThreadPosition(threading.local):
    # per thread, as fp8.py's autocast state (compiled code reads it)
    def __init__(self):
        self.position = RecomputePosition()


_THREAD = _ThreadPosition()


def position() -> RecomputePosition:
    """This thread's recompute position."""
    return _THREAD.position


def reset_position() -> None:
    """Back to outside any checkpoint call on this thread (for a test harness after a
    failure; the checkpoint wrapper itself always restores what it found)."""
    _THREAD.position = RecomputePosition()


def in_region() -> bool:
    return _THREAD.position.region


def in_phase() -> bool:
    return _THREAD.position.phase


def is_training_forward() -> bool:
    """Whether a forward running now counts as training (records amaxes, updates
    scales): grad enabled where it runs (a reentrant phase 1 runs under the call site's
    grad mode: NOTE [Reentrant phase 1] in checkpoint_modes.py), or inside a client
    checkpoint's first forward."""
    return torch.is_grad_enabled() or _THREAD.position.training_under_no_grad


# ---- module modes (NOTE [Module modes]) ---------------------------------------------

_HOOK_LOCK = threading.Lock()
_hook_users = 0
_hook_handle = None


def _record_module_mode(module: torch.nn.Module, _args) -> None:
    """Global forward pre-hook: the calling thread's recording frames note the
    module's training flag. Module calls traced by torch.compile are not noted (the
    graph is specialized on the flags: a recompute in another mode compiles anew)."""
    if torch.compiler.is_compiling():
        return
    frames = _THREAD.position.frames
    if not frames:
        return
    if len(frames) == 1:                  # the common case, on every module call
        frame, recomputing = frames[0]
        if not recomputing:
            frame.record_mode(module)
        return
    for frame in _recording(frames):
        frame.record_mode(module)


def _acquire_mode_hook() -> None:
    """Register the module-mode hook for the first user. It goes back under the handle
    it first had: torch.compile guards on the ids of the global hooks, and a new id
    at every checkpoint call would make it compile again at each."""
    global _hook_users, _hook_handle
    with _HOOK_LOCK:
        if _hook_users == 0:
            hooks = None if _hook_handle is None else _hook_handle.hooks_dict_ref()
            if hooks is None:
                _hook_handle = torch.nn.modules.module.register_module_forward_pre_hook(
                    _record_module_mode)
            else:
                hooks[_hook_handle.id] = _record_module_mode
        _hook_users += 1


def _release_mode_hook() -> None:
    global _hook_users
    with _HOOK_LOCK:
        _hook_users -= 1
        if _hook_users == 0:
            _hook_handle.remove()       # (kept for its id)


def mode_hook_users() -> int:
    """How many phase-1 runs (all threads) hold the module-mode hook now."""
    return _hook_users


# ---- entering a phase, stashing, taking ------------------------------------------------

@contextlib.contextmanager
def enter(frame: RecomputeFrame, recomputing: bool,
          training_under_no_grad: Optional[bool] = None):
    """Enter a phase of one checkpoint call on this thread; on exit put back exactly
    the position found. Phase 1 of a region nested inside a recompute is itself part
    of that recompute, so the phase flag is only ever raised on entry. A phase 1 holds
    the module-mode hook for its duration. The frame's `PhaseFlags` say which phase
    runs, for backwards on any thread."""
    saved = _THREAD.position
    flags = frame.flags
    was = flags.replaying if recomputing else flags.recording
    _THREAD.position = RecomputePosition(
        region=True, phase=saved.phase or recomputing,
        frames=saved.frames + ((frame, recomputing),),
        training_under_no_grad=(saved.training_under_no_grad if training_under_no_grad is None
                                else training_under_no_grad))
    if recomputing:
        flags.replaying = True
    else:
        flags.recording = True
        _acquire_mode_hook()
    try:
        yield
    finally:
        _THREAD.position = saved
        if recomputing:
            flags.replaying = was
        else:
            flags.recording = was
            _release_mode_hook()


def _recording(frames) -> List[RecomputeFrame]:
    """Phase-1 frames newer than the innermost recomputing frame."""
    out = []
    for frame, recomputing in reversed(frames):
        if recomputing:
            break
        out.append(frame)
    return out


def stash(fp8_meta: dict, entry: RecomputeStash) -> Optional[int]:
    """Give ``entry`` to every recording frame of this thread; returns its position in
    the innermost one (None when no frame records)."""
    frames = _THREAD.position.frames
    if len(frames) == 1 and not frames[0][1]:      # one phase-1 frame: the common case
        return frames[0][0].add(fp8_meta, entry)
    position_ = None
    for frame in _recording(frames):
        p = frame.add(fp8_meta, entry)
        position_ = p if position_ is None else position_
    return position_


def take(fp8_meta: dict) -> RecomputeStash:
    """The next stash of this module in the call being recomputed; also handed to
    checkpoint calls nested inside that recompute."""
    frames = _THREAD.position.frames
    if len(frames) == 1 and frames[0][1]:          # one recomputing frame: the common case
        return frames[0][0].take(fp8_meta)
    source = next((frame for frame, recomputing in reversed(frames) if recomputing), None)
    if source is None:
        raise RecomputeStateError("te.checkpoint: an FP8 module asked for its recompute stash "
                                  "outside any checkpoint recompute")
    entry = source.take(fp8_meta)
    for frame in _recording(frames):
        frame.add(fp8_meta, entry)
    return entry


def recording_flags() -> Tuple[PhaseFlags, ...]:
    """The `PhaseFlags` of this thread's recording checkpoint calls: the owners of a
    stash made now."""
    frames = _THREAD.position.frames
    if len(frames) == 1:                           # the common case
        return (frames[0][0].flags,)
    return tuple(frame.flags for frame in _recording(frames))


def replay_flags() -> Optional[PhaseFlags]:
    """The `PhaseFlags` of this thread's outermost recomputing checkpoint call (None
    outside any recompute): while it replays, a backward of a module call made now is
    part of the recompute (NOTE [Backward inside a checkpointed function]). Recomputes
    nest last in, first out, so the outermost one runs as long as any does."""
    for frame, recomputing in _THREAD.position.frames:
        if recomputing:
            return frame.flags
    return None


def stash_tensor_count() -> int:
    """Tensors held by live recompute stashes, across all checkpoint calls and threads
    (for tests and leak checks; call ``gc.collect()`` first to drop unreachable graphs)."""
    return sum(frame.tensor_count() for frame in list(_LIVE_FRAMES))


def live_frames() -> List[RecomputeFrame]:
    """The checkpoint frames alive now, all threads (``gc.collect()`` first to drop
    unreachable graphs)."""
    return list(_LIVE_FRAMES)
