"""Activation checkpointing that keeps FP8 delayed-scaling state right, the RNG
states tracker, and the tensor-parallel split/gather helpers it uses.

NOTE [Recompute stashes]
    `checkpoint(fn, *args)` runs ``fn`` once without keeping its activations
    (phase 1) and again during backward (phase 2, the recompute). Between the two
    the outermost FP8 autocast may have updated every scale, so a delayed-scaling
    module must recompute with the scale its phase-1 forward used.

    Two module-level flags say where we are: *in a recompute region* (set on entry to
    either phase, whatever the FP8 state is then) and *in the recompute phase*. Every
    exit restores the values found at entry. `is_fp8_activation_recompute_enabled()`
    is the region flag AND the *live* FP8 state, so an autocast opened inside the
    checkpointed function counts (the seed's change).

    The bookkeeping lives in one `_RecomputeFrame` per checkpoint call, owned by that
    call's autograd graph (the reentrant Function's ctx, or the saved-tensor hooks of
    the non-reentrant checkpoint). In phase 1 each delayed-scaling FP8 module appends
    a `RecomputeStash` (a snapshot of its forward scale, scale_inv and amax history,
    and the backward-update session if it was the session's first FP8 module) to every
    frame that is recording; in phase 2 it takes its stashes back in call order. The
    snapshot is copied on write (`fp8.ScalingSnapshot`): phase 1 copies nothing; the
    delayed-scaling update, the only writer of a scale, first copies every state that
    snapshots still read, in two concatenations. So the recompute casts with exactly
    the scales of phase 1, and a forward pays no copy kernels for its stash. A
    checkpoint nested inside a recompute records the stashes its enclosing recompute
    hands out, so nested regions see the phase-1 state too. A dropped graph drops its
    frame: nothing global grows. The recompute records no amax, registers nothing
    for an update, and claims no "first module": the stash says what phase 1 did.

    The train/eval mode at phase-1 time governs: each frame also records the
    ``training`` flag every ``nn.Module`` had at its first call in phase 1, and the
    recompute sets that flag again just before the module's call and puts every flag it
    changed back when the recompute ends (so a switch to eval before backward neither
    drops a dropout mask nor changes what is saved). A global module forward pre-hook
    does this; it is registered only while some checkpoint call is running.

    Invariance assumes ``fn`` runs the same FP8 modules in both phases (it must not
    branch on `in_fp8_activation_recompute_phase()` or on live scales).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.utils.checkpoint as torch_checkpoint

from .fp8 import FP8GlobalStateManager, RecomputeStateError, ScalingSnapshot, ScalingState
from .tensor_parallel import (get_distributed_rank, get_distributed_world_size,
                              set_tensor_model_parallel_attributes)

__all__ = [
    "checkpoint", "is_fp8_activation_recompute_enabled", "in_fp8_activation_recompute_phase",
    "CudaRNGStatesTracker", "RecomputeStash", "recompute_stash_count",
    "split_tensor_into_1d_equal_chunks", "gather_split_1d_tensor",
    "get_distributed_world_size", "get_distributed_rank", "set_tensor_model_parallel_attributes",
]

# ---- where we are: the two flags, and the frames of the calls we are inside -------
_in_recompute_region: bool = False
_in_recompute_phase: bool = False
_frames: Tuple[Tuple["_RecomputeFrame", bool], ...] = ()   # (frame, recomputing), innermost last
_training_under_no_grad: bool = False    # reentrant phase 1 of a call made with grad enabled
_LIVE_FRAMES: "weakref.WeakSet[_RecomputeFrame]" = weakref.WeakSet()


def is_fp8_activation_recompute_enabled() -> bool:
    """True inside a checkpointed region (either phase) while FP8 is enabled *now*."""
    return _in_recompute_region and FP8GlobalStateManager.is_fp8_enabled()


def in_fp8_activation_recompute_phase() -> bool:
    """True while a checkpointed function is being recomputed for backward."""
    return _in_recompute_phase


def is_training_forward() -> bool:
    """Whether a forward running now counts as training (records amaxes, updates
    scales): grad enabled, or the reentrant phase 1 of a call made with grad enabled."""
    return torch.is_grad_enabled() or _training_under_no_grad


class RecomputeStash(NamedTuple):
    """What one FP8 module call stashed in phase 1 for its recompute: its forward
    scaling state as phase 1 saw it (copied on write), and the backward-update session
    if it was the session's first FP8 module."""

    snapshot: ScalingSnapshot
    bwd_session: Any

    @property
    def scaling_fwd(self) -> ScalingState:
        return self.snapshot.state


class _RecomputeFrame:
    """The stashes of one checkpoint call, keyed by module, in call order."""

    __slots__ = ("stashes", "metas", "cursor", "modes", "replaced_modes", "__weakref__")

    def __init__(self):
        self.stashes: Dict[int, List[RecomputeStash]] = {}
        self.metas: Dict[int, dict] = {}     # keeps each keyed fp8_meta (so its id) alive
        self.cursor: Dict[int, int] = {}
        # id(module) -> (module, its training flag at its first phase-1 call)
        self.modes: Dict[int, Tuple[torch.nn.Module, bool]] = {}
        # id(module) -> (module, the flag it had before this recompute set it)
        self.replaced_modes: Dict[int, Tuple[torch.nn.Module, bool]] = {}
        _LIVE_FRAMES.add(self)

    def record_mode(self, module: torch.nn.Module) -> None:
        self.modes.setdefault(id(module), (module, module.training))

    def record_tree(self, owner: torch.nn.Module) -> None:
        """Record the training flag of ``owner`` and of every submodule now, at the
        start of phase 1 (no per-call hook needed: see `_CheckpointCall`)."""
        for module in owner.modules():
            self.modes.setdefault(id(module), (module, module.training))

    def replay_modes(self) -> None:
        """Give every recorded module its phase-1 training flag for the recompute."""
        for key, (module, training) in self.modes.items():
            if module.training != training and key not in self.replaced_modes:
                self.replaced_modes[key] = (module, module.training)
                module.training = training

    def end_recompute(self) -> None:
        """Put back the training flags this recompute changed."""
        for module, training in self.replaced_modes.values():
            module.training = training
        self.replaced_modes = {}

    def add(self, fp8_meta: dict, entry: RecomputeStash) -> int:
        key = id(fp8_meta)
        entries = self.stashes.get(key)
        if entries is None:
            entries = self.stashes[key] = []
            self.metas[key] = fp8_meta
        entries.append(entry)
        return len(entries) - 1

    def start_recompute(self) -> None:
        self.cursor = {}

    def take(self, fp8_meta: dict) -> RecomputeStash:
        key = id(fp8_meta)
        entries = self.stashes.get(key, [])
        position = self.cursor.get(key, 0)
        if position >= len(entries):
            raise RecomputeStateError(
                "te.checkpoint: the recompute ran a delayed-scaling FP8 forward "
                f"(call #{position + 1} of this module in the region) for which the first "
                f"forward stashed no FP8 state ({len(entries)} stash(es) recorded). The "
                "checkpointed function must run the same FP8 modules, under the same FP8 "
                "autocast, in both phases; it must not branch on "
                "in_fp8_activation_recompute_phase() or on live scales. Refusing to "
                "recompute with the live (already updated) scales.")
        self.cursor[key] = position + 1
        return entries[position]

    def tensor_count(self) -> int:
        return 3 * sum(len(v) for v in self.stashes.values())


def recompute_stash_count() -> int:
    """Tensors held by live recompute stashes, across all checkpoint calls (for tests
    and leak checks; call ``gc.collect()`` first to drop unreachable graphs)."""
    return sum(frame.tensor_count() for frame in list(_LIVE_FRAMES))


def _recording_frames() -> List["_RecomputeFrame"]:
    """Phase-1 frames newer than the innermost recomputing frame."""
    out = []
    for frame, recomputing in reversed(_frames):
        if recomputing:
            break
        out.append(frame)
    return out


def stash_for_recompute(fp8_meta: dict, entry: RecomputeStash) -> Optional[int]:
    """Give ``entry`` to every recording frame; returns its position in the innermost."""
    if len(_frames) == 1 and not _frames[0][1]:      # one phase-1 frame: the common case
        return _frames[0][0].add(fp8_meta, entry)
    position = None
    for frame in _recording_frames():
        p = frame.add(fp8_meta, entry)
        position = p if position is None else position
    return position


def take_recompute_stash(fp8_meta: dict) -> RecomputeStash:
    """The next stash of this module in the call being recomputed; also handed to
    checkpoint calls nested inside that recompute."""
    if len(_frames) == 1 and _frames[0][1]:          # one recomputing frame: the common case
        return _frames[0][0].take(fp8_meta)
    source = next((frame for frame, recomputing in reversed(_frames) if recomputing), None)
    if source is None:
        raise RecomputeStateError("te.checkpoint: an FP8 module asked for its recompute stash "
                                  "outside any checkpoint recompute")
    entry = source.take(fp8_meta)
    for frame in _recording_frames():
        frame.add(fp8_meta, entry)
    return entry


def _module_mode_hook(module: torch.nn.Module, args) -> None:
    """Global forward pre-hook while a checkpoint call whose function is not a module
    runs its phase 1: the recording frames note the module's training flag."""
    if len(_frames) == 1:       # the common case, on every module call
        frame, recomputing = _frames[0]
        if not recomputing:
            frame.record_mode(module)
        return
    for frame in _recording_frames():
        frame.record_mode(module)


_mode_hook = None   # the handle of `_module_mode_hook` while it is registered


@contextlib.contextmanager
def _recompute_region(frame: _RecomputeFrame, recomputing: bool, training_under_no_grad=None,
                      record_by_hook: bool = False):
    """Enter a phase of one checkpoint call; restores every flag it changes.

    Phase 1 of a region nested inside a recompute is itself part of that recompute,
    so the phase flag is only ever raised, never lowered, on entry. A phase 1 that
    records module modes by hook registers the hook unless it is registered already;
    the entry that registered it removes it on exit.
    """
    global _in_recompute_region, _in_recompute_phase, _frames, _training_under_no_grad
    global _mode_hook
    saved = (_in_recompute_region, _in_recompute_phase, _frames, _training_under_no_grad)
    hook = None
    if record_by_hook and _mode_hook is None:
        hook = _mode_hook = torch.nn.modules.module.register_module_forward_pre_hook(
            _module_mode_hook)
    _in_recompute_region = True
    _in_recompute_phase = _in_recompute_phase or recomputing
    _frames = _frames + ((frame, recomputing),)
    if training_under_no_grad is not None:
        _training_under_no_grad = training_under_no_grad
    try:
        yield
    finally:
        _in_recompute_region, _in_recompute_phase, _frames, _training_under_no_grad = saved
        if hook is not None:
            hook.remove()
            _mode_hook = None


# ---- RNG ---------------------------------------------------------------------------

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


class _RngSnapshot:
    """RNG states at a checkpoint call, replayed for its recompute."""

    def __init__(self, tracker: Optional[CudaRNGStatesTracker]):
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
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


# ---- the checkpoint call -------------------------------------------------------------

def _autocast_snapshot() -> List[Tuple[str, bool, torch.dtype]]:
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    return [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in devices]


_NO_CONTEXT = contextlib.nullcontext()     # stateless, so one instance serves every call


def _module_of(function) -> Optional[torch.nn.Module]:
    """The module ``function`` is, or is a bound method of; None otherwise."""
    if isinstance(function, torch.nn.Module):
        return function
    owner = getattr(function, "__self__", None)
    return owner if isinstance(owner, torch.nn.Module) else None


class _CheckpointCall:
    """Everything one checkpoint call carries from phase 1 into its recompute.

    NOTE [Module modes]: the recompute runs each module in the train/eval mode it had
    in phase 1. When ``function`` is a module (or a bound method of one), the flags of
    that module and all its submodules are recorded at the start of phase 1, which
    costs one walk of the tree instead of a global forward pre-hook that would put
    every module call of phase 1 on torch's slow hook path; a module outside that
    tree (held in a plain list or a closure) then keeps its live mode. For any other
    callable the hook records the flag of each module at its first call. The
    recompute sets the recorded flags at its start and puts back what it changed at
    its end, which for a deterministic function is the same as setting each at its
    first call.
    """

    def __init__(self, function: Callable, tracker, context_fn):
        self.function = function
        self.frame = _RecomputeFrame()
        owner = _module_of(function)
        self.record_by_hook = owner is None
        if owner is not None:
            self.frame.record_tree(owner)
        self.training = is_training_forward()   # a call nested in a reentrant phase 1 inherits it
        self.rng = _RngSnapshot(tracker)
        self.fp8_state = FP8GlobalStateManager.get_fp8_autocast_state()
        self.autocast = _autocast_snapshot()
        user = context_fn() if context_fn is not None else None
        self.user_forward_ctx = user[0] if user is not None else _NO_CONTEXT
        self.user_recompute_ctx = user[1] if user is not None else _NO_CONTEXT

    @contextlib.contextmanager
    def phase1(self, reentrant: bool):
        with _recompute_region(self.frame, recomputing=False,
                               training_under_no_grad=self.training if reentrant else None,
                               record_by_hook=self.record_by_hook):
            with self.user_forward_ctx:
                yield

    @contextlib.contextmanager
    def recompute(self):
        """The call site's FP8 autocast state, flags, RNG states (torch's and the
        tracker's) and ``torch.autocast`` state around a recompute."""
        saved_fp8 = FP8GlobalStateManager.get_fp8_autocast_state()
        self.frame.start_recompute()
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.rng.replay())
            for device, enabled, dtype in self.autocast:
                if (torch.is_autocast_enabled(device) != enabled
                        or torch.get_autocast_dtype(device) != dtype):
                    stack.enter_context(torch.autocast(device_type=device, enabled=enabled,
                                                       dtype=dtype))
            stack.enter_context(_recompute_region(self.frame, recomputing=True,
                                                  training_under_no_grad=False))
            FP8GlobalStateManager.set_fp8_autocast_state(self.fp8_state)
            try:
                self.frame.replay_modes()
                with self.user_recompute_ctx:
                    yield
            finally:
                FP8GlobalStateManager.set_fp8_autocast_state(saved_fp8)
                self.frame.end_recompute()


def _flatten(args: tuple, kwargs: dict):
    keys = tuple(kwargs)
    return keys, tuple(args) + tuple(kwargs[k] for k in keys)


def _unflatten(flat: tuple, keys: tuple):
    n = len(flat) - len(keys)
    return flat[:n], dict(zip(keys, flat[n:]))


class _ReentrantCheckpointFunction(torch.autograd.Function):
    """Phase 1 under no_grad in forward; recompute + inner backward in backward."""

    @staticmethod
    def forward(ctx, call: _CheckpointCall, keys: tuple, distribute: Optional[Any],
                _grad_anchor: torch.Tensor, *flat):
        ctx.call, ctx.keys = call, keys
        args, kwargs = _unflatten(flat, keys)
        first = next((a for a in flat if torch.is_tensor(a)), None)
        if distribute is not None and first is not None:
            _chunk_numel(first, distribute)     # fail before phase 1 touches any FP8 state
        with call.phase1(reentrant=True):
            outputs = call.function(*args, **kwargs)
        ctx.tensor_positions = [i for i, a in enumerate(flat) if torch.is_tensor(a)]
        ctx.inputs_require_grad = [flat[i].requires_grad for i in ctx.tensor_positions]
        ctx.non_tensors = [None if torch.is_tensor(a) else a for a in flat]
        tensors = [flat[i] for i in ctx.tensor_positions]
        ctx.distributed_shape = None
        if distribute is not None and tensors:
            ctx.distributed_shape = tensors[0].shape
            tensors[0] = split_tensor_into_1d_equal_chunks(tensors[0], distribute, new_buffer=True)
        ctx.distribute = distribute
        ctx.save_for_backward(*tensors)
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError(
                "te.checkpoint(use_reentrant=True) does not work with torch.autograd.grad(): "
                "its recompute runs a nested .backward(). Use loss.backward(), or "
                "te.checkpoint(..., use_reentrant=False).")
        call: _CheckpointCall = ctx.call
        tensors = list(ctx.saved_tensors)
        if ctx.distributed_shape is not None:
            tensors[0] = gather_split_1d_tensor(tensors[0], ctx.distribute).view(
                ctx.distributed_shape)
        flat = list(ctx.non_tensors)
        inputs = []
        for pos, tensor, req in zip(ctx.tensor_positions, tensors, ctx.inputs_require_grad):
            t = tensor.detach().requires_grad_(req)
            flat[pos] = t
            inputs.append(t)
        args, kwargs = _unflatten(tuple(flat), ctx.keys)
        with call.recompute(), torch.enable_grad():
            outputs = call.function(*args, **kwargs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads)
                 if torch.is_tensor(o) and o.requires_grad and g is not None]
        if not pairs:
            raise RuntimeError(
                "te.checkpoint: no output of the checkpointed function requires grad, so "
                "there is nothing to backpropagate through it; call the function "
                "directly instead of checkpointing it.")
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        input_grads = [t.grad if req else None for t, req in zip(inputs, ctx.inputs_require_grad)]
        grads_out = [None] * len(flat)
        for pos, g in zip(ctx.tensor_positions, input_grads):
            grads_out[pos] = g
        return (None, None, None, None, *grads_out)


# Modules found to contain a TE module. Only True is remembered: a stale True (TE
# modules removed later) still takes te.checkpoint's own path, which is right for any
# function, while a stale False would hand FP8 modules to torch.utils.checkpoint.
_HAS_TE_MODULE: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def _contains_te_module(function) -> Optional[bool]:
    """True/False when ``function`` is (a bound method of) an nn.Module; None if unknown."""
    owner = _module_of(function)
    if owner is None:
        return None
    if owner in _HAS_TE_MODULE:
        return True
    from .module.base import TransformerEngineBaseModule
    if any(isinstance(m, TransformerEngineBaseModule) for m in owner.modules()):
        _HAS_TE_MODULE.add(owner)
        return True
    return False


def _check_checkpoint_args(function, use_reentrant, distribute_saved_activations,
                           get_rng_state_tracker, tp_group, context_fn):
    if not callable(function):
        raise TypeError(f"te.checkpoint: function must be callable, got {type(function).__name__}")
    if not isinstance(use_reentrant, bool):
        raise TypeError(f"te.checkpoint: use_reentrant must be a bool, got {use_reentrant!r}")
    if get_rng_state_tracker is not None and not callable(get_rng_state_tracker):
        raise TypeError("te.checkpoint: get_rng_state_tracker must be a callable returning a "
                        f"CudaRNGStatesTracker, got {type(get_rng_state_tracker).__name__}")
    if context_fn is not None and not callable(context_fn):
        raise TypeError("te.checkpoint: context_fn must be a callable returning two context "
                        f"managers, got {type(context_fn).__name__}")
    if distribute_saved_activations:
        if not use_reentrant:
            raise ValueError("te.checkpoint: distribute_saved_activations=True needs "
                             "use_reentrant=True")
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("te.checkpoint: distribute_saved_activations=True needs an "
                               "initialized torch.distributed process group (tp_group); "
                               "call torch.distributed.init_process_group() first")
        if tp_group is not None and not isinstance(tp_group, dist.ProcessGroup):
            raise TypeError("te.checkpoint: tp_group must be a torch.distributed.ProcessGroup, "
                            f"got {type(tp_group).__name__}")


def checkpoint(function: Callable, *args, use_reentrant: bool = True,
               distribute_saved_activations: bool = False,
               get_rng_state_tracker: Optional[Callable[[], CudaRNGStatesTracker]] = None,
               tp_group=None, context_fn: Optional[Callable] = None, **kwargs):
    """Activation checkpointing that keeps FP8 delayed-scaling state right.

    Runs ``function(*args, **kwargs)`` without keeping its activations and re-runs it
    during backward. The recompute replays torch's CPU and CUDA RNG states, the
    tracker's states, the ``torch.autocast`` state and the FP8 autocast state of the
    call site, and each module's train/eval mode of the first forward (NOTE [Module
    modes]: of the submodules, when ``function`` is a module); FP8 modules
    recompute with the scales their first forward used (NOTE [Recompute stashes]);
    an FP8 autocast opened inside ``function`` counts.
    With and without checkpointing a training run gives identical results, provided
    ``function`` does not branch on recompute state.

    Parameters
    ----------
    function : callable
        What to checkpoint. An ``nn.Module`` containing no TE module is handed to
        ``torch.utils.checkpoint`` when no TE-only option is used.
    *args, **kwargs
        Passed to ``function``; non-tensor arguments pass through untouched.
    use_reentrant : bool, default True
        True: an autograd Function that re-runs ``function`` in its backward (not
        usable with ``torch.autograd.grad``; ``retain_graph`` works). False: saved-
        tensor hooks that recompute the whole function at the first unpack.
    distribute_saved_activations : bool, default False
        Reentrant only: keep 1/tp of the first tensor argument per rank of
        ``tp_group`` (needs an initialized process group), gathered for the recompute.
    get_rng_state_tracker : callable, optional
        Returns the `CudaRNGStatesTracker` whose states are replayed.
    tp_group : torch.distributed.ProcessGroup, optional
        Group for ``distribute_saved_activations`` (the default group when None).
    context_fn : callable, optional
        Returns two context managers, entered around phase 1 and around each recompute.

    Returns
    -------
    What ``function`` returns.
    """
    _check_checkpoint_args(function, use_reentrant, distribute_saved_activations,
                           get_rng_state_tracker, tp_group, context_fn)
    tracker = get_rng_state_tracker() if get_rng_state_tracker is not None else None
    if (tracker is None and not distribute_saved_activations
            and _contains_te_module(function) is False
            and (not use_reentrant or (not kwargs and context_fn is None))):
        extra = {} if use_reentrant else {"context_fn": context_fn or torch_checkpoint.noop_context_fn}
        return torch_checkpoint.checkpoint(function, *args, use_reentrant=use_reentrant,
                                           **extra, **kwargs)
    if use_reentrant:
        call = _CheckpointCall(function, tracker, context_fn)
        keys, flat = _flatten(args, kwargs)
        anchor = torch.empty(0, requires_grad=True) if torch.is_grad_enabled() else torch.empty(0)
        distribute = None
        if distribute_saved_activations:
            distribute = tp_group if tp_group is not None else torch.distributed.group.WORLD
        return _ReentrantCheckpointFunction.apply(call, keys, distribute, anchor, *flat)
    return _non_reentrant_checkpoint(function, tracker, context_fn, args, kwargs)


class _SavedInputs(torch.autograd.Function):
    """Holds a non-reentrant call's tensor arguments for its recompute on a graph node
    of their own. Saving them (rather than keeping references) lets an enclosing
    checkpoint's hooks drop and recompute them like any other activation, and lets
    autograd's version check catch an argument modified in place before backward.
    The node's output is never used in the graph, so the node never runs."""

    @staticmethod
    def forward(ctx, _anchor: torch.Tensor, *tensors: torch.Tensor):
        ctx.save_for_backward(*tensors)
        return _anchor.new_empty(0)

    @staticmethod
    def backward(ctx, _grad):
        raise RuntimeError("te.checkpoint: internal node _SavedInputs must never run backward")


class _NonReentrantCheckpoint:
    """One non-reentrant checkpoint call: saved-tensor hooks that keep no activation in
    phase 1 (each saved tensor is packed as its position) and, at the first unpack of
    a backward pass, recompute the whole function and hand the recomputed tensors out
    by position, each exactly once (so a retained graph's next pass recomputes again).

    The hooks are bound methods of this object, so the phase-1 graph owns it; it holds
    no tensor of that graph (arguments sit on a `_SavedInputs` node, recomputed
    tensors are detached), so no reference cycle keeps a dropped graph alive.
    """

    __slots__ = ("call", "keys", "non_tensors", "tensor_positions", "inputs_holder",
                 "saved_count", "recomputed", "__weakref__")

    def __init__(self, call: _CheckpointCall, keys: tuple, flat: tuple):
        self.call, self.keys = call, keys
        self.tensor_positions = [i for i, a in enumerate(flat) if torch.is_tensor(a)]
        self.non_tensors = [None if torch.is_tensor(a) else a for a in flat]
        # Keep the node's (empty) output, not only the node: some torch releases (2.11)
        # free a custom Function's saved tensors once all its outputs are gone.
        self.inputs_holder = _SavedInputs.apply(torch.empty(0, requires_grad=True),
                                                *(flat[i] for i in self.tensor_positions))
        self.saved_count = 0
        self.recomputed: Dict[int, torch.Tensor] = {}

    def pack_phase1(self, _tensor: torch.Tensor) -> int:
        position = self.saved_count
        self.saved_count = position + 1
        return position

    def unpack(self, position: int) -> torch.Tensor:
        tensor = self.recomputed.pop(position, None)
        if tensor is None:
            self._recompute()
            tensor = self.recomputed.pop(position)
        return tensor

    def _recompute(self) -> None:
        flat = list(self.non_tensors)
        saved_inputs = self.inputs_holder.grad_fn.saved_tensors
        for position, tensor in zip(self.tensor_positions, saved_inputs):
            flat[position] = tensor
        args, kwargs = _unflatten(tuple(flat), self.keys)
        recomputed: Dict[int, torch.Tensor] = {}

        def pack(tensor: torch.Tensor) -> None:
            recomputed[len(recomputed)] = tensor.detach()

        with (self.call.recompute(), torch.enable_grad(),
              torch.autograd.graph.saved_tensors_hooks(pack, _unpack_in_recompute)):
            self.call.function(*args, **kwargs)
        if len(recomputed) != self.saved_count:
            raise RecomputeStateError(
                f"te.checkpoint: the recompute saved {len(recomputed)} tensor(s) for "
                f"backward where the first forward saved {self.saved_count}; the "
                "checkpointed function must run the same operations in both phases")
        self.recomputed = recomputed


def _unpack_in_recompute(_packed) -> torch.Tensor:
    raise RuntimeError("te.checkpoint: a saved tensor of the recompute's own graph was "
                       "used; the recompute graph exists only to produce saved tensors")


def _non_reentrant_checkpoint(function, tracker, context_fn, args, kwargs):
    """Phase 1 under saved-tensor hooks that keep nothing; the recompute at the first
    unpack in backward (`_NonReentrantCheckpoint`). Works with ``torch.autograd.grad``
    and ``retain_graph``; runs the whole function (no early stop)."""
    call = _CheckpointCall(function, tracker, context_fn)
    if not torch.is_grad_enabled():
        with call.phase1(reentrant=False):
            return function(*args, **kwargs)
    keys, flat = _flatten(args, kwargs)
    state = _NonReentrantCheckpoint(call, keys, flat)
    with call.phase1(reentrant=False), torch.autograd.graph.saved_tensors_hooks(
            state.pack_phase1, state.unpack):
        outputs = function(*args, **kwargs)
    if not _any_requires_grad(outputs):
        raise RuntimeError(
            "te.checkpoint: no output of the checkpointed function requires grad, so there "
            "is nothing to backpropagate through it; call the function directly instead "
            "of checkpointing it.")
    return outputs


def _any_requires_grad(outputs) -> bool:
    if torch.is_tensor(outputs):
        return outputs.requires_grad
    if isinstance(outputs, (tuple, list)):
        return any(_any_requires_grad(o) for o in outputs)
    if isinstance(outputs, dict):
        return any(_any_requires_grad(o) for o in outputs.values())
    return False


# ---- tensor-parallel helpers ---------------------------------------------------------

def _chunk_numel(tensor: torch.Tensor, group) -> int:
    world = torch.distributed.get_world_size(group)
    numel = tensor.numel()
    if numel % world != 0:
        raise ValueError(f"te.checkpoint: distribute_saved_activations needs the first "
                         f"tensor argument's numel ({numel}, shape {tuple(tensor.shape)}) "
                         f"divisible by the tensor-parallel size {world}")
    return numel // world


def split_tensor_into_1d_equal_chunks(tensor: torch.Tensor, group, new_buffer: bool = False):
    """This rank's 1/world_size slice of ``tensor`` flattened (a copy of just that
    slice when ``new_buffer``, so the whole can be freed)."""
    part = _chunk_numel(tensor, group)
    rank = torch.distributed.get_rank(group)
    chunk = tensor.detach().reshape(-1)[rank * part:(rank + 1) * part]
    return chunk.clone() if new_buffer else chunk


def gather_split_1d_tensor(tensor: torch.Tensor, group) -> torch.Tensor:
    """Inverse of `split_tensor_into_1d_equal_chunks`: the flattened whole, in rank
    order. Uses the list form of all_gather, which gloo and NCCL both take."""
    dist = torch.distributed
    world = dist.get_world_size(group)
    out = torch.empty(world * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    dist.all_gather(list(out.chunk(world)), tensor.contiguous(), group=group)
    return out
