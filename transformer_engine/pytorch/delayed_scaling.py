"""The delayed-scaling formulas, stateless, on concatenated buffers: amax from the
history, scale from the amax, the history roll, and the in-place update of many
modules' states at once (one Triton launch on CUDA, NOTE [Fused casts] in
quantize.py). Which states update when is `amax_update.py`'s business.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from .quantize import fused_kernels, fused_or_none

__all__ = ["amax_from_history", "scale_from_amax", "roll_amax_history", "resize_amax_history",
           "sanitize_live_amax", "idle_columns", "check_computed_scale", "delayed_scaling_update",
           "delayed_scaling_update_", "copy_all"]

_FP32_MAX = torch.finfo(torch.float32).max
_FP32_TINY = torch.finfo(torch.float32).tiny     # smallest normal float32


def amax_from_history(history: torch.Tensor, algo) -> torch.Tensor:
    """The amax each scale is computed from. ``history`` is ``[L, n]`` with row 0
    the live (most recent) row; returns ``[n]``."""
    if algo == "max":
        return history.amax(dim=0)
    if algo == "most_recent":
        return history[0].clone()
    # The update hands over a finite, non-negative history (NOTE [Non-finite amaxes] in
    # amax_update.py), so a result that is not is the callable's error. One host sync:
    # only custom algorithms pay it.
    amax_value = _algo_result("amax_compute_algo", algo(history), history[0])
    bad = ~torch.isfinite(amax_value) | (amax_value < 0)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"DelayedScaling.amax_compute_algo: the callable returned "
                         f"{amax_value[i].item()} for tensor {i}; an amax must be finite "
                         "and >= 0")
    return amax_value


def _algo_result(field: str, out, like: torch.Tensor) -> torch.Tensor:
    """The result of a recipe's callable ``field`` as float32 on ``like``'s device,
    after checking that it is a real tensor shaped like ``like``."""
    api = f"DelayedScaling.{field}"
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{api}: the callable must return a torch.Tensor of shape "
                        f"{tuple(like.shape)}, got {type(out).__name__}")
    if out.dtype == torch.bool or out.dtype.is_complex:
        raise TypeError(f"{api}: the callable must return a real-valued tensor (it is "
                        f"converted to float32), got dtype {out.dtype}")
    if out.shape != like.shape:
        raise ValueError(f"{api}: the callable must return a tensor of shape "
                         f"{tuple(like.shape)} (one value per tensor), got {tuple(out.shape)}")
    return out.detach().to(device=like.device, dtype=torch.float32)


def check_computed_scale(out, scale: torch.Tensor,
                         amax_value: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The result of ``DelayedScaling.scaling_factor_compute_algo`` for ``scale [n]``,
    as float32, checked: shape ``[n]``, finite, and at least the smallest normal
    float32 (so that ``1 / scale`` is finite too and FP8 data never meets a zero
    scale). ``amax_value`` is what the callable was given, named in the error. Reads
    the values on the host (one sync: only custom algorithms pay it)."""
    new_scale = _algo_result("scaling_factor_compute_algo", out, scale)
    bad = ~torch.isfinite(new_scale) | (new_scale < _FP32_TINY)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        amax_note = "" if amax_value is None else f" (its amax was {amax_value[i].item()})"
        raise ValueError(f"DelayedScaling.scaling_factor_compute_algo: the callable returned "
                         f"{new_scale[i].item()} for tensor {i}{amax_note}; a scale must be "
                         f"finite and >= {_FP32_TINY} "
                         "(the smallest normal float32); keep the old scale where amax is 0 "
                         "or not finite, as the default formula does")
    return new_scale


def scale_from_amax(amax_value: torch.Tensor, scale: torch.Tensor, max_value: float,
                    margin: int) -> torch.Tensor:
    """``(fp8_max / amax) / 2**margin``; keeps the old scale where amax is 0, NaN or
    inf, and clamps an infinite result to the float32 maximum."""
    new = max_value / amax_value
    if margin != 0:                 # x / 2**0 is x: one op less in the common case
        new = new / (2.0 ** margin)
    ok = (amax_value > 0) & (amax_value <= _FP32_MAX)      # positive and finite
    return torch.where(ok, new, scale).clamp(max=_FP32_MAX)


def roll_amax_history(history: torch.Tensor) -> torch.Tensor:
    """Advance the history by one step: rows shift up by one (row 0 goes to the
    end) and the new live row 0 is zeroed. Returns a new tensor."""
    rolled = torch.roll(history, shifts=-1, dims=0)
    rolled[0].zero_()
    return rolled


def idle_columns(history: torch.Tensor) -> torch.Tensor:
    """The columns of ``history [L, n]`` whose live amax (row 0) is exactly 0: no
    amax was recorded for them since the last update (a cached FP8 weight reused with
    ``is_first_microbatch=False``, a module whose backward saw all-zero gradients).
    As in TE's update kernel, such a column is left alone: its history does not roll
    and its scale stays. A non-finite live amax is not idle (NOTE [Non-finite amaxes]
    in non_finite.py)."""
    return history[0] == 0


def sanitize_live_amax(history: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``history [L, n]`` with non-finite live amaxes (row 0) replaced by 0, and the
    mask of the finite ones (NOTE [Non-finite amaxes] in amax_update.py)."""
    finite = torch.isfinite(history[0])
    clean = torch.cat((torch.where(finite, history[0], 0.0).unsqueeze(0), history[1:]))
    return clean, finite


def resize_amax_history(history: torch.Tensor, length: int) -> torch.Tensor:
    """``history [L, n]`` as a new ``[length, n]`` history that keeps the live row and
    the most recent ``length - 1`` completed rows in their places relative to the roll:
    row 0 stays row 0 and the most recent rows stay at the end, so a shorter history
    drops the oldest rows (rows 1, 2, ...) and a longer one gets zero rows (no amax
    seen) in the oldest places, right after row 0."""
    old = history.shape[0]
    if length == old:
        return history.clone()
    if length < old:
        return torch.cat([history[:1], history[old - length + 1:]])
    pad = history.new_zeros(length - old, history.shape[1])
    return torch.cat([history[:1], pad, history[1:]])


def delayed_scaling_update(history: torch.Tensor, scale: torch.Tensor, max_value: float,
                           margin: int, algo) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The delayed-scaling update of ``n`` tensors at once, as new tensors: ``(new_scale,
    new_scale_inv, new_history)`` from ``history [L, n]`` and ``scale [n]`` (amax from
    the history by ``algo``, scale from amax, ``1 / scale``, history rolled). A
    non-finite live amax keeps its scale and enters the history as 0; a column with
    a live amax of 0 keeps its scale and its history (`idle_columns`). These are the
    reference formulas; `delayed_scaling_update_` applies them in place."""
    idle = idle_columns(history)
    history, finite = sanitize_live_amax(history)
    return _update_from_clean(history, finite, idle, scale, max_value, margin, algo)


def _update_from_clean(history: torch.Tensor, finite: torch.Tensor, idle: torch.Tensor,
                       scale: torch.Tensor, max_value: float, margin: int, algo):
    """`delayed_scaling_update` on a history `sanitize_live_amax` has cleaned; ``idle``
    from `idle_columns` of the history before cleaning."""
    amax_value = amax_from_history(history, algo)
    new_scale = torch.where(finite & ~idle,
                            scale_from_amax(amax_value, scale, max_value, margin), scale)
    new_history = torch.where(idle, history, roll_amax_history(history))
    return new_scale, torch.reciprocal(new_scale), new_history


def delayed_scaling_update_(histories: Sequence[torch.Tensor], scales: Sequence[torch.Tensor],
                            scale_invs: Sequence[torch.Tensor], max_value: float, margin: int,
                            algo, non_finite: Optional[torch.Tensor] = None) -> None:
    """Update many delayed-scaling states in place: for each ``i``, ``scales[i]``,
    ``scale_invs[i]`` (``[n_i]``) and ``histories[i]`` (``[L, n_i]``, one ``L``) get
    the values of `delayed_scaling_update`; the number of non-finite live amaxes is
    added to ``non_finite`` (a one-element int32 tensor on their device) if given.

    On CUDA with Triton and ``algo`` "max" or "most_recent" this is one launch for all
    states (NOTE [Fused casts]); otherwise the formulas run once on the concatenated
    states and the results are copied back.
    """
    kernels = fused_kernels(histories[0])
    if (kernels is not None and algo in ("max", "most_recent")
            and fused_or_none(kernels.delayed_update_, histories, scales, scale_invs,
                              max_value, margin, algo, non_finite)):
        return
    sizes = [s.numel() for s in scales]
    history = torch.cat(list(histories), dim=1)
    idle = idle_columns(history)
    history, finite = sanitize_live_amax(history)
    if non_finite is not None:
        non_finite.add_((~finite).sum())
    new_scale, new_scale_inv, new_history = _update_from_clean(
        history, finite, idle, torch.cat(list(scales)), max_value, margin, algo)
    copy_all(list(scales) + list(scale_invs) + list(histories),
             list(new_scale.split(sizes)) + list(new_scale_inv.split(sizes))
             + list(new_history.split(sizes, dim=1)))


def copy_all(targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """``target.copy_(source)`` for each pair: one ``torch._foreach_copy_`` in eager mode
    (one launch), one copy each while dynamo traces. torch 2.11's Inductor lowers a
    foreach op to a foreach kernel node, and its loop reordering after fusion then
    asserts that every node it reorders is a plain one (``reorder_loops_by_dep_pair``:
    ``assert isinstance(snode, SchedulerNode)``) when the foreach copies of these
    differently shaped states meet the amax reductions; Inductor fuses plain copies
    into their producers anyway."""
    if torch.compiler.is_compiling():
        for target, source in zip(targets, sources):
            target.copy_(source)
    else:
        torch._foreach_copy_(list(targets), list(sources))
