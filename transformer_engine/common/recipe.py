"""FP8 recipes: which FP8 formats to use and how scaling factors are chosen.

NOTE [Recipe validation]
    Recipes are mutable dataclasses, as TE's are: scripts set fields after
    construction (``recipe.margin = 1``). Every field is checked at construction and
    again whenever ``te.autocast`` is entered with the recipe (`validated_copy`), so a
    bad value set later fails there, with the field named. The autocast then runs on a
    read-only copy taken at entry: its modules, its scale updates and the backward of
    its forwards all see the values in force at entry, whatever the script changes
    meanwhile; a change takes effect at the next ``te.autocast`` entry. The copy is kept
    on the recipe while its values stay the same, so entering an autocast with an
    unchanged recipe costs one comparison of its fields. Recipes compare and hash by
    value (equal recipes share one scale update), so a recipe used as a dict key must
    not be changed.
"""

from __future__ import annotations

import math
import os
from dataclasses import InitVar, dataclass, field
from typing import Any, Callable, Optional, Tuple, Union

import torch

from .recipe_base import (BACKWARD_OVERRIDES, Format, Recipe, _check_backward_override,
                          _check_format, _env_backward_override)
# pickles of a Format name these here (TE's and this package's earlier payloads)
from .recipe_base import _FormatHelper, _FormatSpec  # noqa: F401
from .recipe_fields import MMParams, QParams, check_bool, check_mmparams, check_qparams, validated_copy
from .recipe_mx import FP4QParams, MXFP8BlockScaling, NVFP4BlockScaling

__all__ = ["Format", "Recipe", "QParams", "MMParams", "DelayedScaling", "Float8CurrentScaling",
           "MXFP8BlockScaling", "Float8BlockScaling", "NVFP4BlockScaling", "FP4QParams",
           "max_margin",
           "MAX_AMAX_HISTORY_LEN", "validated_copy", "BACKWARD_OVERRIDES"]



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



def _check_common(recipe, quant_and_gemm: bool = True) -> None:
    """fp8_format, fp8_dpa, fp8_mha and (current and block scaling) the QParams and
    MMParams fields. fp8_dpa / fp8_mha = True is refused when an autocast enables the
    recipe (fp8.py), not here: TE builds such recipes."""
    name = type(recipe).__name__
    _check_format(name, recipe.fp8_format)
    for flag in ("fp8_dpa", "fp8_mha"):
        check_bool(name, flag, getattr(recipe, flag))
    if quant_and_gemm:
        for f in QUANT_FIELDS:
            check_qparams(name, f + ".", getattr(recipe, f))
        for f in GEMM_FIELDS:
            check_mmparams(name, f + ".", getattr(recipe, f))


QUANT_FIELDS = ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad")
GEMM_FIELDS = ("fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad")


@dataclass(unsafe_hash=True)
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
        A module's history is resized (newest amaxes kept) when this changes.
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
    fp8_dpa, fp8_mha : bool, default False
        FP8 attention: not implemented; True raises NotImplementedError when an
        autocast enables the recipe.
    backward_override : None, default ``NVTE_BACKWARD_OVERRIDE``
        TE's field; delayed scaling takes only None (anything else raises ValueError).
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
    backward_override: Optional[str] = field(default_factory=_env_backward_override)
    params_dtype: InitVar[Any] = None
    device: InitVar[Any] = None

    def __post_init__(self, params_dtype=None, device=None):
        self.validate()

    def delayed(self) -> bool:
        return True

    def validate(self) -> None:
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
        _check_common(self, quant_and_gemm=False)
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
        check_bool(name, "reduce_amax", self.reduce_amax)
        _check_backward_override(name, self.backward_override, stateless=False)


def _no_split_accumulator() -> MMParams:
    return MMParams(use_split_accumulator=False)


@dataclass(unsafe_hash=True)
class Float8CurrentScaling(Recipe):
    """Current (per-tensor, just-in-time) scaling: each cast uses
    ``fp8_max / max(amax(x), amax_epsilon)`` of the tensor being cast. Stateless.

    Parameters
    ----------
    fp8_format : Format, default Format.HYBRID
    fp8_quant_fwd_inp, fp8_quant_fwd_weight, fp8_quant_bwd_grad : QParams
        How inputs, weights and output gradients are scaled (default
        ``QParams(power_2_scale=False, amax_epsilon=0.0)``).
    fp8_gemm_fprop, fp8_gemm_dgrad, fp8_gemm_wgrad : MMParams
        ``use_split_accumulator`` of the forward (default False), dgrad and wgrad
        (default True) GEMMs; see `MMParams` for what it changes here.
    fp8_dpa, fp8_mha : bool, default False
        FP8 attention: not implemented; True raises NotImplementedError when an
        autocast enables the recipe.
    backward_override : None | "high_precision" | "dequantized", default ``NVTE_BACKWARD_OVERRIDE``
        None: FP8 dgrad and wgrad GEMMs. "high_precision": the backward GEMMs run in the
        activation dtype on the forward's unquantized input and weight; "dequantized":
        on the dequantized FP8 operands of the forward GEMM (NOTE [Backward override]
        in ``transformer_engine/pytorch/module/backward_override.py``).
    """

    fp8_format: Format = Format.HYBRID
    fp8_quant_fwd_inp: QParams = field(default_factory=QParams)
    fp8_quant_fwd_weight: QParams = field(default_factory=QParams)
    fp8_quant_bwd_grad: QParams = field(default_factory=QParams)
    fp8_gemm_fprop: MMParams = field(default_factory=_no_split_accumulator)
    fp8_gemm_dgrad: MMParams = field(default_factory=MMParams)
    fp8_gemm_wgrad: MMParams = field(default_factory=MMParams)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = field(default_factory=_env_backward_override)

    def float8_current_scaling(self) -> bool:
        return True

    def validate(self) -> None:
        _check_common(self)
        _check_backward_override("Float8CurrentScaling", self.backward_override)


def _block_qparams() -> QParams:
    """TE's default for block scaling: power-of-2 scales, unless the environment asks
    for plain float32 scales (``NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1``, read at
    construction)."""
    fp32_scales = os.environ.get("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "0") == "1"
    return QParams(power_2_scale=not fp32_scales, amax_epsilon=0.0)


_BLOCK_DIM_FIELDS = ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim")
# the operands of each GEMM (NOTE [GEMM vocabulary] in pytorch/quantize.py)
_GEMM_OPERANDS = (("forward", "x_block_scaling_dim", "w_block_scaling_dim"),
                  ("dgrad", "grad_block_scaling_dim", "w_block_scaling_dim"),
                  ("wgrad", "grad_block_scaling_dim", "x_block_scaling_dim"))


@dataclass(unsafe_hash=True)
class Float8BlockScaling(Recipe):
    """FP8 with one scale per block of 128 values (1D: 128 consecutive values of a row)
    or 128x128 values (2D), from the block's own amax at cast time. Stateless. The
    GEMMs are emulated exactly (NOTE [Block scaling layout] in
    ``transformer_engine/pytorch/block_scaling.py``).

    Parameters
    ----------
    fp8_format : Format, default Format.E4M3
        E4M3 both ways by default (the per-block scales leave enough range for
        gradients); HYBRID is accepted, E5M2 is not.
    fp8_quant_fwd_inp, fp8_quant_fwd_weight, fp8_quant_bwd_grad : QParams
        Default ``QParams(power_2_scale=True, amax_epsilon=0.0)``
        (``power_2_scale=False`` when ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1``).
    x_block_scaling_dim, w_block_scaling_dim, grad_block_scaling_dim : 1 or 2
        Block shape of inputs (default 1), weights (default 2) and output gradients
        (default 1). As in TE, no GEMM may take two 2D-scaled operands.
    fp8_gemm_fprop, fp8_gemm_dgrad, fp8_gemm_wgrad : MMParams
        Default ``use_split_accumulator=True``; the emulation accumulates in float32
        either way.
    fp8_dpa, fp8_mha : bool, default False
        FP8 attention: not implemented; True raises NotImplementedError when an
        autocast enables the recipe.
    backward_override : None | "high_precision" | "dequantized", default ``NVTE_BACKWARD_OVERRIDE``
        None: FP8 dgrad and wgrad GEMMs. "high_precision": the backward GEMMs run in the
        activation dtype on the forward's unquantized input and weight; "dequantized":
        on the dequantized FP8 operands of the forward GEMM (NOTE [Backward override]
        in ``transformer_engine/pytorch/module/backward_override.py``).
    """

    fp8_format: Format = Format.E4M3
    fp8_quant_fwd_inp: QParams = field(default_factory=_block_qparams)
    fp8_quant_fwd_weight: QParams = field(default_factory=_block_qparams)
    fp8_quant_bwd_grad: QParams = field(default_factory=_block_qparams)
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    fp8_gemm_fprop: MMParams = field(default_factory=MMParams)
    fp8_gemm_dgrad: MMParams = field(default_factory=MMParams)
    fp8_gemm_wgrad: MMParams = field(default_factory=MMParams)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = field(default_factory=_env_backward_override)

    def float8_block_scaling(self) -> bool:
        return True

    def validate(self) -> None:
        name = "Float8BlockScaling"
        _check_common(self)
        _check_backward_override(name, self.backward_override)
        for f in _BLOCK_DIM_FIELDS:
            value = getattr(self, f)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name}: {f} must be an int (1 or 2), got {value!r}")
            if value not in (1, 2):
                raise ValueError(f"{name}: {f} must be 1 (1x128 blocks) or 2 (128x128 blocks), "
                                 f"got {value}")
        for gemm, a, b in _GEMM_OPERANDS:
            if getattr(self, a) == 2 and getattr(self, b) == 2:
                raise ValueError(f"{name}: {a}=2 with {b}=2 would make the {gemm} GEMM take two "
                                 "2D-scaled operands, which TE does not support; at most one "
                                 "operand of each GEMM may use 128x128 blocks")

