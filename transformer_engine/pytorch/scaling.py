"""Per-module delayed-scaling state, and the copy-on-write snapshots of it that
activation recompute keeps (NOTE [Recompute stashes] in recompute.py).

`ScalingState` is the typed state behind ``fp8_meta["scaling_fwd"]`` and
``fp8_meta["scaling_bwd"]``; only the delayed-scaling update (fp8.py) writes its
scale, and it calls `copy_before_write` first, so a `ScalingSnapshot` always reads
the values that were in force when it was taken.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

__all__ = ["ScalingState", "ScalingSnapshot", "copy_before_write"]


@dataclass(eq=False)
class ScalingState:
    """Delayed-scaling state of one module's forward or backward tensors.

    ``scale[i]`` casts tensor ``i``; ``scale_inv = 1 / scale``; ``amax_history`` is
    ``[amax_history_len, n]`` with row 0 the live row being recorded this step.
    Compared by identity (it is mutable state, not a value).
    """

    scale: torch.Tensor
    scale_inv: torch.Tensor
    amax_history: torch.Tensor
    # The `_PendingCopy` that snapshots taken since the last update share (weakly: a
    # copy is made only while some snapshot still reads this state).
    pending: Optional["weakref.ref[_PendingCopy]"] = field(default=None, init=False, repr=False)

    @classmethod
    def new(cls, num_tensors: int, history_len: int, device) -> "ScalingState":
        return cls(torch.ones(num_tensors, dtype=torch.float32, device=device),
                   torch.ones(num_tensors, dtype=torch.float32, device=device),
                   torch.zeros(history_len, num_tensors, dtype=torch.float32, device=device))

    def clone(self) -> "ScalingState":
        return ScalingState(self.scale.clone(), self.scale_inv.clone(), self.amax_history.clone())

    def __getstate__(self) -> dict:
        # A copy (pickle, deepcopy, torch.save of a module) is a new state that no
        # snapshot reads; the weak reference to the shared pending copy stays behind.
        return {"scale": self.scale, "scale_inv": self.scale_inv,
                "amax_history": self.amax_history}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.pending = None

    def record_amax(self, index: int, amax_value: torch.Tensor) -> None:
        """Fold an amax into the live row (max with what this step already saw)."""
        live = (self.amax_history[0, index] if torch.compiler.is_compiling()
                else self.cast_views(index)[1])
        torch.maximum(live, amax_value, out=live)

    def cast_views(self, index: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(scale[index:index + 1], amax_history[0, index])``: views made at the first
        call for ``index`` and kept (the tensors change in place; a view costs host time
        on every cast). Made anew if ``scale`` or ``amax_history`` was reassigned."""
        cache = self.__dict__.get("_views")
        if cache is None or cache[0] is not self.scale or cache[1] is not self.amax_history:
            cache = self.__dict__["_views"] = (self.scale, self.amax_history, {})
        found = cache[2].get(index)
        if found is None:
            found = cache[2][index] = (self.scale[index:index + 1], self.amax_history[0, index])
        return found


class _PendingCopy:
    """Where the next update of one live state puts the copy that the snapshots taken
    before it read (one per state and update interval, shared by those snapshots, so
    the update never enumerates snapshots)."""

    __slots__ = ("copy", "__weakref__")

    def __init__(self):
        self.copy: Optional[ScalingState] = None


class ScalingSnapshot:
    """A `ScalingState` as it is now, copied on write: ``state`` is the live state
    itself until the delayed-scaling update is about to change it (`copy_before_write`),
    then a copy made just before. The scale is therefore exactly the one in force when
    the snapshot was taken (only the update changes it); the live amax row may also
    hold amaxes recorded later in the same autocast."""

    __slots__ = ("live", "pending")

    def __init__(self, live: ScalingState):
        pending = live.pending() if live.pending is not None else None
        if pending is None:
            pending = _PendingCopy()
            live.pending = weakref.ref(pending)
        self.live, self.pending = live, pending

    @property
    def state(self) -> ScalingState:
        copy = self.pending.copy
        return self.live if copy is None else copy


def copy_before_write(states: List[ScalingState]) -> None:
    """Give the snapshots still reading any of ``states`` a copy, before the states are
    changed in place: two concatenations (scales with scale_invs, and the histories
    side by side) per device and history length, whatever the number of states, and
    no per-state tensor op (the host cost of an update with many modules matters)."""
    groups: Dict[Tuple[torch.device, int], list] = {}
    for s in states:
        ref = s.pending
        if ref is not None:
            s.pending = None
            pending = ref()
            if pending is not None:
                key = (s.scale.device, s.amax_history.shape[0])
                groups.setdefault(key, []).append((s, pending))
    for todo in groups.values():
        sizes = [s.scale.shape[0] for s, _ in todo]
        vectors = torch.cat([s.scale for s, _ in todo] + [s.scale_inv for s, _ in todo])
        vectors = vectors.split(sizes + sizes)
        histories = torch.cat([s.amax_history for s, _ in todo], dim=1).split(sizes, dim=1)
        n = len(todo)
        for i, (_, pending) in enumerate(todo):
            pending.copy = ScalingState(vectors[i], vectors[n + i], histories[i])


