"""What the recipes are built from: `QParams`, `MMParams`, the field checks they share,
and the read-only copy ``te.autocast`` runs on (NOTE [Recipe validation] in recipe.py).
`recipe.py` re-exports `QParams` and `MMParams`, where TE has them."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch

__all__ = ["QParams", "MMParams", "validated_copy", "check_bool", "check_qparams",
           "check_mmparams"]

_FP32_MAX = torch.finfo(torch.float32).max


class ReadOnlyWhenCopied:
    """Base of the recipe dataclasses: the read-only copy an autocast takes refuses
    assignments (NOTE [Recipe validation])."""

    def __setattr__(self, name: str, value) -> None:
        if self.__dict__.get("_read_only", False):
            raise AttributeError(
                f"{type(self).__name__}.{name}: this is the read-only copy te.autocast took of "
                "a recipe at entry; set the field on the recipe passed to te.autocast (it takes "
                "effect at the next entry)")
        object.__setattr__(self, name, value)


def check_bool(name: str, field_name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: {field_name} must be a bool, got {value!r}")


def check_qparams(name: str, prefix: str, q) -> None:
    """``q`` is a valid `QParams`; errors name ``<prefix>power_2_scale`` etc."""
    if not isinstance(q, QParams):
        raise TypeError(f"{name}: {prefix.rstrip('.')} must be a "
                        f"transformer_engine.common.recipe.QParams, got {q!r}")
    check_bool(name, prefix + "power_2_scale", q.power_2_scale)
    eps = q.amax_epsilon
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"{name}: {prefix}amax_epsilon must be a float, got {eps!r}")
    if not 0.0 <= eps <= _FP32_MAX:
        raise ValueError(f"{name}: {prefix}amax_epsilon must be in [0, {_FP32_MAX}] (a finite "
                         f"float32 floor for the amax), got {eps}")


def check_mmparams(name: str, prefix: str, m) -> None:
    if not isinstance(m, MMParams):
        raise TypeError(f"{name}: {prefix.rstrip('.')} must be a "
                        f"transformer_engine.common.recipe.MMParams, got {m!r}")
    check_bool(name, prefix + "use_split_accumulator", m.use_split_accumulator)


@dataclass(unsafe_hash=True)
class QParams(ReadOnlyWhenCopied):
    """How the tensors of one role (input, weight or gradient) are quantized by current
    and block scaling.

    Parameters
    ----------
    power_2_scale : bool, default False
        Round each scale down to a power of two (its mantissa zeroed), so that
        multiplying by the scale and by ``scale_inv`` is exact.
    amax_epsilon : float, default 0.0
        The amax a scale is computed from is at least this: a floor that keeps the
        scale of a (nearly) all-zero tensor or block from growing without bound.
    random_hadamard_transform, stochastic_rounding, fp4_2d_quantization : bool, default False
        NVFP4BlockScaling's options for the role (TE's fields): a 16-point random
        Hadamard transform before the cast, stochastic rounding, 16x16 blocks. Only
        NVFP4BlockScaling reads them.
    """

    power_2_scale: bool = False
    amax_epsilon: float = 0.0
    random_hadamard_transform: bool = False
    stochastic_rounding: bool = False
    fp4_2d_quantization: bool = False

    def __post_init__(self):
        check_qparams("QParams", "", self)
        for flag in ("random_hadamard_transform", "stochastic_rounding", "fp4_2d_quantization"):
            check_bool("QParams", flag, getattr(self, flag))


@dataclass(unsafe_hash=True)
class MMParams(ReadOnlyWhenCopied):
    """Options of one FP8 GEMM.

    Parameters
    ----------
    use_split_accumulator : bool, default True
        On Hopper's FP8 tensor cores, promote partial sums into a float32 accumulator
        at intervals (True) instead of keeping them in the faster, less precise
        accumulator (False). Here it is ``torch._scaled_mm``'s ``use_fast_accum = not
        use_split_accumulator`` on CUDA; the CPU GEMM and the block-scaling emulation
        accumulate in float32 either way, so there it changes nothing.
    """

    use_split_accumulator: bool = True

    def __post_init__(self):
        check_mmparams("MMParams", "", self)


# NVIDIA's TE defines QParams and MMParams in transformer_engine.common.recipe, which
# re-exports them: pickles of a recipe (FP8 extra state) name them there, as TE's do.
QParams.__module__ = MMParams.__module__ = "transformer_engine.common.recipe"


def validated_copy(recipe):
    """``recipe`` checked (`Recipe.validate`) and copied read-only, as an autocast runs
    it (NOTE [Recipe validation]). The copy is cached on ``recipe`` and reused while
    ``recipe`` still equals it; a read-only copy is returned as it is."""
    if recipe.__dict__.get("_read_only", False):
        return recipe
    cached = recipe.__dict__.get("_validated_copy")
    if cached is not None and cached == recipe:
        return cached
    recipe.validate()
    checked = _read_only_copy(recipe)
    object.__setattr__(recipe, "_validated_copy", checked)
    return checked


def _read_only_copy(obj):
    new = copy.copy(obj)
    new.__dict__.pop("_validated_copy", None)
    for f in dataclasses.fields(new):
        value = new.__dict__.get(f.name)
        if isinstance(value, ReadOnlyWhenCopied):
            new.__dict__[f.name] = _read_only_copy(value)
    new.__dict__["_read_only"] = True
    return new
