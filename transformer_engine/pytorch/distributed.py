"""Activation checkpointing that keeps FP8 delayed-scaling state right (``te.checkpoint``
/ ``te.distributed.checkpoint``), the public recompute queries, and the names TE users
import from ``transformer_engine.pytorch.distributed``.

The checkpoint wrapper here enters and leaves the two phases of a call; where a
thread stands (in a recompute region, in the recompute phase) and what a call keeps
for its recompute live in recompute.py (NOTE [Recompute stashes], NOTE [Module
modes]). Every call takes this path, whatever the function is: a module, a bound
method, a closure, a module whose TE modules are not registered submodules.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Callable, List, Optional

import torch

from . import recompute
from .checkpoint_modes import non_reentrant_checkpoint, reentrant_checkpoint
from .fp8 import FP8GlobalStateManager
from .recompute import RecomputeFrame, RecomputeStateError
from .rng import CudaRNGStatesTracker, get_all_rng_states
from .utils import check_process_group
from .tensor_parallel import (gather_split_1d_tensor, get_distributed_rank,
                              get_distributed_world_size, set_tensor_model_parallel_attributes,
                              split_tensor_into_1d_equal_chunks)

__all__ = [
    "checkpoint", "is_fp8_activation_recompute_enabled", "in_fp8_activation_recompute_phase",
    "activation_recompute_forward",
    "CudaRNGStatesTracker", "get_all_rng_states", "recompute_stash_count",
    "split_tensor_into_1d_equal_chunks", "gather_split_1d_tensor",
    "get_distributed_world_size", "get_distributed_rank", "set_tensor_model_parallel_attributes",
]


def is_fp8_activation_recompute_enabled() -> bool:
    """True inside a checkpointed region (either phase) while FP8 is enabled *now*,
    on the calling thread: an FP8 autocast opened inside the checkpointed function
    counts."""
    return recompute.in_region() and FP8GlobalStateManager.is_fp8_enabled()


def in_fp8_activation_recompute_phase() -> bool:
    """True while a checkpointed function is being recomputed for backward (on the
    calling thread)."""
    return recompute.in_phase()


def recompute_stash_count() -> int:
    """Tensors held by live recompute stashes, across all checkpoint calls (for tests
    and leak checks; call ``gc.collect()`` first to drop unreachable graphs)."""
    return recompute.stash_tensor_count()


_LEGACY_FRAMES: List[RecomputeFrame] = []       # phase-1 frames awaiting their recompute
_LEGACY_LOCK = threading.Lock()


@contextlib.contextmanager
def activation_recompute_forward(activation_recompute: bool = False,
                                 recompute_phase: bool = False):
    """TE's context for checkpoint implementations of its clients (Megatron Core's
    ``CheckpointWithoutOutput``): around their first forward
    (``activation_recompute=True, recompute_phase=False``) FP8 modules stash their
    forward state; around the recompute (``recompute_phase=True``) they swap it in.

    The stash travels in a `RecomputeFrame` that the two calls pair in reverse order
    (last first forward, first recompute), process-wide, as the backward of a plain
    training step runs; ``te.checkpoint`` pairs each recompute with its own first
    forward whatever the order, and is the one to use for new code. A recompute with
    no first forward left to pair raises `RecomputeStateError`.
    """
    if not activation_recompute:
        yield
        return
    if not recompute_phase:
        frame = RecomputeFrame()
        # The client runs this forward under no_grad to keep nothing; it is a training
        # forward all the same (amaxes recorded, as without recompute). Unlike
        # te.checkpoint's (NOTE [Reentrant phase 1]), a no_grad branch inside it
        # cannot be told apart and counts as training too.
        with recompute.enter(frame, recomputing=False, training_under_no_grad=True):
            yield
        with _LEGACY_LOCK:
            _LEGACY_FRAMES.append(frame)
        return
    with _LEGACY_LOCK:
        frame = _LEGACY_FRAMES.pop() if _LEGACY_FRAMES else None
    if frame is None:
        raise RecomputeStateError("activation_recompute_forward: a recompute phase with no "
                                  "first forward to pair with (each recompute_phase=True "
                                  "context needs an earlier recompute_phase=False one)")
    frame.start_recompute()
    with recompute.enter(frame, recomputing=True, training_under_no_grad=False):
        frame.replay_modes()
        try:
            yield
        finally:
            frame.end_recompute()


def _check_checkpoint_args(function, use_reentrant, distribute_saved_activations,
                           get_rng_state_tracker, tp_group, context_fn, determinism_check,
                           debug):
    if not callable(function):
        raise TypeError(f"te.checkpoint: function must be callable, got {type(function).__name__}")
    if not isinstance(use_reentrant, bool):
        raise TypeError(f"te.checkpoint: use_reentrant must be a bool, got {use_reentrant!r}")
    if not isinstance(distribute_saved_activations, bool):
        raise TypeError("te.checkpoint: distribute_saved_activations must be a bool, got "
                        f"{distribute_saved_activations!r}")
    if get_rng_state_tracker is not None and not callable(get_rng_state_tracker):
        raise TypeError("te.checkpoint: get_rng_state_tracker must be a callable returning a "
                        f"CudaRNGStatesTracker, got {type(get_rng_state_tracker).__name__}")
    if context_fn is not None and not callable(context_fn):
        raise TypeError("te.checkpoint: context_fn must be a callable returning two context "
                        f"managers, got {type(context_fn).__name__}")
    dist = torch.distributed
    check_process_group("te.checkpoint", "tp_group", tp_group)
    if distribute_saved_activations and use_reentrant:
        if not dist.is_initialized():
            raise RuntimeError("te.checkpoint: distribute_saved_activations=True needs an "
                               "initialized torch.distributed process group (tp_group); "
                               "call torch.distributed.init_process_group() first")
    elif distribute_saved_activations:
        warnings.warn("te.checkpoint: distribute_saved_activations=True is ignored with "
                      "use_reentrant=False (the non-reentrant checkpoint saves no activation "
                      "to distribute)", stacklevel=3)
    elif tp_group is not None:
        warnings.warn("te.checkpoint: tp_group is used only with "
                      "distribute_saved_activations=True; it is ignored here", stacklevel=3)
    if determinism_check not in ("default", "none"):
        raise ValueError("te.checkpoint: determinism_check must be 'default' or 'none', "
                         f"got {determinism_check!r}")
    if not isinstance(debug, bool):
        raise TypeError(f"te.checkpoint: debug must be a bool, got {debug!r}")
    if debug:
        raise NotImplementedError("te.checkpoint: debug=True (torch.utils.checkpoint's "
                                  "operator traces on a recompute mismatch) is not implemented")


def _legacy_positional_form(args: tuple) -> bool:
    """TE's deprecated ``checkpoint(fn, distribute_saved_activations,
    get_rng_state_tracker, tp_group, *args)``: a bool, a callable or None, and a process
    group or None before the function's own arguments."""
    dist = torch.distributed
    return (len(args) >= 3 and isinstance(args[0], bool)
            and (args[1] is None or callable(args[1]))
            and (args[2] is None or (dist.is_available()
                                     and isinstance(args[2], dist.ProcessGroup))))


def checkpoint(function: Callable, *args, use_reentrant: bool = True,
               distribute_saved_activations: bool = False,
               get_rng_state_tracker: Optional[Callable[[], CudaRNGStatesTracker]] = None,
               tp_group=None, context_fn: Optional[Callable] = None,
               determinism_check: str = "default", debug: bool = False, **kwargs):
    """Activation checkpointing that keeps FP8 delayed-scaling state right.

    Runs ``function(*args, **kwargs)`` without keeping its activations and re-runs it
    during backward. The recompute replays torch's CPU and CUDA RNG states, the
    tracker's states, the ``torch.autocast`` state and the FP8 autocast state of the
    call site, and each module's train/eval mode of the first forward (NOTE [Module
    modes]); FP8 modules recompute with the scales their first forward used (NOTE
    [Recompute stashes]); an FP8 autocast opened inside ``function`` counts.
    With and without checkpointing a training run gives bit-identical results,
    provided ``function`` does not itself branch on recompute state (the recompute
    phase query, live scales).

    Parameters
    ----------
    function : callable
        What to checkpoint: any callable (module, method, closure).
    *args, **kwargs
        Passed to ``function``; non-tensor arguments pass through untouched.
    use_reentrant : bool, default True
        True: an autograd Function that re-runs ``function`` in its backward (not
        usable with ``torch.autograd.grad``; ``retain_graph`` works); its first
        forward runs under the call site's grad mode and drops its graph when it
        returns, so ``function`` sees the grad mode a plain call would (NOTE
        [Reentrant phase 1] in checkpoint_modes.py). False: saved-tensor hooks that
        recompute the whole function at the first unpack.
    distribute_saved_activations : bool, default False
        Reentrant only: keep 1/tp of the first tensor argument per rank of
        ``tp_group`` (needs an initialized process group), gathered for the recompute.
    get_rng_state_tracker : callable, optional
        Returns the `CudaRNGStatesTracker` whose states are replayed.
    tp_group : torch.distributed.ProcessGroup, optional
        Group for ``distribute_saved_activations`` (the default group when None).
    context_fn : callable, optional
        Returns a pair of context managers, entered around phase 1 and around each
        recompute.
    determinism_check : "default" | "none", default "default"
        Non-reentrant: "default" also checks that the recompute saves tensors of the
        shapes, dtypes and devices phase 1 saved (the count is always checked).
    debug : bool, default False
        True raises NotImplementedError.

    TE's older positional form ``checkpoint(function, distribute_saved_activations,
    get_rng_state_tracker, tp_group, *args)`` still works, with a DeprecationWarning.

    Returns
    -------
    What ``function`` returns (tensors in nested tuples, lists and dicts included).
    """
    if torch.compiler.is_compiling():
        raise NotImplementedError(
            "te.checkpoint inside a function compiled with torch.compile is not supported "
            "(its recompute runs Python in the backward pass); checkpoint the compiled "
            "function instead: te.checkpoint(torch.compile(fn), *args)")
    if _legacy_positional_form(args):
        warnings.warn("te.checkpoint(function, distribute_saved_activations, "
                      "get_rng_state_tracker, tp_group, *args) is deprecated; pass these as "
                      "keyword arguments", DeprecationWarning, stacklevel=2)
        (distribute_saved_activations, get_rng_state_tracker, tp_group), args = args[:3], args[3:]
    _check_checkpoint_args(function, use_reentrant, distribute_saved_activations,
                           get_rng_state_tracker, tp_group, context_fn, determinism_check, debug)
    tracker = get_rng_state_tracker() if get_rng_state_tracker is not None else None
    if use_reentrant:
        distribute = None
        if distribute_saved_activations:
            distribute = tp_group if tp_group is not None else torch.distributed.group.WORLD
        return reentrant_checkpoint(function, tracker, context_fn, distribute, args, kwargs)
    return non_reentrant_checkpoint(function, tracker, context_fn,
                                     determinism_check == "default", args, kwargs)
