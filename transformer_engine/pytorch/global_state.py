"""One read-only view of every piece of global FP8 and recompute state, for tests and
leak checks: what a test must leave as it found it."""

from __future__ import annotations

from typing import NamedTuple

from . import recompute
from .fp8 import FP8GlobalStateManager, _AutocastState
from .model_init import _ModelInitState, model_init_state
from .kernel_config import KernelConfig, get_kernel_config

__all__ = ["GlobalStateSnapshot", "snapshot", "clean"]


class GlobalStateSnapshot(NamedTuple):
    """The calling thread's FP8 autocast state and recompute position, and, process-wide,
    the module-mode hook users, the checkpoint frames alive (call ``gc.collect()``
    first to drop unreachable graphs), the kernel configuration, whether a
    skip-update tensor is set and the thread's ``quantized_model_init`` state
    (compare with ``==``; the autocast state is compared by value, frames by
    identity)."""

    autocast: _AutocastState
    recompute: recompute.RecomputePosition
    mode_hook_users: int
    live_frames: int
    kernels: KernelConfig
    skip_weight_update_set: bool = False
    model_init: _ModelInitState = _ModelInitState()


def snapshot() -> GlobalStateSnapshot:
    return GlobalStateSnapshot(FP8GlobalStateManager.get_fp8_autocast_state(),
                               recompute.position(), recompute.mode_hook_users(),
                               len(recompute.live_frames()), get_kernel_config(),
                               FP8GlobalStateManager.get_skip_fp8_weight_update_tensor()
                               is not None, model_init_state())


def clean() -> GlobalStateSnapshot:
    """The state outside any autocast and checkpoint call, with the kernel
    configuration the environment gives."""
    return GlobalStateSnapshot(_AutocastState(), recompute.RecomputePosition(), 0, 0,
                               KernelConfig.from_environment())
