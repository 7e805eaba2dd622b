"""The FP8 global state: the per-thread FP8 autocast, the hooks modules call, and
FP8 availability.

The delayed-scaling update this state drives is in amax_update.py (NOTE
[Delayed-scaling update order]); the recompute stashes the hooks fill are in
recompute.py (NOTE [Recompute stashes]).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..common.recipe import DelayedScaling, Recipe, validated_copy
from . import amax_update, non_finite, recompute, torch_compile
from .amax_update import AutocastSession
# quantized_model_init / fp8_model_init: TE's fp8 module has them too
# is_fp8_available and the check_*_support queries: TE's fp8 module has them too
from .fp8_support import (check_fp8_block_scaling_support, check_fp8_support,  # noqa: F401
                          check_mxfp8_support, is_fp8_available)
from .model_init import _MODEL_INIT, _ModelInitState, fp8_model_init, quantized_model_init
from .recompute import RecomputeStash, RecomputeStateError
from .scaling import ScalingSnapshot, ScalingState
from .utils import check_process_group

__all__ = ["ScalingState", "FP8GlobalStateManager", "autocast", "fp8_autocast",
           "is_fp8_available", "get_default_fp8_recipe", "RecomputeStateError"]


@dataclass(frozen=True)
class _AutocastState:
    """One thread's FP8 autocast state; replaced whole on enter, put back whole on exit."""

    enabled: bool = False
    calibrating: bool = False
    recipe: Optional[Recipe] = None          # as passed to the autocast
    checked_recipe: Optional[Recipe] = None  # its read-only copy (NOTE [Recipe validation])
    group: Any = None
    depth: int = 0
    session: Optional[AutocastSession] = None


class _ThreadAutocast(threading.local):
    # set per thread (not a class default): compiled code reads it from the thread's
    # own attributes (NOTE [torch.compile] in torch_compile.py)
    def __init__(self):
        self.state = _AutocastState()


_THREAD = _ThreadAutocast()


class _SkipWeightUpdate:
    """The process-wide skip-update flag (NOTE [Skip-update flag] in
    module/fp8_operands.py): one tensor, filled in place so that captured graphs keep
    reading it."""

    tensor: Optional[torch.Tensor] = None


class _GraphWarmUp(threading.local):
    def __init__(self):
        self.active = False


_GRAPH_WARM_UP = _GraphWarmUp()


@contextlib.contextmanager
def graph_warm_up():
    """The warm-up of ``te.make_graphed_callables(cache_quantized_params=True)``: module
    forwards read the skip-update tensor as they will while captured, so that the
    warm-up makes the FP8 weight caches the captured forwards select from."""
    previous = _GRAPH_WARM_UP.active
    _GRAPH_WARM_UP.active = True
    try:
        yield
    finally:
        _GRAPH_WARM_UP.active = previous


def get_default_fp8_recipe() -> Recipe:
    """The recipe an autocast uses when none is given: ``DelayedScaling()``."""
    return DelayedScaling()


class FP8GlobalStateManager:
    """Class-level access to the FP8 autocast state of the calling thread (per thread,
    as ``torch.autocast``'s is) and the hooks modules call.

    The state is one `_AutocastState` object per thread; `reset()` replaces it.
    """

    # ---- queries ---------------------------------------------------------------
    @staticmethod
    def get_meta_tensor_key(forward: bool = True) -> str:
        """The ``fp8_meta`` key of a module's forward (``"scaling_fwd"``) or backward
        (``"scaling_bwd"``) delayed-scaling state."""
        return "scaling_fwd" if forward else "scaling_bwd"

    @classmethod
    def reset(cls) -> None:
        """Back to no autocast and no ``quantized_model_init`` on this thread, and no
        skip-update tensor (process-wide). Pending backward updates still run."""
        _THREAD.state = _AutocastState()
        _MODEL_INIT.state = _ModelInitState()
        _SkipWeightUpdate.tensor = None

    @classmethod
    def with_fp8_parameters(cls) -> bool:
        """Whether modules built now get FP8 primary weights (``quantized_model_init``)."""
        return _MODEL_INIT.state.enabled

    @classmethod
    def with_high_precision_init_val(cls) -> bool:
        """Whether FP8 primary weights built now keep their initial value."""
        return _MODEL_INIT.state.preserve_high_precision_init_val

    @classmethod
    def is_fp8_enabled(cls) -> bool:
        return _THREAD.state.enabled

    @classmethod
    def is_fp8_calibration(cls) -> bool:
        return _THREAD.state.calibrating

    @classmethod
    def get_fp8_recipe(cls) -> Recipe:
        recipe = _THREAD.state.recipe
        return recipe if recipe is not None else get_default_fp8_recipe()

    @classmethod
    def get_checked_fp8_recipe(cls) -> Recipe:
        """The read-only copy of the recipe that the running autocast took at entry, which
        the modules run (NOTE [Recipe validation] in common/recipe.py)."""
        checked = _THREAD.state.checked_recipe
        return checked if checked is not None else validated_copy(get_default_fp8_recipe())

    @classmethod
    def get_fp8_group(cls):
        return _THREAD.state.group

    @classmethod
    def get_autocast_depth(cls) -> int:
        return _THREAD.state.depth

    @classmethod
    def get_fp8_autocast_state(cls) -> _AutocastState:
        return _THREAD.state

    @classmethod
    def set_fp8_autocast_state(cls, state: _AutocastState) -> None:
        _THREAD.state = state

    @classmethod
    def current_session(cls) -> Optional[AutocastSession]:
        return _THREAD.state.session

    @classmethod
    def get_non_finite_amax_count(cls) -> int:
        """NaN or infinite amaxes seen so far (NOTE [Non-finite amaxes])."""
        return non_finite.non_finite_amax_count()

    @classmethod
    def reset_non_finite_amax_count(cls) -> None:
        non_finite.reset_non_finite_amax_count()

    # ---- FP8 weight updates under CUDA graphs (NOTE [Skip-update flag]) ----------
    @classmethod
    def set_skip_fp8_weight_update_tensor(cls, skip) -> None:
        """Fill the skip-update tensor with ``skip`` (True / 1.0: a module forward
        captured in a CUDA graph keeps its cached FP8 weight; False / 0.0: it casts the
        weight afresh). The tensor, a float32 ``[1]`` on CUDA if available else the CPU,
        is made at the first call and filled in place after, so graphs that read it
        see each new value. ``skip`` is a bool, a number, or a one-element tensor
        (copied on the device, no host sync)."""
        api = "FP8GlobalStateManager.set_skip_fp8_weight_update_tensor"
        if torch.is_tensor(skip):
            if skip.numel() != 1 or skip.dtype.is_complex:
                raise ValueError(f"{api}: skip must be a bool, a number or a one-element real "
                                 f"tensor, got a {skip.dtype} tensor of shape "
                                 f"{tuple(skip.shape)}")
        elif not isinstance(skip, (bool, int, float)):
            raise TypeError(f"{api}: skip must be a bool, a number or a one-element tensor, "
                            f"got {type(skip).__name__}")
        if _SkipWeightUpdate.tensor is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
            _SkipWeightUpdate.tensor = torch.empty(1, dtype=torch.float32, device=device)
        flag = _SkipWeightUpdate.tensor
        if torch.is_tensor(skip):
            flag.copy_(skip.reshape(1), non_blocking=True)
        else:
            flag.fill_(float(skip))

    @classmethod
    def get_skip_fp8_weight_update_tensor(cls) -> Optional[torch.Tensor]:
        """The skip-update tensor, or None before the first
        `set_skip_fp8_weight_update_tensor` (and after `reset`)."""
        return _SkipWeightUpdate.tensor

    @classmethod
    def fp8_graph_capturing(cls) -> bool:
        """Whether the current CUDA stream is capturing a graph, or this thread runs the
        warm-up of graphs that cache FP8 weights (`graph_warm_up`): module forwards then
        take the FP8 weight choice from the skip-update tensor, when one is set."""
        return _GRAPH_WARM_UP.active or (torch.cuda.is_available()
                                         and torch.cuda.is_current_stream_capturing())

    # ---- autocast --------------------------------------------------------------
    @classmethod
    def fp8_autocast_enter(cls, enabled: bool, calibrating: bool, recipe: Recipe, group) -> None:
        traced = torch.compiler.is_compiling()
        if traced:      # a graph cannot change the recipe: no copy (NOTE [torch.compile])
            recipe.validate()
            checked = recipe
        else:
            checked = validated_copy(recipe)
        s = _THREAD.state
        session = s.session if s.depth > 0 else AutocastSession(traced)
        _THREAD.state = _AutocastState(enabled=enabled, calibrating=calibrating, recipe=recipe,
                                       checked_recipe=checked, group=group, depth=s.depth + 1,
                                       session=session)

    @classmethod
    def add_fp8_tensors_to_global_buffer(cls, fp8_meta: dict) -> None:
        """Register a module's delayed-scaling state for the session's update."""
        s = _THREAD.state
        if s.session is not None:
            s.session.register(fp8_meta, fp8_meta["recipe"], s.group)

    @classmethod
    def reduce_and_update_fp8_tensors(cls, forward: bool = True,
                                      session: Optional[AutocastSession] = None) -> None:
        """Update the forward (or backward) delayed-scaling state of a session's modules
        now (the running session's when None)."""
        session = session if session is not None else _THREAD.state.session
        if session is not None:
            amax_update.update_sessions([session], forward)

    # ---- recompute hooks (NOTE [Recompute stashes] in recompute.py) ------------
    # TE's signatures, ``(fp8_meta) -> None``: a caller (or a wrapper a test installs
    # on this class) needs nothing back. What the module needs travels in ``fp8_meta``:
    # `RECOMPUTE_POSITION_KEY` (TE's key: set once the module stashed, kept after) and,
    # for the one call that is running, `RECOMPUTE_STASH_KEY` (the module takes it).
    @classmethod
    def copy_forward_fp8_meta_tensors_for_recompute(cls, fp8_meta: dict) -> None:
        """Phase 1: stash this module's forward scale and amax history, with the
        autocast session of a training forward, into every checkpoint call that is
        recording; a no-op for a module without delayed-scaling state."""
        if not _has_delayed_scaling_state(fp8_meta):
            return
        training = cls.is_fp8_enabled() and recompute.is_training_forward()
        entry = RecomputeStash(ScalingSnapshot(fp8_meta["scaling_fwd"]),
                               cls.current_session() if training else None, {},
                               recompute.recording_flags(), {})
        position = recompute.stash(fp8_meta, entry)
        if position is not None:                # (None: no checkpoint call is recording)
            fp8_meta[RECOMPUTE_POSITION_KEY] = position
            fp8_meta[RECOMPUTE_STASH_KEY] = entry

    @classmethod
    def get_old_fp8_meta_tensors_for_recompute(cls, fp8_meta: dict) -> None:
        """Phase 2: swap this call's stashed forward state in (the live one waits under
        ``"updated_fp8_state_fwd"`` for `restore_fp8_meta_tensors`); a no-op for a
        module without delayed-scaling state."""
        if not _has_delayed_scaling_state(fp8_meta):
            return
        entry = recompute.take(fp8_meta)
        fp8_meta["updated_fp8_state_fwd"] = fp8_meta["scaling_fwd"]
        fp8_meta["scaling_fwd"] = entry.snapshot.state
        fp8_meta[RECOMPUTE_STASH_KEY] = entry

    @staticmethod
    def restore_fp8_meta_tensors(fp8_meta: dict) -> None:
        """Phase 2, after the forward: put the live forward state back (a no-op when
        nothing was swapped in)."""
        fp8_meta.pop(RECOMPUTE_STASH_KEY, None)
        if "updated_fp8_state_fwd" in fp8_meta:
            fp8_meta["scaling_fwd"] = fp8_meta.pop("updated_fp8_state_fwd")


RECOMPUTE_POSITION_KEY = "global_fp8_buffer_pos_fwd_recompute"
"""The ``fp8_meta`` key of a module that stashed recompute state (TE's key): its
position in the innermost recording checkpoint call."""

RECOMPUTE_STASH_KEY = "recompute_stash_fwd"
"""The ``fp8_meta`` key under which the recompute hooks leave the running call's
`RecomputeStash` for the module (which takes it off in phase 1;
`restore_fp8_meta_tensors` does in phase 2)."""


def _has_delayed_scaling_state(fp8_meta: dict) -> bool:
    recipe = fp8_meta.get("recipe")
    return recipe is not None and recipe.delayed() and fp8_meta.get("scaling_fwd") is not None


def _check_autocast_args(api: str, enabled, calibrating, recipe, group_name: str,
                         group) -> None:
    if not isinstance(enabled, bool):
        raise TypeError(f"{api}: enabled must be a bool, got {enabled!r}")
    if not isinstance(calibrating, bool):
        raise TypeError(f"{api}: calibrating must be a bool, got {calibrating!r}")
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(f"{api}: the recipe must be a transformer_engine.common.recipe.Recipe "
                        f"(DelayedScaling, Float8CurrentScaling, Float8BlockScaling) or None, "
                        f"got {type(recipe).__name__}")
    if recipe is not None:
        # Fields may have been set since construction (NOTE [Recipe validation]).
        try:
            if torch.compiler.is_compiling():
                recipe.validate()
            else:
                validated_copy(recipe)
        except (TypeError, ValueError) as err:
            raise type(err)(f"{api}: {err}") from None
    if recipe is not None and (enabled or calibrating):
        name = type(recipe).__name__
        if not recipe.implemented():
            raise NotImplementedError(
                f"{api}: {name} is not implemented by this pure-PyTorch Transformer Engine; use "
                "DelayedScaling, Float8CurrentScaling or Float8BlockScaling")
        for flag in ("fp8_dpa", "fp8_mha"):
            if getattr(recipe, flag, False):
                raise NotImplementedError(
                    f"{api}: {name}.{flag}=True (FP8 attention) is not implemented by this "
                    f"pure-PyTorch Transformer Engine: attention runs in high precision; set "
                    f"{flag}=False")
    check_process_group(api, group_name, group)


@contextlib.contextmanager
def autocast(enabled: bool = True, calibrating: bool = False, recipe: Optional[Recipe] = None,
             amax_reduction_group=None):
    """Run TE modules in FP8.

    Parameters
    ----------
    enabled : bool, default True
        Whether TE modules inside run their GEMMs in FP8.
    calibrating : bool, default False
        Record amaxes (and update scales) while running in high precision.
    recipe : Recipe, optional
        ``DelayedScaling()`` when None. Its fields are checked again here and the
        autocast runs a copy of them taken now (NOTE [Recipe validation] in
        common/recipe.py): a field set later takes effect at the next entry.
    amax_reduction_group : torch.distributed.ProcessGroup, optional
        Group over which amaxes are all-reduced (MAX) before each update; the
        default process group when None and torch.distributed is initialized.

    Nestable, per thread. On exit the previous state is restored exactly; the outermost
    exit of a training forward updates the delayed-scaling state (NOTE [Delayed-scaling
    update order] in amax_update.py). An exception inside restores the state and drops
    the amaxes it recorded.
    """
    _check_autocast_args("te.autocast", enabled, calibrating, recipe, "amax_reduction_group",
                         amax_reduction_group)
    saved = FP8GlobalStateManager.get_fp8_autocast_state()
    recipe = recipe if recipe is not None else get_default_fp8_recipe()
    FP8GlobalStateManager.fp8_autocast_enter(enabled, calibrating, recipe, amax_reduction_group)
    session = FP8GlobalStateManager.current_session()
    outermost = saved.depth == 0
    if outermost and session.traced:        # NOTE [torch.compile] in torch_compile.py
        try:
            yield
            torch_compile.exit_traced_autocast(session, recompute.in_phase())
        finally:
            FP8GlobalStateManager.set_fp8_autocast_state(saved)
        return
    try:
        yield
    except BaseException:
        if outermost and session is not None and not recompute.in_phase():
            session.discard_forward_amaxes()
        raise
    else:
        if outermost and not recompute.in_phase():
            FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=True, session=session)
    finally:
        FP8GlobalStateManager.set_fp8_autocast_state(saved)


def fp8_autocast(enabled: bool = True, calibrating: bool = False,
                 fp8_recipe: Optional[Recipe] = None, fp8_group=None):
    """The older spelling of `autocast` (``fp8_recipe`` / ``fp8_group``)."""
    _check_autocast_args("te.fp8_autocast", enabled, calibrating, fp8_recipe, "fp8_group",
                         fp8_group)
    return autocast(enabled=enabled, calibrating=calibrating, recipe=fp8_recipe,
                    amax_reduction_group=fp8_group)


__all__ += ["check_fp8_support", "check_mxfp8_support", "check_fp8_block_scaling_support",
            "quantized_model_init", "fp8_model_init"]
