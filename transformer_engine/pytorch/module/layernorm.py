"""te.LayerNorm and te.RMSNorm, and the normalization helper the fused modules share."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .base import default_device
from .linear import check_params_dtype

__all__ = ["LayerNorm", "RMSNorm", "NORMALIZATIONS", "make_norm_params", "apply_norm"]

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def check_normalization(api: str, normalization: str) -> None:
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"{api}: normalization must be one of {NORMALIZATIONS}, got {normalization!r}")


def make_norm_params(normalization: str, hidden_size: int, zero_centered_gamma: bool,
                     dtype: torch.dtype, device) -> tuple:
    """(weight, bias-or-None) parameters; with ``zero_centered_gamma`` the weight
    starts at 0 and the norm scales by ``1 + weight``."""
    init = torch.zeros if zero_centered_gamma else torch.ones
    weight = torch.nn.Parameter(init(hidden_size, dtype=dtype, device=device))
    bias = None
    if normalization == "LayerNorm":
        bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype, device=device))
    return weight, bias


def apply_norm(x: torch.Tensor, normalization: str, weight: torch.Tensor,
               bias: Optional[torch.Tensor], eps: float, zero_centered_gamma: bool) -> torch.Tensor:
    gamma = weight + 1 if zero_centered_gamma else weight
    if normalization == "LayerNorm":
        return F.layer_norm(x, (x.shape[-1],), gamma, bias, eps)
    return F.rms_norm(x, (x.shape[-1],), gamma, eps)


class _Norm(torch.nn.Module):
    _kind = ""

    def __init__(self, hidden_size: int, eps: float = 1e-5, params_dtype=None,
                 zero_centered_gamma: bool = False, device=None):
        super().__init__()
        api = f"te.{self._kind}"
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size <= 0:
            raise ValueError(f"{api}: hidden_size must be a positive int, got {hidden_size!r}")
        dtype = check_params_dtype(api, params_dtype)
        self.hidden_size, self.eps, self.zero_centered_gamma = hidden_size, eps, zero_centered_gamma
        self.weight, bias = make_norm_params(self._kind, hidden_size, zero_centered_gamma, dtype,
                                             default_device(device))
        if bias is not None:
            self.bias = bias

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        if inp.shape[-1] != self.hidden_size:
            raise ValueError(f"te.{self._kind}: the input's last dimension must be "
                             f"hidden_size={self.hidden_size}, got shape {tuple(inp.shape)}")
        return apply_norm(inp, self._kind, self.weight, getattr(self, "bias", None), self.eps,
                          self.zero_centered_gamma)


class LayerNorm(_Norm):
    """``(x - mean) / sqrt(var + eps) * gamma + beta`` over the last dimension.

    Parameters
    ----------
    hidden_size : int
    eps : float, default 1e-5
    params_dtype : torch.dtype, optional
    zero_centered_gamma : bool, default False
        Store ``gamma - 1`` (initialized to 0), which keeps small weights exact in low precision.
    device : torch.device, optional
    """

    _kind = "LayerNorm"


class RMSNorm(_Norm):
    """``x / sqrt(mean(x^2) + eps) * gamma`` over the last dimension; parameters as `LayerNorm`
    (no bias)."""

    _kind = "RMSNorm"
