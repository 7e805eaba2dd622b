"""Graph-safe RNG for ``te.make_graphed_callables``: every generator a capture draws
from is registered with its graphs, and a checkpoint recompute captured in a backward
graph replays the RNG states of its checkpoint call.

NOTE [Graph-safe RNG]
    A CUDA graph reads each registered generator's seed and offset from device memory
    that every replay first fills from the generator's host state, and the replay then
    advances the host offset by what the graph draws (PyTorch's graph-safe RNG). So a
    replay draws fresh numbers each step, exactly those an eager run from the same
    states draws, provided every generator the capture draws from was registered before
    the capture began: the default CUDA generator (torch registers it) and the named
    generators of every live `CudaRNGStatesTracker`, which its forks swap in (NOTE
    [Tracker generators] in rng.py).

    A checkpoint recompute must draw what its phase 1 drew, from the states at the
    checkpoint call. Eagerly they are read at the call and written back around the
    recompute (rng.RngSnapshot). In a graph neither can be done at capture time (host
    state cannot be read or set while capturing), and at the call's point inside a
    forward graph the states exist only on the device. So the forward is captured in
    segments, a new graph at every checkpoint call: a replay runs the segments in
    order, and between two of them the host states are exactly those at the call, which
    it reads. Each call gets a `ReplaySlot`: replay generators (one for the default
    generator, one per tracker state) registered with the backward graph, which the
    recompute draws from (the snapshot's replay swaps them in). Before replaying the
    backward graph, the graphed callable writes into them the states its forward replay
    read. A checkpoint call made inside a recompute is captured in the (unsplit)
    backward graph and gets no slot: dropout of TE modules in it is refused
    (rng.check_dropout_replayable).
"""

from __future__ import annotations

import contextlib
from typing import Dict, List, Optional

import torch

from . import rng

__all__ = ["GraphRng", "ReplaySlot"]


class ReplaySlot:
    """One checkpoint call of a forward capture: the generators whose host states its
    recompute needs (read between segments at replay) and the replay generators its
    recompute draws from (written before the backward replay), in the same order."""

    __slots__ = ("sources", "default_replay", "tracker_replay")

    def __init__(self, default_source: torch.Generator,
                 tracker_sources: Dict[str, torch.Generator], device: torch.device):
        self.sources = [default_source, *tracker_sources.values()]
        self.default_replay = torch.Generator(device=device)
        self.tracker_replay = {name: torch.Generator(device=device) for name in tracker_sources}

    def replay_generators(self) -> List[torch.Generator]:
        return [self.default_replay, *self.tracker_replay.values()]

    def read(self) -> List[torch.Tensor]:
        return [gen.get_state() for gen in self.sources]

    def write(self, states: List[torch.Tensor]) -> None:
        for gen, state in zip(self.replay_generators(), states):
            gen.set_state(state)


class GraphRng:
    """The forward segments of one graphed callable, its checkpoint calls' replay
    slots, and the generators registered with the capture underway
    (NOTE [Graph-safe RNG])."""

    def __init__(self, pool, stream: torch.cuda.Stream):
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.pool, self.stream = pool, stream
        self.segments: List[torch.cuda.CUDAGraph] = []
        self.slots: List[ReplaySlot] = []
        self._registered: List[torch.Generator] = []
        self._registered_ids: set = set()
        self._open: Optional[torch.cuda.CUDAGraph] = None
        self._splittable = False
        self._default_state: Optional[torch.Generator] = None

    # ---- capture ---------------------------------------------------------------------
    def _register(self, graph: torch.cuda.CUDAGraph, extra=()) -> None:
        """Register every generator the capture may draw from (before it begins)."""
        gens = [self._default_state, *rng.tracker_generators(self.device), *extra]
        for gen in gens:
            graph.register_generator_state(gen)
        self._registered = gens
        self._registered_ids = {id(g) for g in gens}

    def is_registered(self, gen: torch.Generator) -> bool:
        return id(gen) in self._registered_ids

    def _begin_segment(self) -> None:
        graph = torch.cuda.CUDAGraph()
        self._register(graph)
        graph.capture_begin(pool=self.pool)
        self.segments.append(graph)
        self._open = graph

    def _end_segment(self) -> None:
        graph, self._open = self._open, None
        graph.capture_end()

    @contextlib.contextmanager
    def capture_forward(self):
        """Capture the block as the forward segments; a checkpoint call inside starts a
        new segment (`checkpoint_slot`)."""
        self._default_state = torch.cuda.default_generators[self.device.index] \
            .graphsafe_get_state()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        with torch.cuda.stream(self.stream):
            self._begin_segment()
            finished = False
            try:
                self._splittable = True
                with rng.graph_capture(self):
                    yield
                finished = True
            finally:
                self._splittable = False
                if finished:
                    self._end_segment()
                elif self._open is not None:
                    _end_quietly(self._open)
                    self._open = None

    @contextlib.contextmanager
    def capture_backward(self, graph: torch.cuda.CUDAGraph):
        """Capture the block into ``graph`` with the replay generators of every slot
        registered too (the recomputes draw from them)."""
        self._register(graph, [g for slot in self.slots for g in slot.replay_generators()])
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream), \
                rng.graph_capture(self):
            yield

    def checkpoint_slot(self, tracker) -> Optional[ReplaySlot]:
        """At a checkpoint call during the forward capture: end the segment, make the
        call's slot, begin the next segment. None where the capture cannot be split
        (the backward)."""
        if not self._splittable:
            return None
        self._end_segment()
        sources = dict(tracker.states_) if tracker is not None else {}
        default = torch.cuda.default_generators[self.device.index]
        slot = ReplaySlot(default.graphsafe_get_state(), sources, self.device)
        self.slots.append(slot)
        self._begin_segment()
        return slot

    # ---- replay ------------------------------------------------------------------------
    def replay_forward(self) -> List[List[torch.Tensor]]:
        """Replay the segments; returns each slot's states, read at its call."""
        states = []
        for i, graph in enumerate(self.segments):
            if i:
                states.append(self.slots[i - 1].read())
            graph.replay()
        return states

    def prepare_backward(self, states: List[List[torch.Tensor]]) -> None:
        """Write the states a forward replay read into the slots' replay generators."""
        for slot, slot_states in zip(self.slots, states):
            slot.write(slot_states)


def _end_quietly(graph: torch.cuda.CUDAGraph) -> None:
    """End a capture that an error interrupted; the error being raised says why."""
    try:
        graph.capture_end()
    except RuntimeError:
        pass
