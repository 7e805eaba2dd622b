"""te.LayerNormMLP: Norm -> FC1 -> activation -> FC2, both GEMMs in FP8 inside an
enabled ``te.autocast``, each with its own delayed-scaling slots (FC1 is GEMM 0,
FC2 is GEMM 1: forward slots ``[fc1 input, fc1 weight, fc2 input, fc2 weight]``,
backward slots ``[fc1 grad_output, fc2 grad_output]``).

The two GEMMs share the module's one `ForwardPlan` (so one registration with the
autocast session, and one backward update per backward pass, NOTE [Delayed-scaling
update order] in amax_update.py).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .. import distributed
from ..tensor_parallel import (TensorParallelConfig, gather_from_sequence_parallel_region,
                               mark_sequence_parallel)
from ..utils import (check_bool, check_eps, check_input, check_normalization, check_params_dtype,
                     check_optional_positive_int, check_positive_int, reject_unsupported)
from .activations import ACTIVATIONS, activate, check_activation, fusable, is_gated
from .base import TransformerEngineBaseModule
from .devices import activation_dtype, default_device
from .fused_producers import (GradHandoff, act_cast_input, fused_producers_on, gemm_shapes_ok,
                              norm_cast_input)
from .layernorm import make_norm_params, normalize
from .layernorm_linear import pack_outputs
from .fp8_linear import fp8_linear
from .linear import check_init_args
from .params import ParamInit, normal_init, register_linear_params

__all__ = ["LayerNormMLP", "ACTIVATIONS", "activate"]


class LayerNormMLP(TransformerEngineBaseModule):
    """``y = act(Norm(x) W1^T + b1) W2^T + b2``; both GEMMs in FP8 inside an enabled
    ``te.autocast``, the normalization and the activation in high precision (on CUDA
    their kernels write the GEMMs' FP8 operands, and the activation's gradient FC1's:
    NOTE [Fused producers] in fused_producers.py). TE's signature; parameters in TE's
    order (``layer_norm_weight``, ``layer_norm_bias``, ``fc1_weight``, ``fc1_bias``,
    ``fc2_weight``, ``fc2_bias``).

    Parameters
    ----------
    hidden_size, ffn_hidden_size : int
    eps : float, default 1e-5
    sequence_parallel : bool, default False
        With ``set_parallel_mode`` the input and output are this rank's slice of the
        sequence (dim 0); the norm parameters and ``fc2_bias`` get partial gradients
        (marked ``sequence_parallel``: sum them over the TP group).
    return_bias : bool, default False
        Return FC2's bias instead of adding it.
    get_rng_state_tracker : callable, optional
        Both weights are initialized under its ``fork()``.
    tp_group, tp_size : see `te.Linear`
    init_method, output_layer_init_method : callable, optional
        Initialize ``fc1_weight`` and ``fc2_weight``; normal(0, 0.023) when None.
    bias : bool, default True
    normalization : "LayerNorm" | "RMSNorm", default "LayerNorm"
    activation : str, default "gelu"
        gelu (tanh approximation), relu, qgelu, srelu, silu, or a gated form geglu,
        glu (sigmoid), reglu, qgeglu, sreglu, swiglu (``f(first half) * second
        half`` of FC1's output), clamped_swiglu (GPT-OSS's: NOTE [Clamped SwiGLU] in
        activations.py).
    activation_params : dict, optional
        For "clamped_swiglu": ``limit`` (default 7.0), ``alpha`` (1.702) and
        ``glu_linear_offset`` (1.0). Other activations take none (None or ``{}``);
        unknown keys or non-numbers raise ``TypeError``. Kept as the attribute
        ``activation_params``, as in TE.
    fuse_wgrad_accumulation : bool, default False
        Both weight gradients go into ``fc1_weight.main_grad`` / ``fc2_weight.main_grad``.
    params_dtype : torch.dtype, optional
        float32, bfloat16 or float16; ``torch.get_default_dtype()`` when None.
    return_layernorm_output : bool, default False
        Also return ``Norm(x)``.
    return_layernorm_output_gathered : bool, default False
        With sequence parallelism, return the all-gathered ``Norm(x)``.
    seq_length, micro_batch_size : int, optional
        TE's JIT warm-up hints; checked, no effect here (there is no JIT to warm up).
    set_parallel_mode : bool, default False
        Tensor parallelism as in TE: FC1 column-parallel (``fc1_weight`` holds this
        rank's ``ffn_hidden_size / tp`` rows; for a gated activation its halves are
        this rank's slices of the two halves), FC2 row-parallel (``fc2_weight`` holds
        ``ffn_hidden_size / tp`` columns, the output is summed over the group and
        ``fc2_bias`` added after). See NOTE [Tensor-parallel layouts].
    zero_centered_gamma : bool, default False
    device : torch.device, optional
        CUDA if available, else CPU, when None; ``"meta"`` defers initialization.
    name : str, optional
    checkpoint : bool, default False
        Recompute FC1 -> activation -> FC2 during backward instead of keeping their
        activations (through ``te.checkpoint``, non-reentrant, so FP8 scales are kept
        right), whenever grad is enabled. The normalization output is kept.
    delay_wgrad_compute : bool, default False
        The backward computes the input and bias gradients only; ``backward_dw()``
        computes the weight gradients later (NOTE [Delayed wgrad] in delayed_wgrad.py).
    ub_overlap_ag, ub_overlap_rs, ub_overlap_rs_dgrad, ub_bulk_dgrad, ub_bulk_wgrad,
    symmetric_ar_type
        Not implemented: anything but the default raises ``NotImplementedError``.

    Returns
    -------
    ``out``, then FC2's bias if ``return_bias``, then ``Norm(x)`` if
    ``return_layernorm_output``.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, eps: float = 1e-5,
                 sequence_parallel: bool = False, return_bias: bool = False,
                 get_rng_state_tracker: Optional[Callable] = None, tp_group=None,
                 tp_size: int = 1, init_method: Optional[Callable] = None, bias: bool = True,
                 normalization: str = "LayerNorm", activation: str = "gelu",
                 activation_params: Optional[dict] = None,
                 output_layer_init_method: Optional[Callable] = None,
                 fuse_wgrad_accumulation: bool = False,
                 params_dtype: Optional[torch.dtype] = None, return_layernorm_output: bool = False,
                 return_layernorm_output_gathered: bool = False,
                 seq_length: Optional[int] = None, micro_batch_size: Optional[int] = None,
                 set_parallel_mode: bool = False, zero_centered_gamma: bool = False,
                 device=None, ub_overlap_ag: bool = False, name: Optional[str] = None,
                 ub_overlap_rs: bool = False, ub_overlap_rs_dgrad: bool = False,
                 ub_bulk_dgrad: bool = False, ub_bulk_wgrad: bool = False,
                 delay_wgrad_compute: bool = False, symmetric_ar_type: Optional[str] = None,
                 checkpoint: bool = False):
        super().__init__(num_gemms=2, name=name)
        api = "te.LayerNormMLP"
        reject_unsupported(api, ub_overlap_ag=(ub_overlap_ag, False),
                           ub_overlap_rs=(ub_overlap_rs, False),
                           ub_overlap_rs_dgrad=(ub_overlap_rs_dgrad, False),
                           ub_bulk_dgrad=(ub_bulk_dgrad, False),
                           ub_bulk_wgrad=(ub_bulk_wgrad, False),
                           symmetric_ar_type=(symmetric_ar_type, None))
        self._init_delay_wgrad(api, delay_wgrad_compute)
        self.set_parallel_mode = check_bool(api, "set_parallel_mode", set_parallel_mode)
        self.tp_fc1 = TensorParallelConfig(api, "column" if set_parallel_mode else None,
                                           tp_group, tp_size, sequence_parallel,
                                           split_by="set_parallel_mode=True")
        self.tp_fc2 = TensorParallelConfig(api, "row" if set_parallel_mode else None,
                                           tp_group, tp_size, sequence_parallel, split_by=None)
        self.hidden_size = check_positive_int(api, "hidden_size", hidden_size)
        self.ffn_hidden_size = check_positive_int(api, "ffn_hidden_size", ffn_hidden_size)
        self.eps = check_eps(api, eps)
        self.normalization = check_normalization(api, normalization)
        self._act_params = check_activation(api, activation, activation_params)
        self.activation, self.activation_params = activation, activation_params
        self.checkpoint = check_bool(api, "checkpoint", checkpoint)
        self.zero_centered_gamma = check_bool(api, "zero_centered_gamma", zero_centered_gamma)
        self.return_layernorm_output = check_bool(api, "return_layernorm_output",
                                                  return_layernorm_output)
        self.return_layernorm_output_gathered = check_bool(
            api, "return_layernorm_output_gathered", return_layernorm_output_gathered)
        self.return_bias = check_bool(api, "return_bias", return_bias)
        self.use_bias = check_bool(api, "bias", bias)
        self.fuse_wgrad_accumulation = check_bool(api, "fuse_wgrad_accumulation",
                                                  fuse_wgrad_accumulation)
        self.seq_length = check_optional_positive_int(api, "seq_length", seq_length)
        self.micro_batch_size = check_optional_positive_int(api, "micro_batch_size",
                                                            micro_batch_size)
        check_init_args(api, init_method, get_rng_state_tracker, None)
        check_init_args(api, output_layer_init_method, None, None)
        dtype = check_params_dtype(api, params_dtype)
        device = default_device(device)
        self.get_rng_state_tracker = get_rng_state_tracker
        make_norm_params(self, hidden_size, normalization, self.zero_centered_gamma, dtype,
                         device, "layer_norm_weight", "layer_norm_bias")
        local_ffn = self.tp_fc1.local_features("ffn_hidden_size", ffn_hidden_size)
        fc1_out = local_ffn * (2 if is_gated(activation) else 1)
        register_linear_params(self, [("fc1_", fc1_out)], hidden_size, self.use_bias, dtype,
                               device, ParamInit(init_method or normal_init,
                                                 get_rng_state_tracker))
        register_linear_params(self, [("fc2_", hidden_size)], local_ffn, self.use_bias, dtype,
                               device, ParamInit(output_layer_init_method or normal_init,
                                                 get_rng_state_tracker),
                               fp8_weight_index=self.FWD_TENSORS_PER_GEMM + 1)
        self.tp_fc1.mark_params(self.fc1_weight, self.fc1_bias)
        self.tp_fc2.mark_params(self.fc2_weight, self.fc2_bias)
        if self.tp_fc1.sequence_parallel and self.tp_fc1.size > 1:
            mark_sequence_parallel(self.layer_norm_weight, self.layer_norm_bias)
        self._sync_tp_attributes()
        self.reset_parameters(defer_init=device.type == "meta")

    def _sync_tp_attributes(self) -> None:
        self.sequence_parallel = self.tp_fc1.sequence_parallel
        self.tp_group, self.tp_size = self.tp_fc1.tp_group, self.tp_fc1.tp_size

    def set_tensor_parallel_group(self, tp_group) -> None:
        """Attach the tensor-parallel group (for a module built with ``tp_size``)."""
        self.tp_fc1.set_group(tp_group)
        self.tp_fc2.set_group(tp_group)
        self._sync_tp_attributes()

    def _fc1_act_fc2(self, ln_out: torch.Tensor, is_first_microbatch: Optional[bool] = None
                     ) -> torch.Tensor:
        """FC1 -> activation -> FC2: the module's one FP8 forward (one prepare_forward)."""
        with self.prepare_forward(ln_out, is_first_microbatch) as plan:
            return self._mlp(ln_out, plan)

    def _mlp(self, ln_out: torch.Tensor, plan, ln_fp8=None) -> torch.Tensor:
        """FC1 -> activation -> FC2 under ``plan``; ``ln_fp8``: FC1's FP8 input made by
        the normalization (NOTE [Fused producers] in fused_producers.py)."""
        api = self.named_api("te.LayerNormMLP")
        fuse = self.fuse_wgrad_accumulation
        fc1_in = self.tp_fc1.column_input(ln_out)
        act_fused = (fusable(self.activation) and fused_producers_on(plan, fc1_in)
                     and gemm_shapes_ok(fc1_in.numel() // self.hidden_size, self.hidden_size,
                                        self.fc1_weight.shape[0], self.fc2_weight.shape[1]))
        handoff = GradHandoff() if act_fused else None
        fc1_out = fp8_linear(api, fc1_in, self.fc1_weight, self.fc1_bias, plan, self.fp8_meta,
                             gemm=0, fuse_wgrad_accumulation=fuse, input_name="FC1 input",
                             weight_name="fc1_weight", input_fp8=ln_fp8, grad_handoff=handoff,
                             wgrad_store=self._forward_wgrad_store())
        act_fp8 = None
        if act_fused:
            act_out, act_fp8 = act_cast_input(
                plan, self.fp8_meta, fc1_out, self.activation,
                transpose=self.fc2_weight.requires_grad and torch.is_grad_enabled(),
                handoff=handoff, fwd_index=self.FWD_TENSORS_PER_GEMM,
                bwd_index=0)
        else:
            act_out = activate(fc1_out, self.activation, self._act_params)
        row = self.tp_fc2.size > 1
        fc2_bias = None if (self.return_bias or row) else self.fc2_bias
        out = self.tp_fc2.row_output(fp8_linear(
            api, act_out, self.fc2_weight, fc2_bias, plan, self.fp8_meta, gemm=1,
            fuse_wgrad_accumulation=fuse, input_name="FC2 input (the activation output)",
            weight_name="fc2_weight", input_fp8=act_fp8,
            wgrad_store=self._forward_wgrad_store()))
        if row and not self.return_bias and self.fc2_bias is not None:
            out = out + self.fc2_bias.to(out.dtype)
        return out

    def _norm_fusable(self, plan, inp: torch.Tensor) -> bool:
        """Whether the normalization writes FC1's FP8 input itself (NOTE [Fused
        producers] in fused_producers.py): not through a sequence-parallel gather."""
        return (fused_producers_on(plan, inp)
                and not (self.tp_fc1.sequence_parallel and self.tp_fc1.size > 1)
                and gemm_shapes_ok(inp.numel() // self.hidden_size, self.hidden_size,
                                   self.fc1_weight.shape[0]))

    def _worth_checkpointing(self, ln_out: torch.Tensor) -> bool:
        """Only a forward that builds a graph has activations to drop."""
        if not (self.checkpoint and torch.is_grad_enabled()):
            return False
        params = (self.fc1_weight, self.fc1_bias, self.fc2_weight, self.fc2_bias)
        return ln_out.requires_grad or any(p is not None and p.requires_grad for p in params)

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None):
        """The MLP on ``inp``; ``is_first_microbatch`` as in TE (NOTE [FP8 weight cache]
        in fp8_operands.py)."""
        check_input("te.LayerNormMLP", inp, self.hidden_size)
        inp = inp.contiguous()          # NOTE [Contiguous module inputs] in module/base.py
        if not (self.checkpoint and torch.is_grad_enabled()):
            with self.prepare_forward(inp, is_first_microbatch) as plan:
                ln_fp8 = None
                if self._norm_fusable(plan, inp):
                    ln_out, ln_fp8 = norm_cast_input(
                        plan, self.fp8_meta, inp, self.layer_norm_weight, self.layer_norm_bias,
                        self.normalization, self.eps, self.zero_centered_gamma,
                        activation_dtype(inp), write_y=self.return_layernorm_output,
                        transpose=self.fc1_weight.requires_grad and torch.is_grad_enabled())
                if ln_fp8 is None:  # unfused, or its kernel refused (NOTE [Suspect compiles])
                    ln_out = normalize(inp, self.layer_norm_weight, self.layer_norm_bias,
                                       self.normalization, self.eps, self.zero_centered_gamma)
                out = self._mlp(ln_out, plan, ln_fp8)
        else:
            ln_out = normalize(inp, self.layer_norm_weight, self.layer_norm_bias,
                               self.normalization, self.eps, self.zero_centered_gamma)
            args = (ln_out,) if is_first_microbatch is None else (ln_out, is_first_microbatch)
            if self._worth_checkpointing(ln_out):
                out = distributed.checkpoint(self._fc1_act_fc2, *args, use_reentrant=False)
            else:
                out = self._fc1_act_fc2(*args)
        if (self.return_layernorm_output_gathered and self.tp_fc1.sequence_parallel
                and self.tp_fc1.size > 1):
            ln_out = gather_from_sequence_parallel_region(ln_out, self.tp_fc1.tp_group,
                                                          "te.LayerNormMLP")
        return pack_outputs(out, self.fc2_bias, self.return_bias,
                            ln_out if self.return_layernorm_output else None)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
                f"normalization={self.normalization}, activation={self.activation!r}, "
                + (f"activation_params={self._act_params}, " if self._act_params else "")
                + f"bias={self.use_bias}, checkpoint={self.checkpoint}"
                + "".join(f", {d}" for d in self.tp_fc1.describe()[1:]))
