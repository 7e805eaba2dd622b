"""The MX-family recipes, MXFP8BlockScaling and NVFP4BlockScaling, with NVFP4's derived
per-role `FP4QParams`. Re-exported by ``transformer_engine.common.recipe``, which is
where TE defines them; pickles of these recipes (FP8 extra state) name them there."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

from .recipe_base import (Format, Recipe, _check_backward_override, _check_format,
                     _env_backward_override)
from .recipe_fields import QParams, check_bool

__all__ = ["MXFP8BlockScaling", "NVFP4BlockScaling", "FP4QParams"]


@dataclass(unsafe_hash=True)
class MXFP8BlockScaling(Recipe):
    """MXFP8: FP8 values with one E8M0 (power-of-two) scale per 32 consecutive values,
    from the block's own amax at cast time (TE's rounding of the exponent: up).
    Stateless. Emulated exactly on every device (NOTE [MXFP8 layout and rounding] in
    ``transformer_engine/pytorch/mx_scaling.py``): Blackwell's MX tensor cores are not
    used.

    Parameters
    ----------
    margin : int, default 0
        TE's field, unused by its MXFP8 recipe too.
    fp8_format : Format, default Format.E4M3
        E4M3 both ways, or HYBRID (E5M2 output gradients); E5M2 is refused.
    enable_2d_quantization : bool, default False
        Weights in 32x32 tiles (one scale per tile) instead of 1x32 blocks.
    fp8_dpa, fp8_mha : bool, default False
        FP8 attention: not implemented; True raises NotImplementedError when an
        autocast enables the recipe.
    backward_override : None | "high_precision" | "dequantized", default ``NVTE_BACKWARD_OVERRIDE``
        As for Float8CurrentScaling (NOTE [Backward override] in
        ``transformer_engine/pytorch/module/backward_override.py``).
    """

    margin: int = 0
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = field(default_factory=_env_backward_override)
    enable_2d_quantization: bool = False

    def mxfp8(self) -> bool:
        return True

    def validate(self) -> None:
        name = "MXFP8BlockScaling"
        _check_format(name, self.fp8_format)
        for flag in ("fp8_dpa", "fp8_mha", "enable_2d_quantization"):
            check_bool(name, flag, getattr(self, flag))
        if isinstance(self.margin, bool) or not isinstance(self.margin, int):
            raise TypeError(f"{name}: margin must be an int, got {self.margin!r}")
        _check_backward_override(name, self.backward_override)


class FP4QParams(NamedTuple):
    """How NVFP4BlockScaling quantizes the tensors of one role: TE's QParams fields
    (read-only here, derived from the recipe's ``disable_*`` switches)."""

    power_2_scale: bool = False
    amax_epsilon: float = 0.0
    random_hadamard_transform: bool = False
    stochastic_rounding: bool = False
    fp4_2d_quantization: bool = False


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "0") == "1"


_NVFP4_4OVER6_SCOPES = ("none", "weights", "activations", "all")


@dataclass(unsafe_hash=True)
class NVFP4BlockScaling(Recipe):
    """NVFP4: E2M1 values with an E4M3 scale per 16 values plus a per-tensor float32
    scale. Stateless. Emulated exactly on every device (NOTE [NVFP4 layout and
    rounding] in ``transformer_engine/pytorch/nvfp4_scaling.py``).

    Parameters
    ----------
    disable_rht : bool, default ``NVTE_NVFP4_DISABLE_RHT=1``
        No random Hadamard transform (else applied to the columnwise copies of inputs
        and output gradients: the wgrad GEMM's operands).
    disable_stochastic_rounding : bool, default ``NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING=1``
        Round output gradients to nearest (else stochastically).
    disable_2d_quantization : bool, default ``NVTE_NVFP4_DISABLE_2D_QUANTIZATION=1``
        Weights in 1x16 blocks (else 16x16 tiles).
    row_scaled_activation : bool, default False
        TE's per-row amax for activations: not implemented. True constructs (TE's tests
        build such recipes at import) and raises NotImplementedError at the first cast.
    nvfp4_4over6, nvfp4_4over6_e4m3_use_256, nvfp4_4over6_err_mode
        TE's 4over6 block scaling: only ``nvfp4_4over6="none"`` is implemented. Another
        value constructs (TE's tests build such recipes at import) and raises
        NotImplementedError at the first NVFP4 cast; the other two are checked.
    fp4_format : Format, default Format.E2M1 (the only one)
    fp8_format : Format, default Format.E4M3 (the only one: the block scales' format)
    fp8_dpa, fp8_mha : bool, default False
        FP8 attention: not implemented; True raises NotImplementedError when an
        autocast enables the recipe.
    backward_override : None | "high_precision" | "dequantized", default ``NVTE_BACKWARD_OVERRIDE``

    ``fp4_quant_fwd_inp``, ``fp4_quant_fwd_weight`` and ``fp4_quant_bwd_grad`` are TE's
    derived `FP4QParams` of each role, read-only.
    """

    disable_rht: bool = field(default_factory=lambda: _env_flag("NVTE_NVFP4_DISABLE_RHT"))
    disable_stochastic_rounding: bool = field(
        default_factory=lambda: _env_flag("NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING"))
    disable_2d_quantization: bool = field(
        default_factory=lambda: _env_flag("NVTE_NVFP4_DISABLE_2D_QUANTIZATION"))
    row_scaled_activation: bool = False
    nvfp4_4over6: str = "none"
    nvfp4_4over6_e4m3_use_256: str = "all"
    nvfp4_4over6_err_mode: str = "MAE"
    fp4_format: Format = Format.E2M1
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = field(default_factory=_env_backward_override)

    def nvfp4(self) -> bool:
        return True

    def validate(self) -> None:
        name = "NVFP4BlockScaling"
        for flag in ("disable_rht", "disable_stochastic_rounding", "disable_2d_quantization",
                     "row_scaled_activation", "fp8_dpa", "fp8_mha"):
            check_bool(name, flag, getattr(self, flag))
        if self.fp4_format is not Format.E2M1:
            raise ValueError(f"{name}: fp4_format must be Format.E2M1, got {self.fp4_format!r}")
        if self.fp8_format is not Format.E4M3:
            raise ValueError(f"{name}: fp8_format (the block scales' format) must be "
                             f"Format.E4M3, got {self.fp8_format!r}")
        for scope in ("nvfp4_4over6", "nvfp4_4over6_e4m3_use_256"):
            if getattr(self, scope) not in _NVFP4_4OVER6_SCOPES:
                raise ValueError(f"{name}: {scope} must be one of {_NVFP4_4OVER6_SCOPES}, "
                                 f"got {getattr(self, scope)!r}")
        if self.nvfp4_4over6_err_mode not in ("MAE", "MSE"):
            raise ValueError(f"{name}: nvfp4_4over6_err_mode must be 'MAE' or 'MSE', "
                             f"got {self.nvfp4_4over6_err_mode!r}")
        _check_backward_override(name, self.backward_override)

    # The role QParams are derived from the ``disable_*`` switches unless one was set
    # on the recipe (TE's tests assign them): a set one is kept beside the fields.
    def _role_params(self, role: str, derived: FP4QParams):
        return self.__dict__.get("_fp4_quant", {}).get(role, derived)

    def _set_role_params(self, role: str, value) -> None:
        if not isinstance(value, (QParams, FP4QParams)):
            raise TypeError(f"NVFP4BlockScaling: fp4_quant_{role} must be a "
                            f"transformer_engine.common.recipe.QParams, got {value!r}")
        quant = dict(self.__dict__.get("_fp4_quant", {}), **{role: value})
        self.__setattr__("_fp4_quant", quant)           # refused on a read-only copy
        self.__dict__.pop("_validated_copy", None)      # the next autocast copies anew

    @property
    def fp4_quant_fwd_inp(self):
        return self._role_params("fwd_inp",
                                 FP4QParams(random_hadamard_transform=not self.disable_rht))

    @fp4_quant_fwd_inp.setter
    def fp4_quant_fwd_inp(self, value) -> None:
        self._set_role_params("fwd_inp", value)

    @property
    def fp4_quant_fwd_weight(self):
        return self._role_params("fwd_weight", FP4QParams(
            fp4_2d_quantization=not self.disable_2d_quantization))

    @fp4_quant_fwd_weight.setter
    def fp4_quant_fwd_weight(self, value) -> None:
        self._set_role_params("fwd_weight", value)

    @property
    def fp4_quant_bwd_grad(self):
        return self._role_params("bwd_grad", FP4QParams(
            random_hadamard_transform=not self.disable_rht,
            stochastic_rounding=not self.disable_stochastic_rounding))

    @fp4_quant_bwd_grad.setter
    def fp4_quant_bwd_grad(self, value) -> None:
        self._set_role_params("bwd_grad", value)


# TE defines these in transformer_engine.common.recipe, which re-exports them from here:
# pickles name them there, as TE's do.
for _cls in (MXFP8BlockScaling, NVFP4BlockScaling, FP4QParams):
    _cls.__module__ = "transformer_engine.common.recipe"
del _cls
