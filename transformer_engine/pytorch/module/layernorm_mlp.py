"""te.LayerNormMLP: Norm -> FC1 -> activation -> FC2, both GEMMs in FP8 under autocast."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .base import TransformerEngineBaseModule, default_device
from .layernorm import apply_norm, check_normalization, make_norm_params
from .linear import check_params_dtype, fp8_linear, init_weight_

__all__ = ["LayerNormMLP", "ACTIVATIONS"]


def _gated(act):
    def fn(x):
        a, b = x.chunk(2, dim=-1)
        return act(a) * b
    return fn


_gelu = lambda x: F.gelu(x, approximate="tanh")
ACTIVATIONS = {
    "gelu": _gelu,
    "relu": F.relu,
    "qgelu": lambda x: x * torch.sigmoid(1.702 * x),
    "srelu": lambda x: F.relu(x).square(),
    "swiglu": _gated(F.silu),
    "geglu": _gated(_gelu),
    "reglu": _gated(F.relu),
}
_GATED = ("swiglu", "geglu", "reglu")


class LayerNormMLP(TransformerEngineBaseModule):
    """``FC2(act(FC1(Norm(x))))``. Gated activations (``swiglu``, ``geglu``, ``reglu``)
    split FC1's output in two halves, ``act(first) * second``.

    Parameters
    ----------
    hidden_size, ffn_hidden_size : int
    eps : float, default 1e-5
    bias : bool, default True
    normalization : "LayerNorm" | "RMSNorm", default "LayerNorm"
    activation : str, default "gelu"
        One of gelu (tanh approximation, as TE), relu, qgelu, srelu, swiglu, geglu, reglu.
    return_layernorm_output, return_bias, zero_centered_gamma, params_dtype, device
        As in `LayerNormLinear`.
    checkpoint : bool, default False
        Recompute this module's forward during backward (through ``te.checkpoint``,
        non-reentrant) instead of keeping its activations.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, eps: float = 1e-5,
                 bias: bool = True, normalization: str = "LayerNorm", activation: str = "gelu",
                 return_layernorm_output: bool = False, return_bias: bool = False,
                 zero_centered_gamma: bool = False, params_dtype: Optional[torch.dtype] = None,
                 device=None, checkpoint: bool = False):
        super().__init__(num_gemms=2)
        api = "te.LayerNormMLP"
        check_normalization(api, normalization)
        if activation not in ACTIVATIONS:
            raise ValueError(f"{api}: activation must be one of {sorted(ACTIVATIONS)}, "
                             f"got {activation!r}")
        for name, v in (("hidden_size", hidden_size), ("ffn_hidden_size", ffn_hidden_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{api}: {name} must be a positive int, got {v!r}")
        dtype = check_params_dtype(api, params_dtype)
        device = default_device(device)
        self.hidden_size, self.ffn_hidden_size, self.eps = hidden_size, ffn_hidden_size, eps
        self.normalization, self.activation = normalization, activation
        self.zero_centered_gamma = zero_centered_gamma
        self.return_layernorm_output, self.return_bias = return_layernorm_output, return_bias
        self.checkpoint = checkpoint
        self.layer_norm_weight, ln_bias = make_norm_params(normalization, hidden_size,
                                                           zero_centered_gamma, dtype, device)
        if ln_bias is not None:
            self.layer_norm_bias = ln_bias
        else:
            self.register_parameter("layer_norm_bias", None)
        fc1_out = ffn_hidden_size * (2 if activation in _GATED else 1)
        self.fc1_weight = torch.nn.Parameter(torch.empty(fc1_out, hidden_size, dtype=dtype,
                                                         device=device))
        self.fc2_weight = torch.nn.Parameter(torch.empty(hidden_size, ffn_hidden_size,
                                                         dtype=dtype, device=device))
        init_weight_(self.fc1_weight)
        init_weight_(self.fc2_weight)
        if bias:
            self.fc1_bias = torch.nn.Parameter(torch.zeros(fc1_out, dtype=dtype, device=device))
            self.fc2_bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype, device=device))
        else:
            self.register_parameter("fc1_bias", None)
            self.register_parameter("fc2_bias", None)

    def _forward(self, inp: torch.Tensor):
        api = "te.LayerNormMLP"
        with self.prepare_forward(inp) as plan:
            ln_out = apply_norm(inp, self.normalization, self.layer_norm_weight,
                                self.layer_norm_bias, self.eps, self.zero_centered_gamma)
            h = fp8_linear(api, ln_out, self.fc1_weight, self.fc1_bias, plan, self.fp8_meta, gemm=0)
            h = ACTIVATIONS[self.activation](h)
            fc2_bias = None if self.return_bias else self.fc2_bias
            out = fp8_linear(api, h, self.fc2_weight, fc2_bias, plan, self.fp8_meta, gemm=1)
        return out, ln_out

    def forward(self, inp: torch.Tensor):
        api = "te.LayerNormMLP"
        if not torch.is_tensor(inp):
            raise TypeError(f"{api}: input must be a tensor, got {type(inp).__name__}")
        if inp.shape[-1] != self.hidden_size:
            raise ValueError(f"{api}: the input's last dimension must be hidden_size="
                             f"{self.hidden_size}, got input of shape {tuple(inp.shape)}")
        if self.checkpoint and torch.is_grad_enabled():
            from ..distributed import checkpoint
            out, ln_out = checkpoint(self._forward, inp, use_reentrant=False)
        else:
            out, ln_out = self._forward(inp)
        outputs = (out,)
        if self.return_bias:
            outputs += (self.fc2_bias,)
        if self.return_layernorm_output:
            outputs += (ln_out,)
        return outputs[0] if len(outputs) == 1 else outputs
