"""Counts of non-finite (NaN or infinite) amaxes, on the device, and the warning they
raise once: what `FP8GlobalStateManager.get_non_finite_amax_count` reads.

NOTE [Non-finite amaxes]
    A NaN or infinite amax (from a NaN or inf in an input, a weight or a gradient)
    never enters the history: at the update, such a tensor keeps its scale, its live
    slot enters the history as 0 (no observation), and the event is counted per
    device (`non_finite_amax_count`). The next finite amax updates as usual. Current
    and block scaling count non-finite amaxes at the cast (its cast then uses scale 1);
    an activation recompute's casts count nothing (the first forward did), nor do
    those of a backward it runs again (NOTE [Backward inside a checkpointed function]
    in recompute.py). The
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

import threading
import warnings
from typing import Any, Dict, List, Tuple

import torch

__all__ = ["NON_FINITE", "non_finite_counter", "non_finite_amax_count",
           "reset_non_finite_amax_count", "compiled_counter", "make_compiled_counter",
           "note_compiled_use", "CUDA_CHECK_EVERY"]


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
NON_FINITE = _NonFiniteCounters()


def non_finite_counter(device: torch.device, backward: bool = False) -> torch.Tensor:
    """The calling thread's count of non-finite amaxes on ``device`` (an int32 scalar
    tensor), into which current scaling adds at each cast (`quantize.current_scale`);
    while dynamo traces, the compiled-code counter of ``device`` for a cast in the
    forward or (``backward``) the backward graph."""
    if torch.compiler.is_compiling():
        return compiled_counter(device, backward)
    return NON_FINITE.counter(device)


def make_compiled_counter(device) -> None:
    """Make the counters that compiled code on ``device`` adds non-finite amaxes to, if
    missing (eagerly: a graph cannot make them; the modules call this when built)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if (device, False) not in NON_FINITE.compiled:
        with NON_FINITE.lock:
            for backward in (False, True):
                NON_FINITE.compiled.setdefault(
                    (device, backward), torch.zeros((), dtype=torch.int32, device=device))


def compiled_counter(device: torch.device, backward: bool = False) -> torch.Tensor:
    """The counter compiled code adds the non-finite amaxes it sees on ``device`` to:
    one for forward graphs and one for backward graphs, so that a graph input is
    written in one of them only (AOTAutograd would otherwise hand the backward the
    forward's value, losing what other graphs added in between)."""
    found = NON_FINITE.compiled.get((device, backward))
    if found is None:
        raise RuntimeError(
            f"torch.compile: no non-finite amax counter for {device} (TE modules make it "
            "when they are built; build or move the module to this device before compiling)")
    return found


def note_compiled_use() -> bool:
    """Called (for real) while dynamo traces a TE module: from now on the warn-once
    check also reads the compiled-code counters."""
    NON_FINITE.compiled_in_use = True
    return True


note_compiled_use._dynamo_marked_constant = True     # run at trace time (torch_compile.py)


def _all_counters() -> List[torch.Tensor]:
    return list(NON_FINITE.counters.values()) + list(NON_FINITE.compiled.values())


def non_finite_amax_count() -> int:
    """Non-finite amaxes seen so far, all devices (reads the device counters)."""
    return sum(int(c.item()) for c in _all_counters())


def reset_non_finite_amax_count() -> None:
    """Zero the counters and re-arm the warning."""
    for c in _all_counters():
        c.zero_()
    NON_FINITE.copies.clear()
    NON_FINITE.skips.clear()
    NON_FINITE.warned = False
