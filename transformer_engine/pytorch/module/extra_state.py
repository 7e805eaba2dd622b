"""The FP8 state of a TE module as ``state_dict()`` extra state: the payload that
``get_extra_state`` writes, and the checks ``set_extra_state`` runs on a payload
before it changes anything.

NOTE [FP8 extra state payload]
    The payload is TE's: a uint8 tensor holding ``pickle.dumps`` of a dict, the layout
    Megatron-LM's grouped-expert checkpointing splits and merges per expert:

    recipe               the recipe object, or None (no recipe yet, or one with a
                         callable algorithm, which is not saved: the autocast's recipe
                         is adopted at the next forward). Written as a fresh copy of
                         its fields.
    extra_fp8_variables  ``{"num_gemms": n}``.
    scale_fwd, amax_history_fwd, scale_bwd, amax_history_bwd
                         present when the module has delayed-scaling state: float32
                         ``[k]`` and ``[L, k]`` in TE's slots, 3 per GEMM forward
                         (input, weight, output) and 2 backward (grad output, grad
                         input), GEMM by GEMM, or role by role for te.GroupedLinear
                         (slot ``role * n + gemm``). The output and grad-input slots,
                         which this package does not use, are written as scale 1 and
                         zero history and dropped on load; ``scale_inv`` is not saved
                         (``1 / scale``, as TE 2 does).

    A module with no FP8 state at all writes an empty tensor instead, and loading an
    empty tensor changes nothing (as in TE). A payload is unpickled with an
    allow-list (tensors, torch dtypes, this package's recipe classes; a tensor's
    storage is read with ``torch.load(weights_only=True)``), so it cannot run code,
    and checked whole: keys, ``num_gemms``, tensors float32 of the shapes this module
    needs, scales finite and at least the smallest normal float32, histories finite,
    non-negative, of one length in ``[1, MAX_AMAX_HISTORY_LEN]`` (the recipe's
    ``amax_history_len`` when the recipe is delayed scaling), the recipe rebuilt
    through its own validation. Only then is the module's state replaced, all of it;
    a refused payload leaves the module as it was. Payloads of this package's earlier
    layout (a ``torch.save`` archive of ``{"recipe": <fields>, "scaling_fwd": {...},
    "scaling_bwd": {...}}``) still load, through ``torch.load(weights_only=True)``.

    A history length that differs from the recipe in force at a later forward is
    adapted there (`delayed_scaling.resize_amax_history`: the oldest rows dropped, or zero
    rows added as the oldest), keeping the loaded scales; it is never discarded.
"""

from __future__ import annotations

import collections
import io
import pickle
from typing import NamedTuple, Optional

import torch

from ...common.recipe import (MAX_AMAX_HISTORY_LEN, DelayedScaling, Float8BlockScaling,
                               Float8CurrentScaling, Format, MMParams, QParams, Recipe)
from ...common.recipe import _FormatHelper
from ..scaling import ScalingState
from .payload_recipe import (InvalidPayload, check_recipe, describe,
                             recipe_fields, recipe_to_dict)

__all__ = ["Layout", "LoadedFP8State", "save_fp8_state", "load_fp8_state"]

_TOP_KEYS = frozenset(("recipe", "scaling_fwd", "scaling_bwd"))
_STATE_KEYS = frozenset(("scale", "scale_inv", "amax_history"))
_FP32_TINY = torch.finfo(torch.float32).tiny
_ZIP_MAGIC = b"PK\x03\x04"      # torch.save writes a zip archive


class LoadedFP8State(NamedTuple):
    """A checked payload, on the CPU, ready to replace the module's state."""

    recipe: Optional[Recipe]
    scaling_fwd: Optional[ScalingState]
    scaling_bwd: Optional[ScalingState]


class Layout(NamedTuple):
    """Where a module's FP8 tensors sit: its GEMMs, this package's slots per GEMM
    (forward, backward), and whether TE orders its slots role by role
    (te.GroupedLinear) rather than GEMM by GEMM."""

    num_gemms: int
    fwd_per_gemm: int
    bwd_per_gemm: int
    role_major: bool = False


TE_FWD_PER_GEMM, TE_BWD_PER_GEMM = 3, 2
_TE_KEYS = frozenset(("recipe", "extra_fp8_variables", "scale_fwd", "amax_history_fwd",
                      "scale_bwd", "amax_history_bwd"))


def _te_slots(layout: Layout, forward: bool) -> torch.Tensor:
    """For each of this package's slots, in order, its slot in TE's layout."""
    ours = layout.fwd_per_gemm if forward else layout.bwd_per_gemm
    per_gemm = TE_FWD_PER_GEMM if forward else TE_BWD_PER_GEMM
    n = layout.num_gemms
    return torch.tensor([r * n + g if layout.role_major else g * per_gemm + r
                         for g in range(n) for r in range(ours)], dtype=torch.long)


def save_fp8_state(fp8_meta: dict, layout: Layout) -> torch.Tensor:
    """The payload of NOTE [FP8 extra state payload] for ``fp8_meta``; an empty uint8
    tensor when the module has no FP8 state at all (no recipe, no scaling state), as
    TE writes (Megatron-LM's grouped-expert checkpointing reads an empty tensor as "no
    FP8")."""
    if fp8_meta["recipe"] is None and fp8_meta["scaling_fwd"] is None \
            and fp8_meta["scaling_bwd"] is None:
        return torch.zeros(0, dtype=torch.uint8)
    fields = recipe_to_dict(fp8_meta["recipe"])
    state = {"recipe": None if fields is None else check_recipe(fields),
             "extra_fp8_variables": {"num_gemms": layout.num_gemms}}
    for forward, direction in ((True, "fwd"), (False, "bwd")):
        s = fp8_meta["scaling_" + direction]
        if s is None:
            continue
        slots = _te_slots(layout, forward)
        width = layout.num_gemms * (TE_FWD_PER_GEMM if forward else TE_BWD_PER_GEMM)
        scale = torch.ones(width, dtype=torch.float32)
        scale[slots] = s.scale.detach().cpu()
        history = torch.zeros(s.amax_history.shape[0], width, dtype=torch.float32)
        history[:, slots] = s.amax_history.detach().cpu()
        state["scale_" + direction], state["amax_history_" + direction] = scale, history
    return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)


# ---- loading --------------------------------------------------------------------

def load_fp8_state(payload, api: str, layout: Layout) -> Optional[LoadedFP8State]:
    """Read and check a payload (NOTE [FP8 extra state payload]); None for an empty
    one (nothing to load). ``api`` names the module in errors.

    Raises
    ------
    TypeError
        ``payload`` is not a tensor.
    ValueError
        Anything else is wrong with it: ``"<api>: the FP8 extra state is not a valid
        payload written by get_extra_state: <reason>"``.
    """
    if payload is None or (torch.is_tensor(payload) and payload.numel() == 0):
        return None
    if not torch.is_tensor(payload):
        raise TypeError(f"{api}: expected the uint8 tensor written by get_extra_state, "
                        f"got {type(payload).__name__}")
    try:
        if payload.dtype != torch.uint8 or payload.dim() != 1:
            raise InvalidPayload(f"expected a 1-D uint8 tensor, got {payload.dtype} of shape "
                                 f"{tuple(payload.shape)}")
        raw = payload.detach().cpu().numpy().tobytes()
        if raw.startswith(_ZIP_MAGIC):
            data = _read_archive(raw)
            recipe = check_recipe(data["recipe"])
            fwd = _check_state(data["scaling_fwd"], "scaling_fwd",
                               layout.num_gemms * layout.fwd_per_gemm)
            bwd = _check_state(data["scaling_bwd"], "scaling_bwd",
                               layout.num_gemms * layout.bwd_per_gemm)
        else:
            recipe, fwd, bwd = _read_te_layout(raw, layout)
        _check_lengths(recipe, fwd, bwd)
    except InvalidPayload as err:
        raise ValueError(f"{api}: the FP8 extra state is not a valid payload written by "
                         f"get_extra_state: {err}") from None
    return LoadedFP8State(recipe, fwd, bwd)


def _read_archive(raw: bytes) -> dict:
    """A payload of the earlier layout, loaded with ``weights_only=True``; torch's own
    errors (and their advice to load untrusted bytes with ``weights_only=False``) are
    replaced by a reason."""
    try:
        data = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        reason = ("torch.load(weights_only=True) refuses its contents (objects other than "
                  "tensors and plain Python values, or corrupted data)")
        raise InvalidPayload(reason) from None
    except (RuntimeError, EOFError, ValueError, OSError) as err:
        reason = (f"its bytes are not a complete torch.save archive (truncated or corrupted; "
                  f"{type(err).__name__})")
        raise InvalidPayload(reason) from None
    if not isinstance(data, dict) or set(data) != _TOP_KEYS:
        got = sorted(map(str, data)) if isinstance(data, dict) else type(data).__name__
        raise InvalidPayload(f"expected a dict with keys {sorted(_TOP_KEYS)}, got {got}")
    return data


def _storage_from_bytes(raw: bytes):
    return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)


_ALLOWED = {("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
            ("torch.storage", "_load_from_bytes"): _storage_from_bytes,
            ("collections", "OrderedDict"): collections.OrderedDict}
_ALLOWED.update({("transformer_engine.common.recipe", cls.__name__): cls
                 for cls in (DelayedScaling, Float8CurrentScaling, Float8BlockScaling, Format,
                             type(Format.E4M3.value))})
# NVIDIA's TE defines QParams and MMParams in recipe, and pickles a Format by its
# _FormatHelper value (NOTE [Recipes NVIDIA's TE pickled] in payload_recipe.py)
_ALLOWED.update({(module, cls.__name__): cls for cls in (QParams, MMParams)
                 for module in ("transformer_engine.common.recipe_fields",
                                "transformer_engine.common.recipe")})
_ALLOWED[("transformer_engine.common.recipe", "_FormatHelper")] = _FormatHelper


class _AllowListUnpickler(pickle.Unpickler):
    """Unpickles tensors, torch dtypes and this package's recipes, nothing else."""

    def find_class(self, module: str, name: str):
        found = _ALLOWED.get((module, name))
        if found is None and module == "torch" and isinstance(getattr(torch, name, None),
                                                              torch.dtype):
            found = getattr(torch, name)
        if found is None:
            raise InvalidPayload(f"it refers to {module}.{name}, which an FP8 extra state "
                                 "never holds (only tensors, torch dtypes and recipes load)")
        return found


def _read_te_layout(raw: bytes, layout: Layout):
    """``(recipe, scaling_fwd, scaling_bwd)`` of a payload in TE's layout."""
    try:
        data = _AllowListUnpickler(io.BytesIO(raw)).load()
    except InvalidPayload:
        raise
    except Exception as err:   # whatever malformed bytes make the unpickler raise
        raise InvalidPayload(f"its bytes are not a complete pickle (truncated or corrupted; "
                             f"{type(err).__name__})") from None
    if not isinstance(data, dict) or not ({"recipe", "extra_fp8_variables"} <= set(data)
                                          <= _TE_KEYS):
        got = sorted(map(str, data)) if isinstance(data, dict) else type(data).__name__
        raise InvalidPayload(f"expected a dict with keys 'recipe' and 'extra_fp8_variables' "
                             f"and optionally {sorted(_TE_KEYS - {'recipe', 'extra_fp8_variables'})},"
                             f" got {got}")
    extra = data["extra_fp8_variables"]
    if not isinstance(extra, dict) or extra.get("num_gemms", layout.num_gemms) != layout.num_gemms:
        raise InvalidPayload(f"extra_fp8_variables must be a dict whose num_gemms is this "
                             f"module's {layout.num_gemms}, got {describe(extra)}")
    recipe = data["recipe"]
    if recipe is not None:
        if not isinstance(recipe, (DelayedScaling, Float8CurrentScaling, Float8BlockScaling)):
            raise InvalidPayload(f"recipe: expected None or a DelayedScaling, "
                                 f"Float8CurrentScaling or Float8BlockScaling, got "
                                 f"{type(recipe).__name__}")
        recipe = check_recipe(recipe_fields(recipe))
    states = []
    for forward, direction in ((True, "fwd"), (False, "bwd")):
        scale, history = data.get("scale_" + direction), data.get("amax_history_" + direction)
        if scale is None and history is None:
            states.append(None)
            continue
        width = layout.num_gemms * (TE_FWD_PER_GEMM if forward else TE_BWD_PER_GEMM)
        if not (torch.is_tensor(scale) and torch.is_tensor(history) and scale.dim() == 1
                and history.dim() == 2 and scale.shape[0] == width == history.shape[1]):
            raise InvalidPayload(
                f"scale_{direction} and amax_history_{direction}: this module's {width} slots "
                f"(TE's layout) need tensors of shapes ({width},) and (amax_history_len, "
                f"{width}), got {_describe_tensor(scale)} and {_describe_tensor(history)}")
        slots = _te_slots(layout, forward)
        states.append(_check_state({"scale": scale[slots], "amax_history": history[:, slots]},
                                   "scaling_" + direction, len(slots), saved_inverse=False))
    return recipe, states[0], states[1]


def _check_state(data, key: str, n: int, saved_inverse: bool = True) -> Optional[ScalingState]:
    """A scaling state of ``n`` tensors, copied out of the payload. ``saved_inverse``:
    the payload holds ``scale_inv`` (the earlier layout), checked to be ``1 / scale``;
    else (TE's layout) it is computed."""
    if data is None:
        return None
    keys = _STATE_KEYS if saved_inverse else _STATE_KEYS - {"scale_inv"}
    if not isinstance(data, dict) or set(data) != keys:
        got = sorted(map(str, data)) if isinstance(data, dict) else describe(data)
        raise InvalidPayload(f"{key}: expected a dict with keys {sorted(keys)}, got {got}")
    tensors = {}
    for name in ("scale", "scale_inv", "amax_history"):
        if name not in keys:
            continue
        t = data[name]
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.layout != torch.strided:
            got = f"{t.dtype} tensor" if isinstance(t, torch.Tensor) else describe(t)
            raise InvalidPayload(f"{key}.{name}: expected a float32 tensor, got {got}")
        tensors[name] = t.detach().clone().contiguous()
    scale, history = tensors["scale"], tensors["amax_history"]
    scale_inv = tensors["scale_inv"] if saved_inverse else None
    for name, t in (("scale", scale), ("scale_inv", scale_inv)):
        if t is not None and tuple(t.shape) != (n,):
            raise InvalidPayload(f"{key}.{name}: this module has {n} tensors here, so the shape "
                                 f"must be ({n},), got {tuple(t.shape)} (a state saved from a "
                                 "module with another number of GEMMs?)")
    if history.dim() != 2 or history.shape[1] != n:
        raise InvalidPayload(f"{key}.amax_history: the shape must be (amax_history_len, {n}), "
                             f"got {tuple(history.shape)}")
    if not 1 <= history.shape[0] <= MAX_AMAX_HISTORY_LEN:
        raise InvalidPayload(f"{key}.amax_history: the length must be in "
                             f"[1, {MAX_AMAX_HISTORY_LEN}], got {history.shape[0]}")
    bad = ~torch.isfinite(scale) | (scale < _FP32_TINY)
    if bool(bad.any()):
        raise InvalidPayload(f"{key}.scale: every scale must be finite and >= {_FP32_TINY} "
                             f"(the smallest normal float32), got {scale.tolist()}")
    if scale_inv is None:
        scale_inv = torch.reciprocal(scale)
    # 1 / scale in float32, to the rounding of the division
    elif not torch.allclose(scale_inv, torch.reciprocal(scale), rtol=2.0 ** -23, atol=0.0):
        raise InvalidPayload(f"{key}.scale_inv: must be 1 / scale, got scale_inv "
                             f"{scale_inv.tolist()} for scale {scale.tolist()}")
    if not bool((torch.isfinite(history) & (history >= 0)).all()):
        raise InvalidPayload(f"{key}.amax_history: every amax must be finite and >= 0")
    return ScalingState(scale, scale_inv, history)


def _check_lengths(recipe: Optional[Recipe], fwd: Optional[ScalingState],
                   bwd: Optional[ScalingState]) -> None:
    """Forward and backward states exist together (they are made together) with one
    history length: the recipe's, when the recipe is delayed scaling."""
    if (fwd is None) != (bwd is None):
        raise InvalidPayload("scaling_fwd and scaling_bwd must both be present or both None")
    delayed = isinstance(recipe, DelayedScaling)
    if fwd is None:
        if delayed:
            raise InvalidPayload("a DelayedScaling recipe comes with its scaling state, "
                                 "but scaling_fwd and scaling_bwd are None")
        return
    lengths = (fwd.amax_history.shape[0], bwd.amax_history.shape[0])
    if lengths[0] != lengths[1]:
        raise InvalidPayload(f"the forward and backward amax histories differ in length: "
                             f"{lengths[0]} and {lengths[1]}")
    if delayed and lengths[0] != recipe.amax_history_len:
        raise InvalidPayload(f"the amax histories have {lengths[0]} rows but the saved recipe "
                             f"has amax_history_len={recipe.amax_history_len}")


def _describe_tensor(t) -> str:
    return f"{t.dtype} tensor of shape {tuple(t.shape)}" if torch.is_tensor(t) else describe(t)
