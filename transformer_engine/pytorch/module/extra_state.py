"""The FP8 state of a TE module as ``state_dict()`` extra state: the payload that
``get_extra_state`` writes, and the checks ``set_extra_state`` runs on a payload
before it changes anything.

NOTE [FP8 extra state payload]
    The payload is TE's: a uint8 tensor holding ``pickle.dumps`` of a dict, the layout
    Megatron-LM's grouped-expert checkpointing splits and merges per expert:

    recipe               the recipe object, or None (no recipe yet, or one with a
                         callable algorithm, which is not saved: the autocast's recipe
                         is adopted at the next forward). Written as a fresh copy of
                         its fields; it names only what TE's pickles name (the recipe
                         class, ``Format`` by its ``_FormatHelper`` value, ``QParams``
                         and ``MMParams``, all under ``transformer_engine.common.recipe``),
                         so that Megatron's own allow-list unpickler reads it.
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
    empty tensor (or TE 1's pickled None) changes nothing, as in TE. A payload is read
    by the bounded reader of NOTE [Payload unpickler] (payload_pickle.py): it cannot
    run code or change anything outside the module. It is then checked whole: size
    first (at most what this module's largest state takes), keys, ``num_gemms``,
    tensors float32 of the shapes this module needs, scales finite and at least the
    smallest normal float32, histories finite, non-negative, of one length in
    ``[1, MAX_AMAX_HISTORY_LEN]`` (the recipe's ``amax_history_len`` when the recipe is
    delayed scaling), a recipe or a scaling state present (never neither), the recipe
    rebuilt through its own validation. Only then is the module's state replaced, all
    of it; a refused payload leaves the module as it was. Payloads of this package's
    earlier layout (a ``torch.save`` archive of ``{"recipe": <fields>, "scaling_fwd":
    {...}, "scaling_bwd": {...}}``) still load, read by the same rules.

    A history length that differs from the recipe in force at a later forward is
    adapted there (`delayed_scaling.resize_amax_history`: the oldest rows dropped, or zero
    rows added as the oldest), keeping the loaded scales; it is never discarded.

NOTE [FP8 extra state in distributed checkpoints]
    ``torch.distributed.checkpoint`` (DCP) stores a tensor of the state dict as a
    tensor of fixed shape and loads it in place, into the tensor the loading model's
    state dict holds: a payload's length depends on the state (history length,
    recipe), so a fresh model (an empty payload) or one warmed with another recipe
    could not load it. The payload tensor is therefore an `ExtraStateTensor`: a uint8
    tensor in every way (``load_state_dict``, Megatron's hooks, NVIDIA's TE read it),
    which pickles as a plain uint8 tensor (so ``torch.load(weights_only=True)``
    reads a ``torch.save``d state dict) and tells DCP, through DCP's own
    ``__create_write_items__`` protocol, to store it as one opaque bytes item. DCP
    loads a bytes item by replacing the state dict's entry, whatever the loading
    model's payload was, and ``load_state_dict`` hands it to ``set_extra_state``.
"""

from __future__ import annotations

import pickle
from typing import NamedTuple, Optional

import torch

from ...common.recipe import MAX_AMAX_HISTORY_LEN, DelayedScaling, Recipe
from ..scaling import ScalingState
from .payload_globals import read_archive, read_pickle
from .payload_values import InvalidPayload, describe
from .payload_recipe import check_recipe, recipe_from_record, recipe_to_dict

__all__ = ["Layout", "LoadedFP8State", "ExtraStateTensor", "save_fp8_state", "load_fp8_state",
           "max_payload_bytes"]

_TOP_KEYS = frozenset(("recipe", "scaling_fwd", "scaling_bwd"))
_STATE_KEYS = frozenset(("scale", "scale_inv", "amax_history"))
_FP32_TINY = torch.finfo(torch.float32).tiny
_ZIP_MAGIC = b"PK\x03\x04"      # torch.save writes a zip archive


class ExtraStateTensor(torch.Tensor):
    """The uint8 payload tensor ``get_extra_state`` returns (NOTE [FP8 extra state in
    distributed checkpoints]): pickled, it is a plain uint8 tensor; in
    ``torch.distributed.checkpoint``, one bytes item rather than a tensor of fixed
    shape."""

    @staticmethod
    def of(payload: torch.Tensor) -> "ExtraStateTensor":
        return payload.as_subclass(ExtraStateTensor)

    def plain(self) -> torch.Tensor:
        """The same tensor as a plain ``torch.Tensor``."""
        with torch._C.DisableTorchFunctionSubclass():
            return self.as_subclass(torch.Tensor)

    def __reduce_ex__(self, protocol):
        return self.plain().__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        if id(self) not in memo:
            memo[id(self)] = ExtraStateTensor.of(self.plain().clone())
        return memo[id(self)]

    def __create_write_items__(self, fqn: str, obj):
        # DCP's protocol for objects that choose their own write items
        from torch.distributed.checkpoint.metadata import MetadataIndex
        from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
        return [WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO)]


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
_PAYLOAD_OVERHEAD = 64 << 10        # the pickle around the tensors, generously


def max_payload_bytes(layout: Layout) -> int:
    """The largest payload this module can have written: its scales and histories at
    the longest history (each float32 tensor once, in either layout), and the pickle
    around them."""
    slots = layout.num_gemms * (TE_FWD_PER_GEMM + TE_BWD_PER_GEMM
                                + layout.fwd_per_gemm + layout.bwd_per_gemm)
    return 4 * (MAX_AMAX_HISTORY_LEN + 2) * slots + _PAYLOAD_OVERHEAD


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
        return ExtraStateTensor.of(torch.zeros(0, dtype=torch.uint8))
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
    return ExtraStateTensor.of(torch.frombuffer(bytearray(pickle.dumps(state)),
                                                dtype=torch.uint8))


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
        raw = _payload_bytes(payload, layout)
        if raw.startswith(_ZIP_MAGIC):
            data = read_archive(raw)
            if type(data) is not dict or set(data) != _TOP_KEYS:
                got = sorted(map(str, data)) if type(data) is dict else describe(data)
                raise InvalidPayload(f"expected a dict with keys {sorted(_TOP_KEYS)}, got "
                                     f"{describe(got, 300)}")
            recipe = check_recipe(data["recipe"])
            fwd = _check_state(data["scaling_fwd"], "scaling_fwd",
                               layout.num_gemms * layout.fwd_per_gemm)
            bwd = _check_state(data["scaling_bwd"], "scaling_bwd",
                               layout.num_gemms * layout.bwd_per_gemm)
        else:
            data = read_pickle(raw)
            if data is None:            # what TE 1 wrote for a module without FP8 state
                return None
            recipe, fwd, bwd = _read_te_layout(data, layout)
        _check_lengths(recipe, fwd, bwd)
    except InvalidPayload as err:
        raise ValueError(f"{api}: the FP8 extra state is not a valid payload written by "
                         f"get_extra_state: {err}") from None
    return LoadedFP8State(recipe, fwd, bwd)


def _payload_bytes(payload: torch.Tensor, layout: Layout) -> bytes:
    """The payload's bytes, after its type, shape and size were checked."""
    if payload.dtype != torch.uint8 or payload.dim() != 1 or payload.layout != torch.strided:
        raise InvalidPayload(f"expected a 1-D uint8 tensor, got {payload.dtype} of shape "
                             f"{tuple(payload.shape)}")
    limit = max_payload_bytes(layout)
    if payload.numel() > limit:
        raise InvalidPayload(f"it has {payload.numel()} bytes, more than this module's "
                             f"largest FP8 state takes ({limit})")
    if payload.device.type == "meta":
        raise InvalidPayload("it is a tensor on the meta device (no data)")
    with torch._C.DisableTorchFunctionSubclass():
        plain = payload.as_subclass(torch.Tensor)
        return plain.detach().cpu().contiguous().numpy().tobytes()


def _read_te_layout(data, layout: Layout):
    """``(recipe, scaling_fwd, scaling_bwd)`` of a payload in TE's layout."""
    if type(data) is not dict or not ({"recipe", "extra_fp8_variables"} <= set(data)
                                      <= _TE_KEYS):
        got = describe(sorted(map(str, data)), 300) if type(data) is dict else describe(data)
        raise InvalidPayload(f"expected a dict with keys 'recipe' and 'extra_fp8_variables' "
                             f"and optionally {sorted(_TE_KEYS - {'recipe', 'extra_fp8_variables'})},"
                             f" got {got}")
    extra = data["extra_fp8_variables"]
    gemms = extra.get("num_gemms", layout.num_gemms) if type(extra) is dict else None
    if type(gemms) is not int or gemms != layout.num_gemms:
        raise InvalidPayload(f"extra_fp8_variables must be a dict whose num_gemms is this "
                             f"module's {layout.num_gemms}, got {describe(extra)}")
    recipe = None if data["recipe"] is None else recipe_from_record(data["recipe"])
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
                f"{width}), got {describe(scale)} and {describe(history)}")
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
    if type(data) is not dict or set(data) != keys:
        got = describe(sorted(map(str, data))) if type(data) is dict else describe(data)
        raise InvalidPayload(f"{key}: expected a dict with keys {sorted(keys)}, got {got}")
    tensors = {}
    for name in ("scale", "scale_inv", "amax_history"):
        if name not in keys:
            continue
        t = data[name]      # a tensor the reader made: its own storage, in bounds
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.layout != torch.strided:
            got = f"{t.dtype} tensor" if isinstance(t, torch.Tensor) else describe(t)
            raise InvalidPayload(f"{key}.{name}: expected a float32 tensor, got {got}")
        tensors[name] = t.detach().contiguous()
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
    if recipe is None and fwd is None:
        raise InvalidPayload("it holds neither a recipe nor a scaling state, which "
                             "get_extra_state never writes (a module without FP8 state "
                             "writes an empty tensor)")
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
