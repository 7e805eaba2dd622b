"""``te.ops.LayerNorm`` (and the base it shares with ``te.ops.RMSNorm``): the
normalization of te.LayerNorm / te.LayerNormMLP (`module.layernorm.normalize`), so a
norm operation before a `BasicLinear` gives te.LayerNormLinear's bits."""

from __future__ import annotations

from typing import Optional

import torch

from ...module.devices import default_device
from ...module.layernorm import _normalized_shape, make_norm_params, normalize
from ...module.params import ParameterInitMixin
from ...utils import check_bool, check_eps, check_params_dtype
from ..op import BasicOperation

__all__ = ["LayerNorm"]


class NormOperation(BasicOperation, ParameterInitMixin):
    """A normalization over the trailing ``normalized_shape`` dimensions."""

    _NORMALIZATION = ""

    def __init__(self, normalized_shape, *, eps: float = 1e-5, device=None,
                 dtype: Optional[torch.dtype] = None, zero_centered_gamma: bool = False,
                 sm_margin=0):
        super().__init__()
        api = f"te.ops.{self._NORMALIZATION}"
        if not (sm_margin == 0 or (isinstance(sm_margin, dict)
                                   and all(v == 0 for v in sm_margin.values()))):
            raise NotImplementedError(f"{api}: sm_margin={sm_margin!r} is not implemented "
                                      "(there are no persistent kernels to leave SMs free for); "
                                      "use 0")
        self.normalized_shape = _normalized_shape(api, normalized_shape, None)
        self.eps = check_eps(api, eps)
        self.zero_centered_gamma = check_bool(api, "zero_centered_gamma", zero_centered_gamma)
        device = default_device(device)
        make_norm_params(self, self.normalized_shape, self._NORMALIZATION,
                         self.zero_centered_gamma, check_params_dtype(api, dtype), device,
                         "weight", "bias")
        self.reset_parameters(defer_init=device.type == "meta")

    def check_input(self, x: torch.Tensor) -> None:
        k = len(self.normalized_shape)
        if not x.is_floating_point():
            raise TypeError(f"te.ops.{self._NORMALIZATION}: input must be a floating-point "
                            f"tensor, got dtype {x.dtype}")
        if x.dim() < k or tuple(x.shape[-k:]) != self.normalized_shape:
            raise ValueError(f"te.ops.{self._NORMALIZATION}: the input's trailing dimensions "
                             f"must be normalized_shape={list(self.normalized_shape)}, got "
                             f"input of shape {tuple(x.shape)}")

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """The normalization of ``x`` (contiguous, checked), in the activation dtype."""
        self.check_input(x)
        return normalize(x.contiguous(), self.weight, self.bias, self._NORMALIZATION, self.eps,
                         self.zero_centered_gamma)

    def native_forward(self, x, extra_inputs, kwargs):
        return self.normalize(x), [()]

    def extra_repr(self) -> str:
        return (f"{list(self.normalized_shape)}, eps={self.eps}, "
                f"zero_centered_gamma={self.zero_centered_gamma}")


class LayerNorm(NormOperation):
    """``(x - mean) / sqrt(var + eps) * gamma + beta`` over ``normalized_shape``, in
    float32, returned in the activation dtype; ``gamma = 1 + weight`` when
    ``zero_centered_gamma``. Parameters ``weight`` and ``bias``. TE's signature
    (``sm_margin`` must be 0)."""

    _NORMALIZATION = "LayerNorm"
