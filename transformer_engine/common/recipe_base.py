"""What every recipe builds on: the `Format` pairs, the `Recipe` base class with TE's
kind predicates, and the field checks the recipes share. Defined here so that the
recipe modules (recipe.py, recipe_mx.py) import it one way; TE names these under
``transformer_engine.common.recipe``, which re-exports them, and so do the pickles of
recipes (FP8 extra state)."""

from __future__ import annotations

import enum
import os
from typing import NamedTuple, Optional

import torch

from .recipe_fields import ReadOnlyWhenCopied


class _FormatSpec(NamedTuple):
    """Largest finite value and torch dtype of the forward and backward FP8 types."""

    max_fwd: float
    max_bwd: float
    dtype_fwd: torch.dtype
    dtype_bwd: torch.dtype


class Format(enum.Enum):
    """FP8 format pairs.

    ``E4M3``: E4M3 for forward tensors and gradients (max 448).
    ``E5M2``: E5M2 both ways (max 57344); not usable for training GEMMs.
    ``HYBRID``: E4M3 forward (inputs, weights), E5M2 backward (output gradients).
    ``E2M1``: FP4 (max 6), the values of NVFP4BlockScaling (its ``fp4_format``); the
    torch dtype is the packed ``float4_e2m1fn_x2``. Not an FP8 recipe's format.
    """

    E4M3 = _FormatSpec(448.0, 448.0, torch.float8_e4m3fn, torch.float8_e4m3fn)
    E5M2 = _FormatSpec(57344.0, 57344.0, torch.float8_e5m2, torch.float8_e5m2)
    E2M1 = _FormatSpec(6.0, 6.0, torch.float4_e2m1fn_x2, torch.float4_e2m1fn_x2)
    HYBRID = _FormatSpec(448.0, 57344.0, torch.float8_e4m3fn, torch.float8_e5m2)

    @classmethod
    def _missing_(cls, value):
        # NVIDIA's TE pickles a Format by its value, a (max_fwd, max_bwd) pair
        # (`_FormatHelper`): the member with those maxima
        if isinstance(value, tuple) and len(value) == 2:
            for member in cls:
                if (member.value.max_fwd, member.value.max_bwd) == tuple(value):
                    return member
        return None

    def __reduce_ex__(self, protocol):
        # pickled as NVIDIA's TE pickles a Format, by a `_FormatHelper` value, so that
        # a pickle of a recipe names no torch dtype (Megatron's allow-list unpickler
        # reads FP8 extra state)
        return type(self), (_FormatHelper(self.value.max_fwd, self.value.max_bwd),)


class _FormatHelper(NamedTuple):
    """The value NVIDIA's TE gives a `Format` member, and pickles it by: its maxima.
    Defined under TE's name so that recipes TE pickled (in FP8 extra state) load."""

    max_fwd: float
    max_bwd: float


class Recipe(ReadOnlyWhenCopied):
    """Base class of the FP8 recipes, with TE's kind predicates. Fields may be set
    after construction; ``te.autocast`` checks them again (NOTE [Recipe validation])."""

    # The kind predicates, each answered True by its recipe class (and its subclasses)
    def delayed(self) -> bool:
        """Whether this recipe keeps delayed-scaling state (amax history, scale)."""
        return False

    def float8_current_scaling(self) -> bool:
        """Whether this recipe scales each tensor from its own amax at cast time."""
        return False

    def float8_per_tensor_scaling(self) -> bool:
        """One scale per tensor: delayed or current scaling."""
        return self.delayed() or self.float8_current_scaling()

    def float8_block_scaling(self) -> bool:
        return False

    def mxfp8(self) -> bool:
        return False

    def nvfp4(self) -> bool:
        return False

    def custom(self) -> bool:
        return False

    def implemented(self) -> bool:
        """Whether this package runs this recipe's casts and GEMMs."""
        return (self.float8_per_tensor_scaling() or self.float8_block_scaling()
                or self.mxfp8() or self.nvfp4())

    def validate(self) -> None:
        """Check every field; raise TypeError / ValueError naming the first bad one."""

    def __post_init__(self):
        self.validate()


BACKWARD_OVERRIDES = (None, "high_precision", "dequantized")


def _env_backward_override() -> Optional[str]:
    """TE's default of ``backward_override``: ``NVTE_BACKWARD_OVERRIDE``, read when the
    recipe is constructed (unset: None)."""
    return os.environ.get("NVTE_BACKWARD_OVERRIDE")


def _check_backward_override(name: str, value, stateless: bool = True) -> None:
    """NOTE [Backward override] in pytorch/module/backward_override.py."""
    if value not in BACKWARD_OVERRIDES:
        raise ValueError(f"{name}: backward_override (NVTE_BACKWARD_OVERRIDE) must be None, "
                         f"'high_precision' or 'dequantized', got {value!r}")
    if value is not None and not stateless:
        raise ValueError(f"{name}: delayed scaling only supports backward_override=None, got "
                         f"{value!r}; use Float8CurrentScaling or Float8BlockScaling, or unset "
                         "NVTE_BACKWARD_OVERRIDE")


def _check_format(name: str, fp8_format) -> None:
    if not isinstance(fp8_format, Format):
        raise TypeError(f"{name}: fp8_format must be a transformer_engine.common.recipe.Format, "
                        f"got {fp8_format!r}")
    if fp8_format is Format.E2M1:
        raise ValueError(f"{name}: fp8_format=Format.E2M1 is an FP4 format; use Format.HYBRID "
                         "or Format.E4M3 (NVFP4BlockScaling takes E2M1 as its fp4_format)")
    if fp8_format is Format.E5M2:
        raise ValueError(f"{name}: fp8_format=Format.E5M2 is not supported for training "
                         "(an E5M2 x E5M2 GEMM is not available); use Format.HYBRID or Format.E4M3")


for _cls in (Format, _FormatHelper, _FormatSpec, Recipe):
    _cls.__module__ = "transformer_engine.common.recipe"
del _cls
