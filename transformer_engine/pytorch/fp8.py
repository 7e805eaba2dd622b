"""The FP8 global state: autocast, delayed-scaling updates, and the recompute hooks.

NOTE [Delayed-scaling update order]
    A module's forward inside an enabled autocast casts with the *current* scale of
    its ``fp8_meta["scaling_fwd"]`` and, in a training forward (grad enabled at the
    call site), records each tensor's amax into the live row (row 0) of its amax
    history and registers itself with the running *session* (one per outermost
    autocast). When that outermost autocast exits, every registered module's forward
    state is updated at once, per (recipe, group): one concatenated buffer, one
    optional MAX all-reduce, new scales from the history, history rolled.
    The first delayed-scaling FP8 module of the session to run its forward (so the
    last to run backward) carries the session into its autograd context; when its
    backward ends, the backward states of the session's modules update the same way.
    The activation recompute (`distributed.py`) records nothing and updates nothing:
    see NOTE [Recompute stashes] there.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..common.recipe import DelayedScaling, Recipe
from . import quantize

__all__ = ["ScalingState", "ScalingSnapshot", "copy_before_write", "FP8GlobalStateManager",
           "autocast", "fp8_autocast", "is_fp8_available", "get_default_fp8_recipe",
           "RecomputeStateError"]


class RecomputeStateError(RuntimeError):
    """An activation recompute could not find the FP8 state its forward stashed."""


@dataclass(eq=False)
class ScalingState:
    """Delayed-scaling state of one module's forward or backward tensors.

    ``scale[i]`` casts tensor ``i``; ``scale_inv = 1 / scale``; ``amax_history`` is
    ``[amax_history_len, n]`` with row 0 the live row being recorded this step.
    Compared by identity (it is mutable state, not a value).
    """

    scale: torch.Tensor
    scale_inv: torch.Tensor
    amax_history: torch.Tensor
    # The `_PendingCopy` that snapshots taken since the last update share (weakly: a
    # copy is made only while some snapshot still reads this state).
    pending: Optional["weakref.ref[_PendingCopy]"] = field(default=None, init=False, repr=False)

    @classmethod
    def new(cls, num_tensors: int, history_len: int, device) -> "ScalingState":
        return cls(torch.ones(num_tensors, dtype=torch.float32, device=device),
                   torch.ones(num_tensors, dtype=torch.float32, device=device),
                   torch.zeros(history_len, num_tensors, dtype=torch.float32, device=device))

    def clone(self) -> "ScalingState":
        return ScalingState(self.scale.clone(), self.scale_inv.clone(), self.amax_history.clone())

    def record_amax(self, index: int, amax_value: torch.Tensor) -> None:
        """Fold an amax into the live row (max with what this step already saw)."""
        live = self.amax_history[0, index]
        torch.maximum(live, amax_value, out=live)


class _PendingCopy:
    """Where the next update of one live state puts the copy that the snapshots taken
    before it read (one per state and update interval, shared by those snapshots, so
    the update never enumerates snapshots)."""

    __slots__ = ("copy", "__weakref__")

    def __init__(self):
        self.copy: Optional[ScalingState] = None


class ScalingSnapshot:
    """A `ScalingState` as it is now, copied on write: ``state`` is the live state
    itself until the delayed-scaling update is about to change it (`copy_before_write`),
    then a copy made just before. The scale is therefore exactly the one in force when
    the snapshot was taken (only the update changes it); the live amax row may also
    hold amaxes recorded later in the same autocast."""

    __slots__ = ("live", "pending")

    def __init__(self, live: ScalingState):
        pending = live.pending() if live.pending is not None else None
        if pending is None:
            pending = _PendingCopy()
            live.pending = weakref.ref(pending)
        self.live, self.pending = live, pending

    @property
    def state(self) -> ScalingState:
        copy = self.pending.copy
        return self.live if copy is None else copy


def copy_before_write(states: List[ScalingState]) -> None:
    """Give the snapshots still reading any of ``states`` a copy, before the states are
    changed in place: two concatenations (scales with scale_invs, and the histories
    side by side) per device and history length, whatever the number of states, and
    no per-state tensor op (the host cost of an update with many modules matters)."""
    groups: Dict[Tuple[torch.device, int], list] = {}
    for s in states:
        ref = s.pending
        if ref is not None:
            s.pending = None
            pending = ref()
            if pending is not None:
                key = (s.scale.device, s.amax_history.shape[0])
                groups.setdefault(key, []).append((s, pending))
    for todo in groups.values():
        sizes = [s.scale.shape[0] for s, _ in todo]
        vectors = torch.cat([s.scale for s, _ in todo] + [s.scale_inv for s, _ in todo])
        vectors = vectors.split(sizes + sizes)
        histories = torch.cat([s.amax_history for s, _ in todo], dim=1).split(sizes, dim=1)
        n = len(todo)
        for i, (_, pending) in enumerate(todo):
            pending.copy = ScalingState(vectors[i], vectors[n + i], histories[i])


def _distributed():
    """The checkpoint module (imported on first use: it imports this one)."""
    global _DISTRIBUTED
    if _DISTRIBUTED is None:
        from . import distributed
        _DISTRIBUTED = distributed
    return _DISTRIBUTED


_DISTRIBUTED = None


class _UpdateGroup:
    """Modules of one session that share a recipe and an amax-reduction group."""

    def __init__(self, recipe: DelayedScaling, group):
        self.recipe = recipe
        self.group = group
        self.metas: Dict[int, dict] = {}


class _AutocastSession:
    """What one outermost autocast collected: the modules to update, by
    (recipe, group), and whether the first FP8 module has been claimed."""

    def __init__(self):
        self.groups: Dict[Tuple[Recipe, Any], _UpdateGroup] = {}
        self.first_module_claimed = False

    def register(self, fp8_meta: dict, recipe: DelayedScaling, group) -> None:
        key = (recipe, group)
        if key not in self.groups:
            self.groups[key] = _UpdateGroup(recipe, group)
        self.groups[key].metas.setdefault(id(fp8_meta), fp8_meta)

    def update(self, forward: bool) -> None:
        for g in self.groups.values():
            _update_scaling_states(list(g.metas.values()), g.recipe, g.group, forward)

    def discard_forward_amaxes(self) -> None:
        """Forget the live forward amaxes of an autocast that raised."""
        for g in self.groups.values():
            states = [meta["scaling_fwd"] for meta in g.metas.values()]
            copy_before_write(states)
            for state in states:
                state.amax_history[0].zero_()


@dataclass(frozen=True)
class _AutocastState:
    """The FP8 autocast state; replaced whole on enter, put back whole on exit."""

    enabled: bool = False
    calibrating: bool = False
    recipe: Optional[Recipe] = None
    group: Any = None
    depth: int = 0
    session: Optional[_AutocastSession] = None


def _group_size(group) -> int:
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def _update_scaling_states(metas: List[dict], recipe: DelayedScaling, group,
                           forward: bool) -> None:
    """One delayed-scaling update of many modules' states, on concatenated buffers."""
    key = "scaling_fwd" if forward else "scaling_bwd"
    states = [m[key] for m in metas if m.get(key) is not None]
    if not states:
        return
    copy_before_write(states)       # recompute stashes keep the values they saw
    if recipe.reduce_amax and _group_size(group) > 1:
        # one MAX all-reduce of every live row, copied back before the update
        lives = [s.amax_history[0] for s in states]
        live = torch.cat(lives)
        torch.distributed.all_reduce(live, op=torch.distributed.ReduceOp.MAX, group=group)
        torch._foreach_copy_(lives, list(live.split([t.numel() for t in lives])))
    spec = recipe.fp8_format.value
    max_value = spec.max_fwd if forward else spec.max_bwd
    if recipe.scaling_factor_compute_algo is None:
        # one launch on CUDA (NOTE [Fused casts] in quantize.py)
        quantize.delayed_scaling_update_([s.amax_history for s in states],
                                         [s.scale for s in states],
                                         [s.scale_inv for s in states],
                                         max_value, recipe.margin, recipe.amax_compute_algo)
        return
    sizes = [s.scale.numel() for s in states]
    history = torch.cat([s.amax_history for s in states], dim=1)
    scale = torch.cat([s.scale for s in states])
    amax_value = quantize.amax_from_history(history, recipe.amax_compute_algo)
    new_scale = recipe.scaling_factor_compute_algo(
        amax_value, scale, torch.full_like(scale, max_value), recipe).to(torch.float32)
    torch._foreach_copy_(
        [t for s in states for t in (s.scale, s.scale_inv, s.amax_history)],
        [t for sc, h in zip(new_scale.split(sizes),
                            quantize.roll_amax_history(history).split(sizes, dim=1))
         for t in (sc, torch.reciprocal(sc), h)])


def get_default_fp8_recipe() -> Recipe:
    """The recipe an autocast uses when none is given: ``DelayedScaling()``."""
    return DelayedScaling()


class FP8GlobalStateManager:
    """Class-level holder of the FP8 autocast state and the hooks modules call.

    All state lives in one `_AutocastState` object; `reset()` replaces it.
    """

    _state: _AutocastState = _AutocastState()

    # ---- queries ---------------------------------------------------------------
    @classmethod
    def reset(cls) -> None:
        """Back to no autocast. Pending backward updates of earlier forwards still run."""
        cls._state = _AutocastState()

    @classmethod
    def is_fp8_enabled(cls) -> bool:
        return cls._state.enabled

    @classmethod
    def is_fp8_calibration(cls) -> bool:
        return cls._state.calibrating

    @classmethod
    def get_fp8_recipe(cls) -> Recipe:
        return cls._state.recipe if cls._state.recipe is not None else get_default_fp8_recipe()

    @classmethod
    def get_fp8_group(cls):
        return cls._state.group

    @classmethod
    def get_autocast_depth(cls) -> int:
        return cls._state.depth

    @classmethod
    def get_fp8_autocast_state(cls) -> _AutocastState:
        return cls._state

    @classmethod
    def set_fp8_autocast_state(cls, state: _AutocastState) -> None:
        cls._state = state

    @classmethod
    def is_first_fp8_module(cls) -> bool:
        """True for the first caller in the running session, False afterwards."""
        session = cls._state.session
        if session is None or session.first_module_claimed:
            return False
        session.first_module_claimed = True
        return True

    @classmethod
    def current_session(cls) -> Optional[_AutocastSession]:
        return cls._state.session

    # ---- autocast --------------------------------------------------------------
    @classmethod
    def fp8_autocast_enter(cls, enabled: bool, calibrating: bool, recipe: Recipe, group) -> None:
        s = cls._state
        session = s.session if s.depth > 0 else _AutocastSession()
        cls._state = _AutocastState(enabled=enabled, calibrating=calibrating, recipe=recipe,
                                    group=group, depth=s.depth + 1, session=session)

    @classmethod
    def add_fp8_tensors_to_global_buffer(cls, fp8_meta: dict) -> None:
        """Register a module's delayed-scaling state for the session's update."""
        s = cls._state
        if s.session is not None:
            s.session.register(fp8_meta, fp8_meta["recipe"], s.group)

    @classmethod
    def reduce_and_update_fp8_tensors(cls, forward: bool = True,
                                      session: Optional[_AutocastSession] = None) -> None:
        """Update the forward (or backward) delayed-scaling state of a session's modules."""
        session = session if session is not None else cls._state.session
        if session is not None:
            session.update(forward)

    # ---- recompute hooks (see NOTE [Recompute stashes] in distributed.py) ------
    @classmethod
    def copy_forward_fp8_meta_tensors_for_recompute(cls, fp8_meta: dict, bwd_session=None) -> None:
        """Phase 1: stash this module's forward scale and amax history into every
        checkpoint call that is recording."""
        distributed = _distributed()
        entry = distributed.RecomputeStash(ScalingSnapshot(fp8_meta["scaling_fwd"]), bwd_session)
        position = distributed.stash_for_recompute(fp8_meta, entry)
        fp8_meta["global_fp8_buffer_pos_fwd_recompute"] = position

    @classmethod
    def get_old_fp8_meta_tensors_for_recompute(cls, fp8_meta: dict):
        """Phase 2: swap this call's stashed forward state in; returns the stash."""
        entry = _distributed().take_recompute_stash(fp8_meta)
        fp8_meta["updated_fp8_state_fwd"] = fp8_meta["scaling_fwd"]
        fp8_meta["scaling_fwd"] = entry.snapshot.state
        return entry

    @classmethod
    def restore_fp8_meta_tensors(cls, fp8_meta: dict) -> None:
        """Phase 2, after the forward: put the live forward state back."""
        fp8_meta["scaling_fwd"] = fp8_meta.pop("updated_fp8_state_fwd")


def _check_autocast_args(api: str, enabled, calibrating, recipe, group) -> None:
    if not isinstance(enabled, bool):
        raise TypeError(f"{api}: enabled must be a bool, got {enabled!r}")
    if not isinstance(calibrating, bool):
        raise TypeError(f"{api}: calibrating must be a bool, got {calibrating!r}")
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(f"{api}: the recipe must be a transformer_engine.common.recipe.Recipe "
                        f"(DelayedScaling, Float8CurrentScaling) or None, got {type(recipe).__name__}")
    if group is not None:
        dist = torch.distributed
        if not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
            raise TypeError(f"{api}: the amax reduction group must be a "
                            f"torch.distributed.ProcessGroup or None, got {type(group).__name__}")


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
        ``DelayedScaling()`` when None.
    amax_reduction_group : torch.distributed.ProcessGroup, optional
        Group over which amaxes are all-reduced (MAX) before each update; the
        default process group when None and torch.distributed is initialized.

    Nestable. On exit the previous state is restored exactly; the outermost exit of a
    training forward updates the delayed-scaling state (NOTE [Delayed-scaling update
    order]). An exception inside restores the state and drops the amaxes it recorded.
    """
    _check_autocast_args("te.autocast", enabled, calibrating, recipe, amax_reduction_group)
    from .distributed import in_fp8_activation_recompute_phase
    saved = FP8GlobalStateManager.get_fp8_autocast_state()
    recipe = recipe if recipe is not None else get_default_fp8_recipe()
    FP8GlobalStateManager.fp8_autocast_enter(enabled, calibrating, recipe, amax_reduction_group)
    session = FP8GlobalStateManager.current_session()
    outermost = saved.depth == 0
    try:
        yield
    except BaseException:
        if outermost and session is not None and not in_fp8_activation_recompute_phase():
            session.discard_forward_amaxes()
        raise
    else:
        if outermost and not in_fp8_activation_recompute_phase():
            FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=True, session=session)
    finally:
        FP8GlobalStateManager.set_fp8_autocast_state(saved)


def fp8_autocast(enabled: bool = True, calibrating: bool = False,
                 fp8_recipe: Optional[Recipe] = None, fp8_group=None):
    """The older spelling of `autocast` (``fp8_recipe`` / ``fp8_group``)."""
    _check_autocast_args("te.fp8_autocast", enabled, calibrating, fp8_recipe, fp8_group)
    return autocast(enabled=enabled, calibrating=calibrating, recipe=fp8_recipe,
                    amax_reduction_group=fp8_group)


_CPU_FP8_PROBE: Optional[Tuple[bool, str]] = None


def _probe_cpu_fp8() -> Tuple[bool, str]:
    """Run the CPU FP8 GEMM once on a known product (NOTE [CPU FP8 GEMM])."""
    global _CPU_FP8_PROBE
    if _CPU_FP8_PROBE is None:
        try:
            one = torch.ones(1, dtype=torch.float32)
            a = quantize.Float8Data(torch.ones(16, 16, dtype=torch.float8_e4m3fn), one)
            out = quantize.fp8_gemm(a, a, torch.float32)
            ok = bool(out[0, 0].item() == 16.0)
            _CPU_FP8_PROBE = (ok, "" if ok else "the CPU FP8 GEMM gave a wrong result")
        except (RuntimeError, NotImplementedError) as err:
            _CPU_FP8_PROBE = (False, f"the CPU FP8 GEMM is not available: {err}")
    return _CPU_FP8_PROBE


def is_fp8_available(return_reason: bool = False, device=None):
    """Whether FP8 GEMMs can run on ``device`` (default: CUDA if present, else CPU).

    CUDA needs compute capability 8.9 (Ada) or newer; the CPU needs torch's FP8
    dtypes and the CPU FP8 GEMM to run (probed once).
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            ok, reason = False, "CUDA is not available"
        else:
            major, minor = torch.cuda.get_device_capability(device)
            ok = (major, minor) >= (8, 9)
            reason = "" if ok else f"FP8 needs compute capability 8.9+, device has {major}.{minor}"
    elif device.type == "cpu":
        ok, reason = _probe_cpu_fp8()
    else:
        ok, reason = False, f"FP8 GEMMs are not supported on device type {device.type!r}"
    return (ok, reason) if return_reason else ok


# ---- support checks and model-init contexts, as TE's clients call them ------------

def check_fp8_support() -> Tuple[bool, str]:
    """``(available, reason)``: whether FP8 GEMMs run on the default device (CUDA if
    present, else the CPU), as `is_fp8_available` decides; ``reason`` is empty when
    they do."""
    return is_fp8_available(return_reason=True)


_NOT_IMPLEMENTED_RECIPES = ("this pure-PyTorch Transformer Engine implements the DelayedScaling "
                            "and Float8CurrentScaling recipes only")


def check_mxfp8_support() -> Tuple[bool, str]:
    """``(False, reason)``: MXFP8 block scaling (``MXFP8BlockScaling``) is not implemented."""
    return False, f"MXFP8 block scaling is not implemented: {_NOT_IMPLEMENTED_RECIPES}"


def check_fp8_block_scaling_support() -> Tuple[bool, str]:
    """``(False, reason)``: FP8 block scaling (``Float8BlockScaling``) is not implemented."""
    return False, f"FP8 block scaling is not implemented: {_NOT_IMPLEMENTED_RECIPES}"


def _model_init(api: str, enabled, recipe, preserve_high_precision_init_val):
    if not isinstance(enabled, bool):
        raise TypeError(f"{api}: enabled must be a bool, got {enabled!r}")
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(f"{api}: the recipe must be a transformer_engine.common.recipe.Recipe "
                        f"or None, got {type(recipe).__name__}")
    if not isinstance(preserve_high_precision_init_val, bool):
        raise TypeError(f"{api}: preserve_high_precision_init_val must be a bool, "
                        f"got {preserve_high_precision_init_val!r}")
    if enabled:
        raise NotImplementedError(
            f"{api}(enabled=True): FP8 primary weights (parameters stored only in FP8) are not "
            "implemented; modules keep high-precision weights and cast them in each FP8 forward")
    # Disabled: modules are built with high-precision weights, which is all they do here.
    return contextlib.nullcontext()


def quantized_model_init(enabled: bool = True, recipe: Optional[Recipe] = None,
                         preserve_high_precision_init_val: bool = False):
    """Context in which TE modules would be built with quantized primary weights.

    ``enabled=False`` is a no-op context (weights stay in high precision, as they always
    are here). ``enabled=True`` raises NotImplementedError: FP8 primary weights are not
    implemented. Arguments are checked when called.
    """
    return _model_init("te.quantized_model_init", enabled, recipe,
                       preserve_high_precision_init_val)


def fp8_model_init(enabled: bool = True, recipe: Optional[Recipe] = None,
                   preserve_high_precision_init_val: bool = False):
    """The older spelling of `quantized_model_init`."""
    return _model_init("te.fp8_model_init", enabled, recipe, preserve_high_precision_init_val)


__all__ += ["check_fp8_support", "check_mxfp8_support", "check_fp8_block_scaling_support",
            "quantized_model_init", "fp8_model_init"]
