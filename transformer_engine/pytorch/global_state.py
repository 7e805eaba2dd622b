"""One read-only view of every piece of global FP8 and recompute state, for tests and
leak checks: what a test must leave as it found it."""

from __future__ import annotations

from typing import NamedTuple

from . import recompute
from .fp8 import FP8GlobalStateManager, _AutocastState

__all__ = ["GlobalStateSnapshot", "snapshot", "CLEAN"]


class GlobalStateSnapshot(NamedTuple):
    """The calling thread's FP8 autocast state and recompute position, and the
    process-wide module-mode hook users (compare with ``==``; the autocast state is
    compared by value, frames by identity)."""

    autocast: _AutocastState
    recompute: recompute.RecomputePosition
    mode_hook_users: int


def snapshot() -> GlobalStateSnapshot:
    return GlobalStateSnapshot(FP8GlobalStateManager.get_fp8_autocast_state(),
                               recompute.position(), recompute.mode_hook_users())


CLEAN = GlobalStateSnapshot(_AutocastState(), recompute.RecomputePosition(), 0)
