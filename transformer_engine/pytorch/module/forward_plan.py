"""What one forward call of a TE module does with FP8 (`ForwardPlan`, decided in
`TransformerEngineBaseModule.prepare_forward`), and the scope that hands it out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ...common.recipe import Recipe
from ..fp8 import FP8GlobalStateManager
from ..recompute import RecomputeStateError
from ..scaling import ScalingSnapshot, ScalingState

__all__ = ["ForwardPlan", "ForwardScope"]


@dataclass
class ForwardPlan:
    """What one forward call does with FP8, decided in `prepare_forward`.

    ``fp8``: GEMMs in FP8. ``recipe``: the recipe in force (FP8 or calibration).
    ``record_amax``: write amaxes into the live history row (training forward, not a
    recompute). ``session``: the autocast session whose backward update this call's
    backward asks for (a delayed-scaling FP8 training forward, or its recompute), else
    None (NOTE [Delayed-scaling update order] in amax_update.py).
    ``is_first_microbatch``: the value the caller passed to the module's forward
    (None, True or False; NOTE [FP8 weight cache] in fp8_operands.py). ``stash``: the
    recompute stash of this call (phase 1 fills its FP8 weights, the recompute reads
    them), else None. ``recomputing``: this call is a recompute. ``delayed``: the
    recipe keeps delayed-scaling state and ``blockwise``: it scales blocks
    (Float8BlockScaling, MXFP8, NVFP4; both read on every cast, so decided once here).
    ``skip_weight_update``: the device flag that picks the cached or a fresh FP8
    weight (NOTE [Skip-update flag] in fp8_operands.py), else None. ``fwd_state``: the
    forward scaling state the casts use (the live one, or a recompute's stash), for a
    delayed-scaling recipe. ``traced``: made while dynamo traces (NOTE [torch.compile]
    in torch_compile.py); the backward of GEMM ``bwd_update_gemm`` (-1: none) then
    updates the module's backward state, with the autocast's ``group``. ``replay``:
    for a call made in a recompute, the `PhaseFlags` of the outermost recompute
    running then; ``bwd_taken``: how many stashed backward states its backwards took,
    by slot (NOTE [Backward inside a checkpointed function] in recompute.py).
    """

    fp8: bool
    recipe: Optional[Recipe]
    record_amax: bool
    session: Any = None
    is_first_microbatch: Optional[bool] = None
    stash: Any = None
    recomputing: bool = False
    delayed: bool = field(init=False)
    blockwise: bool = field(init=False)
    skip_weight_update: Optional[torch.Tensor] = None
    fwd_state: Optional[ScalingState] = None
    traced: bool = False
    bwd_update_gemm: int = -1
    group: Any = None
    replay: Any = None
    bwd_taken: Optional[dict] = None

    def __post_init__(self):
        recipe = self.recipe
        self.delayed = recipe is not None and recipe.delayed()
        self.blockwise = (recipe is not None and not self.delayed
                          and (recipe.float8_block_scaling() or recipe.mxfp8()
                               or recipe.nvfp4()))

    def replaying(self) -> bool:
        """Whether a backward of this call runs now as part of the recompute that made
        the call (a backward inside the checkpointed function, run a second time)."""
        return self.replay is not None and self.replay.replaying

    def backward_state(self, live: Optional[ScalingState], slot: int):
        """``(state, record)`` for the backward cast of backward slot ``slot``: the
        state to cast with, and whether the cast records its amax, counts non-finite
        amaxes and asks for the backward update. A backward replayed by a recompute
        casts with the state the same backward of phase 1 used and records nothing; a
        backward inside a running phase 1 keeps that state for it (NOTE [Backward
        inside a checkpointed function] in recompute.py)."""
        stash = self.stash
        if not self.replaying():
            if (live is not None and stash is not None
                    and any(flags.recording for flags in stash.owners)):
                stash.backward.setdefault(slot, []).append(ScalingSnapshot(live))
            return live, True
        if live is None:            # current or block scaling: no state to replay
            return None, False
        taken = self.bwd_taken if self.bwd_taken is not None else {}
        self.bwd_taken = taken
        done = taken.get(slot, 0)
        kept = stash.backward.get(slot, ()) if stash is not None else ()
        if done >= len(kept):
            raise RecomputeStateError(
                "te.checkpoint: the recompute ran a backward of a delayed-scaling FP8 call "
                f"(backward #{done + 1} of slot {slot}) that the first forward did not run "
                f"({len(kept)} recorded). A backward inside the checkpointed function must "
                "run the same way in both phases.")
        taken[slot] = done + 1
        return kept[done].state, False


class ForwardScope:
    """What `prepare_forward` returns: yields the plan; on exit puts the live forward
    state back when the forward ran on a recompute stash (a class, not a generator:
    its enter and exit run on every module call)."""

    __slots__ = ("plan", "swapped_meta")

    def __init__(self, plan: ForwardPlan, swapped_meta: Optional[dict]):
        self.plan, self.swapped_meta = plan, swapped_meta

    def __enter__(self) -> ForwardPlan:
        return self.plan

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.swapped_meta is not None:
            FP8GlobalStateManager.restore_fp8_meta_tensors(self.swapped_meta)
