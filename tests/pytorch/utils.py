"""Helpers shared by the tests: device parametrization and bitwise comparisons."""

import copy

import pytest
import torch

HAS_CUDA_FP8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)

cuda_fp8 = pytest.mark.skipif(not HAS_CUDA_FP8,
                              reason="needs a CUDA GPU with FP8 (compute capability 8.9+)")

DEVICES = ["cpu", pytest.param("cuda", marks=cuda_fp8)]


def fp8_state_snapshot(modules):
    """Copies of every module's forward and backward scaling state."""
    out = []
    for m in modules:
        for key in ("scaling_fwd", "scaling_bwd"):
            out.append(copy.deepcopy(m.fp8_meta.get(key)))
    return out


def assert_states_equal(a, b, what=""):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        if x is None or y is None:
            assert x is None and y is None, f"{what}: state {i}: one is None"
            continue
        for field in ("scale", "scale_inv", "amax_history"):
            u, v = getattr(x, field), getattr(y, field)
            assert torch.equal(u, v), f"{what}: state {i} {field} differs:\n{u}\nvs\n{v}"


def assert_tensors_equal(a, b, what=""):
    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b)):
        if x is None or y is None:
            assert x is None and y is None, f"{what}[{i}]: one is None"
            continue
        assert torch.equal(x, y), f"{what}[{i}] differs: max |diff| {(x - y).abs().max()}"
