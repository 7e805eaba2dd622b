"""Shared fixtures: every test must leave the FP8 and recompute state as it found it."""

import gc
import sys

import pytest
import torch

from transformer_engine.pytorch import global_state, recompute
from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
import helpers
# the Megatron tests' fixtures (a deadline, a gloo group with Megatron's parallel state)
from megatron_helpers import client_deadline, megatron_on_cpu  # noqa: F401


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Note on the test item whether its call phase failed (read by the fixture below)."""
    outcome = yield
    if call.when == "call" and outcome.get_result().failed:
        item.te_call_failed = True


@pytest.fixture(autouse=True)
def global_state_is_clean(request):
    """Fail (not hide) a leak of FP8 autocast or recompute state out of a test. A test
    may not leave more checkpoint frames alive than it found (a failed earlier test's
    traceback can still hold some), unless it failed itself: then the traceback pytest
    keeps of that failure holds the frames of the checkpoint calls it passed through,
    which is no leak (the rest of the state is still checked)."""
    frames = helpers.live_frame_count()
    assert helpers.global_state_is_clean(frames), "global state was dirty before the test"
    yield
    if getattr(request.node, "te_call_failed", False):
        frames = max(frames, helpers.live_frame_count())
    if not helpers.global_state_is_clean(frames):
        found = global_state.snapshot()
        FP8GlobalStateManager.reset()
        recompute.reset_position()
        pytest.fail(f"the test leaked global FP8/recompute state: {found}")


@pytest.fixture(autouse=True)
def deterministic_seed():
    torch.manual_seed(1234)
    yield


@pytest.fixture(autouse=True)
def kernels_compile_clean():
    """Fail a test during which a Triton kernel was compiled to PTX that reads
    registers it never writes, the code ptxas miscompiles (NOTE [FP8 stores] in
    transformer_engine/pytorch/kernels/common.py); only where the kernels are loaded."""
    name = "transformer_engine.pytorch.kernels.launch"
    launch = sys.modules.get(name)
    before = len(launch.suspect_compiles()) if launch is not None else 0
    yield
    launch = sys.modules.get(name)
    found = launch.suspect_compiles()[before:] if launch is not None else []
    if found:
        pytest.fail(f"Triton compiled kernels whose PTX reads registers it never writes: "
                    f"{found}")


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, metavar="I/K",
                     help="run only the collected tests i, i + K, i + 2K, ... (0 <= I < K): "
                          "one of K processes sharing a file (qa/L1_pytorch_gpu/run_job.py)")


def pytest_collection_modifyitems(config, items):
    shard = config.getoption("--shard")
    if shard is None:
        return
    try:
        index, count = (int(part) for part in shard.split("/"))
        if not 0 <= index < count:
            raise ValueError
    except ValueError:
        raise pytest.UsageError(f"--shard must be I/K with 0 <= I < K, got {shard!r}") from None
    keep = items[index::count]
    kept = {id(item) for item in keep}
    config.hook.pytest_deselected(items=[item for item in items if id(item) not in kept])
    items[:] = keep


def pytest_collection_finish(session):
    """Move every object that exists before the first test (torch, the package, the
    test modules) out of the garbage collector's reach: the fixture above collects
    garbage before each test, and scanning those few hundred thousand objects, which
    no test made and none can leak, each time costs over 0.1 s a test."""
    gc.collect()
    gc.freeze()
