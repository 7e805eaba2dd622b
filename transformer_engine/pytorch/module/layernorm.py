"""te.LayerNorm and te.RMSNorm, and the normalization that LayerNormLinear and
LayerNormMLP put in front of their first GEMM.

Normalization has no GEMM, so FP8 does not touch it. It computes in float32
whatever the parameter and input dtypes, and returns the activation dtype (the
``torch.autocast`` dtype when autocast is on, else the input's), as TE's fused
kernels do. ``zero_centered_gamma`` stores ``gamma - 1``: the weight starts at 0 and
the normalization multiplies by ``1 + weight``, which keeps weight decay from
pulling the gain towards 0.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..utils import check_eps, check_input, check_params_dtype, check_positive_int
from .base import activation_dtype, default_device, no_autocast

__all__ = ["LayerNorm", "RMSNorm", "normalize", "make_norm_params"]


# CUDA's layer_norm kernels read and write 16-bit tensors but compute in float32 (mean,
# variance, the affine map, and the input and parameter gradients accumulated in float32,
# each rounded once), which is the float32 path's math in one launch instead of five.
# CPU's bfloat16 kernels are less accurate (the shift's gradient), so CPU upcasts.
_NATIVE_16BIT = (torch.bfloat16, torch.float16)


def normalize(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
              normalization: str, eps: float, zero_centered_gamma: bool) -> torch.Tensor:
    """LayerNorm (``(x - mean) / sqrt(var + eps) * gamma + beta``) or RMSNorm
    (``x / sqrt(mean(x^2) + eps) * gamma``) over the last dimension, in float32;
    ``gamma = 1 + weight`` when ``zero_centered_gamma``. Returns the activation dtype."""
    out_dtype = activation_dtype(x)
    shape = (x.shape[-1],)
    with no_autocast(x.device.type):
        if (normalization == "LayerNorm" and not zero_centered_gamma and x.is_cuda
                and x.dtype in _NATIVE_16BIT and x.dtype == out_dtype == weight.dtype
                and (bias is None or bias.dtype == x.dtype)):
            return F.layer_norm(x, shape, weight, bias, eps)
        x32 = x.to(torch.float32)
        gamma = weight.to(torch.float32)
        if zero_centered_gamma:
            gamma = gamma + 1.0
        if normalization == "LayerNorm":
            beta = bias.to(torch.float32) if bias is not None else None
            y = F.layer_norm(x32, shape, gamma, beta, eps)
        else:
            y = F.rms_norm(x32, shape, gamma, eps)
    return y.to(out_dtype)


def make_norm_params(module: torch.nn.Module, hidden_size: int, normalization: str,
                     zero_centered_gamma: bool, dtype: torch.dtype, device,
                     weight_name: str, bias_name: str) -> None:
    """Register the gain (and, for LayerNorm, the shift) of a normalization under the
    given names, initialized as TE does (gain 1, or 0 when zero-centered; shift 0)."""
    fill = 0.0 if zero_centered_gamma else 1.0
    module.register_parameter(weight_name, torch.nn.Parameter(
        torch.full((hidden_size,), fill, dtype=dtype, device=device)))
    if normalization == "LayerNorm":
        module.register_parameter(bias_name, torch.nn.Parameter(
            torch.zeros(hidden_size, dtype=dtype, device=device)))
    else:
        module.register_parameter(bias_name, None)


class _Norm(torch.nn.Module):
    _NORMALIZATION = ""

    def __init__(self, hidden_size: int, eps: float = 1e-5, *,
                 params_dtype: Optional[torch.dtype] = None, zero_centered_gamma: bool = False,
                 device=None):
        super().__init__()
        api = f"te.{self._NORMALIZATION}"
        self.hidden_size = check_positive_int(api, "hidden_size", hidden_size)
        self.eps = check_eps(api, eps)
        self.zero_centered_gamma = bool(zero_centered_gamma)
        dtype = check_params_dtype(api, params_dtype)
        make_norm_params(self, hidden_size, self._NORMALIZATION, self.zero_centered_gamma,
                         dtype, default_device(device), "weight", "bias")

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.fill_(0.0 if self.zero_centered_gamma else 1.0)
            if self.bias is not None:
                self.bias.zero_()

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        check_input(f"te.{self._NORMALIZATION}", inp, self.hidden_size)
        return normalize(inp, self.weight, self.bias, self._NORMALIZATION, self.eps,
                         self.zero_centered_gamma)

    def extra_repr(self) -> str:
        return (f"{self.hidden_size}, eps={self.eps}, "
                f"zero_centered_gamma={self.zero_centered_gamma}")


class LayerNorm(_Norm):
    """``y = (x - mean) / sqrt(var + eps) * gamma + beta`` over the last dimension.

    Parameters
    ----------
    hidden_size : int
    eps : float, default 1e-5
    params_dtype : torch.dtype, optional
        float32 or bfloat16; ``torch.get_default_dtype()`` when None.
    zero_centered_gamma : bool, default False
        Store ``gamma - 1`` in ``weight`` (initialized to 0) and scale by ``1 + weight``.
    device : torch.device, optional
        CUDA if available, else CPU, when None.
    """

    _NORMALIZATION = "LayerNorm"


class RMSNorm(_Norm):
    """``y = x / sqrt(mean(x^2) + eps) * gamma`` over the last dimension (no shift,
    so ``bias`` is None). Parameters as `LayerNorm`."""

    _NORMALIZATION = "RMSNorm"
