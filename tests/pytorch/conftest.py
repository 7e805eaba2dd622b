"""Shared fixtures: every test must leave the FP8 and recompute state as it found it."""

import pytest
import torch

from transformer_engine.pytorch import distributed
from transformer_engine.pytorch.fp8 import FP8GlobalStateManager, _AutocastState


def _global_state():
    return {
        "fp8_autocast_state": FP8GlobalStateManager.get_fp8_autocast_state(),
        "in_recompute_region": distributed._in_recompute_region,
        "in_recompute_phase": distributed._in_recompute_phase,
        "frames": distributed._frames,
        "training_under_no_grad": distributed._training_under_no_grad,
    }


_CLEAN = {
    "fp8_autocast_state": _AutocastState(),
    "in_recompute_region": False,
    "in_recompute_phase": False,
    "frames": (),
    "training_under_no_grad": False,
}


@pytest.fixture(autouse=True)
def global_state_is_clean():
    """Fail (not hide) a leak of FP8 autocast or recompute state out of a test."""
    assert _global_state() == _CLEAN, "global state was dirty before the test"
    yield
    found = _global_state()
    if found != _CLEAN:
        FP8GlobalStateManager.reset()
        distributed._in_recompute_region = False
        distributed._in_recompute_phase = False
        distributed._frames = ()
        distributed._training_under_no_grad = False
        pytest.fail(f"the test leaked global FP8/recompute state: {found}")


@pytest.fixture(autouse=True)
def deterministic_seed():
    torch.manual_seed(1234)
    yield

