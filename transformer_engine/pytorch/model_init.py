"""``te.quantized_model_init`` / ``te.fp8_model_init``: the per-thread context in which
TE modules are built with FP8 primary weights (NOTE [FP8 primary weights] in
module/fp8_params.py)."""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Optional

from ..common.recipe import DelayedScaling, Recipe, validated_copy

__all__ = ["quantized_model_init", "fp8_model_init", "model_init_state"]


@dataclass(frozen=True)
class _ModelInitState:
    """One thread's ``te.quantized_model_init`` state (NOTE [FP8 primary weights] in
    module/fp8_params.py); replaced whole on enter, put back whole on exit."""

    recipe: Optional[Recipe] = None   # the read-only copy of the recipe in force; None: off
    preserve_high_precision_init_val: bool = False

    @property
    def enabled(self) -> bool:
        return self.recipe is not None


class _ThreadModelInit(threading.local):
    def __init__(self):
        self.state = _ModelInitState()


_MODEL_INIT = _ThreadModelInit()


def model_init_state() -> _ModelInitState:
    """The calling thread's ``quantized_model_init`` state, read by module constructors."""
    return _MODEL_INIT.state


@contextlib.contextmanager
def _model_init_entered(state: _ModelInitState):
    previous = _MODEL_INIT.state
    _MODEL_INIT.state = state
    try:
        yield
    finally:
        _MODEL_INIT.state = previous


def _model_init(api: str, enabled, recipe, preserve_high_precision_init_val):
    if not isinstance(enabled, bool):
        raise TypeError(f"{api}: enabled must be a bool, got {enabled!r}")
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(f"{api}: the recipe must be a transformer_engine.common.recipe.Recipe "
                        f"or None, got {type(recipe).__name__}")
    if not isinstance(preserve_high_precision_init_val, bool):
        raise TypeError(f"{api}: preserve_high_precision_init_val must be a bool, "
                        f"got {preserve_high_precision_init_val!r}")
    checked = None
    if enabled:
        checked = validated_copy(recipe if recipe is not None else DelayedScaling())
        if not checked.implemented():
            raise NotImplementedError(
                f"{api}(enabled=True, recipe={type(checked).__name__}): FP8 primary weights are "
                "implemented for DelayedScaling, Float8CurrentScaling, Float8BlockScaling, "
                "MXFP8BlockScaling and NVFP4BlockScaling")
    return _model_init_entered(_ModelInitState(checked,
                                               enabled and preserve_high_precision_init_val))


def quantized_model_init(enabled: bool = True, recipe: Optional[Recipe] = None,
                         preserve_high_precision_init_val: bool = False):
    """Context in which TE modules are built with FP8 primary weights.

    With ``enabled=True`` the GEMM weights of the TE modules constructed inside are
    quantized parameters made with ``recipe`` (``DelayedScaling()`` when None):
    `Float8Tensor` for DelayedScaling and Float8CurrentScaling, `Float8BlockwiseQTensor`
    for Float8BlockScaling, `MXFP8Tensor` / `NVFP4Tensor` for MXFP8BlockScaling /
    NVFP4BlockScaling; no high-precision copy is kept; the biases and norm
    parameters stay in high precision (NOTE [FP8 primary weights] in
    module/fp8_params.py). ``preserve_high_precision_init_val=True`` keeps each weight's
    initial value on the CPU, read by the weight's ``get_high_precision_init_val()`` (to
    seed an optimizer's master weights) and dropped by
    ``clear_high_precision_init_val()``. ``enabled=False``: modules are built as usual.
    Arguments are checked when called; the state is per thread and put back on exit.
    """
    return _model_init("te.quantized_model_init", enabled, recipe,
                       preserve_high_precision_init_val)


def fp8_model_init(enabled: bool = True, recipe: Optional[Recipe] = None,
                   preserve_high_precision_init_val: bool = False):
    """The older spelling of `quantized_model_init`."""
    return _model_init("te.fp8_model_init", enabled, recipe, preserve_high_precision_init_val)
