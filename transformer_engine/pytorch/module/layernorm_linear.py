"""te.LayerNormLinear: a normalization followed by an (FP8) linear layer."""

from __future__ import annotations

from typing import Optional

import torch

from .base import TransformerEngineBaseModule, default_device
from .layernorm import apply_norm, check_normalization, make_norm_params
from .linear import check_params_dtype, fp8_linear, init_weight_

__all__ = ["LayerNormLinear"]


class LayerNormLinear(TransformerEngineBaseModule):
    """``Linear(Norm(x))``; the GEMM runs in FP8 inside an enabled ``te.autocast``,
    the normalization in high precision.

    Parameters
    ----------
    in_features, out_features : int
    eps : float, default 1e-5
    bias : bool, default True
    normalization : "LayerNorm" | "RMSNorm", default "LayerNorm"
    zero_centered_gamma : bool, default False
    return_layernorm_output : bool, default False
        Also return the normalized input (e.g. for a residual taken after the norm).
    return_bias : bool, default False
        Return the bias instead of adding it.
    params_dtype : torch.dtype, optional
    device : torch.device, optional
    """

    def __init__(self, in_features: int, out_features: int, eps: float = 1e-5, bias: bool = True,
                 normalization: str = "LayerNorm", zero_centered_gamma: bool = False,
                 return_layernorm_output: bool = False, return_bias: bool = False,
                 params_dtype: Optional[torch.dtype] = None, device=None):
        super().__init__(num_gemms=1)
        api = "te.LayerNormLinear"
        check_normalization(api, normalization)
        for name, v in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{api}: {name} must be a positive int, got {v!r}")
        dtype = check_params_dtype(api, params_dtype)
        device = default_device(device)
        self.in_features, self.out_features, self.eps = in_features, out_features, eps
        self.normalization, self.zero_centered_gamma = normalization, zero_centered_gamma
        self.return_layernorm_output, self.return_bias = return_layernorm_output, return_bias
        self.layer_norm_weight, ln_bias = make_norm_params(normalization, in_features,
                                                           zero_centered_gamma, dtype, device)
        if ln_bias is not None:
            self.layer_norm_bias = ln_bias
        else:
            self.register_parameter("layer_norm_bias", None)
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=dtype,
                                                     device=device))
        init_weight_(self.weight)
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device))
        else:
            self.register_parameter("bias", None)

    def forward(self, inp: torch.Tensor):
        api = "te.LayerNormLinear"
        if not torch.is_tensor(inp):
            raise TypeError(f"{api}: input must be a tensor, got {type(inp).__name__}")
        if inp.shape[-1] != self.in_features:
            raise ValueError(f"{api}: the input's last dimension must be in_features="
                             f"{self.in_features}, got input of shape {tuple(inp.shape)}")
        with self.prepare_forward(inp) as plan:
            ln_out = apply_norm(inp, self.normalization, self.layer_norm_weight,
                                self.layer_norm_bias, self.eps, self.zero_centered_gamma)
            fused_bias = None if self.return_bias else self.bias
            out = fp8_linear(api, ln_out, self.weight, fused_bias, plan, self.fp8_meta)
        outputs = (out,)
        if self.return_bias:
            outputs += (self.bias,)
        if self.return_layernorm_output:
            outputs += (ln_out,)
        return outputs[0] if len(outputs) == 1 else outputs
