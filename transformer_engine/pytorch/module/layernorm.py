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

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from ..utils import (check_eps, check_params_dtype, check_positive_int, reject_unsupported)
from .devices import activation_dtype, default_device, no_autocast
from .params import ParamInit, ParameterInitMixin, constant_init

__all__ = ["LayerNorm", "RMSNorm", "normalize", "make_norm_params"]


# CUDA's layer_norm kernels read and write 16-bit tensors but compute in float32 (mean,
# variance, the affine map, and the input and parameter gradients accumulated in float32,
# each rounded once), which is the float32 path's math in one launch instead of five.
# CPU's bfloat16 kernels are less accurate (the shift's gradient), so CPU upcasts.
_NATIVE_16BIT = (torch.bfloat16, torch.float16)


def normalize(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
              normalization: str, eps: float, zero_centered_gamma: bool) -> torch.Tensor:
    """LayerNorm (``(x - mean) / sqrt(var + eps) * gamma + beta``) or RMSNorm
    (``x / sqrt(mean(x^2) + eps) * gamma``) over the trailing ``weight.dim()``
    dimensions, in float32; ``gamma = 1 + weight`` when ``zero_centered_gamma``.
    Returns the activation dtype."""
    out_dtype = activation_dtype(x)
    shape = tuple(weight.shape)
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


def make_norm_params(module: ParameterInitMixin, normalized_shape, normalization: str,
                     zero_centered_gamma: bool, dtype: torch.dtype, device,
                     weight_name: str, bias_name: str) -> None:
    """Register the gain (and, for LayerNorm, the shift) of a normalization under the
    given names, with TE's initializers (gain 1, or 0 when zero-centered; shift 0)."""
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    gain = constant_init(0.0 if zero_centered_gamma else 1.0)
    module.register_initialized(weight_name, torch.empty(shape, dtype=dtype, device=device),
                                ParamInit(gain))
    if normalization == "LayerNorm":
        module.register_initialized(bias_name, torch.empty(shape, dtype=dtype, device=device),
                                    ParamInit(constant_init(0.0)))
    else:
        module.register_parameter(bias_name, None)


def _normalized_shape(api: str, normalized_shape, hidden_size) -> Tuple[int, ...]:
    """TE's ``normalized_shape`` (an int or ints), or its older name ``hidden_size``."""
    if hidden_size is not None:
        if normalized_shape is not None:
            raise ValueError(f"{api}: pass normalized_shape or its older name hidden_size, not "
                             f"both (got {normalized_shape!r} and {hidden_size!r})")
        normalized_shape = hidden_size
    if normalized_shape is None:
        raise TypeError(f"{api}: missing normalized_shape (the size of the normalized "
                        "trailing dimension(s))")
    dims = (normalized_shape,) if not isinstance(normalized_shape, (tuple, list, torch.Size)) \
        else tuple(normalized_shape)
    if not dims:
        raise ValueError(f"{api}: normalized_shape must name at least one dimension, got "
                         f"{normalized_shape!r}")
    return tuple(check_positive_int(api, "normalized_shape", d) for d in dims)


class _Norm(ParameterInitMixin):
    _NORMALIZATION = ""

    def __init__(self, normalized_shape=None, eps: float = 1e-5,
                 sequence_parallel: Optional[bool] = None,
                 params_dtype: Optional[torch.dtype] = None, zero_centered_gamma: bool = False,
                 hidden_size: Optional[int] = None, *, device=None,
                 dtype: Optional[torch.dtype] = None, sm_margin: int = 0, fwd_sm_margin: int = 0,
                 bwd_sm_margin: int = 0, inf_sm_margin: int = 0):
        super().__init__()
        api = f"te.{self._NORMALIZATION}"
        reject_unsupported(api, sm_margin=(sm_margin, 0), fwd_sm_margin=(fwd_sm_margin, 0),
                           bwd_sm_margin=(bwd_sm_margin, 0), inf_sm_margin=(inf_sm_margin, 0))
        self.normalized_shape = _normalized_shape(api, normalized_shape, hidden_size)
        self.eps = check_eps(api, eps)
        self.zero_centered_gamma = bool(zero_centered_gamma)
        if dtype is not None and params_dtype is not None and dtype != params_dtype:
            raise ValueError(f"{api}: dtype={dtype} and params_dtype={params_dtype} disagree; "
                             "pass one of them")
        param_dtype = check_params_dtype(api, params_dtype if params_dtype is not None else dtype)
        if sequence_parallel is not None and not isinstance(sequence_parallel, bool):
            raise TypeError(f"{api}: sequence_parallel must be a bool or None, "
                            f"got {sequence_parallel!r}")
        self.sequence_parallel = sequence_parallel
        device = default_device(device)
        make_norm_params(self, self.normalized_shape, self._NORMALIZATION,
                         self.zero_centered_gamma, param_dtype, device, "weight", "bias")
        if sequence_parallel is not None:
            for p in (self.weight, self.bias):
                if p is not None:
                    p.sequence_parallel = sequence_parallel
        self.reset_parameters(defer_init=device.type == "meta")

    @property
    def hidden_size(self) -> int:
        """How many elements each normalization covers (``normalized_shape``'s product)."""
        return self.weight.numel()

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        api = f"te.{self._NORMALIZATION}"
        if not torch.is_tensor(inp):
            raise TypeError(f"{api}: input must be a tensor, got {type(inp).__name__}")
        if not inp.is_floating_point():
            raise TypeError(f"{api}: input must be a floating-point tensor, got dtype {inp.dtype}")
        k = len(self.normalized_shape)
        if inp.dim() < k or tuple(inp.shape[-k:]) != self.normalized_shape:
            want = (f"last dimension must be hidden_size={self.normalized_shape[0]}" if k == 1
                    else f"trailing dimensions must be normalized_shape="
                         f"{list(self.normalized_shape)}")
            raise ValueError(f"{api}: the input's {want}, got input of shape {tuple(inp.shape)}")
        # NOTE [Contiguous module inputs] in module/base.py
        return normalize(inp.contiguous(), self.weight, self.bias, self._NORMALIZATION,
                         self.eps, self.zero_centered_gamma)

    def extra_repr(self) -> str:
        shape = self.normalized_shape[0] if len(self.normalized_shape) == 1 \
            else self.normalized_shape
        return f"{shape}, eps={self.eps}, zero_centered_gamma={self.zero_centered_gamma}"


class LayerNorm(_Norm):
    """``y = (x - mean) / sqrt(var + eps) * gamma + beta`` over the trailing
    ``normalized_shape`` dimensions. TE's signature.

    Parameters
    ----------
    normalized_shape : int or tuple of int
        The normalized trailing dimension(s); ``hidden_size`` is its older name.
    eps : float, default 1e-5
    sequence_parallel : bool, optional
        Marks ``weight`` and ``bias`` with ``sequence_parallel`` (Megatron-LM then sums
        their gradients over the tensor-parallel group).
    params_dtype : torch.dtype, optional
        float32, bfloat16 or float16; ``torch.get_default_dtype()`` when None.
        ``dtype`` is accepted as its other name.
    zero_centered_gamma : bool, default False
        Store ``gamma - 1`` in ``weight`` (initialized to 0) and scale by ``1 + weight``.
    device : torch.device, optional
        CUDA if available, else CPU, when None; ``"meta"`` defers initialization to
        ``reset_parameters()``.
    sm_margin, fwd_sm_margin, bwd_sm_margin, inf_sm_margin : int, default 0
        Not implemented (SMs reserved for communication kernels); non-zero raises.
    """

    _NORMALIZATION = "LayerNorm"


class RMSNorm(_Norm):
    """``y = x / sqrt(mean(x^2) + eps) * gamma`` over the trailing ``normalized_shape``
    dimensions (no shift, so ``bias`` is None). Parameters as `LayerNorm`."""

    _NORMALIZATION = "RMSNorm"
