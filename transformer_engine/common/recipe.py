"""FP8 recipes: which FP8 formats to use and how scaling factors are chosen.

Recipes are frozen dataclasses validated at construction, so a bad value fails
where it is written, with the field named, and a recipe can be shared safely
between modules and autocast regions.
"""

from __future__ import annotations

import enum
import math
from dataclasses import InitVar, dataclass
from typing import Any, Callable, NamedTuple, Optional, Tuple, Union

import torch

__all__ = ["Format", "Recipe", "DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling",
           "Float8BlockScaling", "NVFP4BlockScaling", "max_margin", "MAX_AMAX_HISTORY_LEN"]


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
    """

    E4M3 = _FormatSpec(448.0, 448.0, torch.float8_e4m3fn, torch.float8_e4m3fn)
    E5M2 = _FormatSpec(57344.0, 57344.0, torch.float8_e5m2, torch.float8_e5m2)
    HYBRID = _FormatSpec(448.0, 57344.0, torch.float8_e4m3fn, torch.float8_e5m2)


_AMAX_ALGOS = ("max", "most_recent")

# The longest amax history a recipe may ask for: 64 times TE's default of 1024. The
# history is ``[amax_history_len, n]`` float32 per module and every update copies all
# of it (the roll), so its cost grows with the length at every step; and an amax from
# tens of thousands of steps ago no longer says anything about today's tensors. A length
# near 2**62 would only fail later, deep inside torch, when the buffer is allocated.
MAX_AMAX_HISTORY_LEN = 1 << 16

_FP32 = torch.finfo(torch.float32)


def max_margin(fp8_format: Format) -> int:
    """The largest ``margin`` that keeps every delayed scale of ``fp8_format`` a
    positive normal float32, whatever amax the history holds.

    The history is float32 and only finite amaxes make a new scale, so
    ``0 < amax <= FP32_MAX``. The scale ``(fp8_max / amax) / 2**margin`` is smallest
    at ``amax = FP32_MAX``; it stays at least the smallest normal float32 ``TINY``
    (``2**-126``; below it the scale is subnormal, ``1 / scale`` overflows to inf, and a
    little further it rounds to 0: NaN outputs) while
    ``2**margin <= fp8_max / (FP32_MAX * TINY)``, i.e.
    ``margin <= floor(log2(fp8_max) - log2(FP32_MAX) + 126)``:
    6 for E4M3 (max 448 = 2**8.81), 13 for E5M2 (max 57344 = 2**15.81). A format
    pair takes the smaller of its forward and backward bounds (6 for HYBRID). A small
    amax only makes the scale larger; that end is clamped to FP32_MAX by the update.
    """
    spec = fp8_format.value
    fp8_max = min(spec.max_fwd, spec.max_bwd)
    return math.floor(math.log2(fp8_max / _FP32.max / _FP32.tiny))


class Recipe:
    """Base class of the FP8 recipes, with TE's kind predicates.

    Recipes are immutable here (frozen dataclasses): where TE scripts assign a field
    after construction, build a new recipe with ``dataclasses.replace(recipe, ...)``.
    """

    def delayed(self) -> bool:
        """Whether this recipe keeps delayed-scaling state (amax history, scale)."""
        return isinstance(self, DelayedScaling)

    def float8_current_scaling(self) -> bool:
        """Whether this recipe scales each tensor from its own amax at cast time."""
        return isinstance(self, Float8CurrentScaling)

    def float8_per_tensor_scaling(self) -> bool:
        """One scale per tensor: delayed or current scaling."""
        return self.delayed() or self.float8_current_scaling()

    def float8_block_scaling(self) -> bool:
        return isinstance(self, Float8BlockScaling)

    def mxfp8(self) -> bool:
        return isinstance(self, MXFP8BlockScaling)

    def nvfp4(self) -> bool:
        return isinstance(self, NVFP4BlockScaling)

    def custom(self) -> bool:
        return False

    def implemented(self) -> bool:
        """Whether this package runs this recipe's casts and GEMMs."""
        return self.float8_per_tensor_scaling()


def _check_format(name: str, fp8_format) -> None:
    if not isinstance(fp8_format, Format):
        raise TypeError(f"{name}: fp8_format must be a transformer_engine.common.recipe.Format, "
                        f"got {fp8_format!r}")
    if fp8_format is Format.E5M2:
        raise ValueError(f"{name}: fp8_format=Format.E5M2 is not supported for training "
                         "(an E5M2 x E5M2 GEMM is not available); use Format.HYBRID or Format.E4M3")


@dataclass(frozen=True)
class DelayedScaling(Recipe):
    """Delayed scaling: each tensor is cast with a scale derived from the amaxes of
    earlier iterations (an amax history), updated once per training step.

    Parameters
    ----------
    margin : int, default 0
        The scale is ``(fp8_max / amax) / 2**margin``; must be in ``[0, max_margin(fp8_format)]``
        (6 for HYBRID and E4M3), so that the scale stays a positive normal float32.
    fp8_format : Format, default Format.HYBRID
    amax_history_len : int, default 1024
        Number of past amaxes kept per tensor; in ``[1, MAX_AMAX_HISTORY_LEN]`` (65536).
    amax_compute_algo : "max" | "most_recent" | callable, default "max"
        How the amax used for the new scale is taken from the history. A callable
        receives the history ``[amax_history_len, n]`` and returns ``[n]`` amaxes
        (finite and >= 0; checked at each update).
    scaling_factor_compute_algo : callable, optional
        ``f(amax, scale, fp8_max, recipe) -> new_scale`` replacing the default formula;
        it must return ``[n]`` finite scales of at least the smallest normal float32
        (checked at each update: it also sees amaxes of 0, where the default formula
        keeps the old scale).
    reduce_amax : bool, default True
        All-reduce amaxes (MAX) over the FP8 group before each update.
    override_linear_precision : (bool, bool, bool), default (False, False, False)
        TE's switch to run the forward, dgrad or wgrad GEMM in high precision; only
        all-False is implemented (a True raises NotImplementedError).
    params_dtype, device : accepted and unused
        Megatron Core passes its module arguments to the recipe too; a recipe has no
        dtype or device.
    """

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: Union[str, Callable] = "max"
    override_linear_precision: Tuple[bool, bool, bool] = (False, False, False)
    scaling_factor_compute_algo: Optional[Callable] = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False
    params_dtype: InitVar[Any] = None
    device: InitVar[Any] = None

    def __post_init__(self, params_dtype=None, device=None):
        name = "DelayedScaling"
        olp = self.override_linear_precision
        if not (isinstance(olp, tuple) and len(olp) == 3
                and all(isinstance(v, bool) for v in olp)):
            raise TypeError(f"{name}: override_linear_precision must be a tuple of three bools "
                            f"(forward, dgrad, wgrad), got {olp!r}")
        if any(olp):
            raise NotImplementedError(f"{name}: override_linear_precision={olp} (a GEMM in high "
                                      "precision inside FP8) is not implemented")
        if isinstance(self.margin, bool) or not isinstance(self.margin, int):
            raise TypeError(f"{name}: margin must be an int, got {self.margin!r}")
        if self.margin < 0:
            raise ValueError(f"{name}: margin must be >= 0, got {self.margin}")
        _check_format(name, self.fp8_format)
        limit = max_margin(self.fp8_format)
        if self.margin > limit:
            raise ValueError(f"{name}: margin must be <= {limit} for "
                             f"fp8_format=Format.{self.fp8_format.name}, got {self.margin}: the "
                             "scale (fp8_max / amax) / 2**margin would underflow float32 for "
                             "large amaxes (a zero scale gives NaN outputs)")
        if isinstance(self.amax_history_len, bool) or not isinstance(self.amax_history_len, int):
            raise TypeError(f"{name}: amax_history_len must be an int, got {self.amax_history_len!r}")
        if not 1 <= self.amax_history_len <= MAX_AMAX_HISTORY_LEN:
            raise ValueError(f"{name}: amax_history_len must be in [1, {MAX_AMAX_HISTORY_LEN}], "
                             f"got {self.amax_history_len}")
        if not callable(self.amax_compute_algo) and self.amax_compute_algo not in _AMAX_ALGOS:
            raise ValueError(f"{name}: amax_compute_algo must be one of {_AMAX_ALGOS} or a "
                             f"callable, got {self.amax_compute_algo!r}")
        if self.scaling_factor_compute_algo is not None and not callable(
                self.scaling_factor_compute_algo):
            raise TypeError(f"{name}: scaling_factor_compute_algo must be callable or None, "
                            f"got {self.scaling_factor_compute_algo!r}")
        if not isinstance(self.reduce_amax, bool):
            raise TypeError(f"{name}: reduce_amax must be a bool, got {self.reduce_amax!r}")
        if self.fp8_dpa or self.fp8_mha:
            raise ValueError(f"{name}: fp8_dpa / fp8_mha (FP8 attention) are not implemented; "
                             "attention runs in high precision")


@dataclass(frozen=True)
class Float8CurrentScaling(Recipe):
    """Current (per-tensor, just-in-time) scaling: each cast uses
    ``fp8_max / amax(x)`` of the tensor being cast. Stateless.

    Parameters
    ----------
    fp8_format : Format, default Format.HYBRID
    """

    fp8_format: Format = Format.HYBRID

    def __post_init__(self):
        _check_format("Float8CurrentScaling", self.fp8_format)


class _UnimplementedRecipe(Recipe):
    """A recipe TE defines that this package constructs (so scripts that build it, or
    check for it, run) but does not run: ``te.autocast`` refuses it."""

    def __post_init__(self):
        _check_format(type(self).__name__, self.fp8_format)


@dataclass(frozen=True)
class MXFP8BlockScaling(_UnimplementedRecipe):
    """MXFP8: E8M0 scales per 32 consecutive values (Blackwell). Not implemented here:
    constructing it works, running it in ``te.autocast`` raises NotImplementedError."""

    margin: int = 0
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False


@dataclass(frozen=True)
class Float8BlockScaling(_UnimplementedRecipe):
    """FP8 with one scale per 1x128 block of activations and gradients and per 128x128
    block of weights. Not implemented here: constructing it works, running it in
    ``te.autocast`` raises NotImplementedError."""

    fp8_format: Format = Format.E4M3
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    fp8_dpa: bool = False
    fp8_mha: bool = False


@dataclass(frozen=True)
class NVFP4BlockScaling(_UnimplementedRecipe):
    """NVFP4: FP4 values with FP8 scales per 16 values (Blackwell). Not implemented
    here: constructing it works, running it in ``te.autocast`` raises
    NotImplementedError."""

    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False
