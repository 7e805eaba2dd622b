"""Named RNG states (`CudaRNGStatesTracker`, TE's tracker for tensor-parallel dropout)
and the snapshot of every RNG state a checkpoint call replays for its recompute.

NOTE [Tracker generators]
    Each named state of a tracker is a ``torch.Generator`` on the tracker's device.
    ``fork(name)`` makes the device's default generator draw from it for the block: on
    CUDA by pointing the default generator at the named generator's state
    (``graphsafe_get_state`` / ``graphsafe_set_state``, allowed during a CUDA graph
    capture, so draws advance the named generator itself); on the CPU, which has no such
    swap, by copying the state in and back out. A CUDA graph can draw from a generator
    only if it was registered with the graph before the capture began;
    ``te.make_graphed_callables`` registers the generators of every live CUDA tracker
    with each graph it captures (NOTE [Graph-safe RNG] in graph_rng.py), so replays
    advance them and draw fresh masks. ``get_states`` returns copies (byte tensors);
    ``set_states`` writes states into the existing generators in place, since a graph
    keeps drawing from the generator objects it was captured with.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Dict, List, Optional, Union

import torch

from . import recompute

__all__ = ["CudaRNGStatesTracker", "RngSnapshot", "check_dropout_replayable",
           "tracker_generators", "get_all_rng_states", "graph_capture", "active_graph_capture",
           "rng_states_restored"]

_LIVE_TRACKERS: "weakref.WeakSet[CudaRNGStatesTracker]" = weakref.WeakSet()
_LATEST_STATES: Dict[str, torch.Generator] = {}   # see get_all_rng_states


def _tracker_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _cuda_default(index: Optional[int] = None) -> torch.Generator:
    """The default CUDA generator of device ``index`` (the current device if None)."""
    return torch.cuda.default_generators[torch.cuda.current_device() if index is None else index]


class CudaRNGStatesTracker:
    """Named RNG states, so that e.g. tensor-parallel ranks can draw dropout masks
    from a shared or a per-rank stream. `fork(name)` runs a block on that state
    (NOTE [Tracker generators]).

    Parameters
    ----------
    device : torch.device, optional
        The device the states belong to: CUDA when available, else the CPU.
    """

    def __init__(self, device=None):
        self.device = torch.device(device) if device is not None else _tracker_device()
        self.reset()
        _LIVE_TRACKERS.add(self)

    def _generator_device(self) -> torch.device:
        if self.device.type == "cuda" and self.device.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        return self.device

    def reset(self) -> None:
        """Forget every state (a graph captured before keeps the generators it drew from)."""
        self.states_: Dict[str, torch.Generator] = {}
        self.seeds_: set = set()

    def get_states(self) -> Dict[str, torch.Tensor]:
        """Copies of the states, as byte tensors (later draws do not change them)."""
        return {name: gen.get_state() for name, gen in self.states_.items()}

    def set_states(self, states: Dict[str, Union[torch.Tensor, torch.Generator]]) -> None:
        """Make ``states`` (byte tensors from `get_states`, or generators) the tracker's
        states: written into the generator of each existing name, a new generator for a
        new name; names not in ``states`` are dropped."""
        if not isinstance(states, dict):
            raise TypeError(f"CudaRNGStatesTracker.set_states: states must be a dict of name -> "
                            f"state, got {type(states).__name__}")
        kept: Dict[str, torch.Generator] = {}
        for name, state in states.items():
            if isinstance(state, torch.Generator):
                state = state.get_state()
            if not torch.is_tensor(state):
                raise TypeError(f"CudaRNGStatesTracker.set_states: the state of {name!r} must be "
                                f"a byte tensor or a torch.Generator, got {type(state).__name__}")
            gen = self.states_.get(name)
            if gen is None:
                gen = torch.Generator(device=self._generator_device())
            gen.set_state(state)
            kept[name] = gen
        self.states_ = kept
        _set_latest_states(self.states_)

    def add(self, name: str, seed: int) -> None:
        if name in self.states_:
            raise ValueError(f"CudaRNGStatesTracker.add: state {name!r} already exists")
        if seed in self.seeds_:
            raise ValueError(f"CudaRNGStatesTracker.add: seed {seed} is already used")
        self.seeds_.add(seed)
        gen = torch.Generator(device=self._generator_device())
        gen.manual_seed(seed)
        self.states_[name] = gen
        _set_latest_states(self.states_)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise KeyError(f"CudaRNGStatesTracker.fork: no state named {name!r}; "
                           f"call add({name!r}, seed) first (known: {sorted(self.states_)})")
        gen = self.states_[name]
        if gen.device.type != "cuda":
            with _copied_in(torch.default_generator, gen):
                yield
            return
        if torch.cuda.is_current_stream_capturing():
            _check_capturable(name, gen)
        default = _cuda_default(gen.device.index)
        outside = default.graphsafe_get_state()
        default.graphsafe_set_state(gen)
        try:
            yield
        finally:
            default.graphsafe_set_state(outside)


@contextlib.contextmanager
def _copied_in(default: torch.Generator, gen: torch.Generator):
    """Run a block on ``gen``'s state by copying it into ``default`` and back."""
    outside = default.get_state()
    default.set_state(gen.get_state())
    try:
        yield
    finally:
        gen.set_state(default.get_state())
        default.set_state(outside)


def _set_latest_states(states: Dict[str, torch.Generator]) -> None:
    global _LATEST_STATES
    _LATEST_STATES = states


def get_all_rng_states() -> Dict[str, torch.Generator]:
    """The named states of the tracker that last added or set its states, as TE's
    ``transformer_engine.pytorch.distributed.get_all_rng_states`` gives them: the
    tracker's own dict of name -> ``torch.Generator`` (not copies), process-wide as in TE.
    Megatron-LM reads it through its TE RNG tracker to register the generators with the
    CUDA graphs it captures."""
    return _LATEST_STATES


def tracker_generators(device: torch.device) -> List[torch.Generator]:
    """The generators of every live tracker on ``device``."""
    return [gen for tracker in list(_LIVE_TRACKERS) for gen in tracker.states_.values()
            if gen.device == device]


# ---- the te.make_graphed_callables capture underway (graph_rng.py) ---------------------

_capture = None


@contextlib.contextmanager
def graph_capture(capture):
    """Mark ``capture`` (a graph_rng.GraphRng) as the capture underway, process-wide:
    a backward capture runs its recomputes in autograd's threads."""
    global _capture
    saved, _capture = _capture, capture
    try:
        yield
    finally:
        _capture = saved


def active_graph_capture():
    """The te.make_graphed_callables capture underway on this stream, or None."""
    if _capture is not None and torch.cuda.is_current_stream_capturing():
        return _capture
    return None


def _check_capturable(name: str, gen: torch.Generator) -> None:
    capture = active_graph_capture()
    if capture is None:
        raise RuntimeError(
            f"CudaRNGStatesTracker.fork: state {name!r} is used inside a CUDA graph capture that "
            "te.make_graphed_callables did not start; only its captures register the "
            "tracker's generators with the graph (NOTE [Tracker generators]). Capture with "
            "te.make_graphed_callables, or draw from torch's default generator.")
    if not capture.is_registered(gen):
        raise RuntimeError(
            f"CudaRNGStatesTracker.fork: state {name!r} is not registered with the CUDA graph "
            "being captured: te.make_graphed_callables registers the states trackers hold when "
            f"a capture begins; add({name!r}, seed) before calling it.")


@contextlib.contextmanager
def rng_states_restored(device: torch.device):
    """On exit put back the CPU generator, ``device``'s default generator and every live
    tracker's states as they were on entry (around eager warm-up iterations)."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state(device)
    trackers = [(t, t.get_states()) for t in list(_LIVE_TRACKERS)]
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        torch.cuda.set_rng_state(cuda, device)
        for tracker, states in trackers:
            for name, state in states.items():
                if name in tracker.states_:
                    tracker.states_[name].set_state(state)


class RngSnapshot:
    """RNG states at a checkpoint call, replayed for its recompute.

    Eagerly: copies of the CPU and CUDA generators' states and of the tracker's,
    written back around the recompute. During a forward capture by
    te.make_graphed_callables: a `graph_rng.ReplaySlot`, whose replay generators the
    recompute draws from (NOTE [Graph-safe RNG]). In any other capture the states
    cannot be read: the snapshot holds none and ``graph_safe`` is False, and
    `check_dropout_replayable` refuses the dropout of TE modules in the region."""

    def __init__(self, tracker: Optional[CudaRNGStatesTracker]):
        self.cpu = torch.get_rng_state()
        self.tracker = tracker
        self.slot = None
        self.cuda = self.tracker_states = None
        capturing = torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()
        if capturing:
            capture = active_graph_capture()
            cuda_tracker = tracker if tracker is not None and tracker.device.type == "cuda" \
                else None
            self.slot = capture.checkpoint_slot(cuda_tracker) if capture is not None else None
            if tracker is not None and cuda_tracker is None:
                self.tracker_states = tracker.get_states()
        else:
            if torch.cuda.is_initialized():
                self.cuda = torch.cuda.get_rng_state_all()
            if tracker is not None:
                self.tracker_states = tracker.get_states()
        self.graph_safe = not capturing or self.slot is not None

    @contextlib.contextmanager
    def replay(self):
        now_cpu = torch.get_rng_state()
        now_cuda = torch.cuda.get_rng_state_all() if self.cuda is not None else None
        now_tracker = self.tracker.get_states() if self.tracker_states is not None else None
        try:
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state_all(self.cuda)
            if self.tracker_states is not None:
                self.tracker.set_states(self.tracker_states)
            if self.slot is not None:
                with self._slot_swapped_in():
                    yield
            else:
                yield
        finally:
            torch.set_rng_state(now_cpu)
            if now_cuda is not None:
                torch.cuda.set_rng_state_all(now_cuda)
            if now_tracker is not None:
                self.tracker.set_states(now_tracker)

    @contextlib.contextmanager
    def _slot_swapped_in(self):
        """The recompute, inside a backward capture, draws from the slot's replay
        generators: the default CUDA generator and the tracker's states point at them."""
        if not torch.cuda.is_current_stream_capturing():
            raise RuntimeError("te.checkpoint: a region captured in a CUDA graph's forward can "
                               "only be recomputed inside the graph's backward capture")
        default = _cuda_default()
        outside = default.graphsafe_get_state()
        tracker_outside = self.tracker.states_ if self.slot.tracker_replay else None
        default.graphsafe_set_state(self.slot.default_replay)
        if tracker_outside is not None:
            self.tracker.states_ = dict(self.slot.tracker_replay)
        try:
            yield
        finally:
            default.graphsafe_set_state(outside)
            if tracker_outside is not None:
                self.tracker.states_ = tracker_outside


def check_dropout_replayable(api: str, p: float, x: torch.Tensor) -> None:
    """Refuse dropout in a checkpoint region whose recompute, inside a CUDA graph, could
    not replay the masks (an `RngSnapshot` that is not ``graph_safe``)."""
    # (not while dynamo traces: it cannot trace the capture query, and a compiled
    # region is not captured by te.make_graphed_callables' recompute)
    if (p > 0.0 and x.is_cuda and not torch.compiler.is_compiling()
            and torch.cuda.is_current_stream_capturing()
            and any(not frame.rng_graph_safe for frame, _ in recompute.position().frames)):
        raise RuntimeError(
            f"{api}: dropout (p={p}) inside a te.checkpoint region whose recompute cannot "
            "replay the masks in a CUDA graph: only a region that te.make_graphed_callables "
            "captures in a forward is replayable (not a region checkpointed inside a "
            "recompute, nor one captured by torch.cuda.graph directly). Use dropout 0 there.")
