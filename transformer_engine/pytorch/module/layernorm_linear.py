"""te.LayerNormLinear: a normalization (high precision) followed by one linear
layer (FP8 inside an enabled ``te.autocast``), with TE's parameter names."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..tensor_parallel import TensorParallelConfig, mark_sequence_parallel
from .base import TransformerEngineBaseModule, default_device
from ..utils import (check_eps, check_input, check_normalization, check_params_dtype,
                     check_positive_int)
from .layernorm import make_norm_params, normalize
from .linear import fp8_linear, init_weight_

__all__ = ["LayerNormLinear", "pack_outputs"]


def pack_outputs(out: torch.Tensor, bias: Optional[torch.Tensor], return_bias: bool,
                 ln_out: Optional[torch.Tensor]):
    """TE's return convention: ``out``, then the bias when ``return_bias`` (cast to the
    output dtype), then the normalization output when it was asked for."""
    outputs = (out,)
    if return_bias:
        outputs += (bias.to(out.dtype) if bias is not None else None,)
    if ln_out is not None:
        outputs += (ln_out,)
    return outputs[0] if len(outputs) == 1 else outputs


class LayerNormLinear(TransformerEngineBaseModule):
    """``y = Norm(x) W^T + b``; the GEMM in FP8 inside an enabled ``te.autocast``.

    Parameters
    ----------
    in_features, out_features : int
    eps : float, default 1e-5
    bias : bool, default True
    normalization : "LayerNorm" | "RMSNorm", default "LayerNorm"
    zero_centered_gamma : bool, default False
        The norm scales by ``1 + layer_norm_weight`` (initialized to 0).
    return_layernorm_output : bool, default False
        Also return ``Norm(x)`` (e.g. for a residual taken after the norm).
    return_bias : bool, default False
        Return ``(Norm(x) W^T, b)`` instead of adding the bias.
    init_method : callable, optional
        ``init_method(weight)`` initializes ``weight``; normal(0, 0.023) when None.
    params_dtype : torch.dtype, optional
        float32 or bfloat16; ``torch.get_default_dtype()`` when None.
    device : torch.device, optional
        CUDA if available, else CPU, when None.
    sequence_parallel, tp_group, tp_size : see `te.Linear`
        With sequence parallelism the input is this rank's slice of the sequence:
        it is normalized locally and the normalization output all-gathered along
        dim 0 (``ln_out`` is returned local); the norm parameters' gradients are then
        partial (marked ``sequence_parallel``: sum them over the TP group).
    parallel_mode : None | "column", default None
        "column" splits the output features as in `te.Linear`. "row" is refused:
        it would split the features the normalization needs whole.

    Returns
    -------
    ``out``, ``(out, bias)``, ``(out, ln_out)`` or ``(out, bias, ln_out)``.
    """

    def __init__(self, in_features: int, out_features: int, eps: float = 1e-5, *,
                 bias: bool = True, normalization: str = "LayerNorm",
                 zero_centered_gamma: bool = False, return_layernorm_output: bool = False,
                 return_bias: bool = False, init_method: Optional[Callable] = None,
                 params_dtype: Optional[torch.dtype] = None, device=None,
                 sequence_parallel: bool = False, tp_group=None, tp_size: int = 1,
                 parallel_mode: Optional[str] = None):
        super().__init__(num_gemms=1)
        api = "te.LayerNormLinear"
        if parallel_mode == "row":
            raise ValueError(f"{api}: parallel_mode='row' would split the input features, "
                             "which the normalization needs whole; use parallel_mode='column' "
                             "or None (and te.Linear for a row-parallel layer)")
        self.tp = TensorParallelConfig(api, parallel_mode, tp_group, tp_size, sequence_parallel)
        local_out = self.tp.local_features("out_features", out_features)
        self.in_features = check_positive_int(api, "in_features", in_features)
        self.out_features = check_positive_int(api, "out_features", out_features)
        self.eps = check_eps(api, eps)
        self.normalization = check_normalization(api, normalization)
        self.zero_centered_gamma = bool(zero_centered_gamma)
        self.return_layernorm_output, self.return_bias = return_layernorm_output, return_bias
        self.use_bias = bias
        dtype = check_params_dtype(api, params_dtype)
        device = default_device(device)
        make_norm_params(self, in_features, normalization, self.zero_centered_gamma, dtype,
                         device, "layer_norm_weight", "layer_norm_bias")
        self.weight = torch.nn.Parameter(torch.empty(local_out, in_features, dtype=dtype,
                                                     device=device))
        (init_method or init_weight_)(self.weight)
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(local_out, dtype=dtype, device=device))
        else:
            self.register_parameter("bias", None)
        self.tp.mark_params(self.weight, self.bias)
        if self.tp.sequence_parallel and self.tp.size > 1:
            mark_sequence_parallel(self.layer_norm_weight, self.layer_norm_bias)

    def set_tensor_parallel_group(self, tp_group) -> None:
        """Attach the tensor-parallel group (for a module built with ``tp_size``)."""
        self.tp.set_group(tp_group)

    def forward(self, inp: torch.Tensor):
        api = "te.LayerNormLinear"
        check_input(api, inp, self.in_features, "in_features")
        with self.prepare_forward(inp) as plan:
            ln_out = normalize(inp, self.layer_norm_weight, self.layer_norm_bias,
                               self.normalization, self.eps, self.zero_centered_gamma)
            fused_bias = None if self.return_bias else self.bias
            out = fp8_linear(api, self.tp.column_input(ln_out), self.weight, fused_bias, plan,
                             self.fp8_meta)
        return pack_outputs(out, self.bias, self.return_bias,
                            ln_out if self.return_layernorm_output else None)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"normalization={self.normalization}, bias={self.use_bias}"
                + "".join(f", {d}" for d in self.tp.describe()))
