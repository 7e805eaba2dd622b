"""The recipe inside an FP8 extra-state payload (NOTE [FP8 extra state payload] in
extra_state.py): written as plain fields, and read back only as a recipe rebuilt
through its own constructor and validation, from fields checked one by one;
`InvalidPayload` says why a payload was refused."""

from __future__ import annotations

import dataclasses
from typing import Optional

from ...common.recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format,
                               MMParams, QParams, Recipe)
from ...common.recipe import GEMM_FIELDS, QUANT_FIELDS

__all__ = ["InvalidPayload", "RECIPE_CLASSES", "recipe_to_dict", "recipe_fields",
           "check_recipe", "describe"]

_STATELESS_FIELDS = ("fp8_format",) + QUANT_FIELDS + GEMM_FIELDS + ("fp8_dpa", "fp8_mha",
                                                                  "backward_override")
_BLOCK_DIM_FIELDS = ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim")
_RECIPE_FIELDS = {
    "DelayedScaling": frozenset(("type", "margin", "fp8_format", "amax_history_len",
                                 "amax_compute_algo", "reduce_amax")),
    "Float8CurrentScaling": frozenset(("type",) + _STATELESS_FIELDS),
    "Float8BlockScaling": frozenset(("type",) + _STATELESS_FIELDS + _BLOCK_DIM_FIELDS),
}
RECIPE_CLASSES = {"DelayedScaling": DelayedScaling, "Float8CurrentScaling": Float8CurrentScaling,
                  "Float8BlockScaling": Float8BlockScaling}
# fields older recipes (TE's before backward_override) lack, read as their default
_FIELDS_ADDED_LATER = {"backward_override": None}
_PARAMS_CLASSES = dict.fromkeys(QUANT_FIELDS, QParams) | dict.fromkeys(GEMM_FIELDS, MMParams)
_STR_AMAX_ALGOS = ("max", "most_recent")


class InvalidPayload(ValueError):
    """Why a payload was refused (the caller adds which module refused it)."""


def recipe_to_dict(recipe: Optional[Recipe]):
    """A recipe as plain data; None for a recipe with a callable algorithm."""
    if recipe is None:
        return None
    if isinstance(recipe, DelayedScaling) and (callable(recipe.amax_compute_algo)
                                               or recipe.scaling_factor_compute_algo is not None):
        return None
    if not isinstance(recipe, tuple(RECIPE_CLASSES.values())):
        raise TypeError(f"get_extra_state: unknown recipe type {type(recipe).__name__}")
    return recipe_fields(recipe)


def recipe_fields(recipe) -> dict:
    """A recipe's fields as `check_recipe` takes them. For an unpickled recipe (built
    without its constructor) every field is checked again there; a callable cannot
    come from a payload."""
    # by isinstance: clients subclass the recipes (Megatron's TEDelayedScaling)
    kind = next(name for name, cls in RECIPE_CLASSES.items() if isinstance(recipe, cls))
    fields = {"type": kind}
    _check_foreign_fields("recipe", recipe)
    try:
        if kind == "DelayedScaling" and recipe.scaling_factor_compute_algo is not None:
            raise InvalidPayload("recipe: scaling_factor_compute_algo must be None (a "
                                 "callable cannot come from a payload)")
        for name in sorted(_RECIPE_FIELDS[kind] - {"type"}):
            if name in _FIELDS_ADDED_LATER and name not in vars(recipe):
                fields[name] = _FIELDS_ADDED_LATER[name]
                continue
            value = getattr(recipe, name)
            if name in _PARAMS_CLASSES and dataclasses.is_dataclass(value):
                _check_foreign_fields(f"recipe: {name}", value)
                value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
            fields[name] = value.name if isinstance(value, Format) else value
    except AttributeError as err:
        raise InvalidPayload(f"recipe: a {kind} without a field ({err})") from None
    return fields


# NOTE [Recipes NVIDIA's TE pickled]
#     TE's extra state pickles its recipe objects; their classes have this package's
#     names and modules (QParams and MMParams are looked up in recipe too), and a
#     Format pickled by TE's (max_fwd, max_bwd) value finds its member (Format._missing_).
#     Such an object may hold fields this package's class lacks: TE's deprecated
#     ``interval`` (ignored by TE 2 too) is dropped, the NVFP4 options of QParams are
#     accepted at their default (off); any other field, or those options on, is refused.
_FOREIGN_FIELDS = {"interval": None, "random_hadamard_transform": False,
                   "stochastic_rounding": False, "fp4_2d_quantization": False}


def _check_foreign_fields(what: str, obj) -> None:
    own = {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else set()
    for name, value in vars(obj).items():
        if name in own or name.startswith("_"):
            continue
        if name not in _FOREIGN_FIELDS or (_FOREIGN_FIELDS[name] is not None
                                           and value != _FOREIGN_FIELDS[name]):
            raise InvalidPayload(f"{what}: {type(obj).__name__}.{name}={describe(value)} is "
                                 "not implemented by this package")



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
    required = allowed if kind == "DelayedScaling" else {"type", "fp8_format"}
    if not required <= set(data) <= allowed:
        raise InvalidPayload(f"recipe: a {kind} has the fields {sorted(allowed)}, "
                             f"got {sorted(map(str, data))}")
    fields = {k: v for k, v in data.items() if k != "type"}
    for name, cls in _PARAMS_CLASSES.items():
        if name in fields:
            fields[name] = _check_params(name, cls, fields[name])
    fmt = fields["fp8_format"]
    if not (isinstance(fmt, str) and fmt in Format.__members__):
        raise InvalidPayload(f"recipe: fp8_format must be one of {list(Format.__members__)}, "
                             f"got {describe(fmt)}")
    fields["fp8_format"] = Format[fmt]
    # Only the named algorithms are data; a callable cannot come from a payload.
    algo = fields.get("amax_compute_algo", "max")
    if not (isinstance(algo, str) and algo in _STR_AMAX_ALGOS):
        raise InvalidPayload(f"recipe: amax_compute_algo must be one of {_STR_AMAX_ALGOS}, "
                             f"got {describe(algo)}")
    try:
        return RECIPE_CLASSES[kind](**fields)
    except (TypeError, ValueError) as err:
        raise InvalidPayload(f"recipe: {err}") from None


def _check_params(name: str, cls, data):
    """A `QParams` / `MMParams` field from its dict (its own checks run on construction)."""
    names = {f.name for f in dataclasses.fields(cls)}
    if not isinstance(data, dict) or set(data) != names:
        raise InvalidPayload(f"recipe: {name} must be a dict with keys {sorted(names)}, got "
                             f"{describe(data)}")
    try:
        return cls(**data)
    except (TypeError, ValueError) as err:
        raise InvalidPayload(f"recipe: {name}: {err}") from None


def describe(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
