"""Fused optimizers and the multi-tensor operations, with TE's names
(``transformer_engine.pytorch.optimizers``): `FusedAdam`, `FusedSGD`,
`multi_tensor_applier` and the ``multi_tensor_*`` operations it applies
(NOTE [Multi-tensor paths] in multi_tensor.py); TE has
``multi_tensor_compute_scale_and_scale_inv`` only in its compiled extension."""

from .fused_adam import FusedAdam
from .fused_sgd import FusedSGD
from .multi_tensor import (multi_tensor_adam, multi_tensor_adam_capturable,
                           multi_tensor_adam_capturable_master, multi_tensor_adam_fp8,
                           multi_tensor_compute_scale_and_scale_inv,
                           multi_tensor_adam_param_remainder, multi_tensor_l2norm,
                           multi_tensor_scale, multi_tensor_scale_tensor, multi_tensor_sgd,
                           multi_tensor_unscale_l2norm)
from .multi_tensor_apply import MultiTensorApply, multi_tensor_applier

__all__ = ["FusedAdam", "FusedSGD", "MultiTensorApply", "multi_tensor_applier",
           "multi_tensor_scale", "multi_tensor_scale_tensor", "multi_tensor_l2norm",
           "multi_tensor_unscale_l2norm", "multi_tensor_adam", "multi_tensor_adam_param_remainder",
           "multi_tensor_adam_fp8", "multi_tensor_adam_capturable",
           "multi_tensor_adam_capturable_master", "multi_tensor_sgd",
           "multi_tensor_compute_scale_and_scale_inv"]
