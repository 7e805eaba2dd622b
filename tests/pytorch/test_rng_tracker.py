"""CudaRNGStatesTracker (NOTE [Tracker generators] in rng.py): named states are
generators; fork draws from them and leaves the default generator as it found it;
get_states copies, set_states writes in place (a graph keeps the generator objects it
was captured with); misuse, and a fork inside a CUDA graph capture that
te.make_graphed_callables did not start, fail with clear errors. The references are
plain torch.Generator objects seeded alike."""

import gc

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.pytorch import rng
from helpers import DEVICES, cuda_fp8

NAME = "model-parallel-rng"


def _tracker(device, seed=77):
    tracker = te.CudaRNGStatesTracker(device=device)
    tracker.add(NAME, seed)
    return tracker


def _default_state(device):
    return torch.cuda.get_rng_state() if device == "cuda" else torch.get_rng_state()


@pytest.mark.parametrize("device", DEVICES)
def test_fork_draws_from_the_named_state_and_leaves_the_default_alone(device):
    tracker = _tracker(device)
    before = _default_state(device)
    with tracker.fork():
        a = torch.rand(64, device=device)
    with tracker.fork(NAME):
        b = torch.rand(64, device=device)
    reference = torch.Generator(device=device).manual_seed(77)
    assert torch.equal(a, torch.rand(64, device=device, generator=reference))
    assert torch.equal(b, torch.rand(64, device=device, generator=reference))
    assert torch.equal(_default_state(device), before)


@pytest.mark.parametrize("device", DEVICES)
def test_fork_restores_the_default_generator_after_an_exception(device):
    tracker = _tracker(device)
    before = _default_state(device)
    with pytest.raises(ZeroDivisionError):
        with tracker.fork():
            torch.rand(8, device=device)
            raise ZeroDivisionError
    assert torch.equal(_default_state(device), before)
    assert torch.equal(torch.rand(8, device=device),
                       torch.rand(8, device=device, generator=_seeded_like(before, device)))


def _seeded_like(state, device):
    gen = torch.Generator(device=device)
    gen.set_state(state)
    return gen


@pytest.mark.parametrize("device", DEVICES)
def test_get_states_copies_and_set_states_writes_in_place(device):
    tracker = _tracker(device)
    generator = tracker.states_[NAME]
    saved = tracker.get_states()
    with tracker.fork():
        first = torch.rand(16, device=device)
    assert not torch.equal(tracker.get_states()[NAME], saved[NAME])   # the state moved on
    tracker.set_states(saved)
    assert tracker.states_[NAME] is generator                        # the same object
    with tracker.fork():
        assert torch.equal(torch.rand(16, device=device), first)


@pytest.mark.parametrize("device", DEVICES)
def test_set_states_takes_generators_adds_and_drops_names(device):
    tracker = _tracker(device)
    source = torch.Generator(device=device).manual_seed(5)
    tracker.set_states({"expert-parallel-rng": source})
    assert list(tracker.states_) == ["expert-parallel-rng"]
    with tracker.fork("expert-parallel-rng"):
        got = torch.rand(8, device=device)
    assert torch.equal(got, torch.rand(8, device=device, generator=source))


@pytest.mark.parametrize("states, error, match", [
    ([1, 2], TypeError, "states must be a dict of name -> state, got list"),
    ({NAME: 3}, TypeError, f"the state of '{NAME}' must be a byte tensor or a torch.Generator, "
                           "got int"),
], ids=["not-a-dict", "int-state"])
def test_set_states_rejects_bad_states(states, error, match):
    with pytest.raises(error, match=match):
        _tracker("cpu").set_states(states)


def test_add_and_fork_misuse():
    tracker = _tracker("cpu")
    with pytest.raises(ValueError, match=f"state '{NAME}' already exists"):
        tracker.add(NAME, 1)
    with pytest.raises(ValueError, match="seed 77 is already used"):
        tracker.add("other", 77)
    with pytest.raises(KeyError, match="no state named 'other'"):
        with tracker.fork("other"):
            raise AssertionError("fork must refuse an unknown state")


def test_reset_forgets_states_and_seeds():
    tracker = _tracker("cpu")
    tracker.reset()
    assert tracker.get_states() == {}
    tracker.add(NAME, 77)                          # the seed may be used again
    assert list(tracker.get_states()) == [NAME]


def test_tracker_generators_lists_live_trackers_by_device():
    tracker = _tracker("cpu", seed=1234)
    assert any(g is tracker.states_[NAME] for g in rng.tracker_generators(torch.device("cpu")))
    gone = tracker.states_[NAME]
    del tracker
    gc.collect()
    assert all(g is not gone for g in rng.tracker_generators(torch.device("cpu")))


# ---- CUDA graph capture (GPU) -------------------------------------------------------------

@cuda_fp8
def test_fork_in_a_foreign_capture_is_refused():
    """Only te.make_graphed_callables registers the tracker's generators with its graphs."""
    tracker = _tracker("cuda")
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="te.make_graphed_callables did not start"):
        with torch.cuda.graph(graph):
            with tracker.fork():
                raise AssertionError("fork must refuse a foreign capture")
    assert not torch.cuda.is_current_stream_capturing()


@cuda_fp8
def test_dropout_in_a_checkpoint_captured_by_torch_cuda_graph_is_refused():
    """A checkpoint region in a capture te did not start cannot replay its masks."""
    x = torch.randn(16, 16, device="cuda", requires_grad=True)

    def region(h):
        rng.check_dropout_replayable("te.TransformerLayer", 0.1, h)
        return h * 2

    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match=r"te.TransformerLayer: dropout \(p=0.1\) inside a "
                                           "te.checkpoint region whose recompute cannot replay"):
        with torch.cuda.graph(graph):
            te.checkpoint(region, x, use_reentrant=False)
    rng.check_dropout_replayable("te.TransformerLayer", 0.1, x)     # eagerly: fine
