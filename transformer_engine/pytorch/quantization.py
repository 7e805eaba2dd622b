"""``transformer_engine.pytorch.quantization``: the module TE 2.9 moved its FP8
autocast, model-init contexts, global state manager and support checks into (its
``fp8`` module stays, as here, under the old name). The names are this package's own
(fp8.py, model_init.py, fp8_support.py); this module adds the ``is_*_available``
queries, the default-recipe alias and the recipe's FP8 dtypes.
"""

from __future__ import annotations

from typing import Tuple, Union

import torch

from ..common.recipe import Format, Recipe
from .fp8 import (FP8GlobalStateManager, autocast, check_fp8_block_scaling_support,
                  check_fp8_support, check_mxfp8_support, fp8_autocast, get_default_fp8_recipe,
                  is_fp8_available)
from .fp8_support import check_nvfp4_support, recipe_execution
from .model_init import fp8_model_init, quantized_model_init

__all__ = ["autocast", "fp8_autocast", "quantized_model_init", "fp8_model_init",
           "FP8GlobalStateManager", "is_fp8_available", "is_mxfp8_available",
           "is_fp8_block_scaling_available", "is_nvfp4_available", "check_fp8_support",
           "check_mxfp8_support", "check_fp8_block_scaling_support", "check_nvfp4_support",
           "get_default_fp8_recipe", "get_default_recipe", "get_fp8_torch_dtype", "get_fp8_max",
           "recipe_execution"]


def _answer(check: Tuple[bool, str], return_reason: bool) -> Union[bool, Tuple[bool, str]]:
    return check if return_reason else check[0]


def is_mxfp8_available(return_reason: bool = False) -> Union[bool, Tuple[bool, str]]:
    """Whether ``MXFP8BlockScaling`` can run here (`check_mxfp8_support`): wherever
    this package's FP8 runs, emulated (`recipe_execution`).
    With ``return_reason``, ``(available, reason)``."""
    return _answer(check_mxfp8_support(), return_reason)


def is_fp8_block_scaling_available(return_reason: bool = False
                                   ) -> Union[bool, Tuple[bool, str]]:
    """Whether ``Float8BlockScaling`` can run (`check_fp8_block_scaling_support`).
    With ``return_reason``, ``(available, reason)``."""
    return _answer(check_fp8_block_scaling_support(), return_reason)


def is_nvfp4_available(return_reason: bool = False) -> Union[bool, Tuple[bool, str]]:
    """Whether ``NVFP4BlockScaling`` can run here (`check_nvfp4_support`): wherever
    this package's FP8 runs, emulated (`recipe_execution`).
    With ``return_reason``, ``(available, reason)``."""
    return _answer(check_nvfp4_support(), return_reason)


def get_default_recipe() -> Recipe:
    """TE's newer name of `get_default_fp8_recipe`."""
    return get_default_fp8_recipe()


def get_fp8_torch_dtype(fp8_recipe: Recipe, fprop_tensor: bool = True) -> torch.dtype:
    """The FP8 dtype of a forward (``fprop_tensor``) or backward tensor under
    ``fp8_recipe``'s format."""
    spec = fp8_recipe.fp8_format.value
    return spec.dtype_fwd if fprop_tensor or fp8_recipe.fp8_format is Format.E4M3 \
        else spec.dtype_bwd


def get_fp8_max(fp8_recipe: Recipe, fprop_tensor: bool = True) -> float:
    """The largest finite value of that dtype (448 for E4M3, 57344 for E5M2)."""
    return float(torch.finfo(get_fp8_torch_dtype(fp8_recipe, fprop_tensor)).max)
