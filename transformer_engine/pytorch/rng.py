"""Named RNG states (`CudaRNGStatesTracker`, TE's tracker for tensor-parallel dropout)
and the snapshot of every RNG state a checkpoint call replays for its recompute."""

from __future__ import annotations

import contextlib
from typing import Dict, Optional

import torch

__all__ = ["CudaRNGStatesTracker", "RngSnapshot", "check_dropout_replayable"]


def _tracker_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _get_rng_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_rng_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class CudaRNGStatesTracker:
    """Named RNG states, so that e.g. tensor-parallel ranks can draw dropout masks
    from a shared or a per-rank stream. `fork(name)` runs a block on that state.

    Parameters
    ----------
    device : torch.device, optional
        The generator the states belong to: CUDA when available, else the CPU one.
    """

    def __init__(self, device=None):
        self.device = torch.device(device) if device is not None else _tracker_device()
        self.reset()

    def reset(self) -> None:
        self.states_: Dict[str, torch.Tensor] = {}
        self.seeds_: set = set()

    def get_states(self) -> Dict[str, torch.Tensor]:
        """Copies of the states (later draws do not change them)."""
        return {name: state.clone() for name, state in self.states_.items()}

    def set_states(self, states: Dict[str, torch.Tensor]) -> None:
        self.states_ = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        if name in self.states_:
            raise ValueError(f"CudaRNGStatesTracker.add: state {name!r} already exists")
        if seed in self.seeds_:
            raise ValueError(f"CudaRNGStatesTracker.add: seed {seed} is already used")
        self.seeds_.add(seed)
        original = _get_rng_state(self.device)
        try:
            if self.device.type == "cuda":
                with torch.cuda.device(self.device):
                    torch.cuda.manual_seed(seed)
            else:
                torch.manual_seed(seed)
            self.states_[name] = _get_rng_state(self.device)
        finally:
            _set_rng_state(original, self.device)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("CudaRNGStatesTracker.fork: the tracker's states are not "
                               "graph-safe; draw from torch's default generator inside a CUDA "
                               "graph (e.g. no get_rng_state_tracker for dropout there)")
        if name not in self.states_:
            raise KeyError(f"CudaRNGStatesTracker.fork: no state named {name!r}; "
                           f"call add({name!r}, seed) first (known: {sorted(self.states_)})")
        original = _get_rng_state(self.device)
        _set_rng_state(self.states_[name], self.device)
        try:
            yield
        finally:
            self.states_[name] = _get_rng_state(self.device)
            _set_rng_state(original, self.device)


class RngSnapshot:
    """RNG states at a checkpoint call, replayed for its recompute.

    Inside CUDA graph capture the CUDA generators' states cannot be read; the snapshot
    then holds none, and `check_dropout_replayable` refuses the dropout of TE modules
    in such a region (a recompute inside a graph would draw other masks)."""

    def __init__(self, tracker: Optional[CudaRNGStatesTracker]):
        self.cpu = torch.get_rng_state()
        self.cuda = (torch.cuda.get_rng_state_all()
                     if torch.cuda.is_initialized() and not torch.cuda.is_current_stream_capturing()
                     else None)
        self.tracker = tracker
        self.tracker_states = tracker.get_states() if tracker is not None else None

    @contextlib.contextmanager
    def replay(self):
        now_cpu = torch.get_rng_state()
        now_cuda = torch.cuda.get_rng_state_all() if self.cuda is not None else None
        now_tracker = self.tracker.get_states() if self.tracker is not None else None
        try:
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state_all(self.cuda)
            if self.tracker is not None:
                self.tracker.set_states(self.tracker_states)
            yield
        finally:
            torch.set_rng_state(now_cpu)
            if now_cuda is not None:
                torch.cuda.set_rng_state_all(now_cuda)
            if now_tracker is not None:
                self.tracker.set_states(now_tracker)


def check_dropout_replayable(api: str, p: float, x: torch.Tensor, in_region: bool) -> None:
    """Refuse dropout that a checkpoint recompute inside a CUDA graph could not replay
    (see `RngSnapshot`)."""
    if p > 0.0 and in_region and x.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"{api}: dropout (p={p}) inside a te.checkpoint region that is "
                           "captured in a CUDA graph is not supported: its recompute could not "
                           "replay the masks. Use dropout 0 in graphed checkpointed regions.")
