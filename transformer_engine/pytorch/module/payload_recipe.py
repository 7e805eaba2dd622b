"""The recipe inside an FP8 extra-state payload (NOTE [FP8 extra state payload] in
extra_state.py): written as a fresh recipe object, and read back only as a recipe
rebuilt through its own constructor and validation, from fields checked one by one
(a `Record` of NOTE [Payload unpickler] in payload_pickle.py, or the plain fields of
this package's earlier layout)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from ...common.recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format,
                               MMParams, MXFP8BlockScaling, NVFP4BlockScaling, QParams, Recipe)
from ...common.recipe import GEMM_FIELDS, QUANT_FIELDS
from .payload_values import InvalidPayload, Record, RecordSpec, describe

__all__ = ["InvalidPayload", "RECIPE_CLASSES", "RECORD_SPECS", "recipe_to_dict",
           "recipe_from_record", "check_recipe", "describe"]

_STATELESS_FIELDS = ("fp8_format",) + QUANT_FIELDS + GEMM_FIELDS + ("fp8_dpa", "fp8_mha",
                                                                  "backward_override")
_BLOCK_DIM_FIELDS = ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim")
_RECIPE_FIELDS = {
    "DelayedScaling": frozenset(("type", "margin", "fp8_format", "amax_history_len",
                                 "amax_compute_algo", "reduce_amax", "fp8_dpa", "fp8_mha")),
    "Float8CurrentScaling": frozenset(("type",) + _STATELESS_FIELDS),
    "Float8BlockScaling": frozenset(("type",) + _STATELESS_FIELDS + _BLOCK_DIM_FIELDS),
    "MXFP8BlockScaling": frozenset(("type", "margin", "fp8_format", "fp8_dpa", "fp8_mha",
                                    "backward_override", "enable_2d_quantization")),
    "NVFP4BlockScaling": frozenset(("type", "disable_rht", "disable_stochastic_rounding",
                                    "disable_2d_quantization", "row_scaled_activation",
                                    "nvfp4_4over6", "nvfp4_4over6_e4m3_use_256",
                                    "nvfp4_4over6_err_mode", "fp4_format", "fp8_format",
                                    "fp8_dpa", "fp8_mha", "backward_override")),
}
RECIPE_CLASSES = {"DelayedScaling": DelayedScaling, "Float8CurrentScaling": Float8CurrentScaling,
                  "Float8BlockScaling": Float8BlockScaling, "MXFP8BlockScaling": MXFP8BlockScaling,
                  "NVFP4BlockScaling": NVFP4BlockScaling}
_PARAMS_CLASSES = dict.fromkeys(QUANT_FIELDS, QParams) | dict.fromkeys(GEMM_FIELDS, MMParams)
_STR_AMAX_ALGOS = ("max", "most_recent")

# NOTE [Recipes NVIDIA's TE pickled]
#     TE's extra state pickles its recipe objects; their classes have this package's
#     names and module (``transformer_engine.common.recipe``), and a Format is pickled
#     by its (max_fwd, max_bwd) value. TE's objects may hold fields this package's
#     classes lack, accepted where they mean what this package does: the deprecated
#     ``interval`` (ignored by TE 2 too), the NVFP4 options of QParams off, and the
#     switches TE's stateless recipes derive their QParams from
#     (``use_power_2_scales``, ``use_f32_scales``); any other value is refused as not
#     implemented. ``backward_override`` is read as the recipes' own field (a
#     DelayedScaling's only at None), its default where a payload lacks it.
_ANY = object()
_TE_ONLY_FIELDS = {
    "DelayedScaling": {"interval": _ANY, "backward_override": None},
    "Float8CurrentScaling": {"use_power_2_scales": bool},
    "Float8BlockScaling": {"use_f32_scales": bool},
    "MXFP8BlockScaling": {},
    # TE sets the derived QParams on the instance; here they are derived properties
    "NVFP4BlockScaling": {"fp4_quant_fwd_inp": _ANY, "fp4_quant_fwd_weight": _ANY,
                          "fp4_quant_bwd_grad": _ANY},
    "QParams": {"random_hadamard_transform": False, "stochastic_rounding": False,
                "fp4_2d_quantization": False},
    "MMParams": {},
}
_CLASSES = dict(RECIPE_CLASSES, QParams=QParams, MMParams=MMParams)
RECORD_SPECS = {name: RecordSpec(name, frozenset(f.name for f in dataclasses.fields(cls))
                                 | frozenset(_TE_ONLY_FIELDS[name]))
                for name, cls in _CLASSES.items()}


def recipe_to_dict(recipe: Optional[Recipe]):
    """A recipe as the plain fields `check_recipe` takes; None for a recipe with a
    callable algorithm (not saved: the autocast's recipe is adopted at the next
    forward)."""
    if recipe is None:
        return None
    if isinstance(recipe, DelayedScaling) and (callable(recipe.amax_compute_algo)
                                               or recipe.scaling_factor_compute_algo is not None):
        return None
    # by isinstance: clients subclass the recipes (Megatron's TEDelayedScaling)
    kind = next((name for name, cls in RECIPE_CLASSES.items() if isinstance(recipe, cls)), None)
    if kind is None:
        raise TypeError(f"get_extra_state: unknown recipe type {type(recipe).__name__}")
    fields = {"type": kind}
    for name in sorted(_RECIPE_FIELDS[kind] - {"type"}):
        value = getattr(recipe, name)
        if name in _PARAMS_CLASSES:
            value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        fields[name] = value.name if isinstance(value, Format) else value
    return fields


def recipe_from_record(record) -> Recipe:
    """The recipe a payload's `Record` describes, rebuilt through `check_recipe`;
    fields it lacks take the class's defaults (NOTE [Recipes NVIDIA's TE pickled])."""
    if not isinstance(record, Record) or record.spec.name not in RECIPE_CLASSES:
        raise InvalidPayload(f"recipe: expected None or a DelayedScaling, Float8CurrentScaling "
                             f"or Float8BlockScaling, got {describe(record)}")
    kind = record.spec.name
    fields = _own_fields("recipe", record)
    if kind == "DelayedScaling":
        if fields.pop("scaling_factor_compute_algo", None) is not None:
            raise InvalidPayload("recipe: scaling_factor_compute_algo must be None (a "
                                 "callable cannot come from a payload)")
        olp = fields.pop("override_linear_precision", (False, False, False))
        if not (type(olp) is tuple and len(olp) == 3 and all(v is False for v in olp)):
            raise InvalidPayload(f"recipe: override_linear_precision={describe(olp, 40)} (a "
                                 "GEMM in high precision inside FP8) is not implemented by "
                                 "this package")
    derived = _derived_qparams(record)
    default = RECIPE_CLASSES[kind]()
    data = {"type": kind}
    for name in _RECIPE_FIELDS[kind] - {"type"}:
        if name in fields:
            value = fields[name]
        elif name in QUANT_FIELDS and derived is not None:
            value = derived
        else:
            value = getattr(default, name)
        if isinstance(value, Record) and name in _PARAMS_CLASSES \
                and value.spec.name == _PARAMS_CLASSES[name].__name__:
            value = _params_fields(f"recipe: {name}", value)
        elif isinstance(value, (QParams, MMParams)):
            value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        data[name] = value.name if isinstance(value, Format) else value
    return check_recipe(data)


def _own_fields(what: str, record: Record) -> dict:
    """The record's fields this package's class has; TE's own fields checked (NOTE
    [Recipes NVIDIA's TE pickled]) and dropped."""
    fields = dict(record.fields)
    for name, expected in _TE_ONLY_FIELDS[record.spec.name].items():
        if name not in fields:
            continue
        value = fields.pop(name)
        if expected is _ANY:
            continue
        if not (isinstance(value, bool) if expected is bool else value is expected):
            raise InvalidPayload(f"{what}: {record.spec.name}.{name}={describe(value, 40)} is "
                                 "not implemented by this package")
    return fields


def _derived_qparams(record: Record) -> Optional[dict]:
    """The QParams TE's stateless recipes derive from their switch, for the QParams
    fields TE does not pickle."""
    fields = record.fields
    if "use_power_2_scales" in fields:
        return {"power_2_scale": fields["use_power_2_scales"], "amax_epsilon": 0.0}
    if "use_f32_scales" in fields:
        return {"power_2_scale": not fields["use_f32_scales"], "amax_epsilon": 0.0}
    return None


def _params_fields(what: str, record: Record) -> dict:
    cls = _CLASSES[record.spec.name]
    fields = _own_fields(what, record)
    for f in dataclasses.fields(cls):
        fields.setdefault(f.name, f.default)
    return fields


def check_recipe(data) -> Optional[Recipe]:
    if data is None:
        return None
    if not (isinstance(data, dict) and isinstance(data.get("type"), str)
            and data["type"] in _RECIPE_FIELDS):
        raise InvalidPayload(f"recipe: expected None or a dict with 'type' one of "
                             f"{sorted(_RECIPE_FIELDS)}, got {describe(data)}")
    kind = data["type"]
    allowed = _RECIPE_FIELDS[kind]
    # a stateless recipe's missing fields take their defaults (older payloads)
    required = allowed - {"fp8_dpa", "fp8_mha"} if kind == "DelayedScaling" \
        else {"type", "fp8_format"}
    if not required <= set(data) <= allowed:
        raise InvalidPayload(f"recipe: a {kind} has the fields {sorted(allowed)}, "
                             f"got {describe(sorted(map(str, data)), 300)}")
    fields = {k: v for k, v in data.items() if k != "type"}
    for name, cls in _PARAMS_CLASSES.items():
        if name in fields:
            fields[name] = _check_params(name, cls, fields[name])
    fmt = fields["fp8_format"]
    if not (isinstance(fmt, str) and fmt in Format.__members__):
        raise InvalidPayload(f"recipe: fp8_format must be one of {list(Format.__members__)}, "
                             f"got {describe(fmt)}")
    fields["fp8_format"] = Format[fmt]
    if "fp4_format" in fields:
        fp4 = fields["fp4_format"]
        if not (isinstance(fp4, str) and fp4 in Format.__members__):
            raise InvalidPayload(f"recipe: fp4_format must be one of "
                                 f"{list(Format.__members__)}, got {describe(fp4)}")
        fields["fp4_format"] = Format[fp4]
    # Only the named algorithms are data; a callable cannot come from a payload.
    algo = fields.get("amax_compute_algo", "max")
    if not (isinstance(algo, str) and algo in _STR_AMAX_ALGOS):
        raise InvalidPayload(f"recipe: amax_compute_algo must be one of {_STR_AMAX_ALGOS}, "
                             f"got {describe(algo)}")
    _check_leaves(fields)
    try:
        return RECIPE_CLASSES[kind](**fields)
    except (TypeError, ValueError, NotImplementedError) as err:
        raise InvalidPayload(f"recipe: {str(err)[:300]}") from None


_LEAF_TYPES = (type(None), bool, int, float, str, Format, QParams, MMParams)


def _check_leaves(fields: dict, prefix: str = "") -> None:
    """Every field a plain value, so that the recipe's own checks (which repr what
    they refuse) stay cheap."""
    for name, value in fields.items():
        if not isinstance(value, _LEAF_TYPES):
            raise InvalidPayload(f"recipe: {prefix}{name} must be a number, a bool, a string, "
                                 f"None or a Format, got {describe(value)}")


def _check_params(name: str, cls, data):
    """A `QParams` / `MMParams` field from its dict (its own checks run on construction)."""
    names = {f.name for f in dataclasses.fields(cls)}
    if not isinstance(data, dict) or set(data) != names:
        raise InvalidPayload(f"recipe: {name} must be a dict with keys {sorted(names)}, got "
                             f"{describe(data)}")
    _check_leaves(data, f"{name}.")
    try:
        return cls(**data)
    except (TypeError, ValueError) as err:
        raise InvalidPayload(f"recipe: {name}: {str(err)[:300]}") from None
