"""te.LayerNormLinear: a normalization (high precision) followed by one linear
layer (FP8 inside an enabled ``te.autocast``), with TE's signature and parameter names.
On CUDA the normalization's kernel writes the GEMM's FP8 input (NOTE [Fused producers]
in fused_producers.py)."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..tensor_parallel import TensorParallelConfig, mark_sequence_parallel
from ..utils import (check_bool, check_eps, check_input, check_normalization, check_params_dtype,
                     check_positive_int, reject_unsupported)
from .base import TransformerEngineBaseModule
from .devices import activation_dtype, default_device
from .fused_producers import fused_producers_on, gemm_shapes_ok, norm_cast_input
from .layernorm import make_norm_params, normalize
from .fp8_linear import fp8_linear
from .linear import check_init_args, local_parts
from .params import (ParamInit, joined_parameter, normal_init, register_linear_params,
                     split_parameters)

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
    sequence_parallel : bool, default False
        With tensor parallelism the input is this rank's slice of the sequence: it is
        normalized locally and the normalization output all-gathered along dim 0;
        the norm parameters' gradients are then partial (marked
        ``sequence_parallel``: sum them over the TP group).
    fuse_wgrad_accumulation : bool, default False
        The weight gradient goes into ``weight.main_grad`` (see `te.Linear`).
    tp_group, tp_size : see `te.Linear`
    get_rng_state_tracker : callable, optional
        The weight is initialized under its ``fork()``.
    init_method : callable, optional
        ``init_method(weight)``; normal(0, 0.023) when None.
    bias : bool, default True
    normalization : "LayerNorm" | "RMSNorm", default "LayerNorm"
    return_bias : bool, default False
        Return ``(Norm(x) W^T, b)`` instead of adding the bias.
    params_dtype : torch.dtype, optional
        float32, bfloat16 or float16; ``torch.get_default_dtype()`` when None.
    parallel_mode : None | "column", default None
        "column" splits the output features as in `te.Linear`. "row" is refused:
        it would split the features the normalization needs whole.
    return_layernorm_output : bool, default False
        Also return ``Norm(x)`` (e.g. for a residual taken after the norm).
    return_layernorm_output_gathered : bool, default False
        With sequence parallelism, return the all-gathered ``Norm(x)`` instead of
        this rank's slice.
    parameters_split : tuple of str or dict, optional
        Split the weight and bias into named parameters (see `te.Linear`).
    zero_centered_gamma : bool, default False
        The norm scales by ``1 + layer_norm_weight`` (initialized to 0).
    device : torch.device, optional
        CUDA if available, else CPU, when None; ``"meta"`` defers initialization.
    name : str, optional
    delay_wgrad_compute : bool, default False
        The backward computes the input and bias gradients only; ``backward_dw()``
        computes the weight gradient later (NOTE [Delayed wgrad] in
        delayed_wgrad.py). Not with ``parameters_split``.
    ub_overlap_ag, ub_overlap_rs, ub_overlap_rs_dgrad, ub_bulk_wgrad, ub_bulk_dgrad,
    symmetric_ar_type
        Not implemented: anything but the default raises ``NotImplementedError``.

    Returns
    -------
    ``out``, ``(out, bias)``, ``(out, ln_out)`` or ``(out, bias, ln_out)``.
    """

    def __init__(self, in_features: int, out_features: int, eps: float = 1e-5,
                 sequence_parallel: bool = False, fuse_wgrad_accumulation: bool = False,
                 tp_group=None, tp_size: int = 1, get_rng_state_tracker: Optional[Callable] = None,
                 init_method: Optional[Callable] = None, bias: bool = True,
                 normalization: str = "LayerNorm", return_bias: bool = False,
                 params_dtype: Optional[torch.dtype] = None, parallel_mode: Optional[str] = None,
                 return_layernorm_output: bool = False,
                 return_layernorm_output_gathered: bool = False, parameters_split=None,
                 zero_centered_gamma: bool = False, device=None, ub_overlap_ag: bool = False,
                 ub_overlap_rs: bool = False, ub_overlap_rs_dgrad: bool = False,
                 ub_bulk_wgrad: bool = False, ub_bulk_dgrad: bool = False,
                 ub_name: Optional[str] = None, delay_wgrad_compute: bool = False,
                 symmetric_ar_type: Optional[str] = None, name: Optional[str] = None):
        super().__init__(num_gemms=1, name=name)
        api = "te.LayerNormLinear"
        reject_unsupported(api, ub_overlap_ag=(ub_overlap_ag, False),
                           ub_overlap_rs=(ub_overlap_rs, False),
                           ub_overlap_rs_dgrad=(ub_overlap_rs_dgrad, False),
                           ub_bulk_wgrad=(ub_bulk_wgrad, False),
                           ub_bulk_dgrad=(ub_bulk_dgrad, False),
                           symmetric_ar_type=(symmetric_ar_type, None))
        if parallel_mode == "row":
            raise ValueError(f"{api}: parallel_mode='row' would split the input features, "
                             "which the normalization needs whole; use parallel_mode='column' "
                             "or None (and te.Linear for a row-parallel layer)")
        self.tp = TensorParallelConfig(api, parallel_mode, tp_group, tp_size, sequence_parallel)
        self.in_features = check_positive_int(api, "in_features", in_features)
        self.out_features = check_positive_int(api, "out_features", out_features)
        self.eps = check_eps(api, eps)
        self.normalization = check_normalization(api, normalization)
        self.zero_centered_gamma = check_bool(api, "zero_centered_gamma", zero_centered_gamma)
        self.return_layernorm_output = check_bool(api, "return_layernorm_output",
                                                  return_layernorm_output)
        self.return_layernorm_output_gathered = check_bool(
            api, "return_layernorm_output_gathered", return_layernorm_output_gathered)
        self.return_bias = check_bool(api, "return_bias", return_bias)
        self.use_bias = check_bool(api, "bias", bias)
        self.fuse_wgrad_accumulation = check_bool(api, "fuse_wgrad_accumulation",
                                                  fuse_wgrad_accumulation)
        check_init_args(api, init_method, get_rng_state_tracker, None)
        parts = split_parameters(api, parameters_split, out_features)
        self._init_delay_wgrad(api, delay_wgrad_compute, parameters_split is not None)
        if parameters_split is not None and self.fuse_wgrad_accumulation:
            raise NotImplementedError(f"{api}: fuse_wgrad_accumulation=True with parameters_split "
                                      "is not implemented (one weight.main_grad per module); "
                                      "use one weight")
        dtype = check_params_dtype(api, params_dtype)
        device = default_device(device)
        self.get_rng_state_tracker, self.ub_name = get_rng_state_tracker, ub_name
        make_norm_params(self, in_features, normalization, self.zero_centered_gamma, dtype,
                         device, "layer_norm_weight", "layer_norm_bias")
        self.weight_names, self.bias_names = register_linear_params(
            self, local_parts(self.tp, parts), in_features, self.use_bias, dtype, device,
            ParamInit(init_method or normal_init, get_rng_state_tracker))
        for w, b in zip(self.weight_names, self.bias_names):
            self.tp.mark_params(getattr(self, w), getattr(self, b))
        if self.tp.sequence_parallel and self.tp.size > 1:
            mark_sequence_parallel(self.layer_norm_weight, self.layer_norm_bias)
        self._sync_tp_attributes()
        self.reset_parameters(defer_init=device.type == "meta")

    def _sync_tp_attributes(self) -> None:
        """TE's attribute names for the TP settings (plain attributes, as `te.Linear`)."""
        self.parallel_mode, self.sequence_parallel = self.tp.parallel_mode, self.tp.sequence_parallel
        self.tp_group, self.tp_size = self.tp.tp_group, self.tp.tp_size

    def set_tensor_parallel_group(self, tp_group) -> None:
        """Attach the tensor-parallel group (for a module built with ``tp_size``)."""
        self.tp.set_group(tp_group)
        self._sync_tp_attributes()

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None,
                fp8_output: bool = False, fp8_grad: bool = False):
        """``Norm(inp) W^T + b``; ``is_first_microbatch`` as in TE (NOTE [FP8 weight
        cache] in fp8_operands.py); ``fp8_output`` / ``fp8_grad`` are not implemented."""
        api = "te.LayerNormLinear"
        reject_unsupported(f"{api}.forward", fp8_output=(fp8_output, False),
                           fp8_grad=(fp8_grad, False))
        check_input(api, inp, self.in_features, "in_features")
        inp = inp.contiguous()          # NOTE [Contiguous module inputs] in module/base.py
        with self.prepare_forward(inp, is_first_microbatch) as plan:
            weight = joined_parameter(self, self.weight_names)
            ln_fp8 = None
            if self._norm_fusable(plan, inp, weight):
                ln_out, ln_fp8 = norm_cast_input(
                    plan, self.fp8_meta, inp, self.layer_norm_weight, self.layer_norm_bias,
                    self.normalization, self.eps, self.zero_centered_gamma,
                    activation_dtype(inp), write_y=self.return_layernorm_output,
                    transpose=weight.requires_grad and torch.is_grad_enabled())
            if ln_fp8 is None:      # unfused, or its kernel refused (NOTE [Suspect compiles])
                ln_out = normalize(inp, self.layer_norm_weight, self.layer_norm_bias,
                                   self.normalization, self.eps, self.zero_centered_gamma)
            bias = joined_parameter(self, self.bias_names)
            gemm_in = self.tp.column_input(ln_out)
            out = fp8_linear(self.named_api(api), gemm_in, weight,
                             None if self.return_bias else bias, plan, self.fp8_meta,
                             fuse_wgrad_accumulation=self.fuse_wgrad_accumulation,
                             input_name="normalized input", input_fp8=ln_fp8,
                             wgrad_store=self._forward_wgrad_store())
        if (self.return_layernorm_output_gathered and self.tp.sequence_parallel
                and self.tp.size > 1):
            ln_out = gemm_in                    # the all-gathered normalization output
        return pack_outputs(out, bias, self.return_bias,
                            ln_out if self.return_layernorm_output else None)

    def _norm_fusable(self, plan, inp: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether the normalization writes the GEMM's FP8 input itself (NOTE [Fused
        producers] in fused_producers.py): not through a sequence-parallel gather."""
        return (fused_producers_on(plan, inp)
                and not (self.tp.sequence_parallel and self.tp.size > 1)
                and gemm_shapes_ok(inp.numel() // self.in_features, self.in_features,
                                   weight.shape[0]))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"normalization={self.normalization}, bias={self.use_bias}"
                + "".join(f", {d}" for d in self.tp.describe()))
