"""What one forward call of a TE module does with FP8 (`ForwardPlan`, decided in
`TransformerEngineBaseModule.prepare_forward`), and the scope that hands it out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ...common.recipe import Recipe
from ..fp8 import FP8GlobalStateManager
from ..scaling import ScalingState

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
    recipe keeps delayed-scaling state (read on every cast, so decided once here).
    ``skip_weight_update``: the device flag that picks the cached or a fresh FP8
    weight (NOTE [Skip-update flag] in fp8_operands.py), else None. ``fwd_state``: the
    forward scaling state the casts use (the live one, or a recompute's stash), for a
    delayed-scaling recipe. ``traced``: made while dynamo traces (NOTE [torch.compile]
    in torch_compile.py); the backward of GEMM ``bwd_update_gemm`` (-1: none) then
    updates the module's backward state, with the autocast's ``group``.
    """

    fp8: bool
    recipe: Optional[Recipe]
    record_amax: bool
    session: Any = None
    is_first_microbatch: Optional[bool] = None
    stash: Any = None
    recomputing: bool = False
    delayed: bool = field(init=False)
    skip_weight_update: Optional[torch.Tensor] = None
    fwd_state: Optional[ScalingState] = None
    traced: bool = False
    bwd_update_gemm: int = -1
    group: Any = None

    def __post_init__(self):
        self.delayed = self.recipe is not None and self.recipe.delayed()


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
