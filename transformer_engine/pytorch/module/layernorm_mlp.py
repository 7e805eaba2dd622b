"""te.LayerNormMLP: Norm -> FC1 -> activation -> FC2, both GEMMs in FP8 inside an
enabled ``te.autocast``, each with its own delayed-scaling slots (FC1 is GEMM 0,
FC2 is GEMM 1: forward slots ``[fc1 input, fc1 weight, fc2 input, fc2 weight]``,
backward slots ``[fc1 grad_output, fc2 grad_output]``).

The two GEMMs share the module's one `ForwardPlan` (so one registration with the
autocast session, and one backward update per backward pass, NOTE [Delayed-scaling
update order] in amax_update.py).
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from .. import distributed
from ..tensor_parallel import TensorParallelConfig, mark_sequence_parallel
from .base import TransformerEngineBaseModule, default_device
from ..utils import (check_eps, check_input, check_normalization, check_params_dtype,
                     check_positive_int)
from .layernorm import make_norm_params, normalize
from .layernorm_linear import pack_outputs
from .linear import fp8_linear, init_weight_

__all__ = ["LayerNormMLP", "ACTIVATIONS", "activate"]


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")      # TE's "gelu" is the tanh approximation


def _qgelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)       # "quick GELU"


def _srelu(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))            # squared ReLU


# name -> (elementwise function, gated). A gated activation splits FC1's output into
# halves ``[a, b]`` along the last dimension and returns ``f(a) * b``, so FC1 has
# ``2 * ffn_hidden_size`` outputs.
ACTIVATIONS: Dict[str, Tuple[Callable[[torch.Tensor], torch.Tensor], bool]] = {
    "gelu": (_gelu, False), "geglu": (_gelu, True),
    "qgelu": (_qgelu, False), "qgeglu": (_qgelu, True),
    "relu": (F.relu, False), "reglu": (F.relu, True),
    "srelu": (_srelu, False), "sreglu": (_srelu, True),
    "silu": (F.silu, False), "swiglu": (F.silu, True),
}


# Activations that are one torch op, which computes in float32 for 16-bit inputs and
# rounds once: applied to a 16-bit input directly they give the float32 result bit for
# bit (forward and backward), without a float32 copy of FC1's output (the widest
# activation of the layer) and two extra passes over it.
_ONE_OP_IN_FLOAT32 = frozenset(("gelu", "relu", "silu"))


def activate(x: torch.Tensor, activation: str) -> torch.Tensor:
    """Apply ``activation`` (a key of `ACTIVATIONS`) in float32; returns ``x.dtype``."""
    fn, gated = ACTIVATIONS[activation]
    if activation in _ONE_OP_IN_FLOAT32:
        return fn(x)
    x32 = x.to(torch.float32)
    if gated:
        a, b = x32.chunk(2, dim=-1)
        return (fn(a) * b).to(x.dtype)
    return fn(x32).to(x.dtype)


class LayerNormMLP(TransformerEngineBaseModule):
    """``y = act(Norm(x) W1^T + b1) W2^T + b2``; both GEMMs in FP8 inside an enabled
    ``te.autocast``, the normalization and the activation in high precision.

    Parameters
    ----------
    hidden_size, ffn_hidden_size : int
    eps : float, default 1e-5
    bias : bool, default True
    normalization : "LayerNorm" | "RMSNorm", default "LayerNorm"
    activation : str, default "gelu"
        gelu (tanh approximation), relu, qgelu, srelu, silu, or a gated form geglu,
        reglu, qgeglu, sreglu, swiglu (``f(first half) * second half`` of FC1's output).
    zero_centered_gamma : bool, default False
    return_layernorm_output : bool, default False
        Also return ``Norm(x)``.
    return_bias : bool, default False
        Return FC2's bias instead of adding it.
    init_method, output_layer_init_method : callable, optional
        Initialize ``fc1_weight`` and ``fc2_weight``; normal(0, 0.023) when None.
    params_dtype : torch.dtype, optional
        float32 or bfloat16; ``torch.get_default_dtype()`` when None.
    device : torch.device, optional
        CUDA if available, else CPU, when None.
    checkpoint : bool, default False
        Recompute FC1 -> activation -> FC2 during backward instead of keeping their
        activations (through ``te.checkpoint``, non-reentrant, so FP8 scales are kept
        right), whenever grad is enabled. The normalization output is kept.
    set_parallel_mode : bool, default False
        Tensor parallelism as in TE: FC1 column-parallel (``fc1_weight`` holds this
        rank's ``ffn_hidden_size / tp`` rows; for a gated activation its halves are
        this rank's slices of the two halves), FC2 row-parallel (``fc2_weight`` holds
        ``ffn_hidden_size / tp`` columns, the output is summed over the group and
        ``fc2_bias`` added after). See NOTE [Tensor-parallel layouts].
    sequence_parallel, tp_group, tp_size : see `te.Linear`
        With sequence parallelism the input and output are this rank's slice of the
        sequence (dim 0); the norm parameters and ``fc2_bias`` get partial gradients
        (marked ``sequence_parallel``: sum them over the TP group).

    Returns
    -------
    ``out``, then FC2's bias if ``return_bias``, then ``Norm(x)`` if
    ``return_layernorm_output``.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, eps: float = 1e-5, *,
                 bias: bool = True, normalization: str = "LayerNorm", activation: str = "gelu",
                 zero_centered_gamma: bool = False, return_layernorm_output: bool = False,
                 return_bias: bool = False, init_method: Optional[Callable] = None,
                 output_layer_init_method: Optional[Callable] = None,
                 params_dtype: Optional[torch.dtype] = None, device=None,
                 checkpoint: bool = False, set_parallel_mode: bool = False,
                 sequence_parallel: bool = False, tp_group=None, tp_size: int = 1):
        super().__init__(num_gemms=2)
        api = "te.LayerNormMLP"
        if not isinstance(set_parallel_mode, bool):
            raise TypeError(f"{api}: set_parallel_mode must be a bool, got {set_parallel_mode!r}")
        self.tp_fc1 = TensorParallelConfig(api, "column" if set_parallel_mode else None,
                                           tp_group, tp_size, sequence_parallel,
                                           split_by="set_parallel_mode=True")
        self.tp_fc2 = TensorParallelConfig(api, "row" if set_parallel_mode else None,
                                           tp_group, tp_size, sequence_parallel, split_by=None)
        self.set_parallel_mode = set_parallel_mode
        self.hidden_size = check_positive_int(api, "hidden_size", hidden_size)
        self.ffn_hidden_size = check_positive_int(api, "ffn_hidden_size", ffn_hidden_size)
        self.eps = check_eps(api, eps)
        self.normalization = check_normalization(api, normalization)
        if activation not in ACTIVATIONS:
            raise ValueError(f"{api}: activation must be one of {sorted(ACTIVATIONS)}, "
                             f"got {activation!r}")
        if not isinstance(checkpoint, bool):
            raise TypeError(f"{api}: checkpoint must be a bool, got {checkpoint!r}")
        self.activation, self.checkpoint = activation, checkpoint
        self.zero_centered_gamma = bool(zero_centered_gamma)
        self.return_layernorm_output, self.return_bias = return_layernorm_output, return_bias
        self.use_bias = bias
        dtype = check_params_dtype(api, params_dtype)
        device = default_device(device)
        make_norm_params(self, hidden_size, normalization, self.zero_centered_gamma, dtype,
                         device, "layer_norm_weight", "layer_norm_bias")
        local_ffn = self.tp_fc1.local_features("ffn_hidden_size", ffn_hidden_size)
        fc1_out = local_ffn * (2 if ACTIVATIONS[activation][1] else 1)
        self.fc1_weight = torch.nn.Parameter(torch.empty(fc1_out, hidden_size, dtype=dtype,
                                                         device=device))
        self.fc2_weight = torch.nn.Parameter(torch.empty(hidden_size, local_ffn,
                                                         dtype=dtype, device=device))
        (init_method or init_weight_)(self.fc1_weight)
        (output_layer_init_method or init_weight_)(self.fc2_weight)
        if bias:
            self.fc1_bias = torch.nn.Parameter(torch.zeros(fc1_out, dtype=dtype, device=device))
            self.fc2_bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype,
                                                           device=device))
        else:
            self.register_parameter("fc1_bias", None)
            self.register_parameter("fc2_bias", None)
        self.tp_fc1.mark_params(self.fc1_weight, self.fc1_bias)
        self.tp_fc2.mark_params(self.fc2_weight, self.fc2_bias)
        if self.tp_fc1.sequence_parallel and self.tp_fc1.size > 1:
            mark_sequence_parallel(self.layer_norm_weight, self.layer_norm_bias)

    def set_tensor_parallel_group(self, tp_group) -> None:
        """Attach the tensor-parallel group (for a module built with ``tp_size``)."""
        self.tp_fc1.set_group(tp_group)
        self.tp_fc2.set_group(tp_group)

    def _fc1_act_fc2(self, ln_out: torch.Tensor) -> torch.Tensor:
        """FC1 -> activation -> FC2: the module's one FP8 forward (one prepare_forward)."""
        api = "te.LayerNormMLP"
        with self.prepare_forward(ln_out) as plan:
            fc1_out = fp8_linear(api, self.tp_fc1.column_input(ln_out), self.fc1_weight,
                                 self.fc1_bias, plan, self.fp8_meta, gemm=0)
            act_out = activate(fc1_out, self.activation)
            row = self.tp_fc2.size > 1
            fc2_bias = None if (self.return_bias or row) else self.fc2_bias
            out = self.tp_fc2.row_output(fp8_linear(api, act_out, self.fc2_weight, fc2_bias,
                                                    plan, self.fp8_meta, gemm=1))
        if row and not self.return_bias and self.fc2_bias is not None:
            out = out + self.fc2_bias.to(out.dtype)
        return out

    def _worth_checkpointing(self, ln_out: torch.Tensor) -> bool:
        """Only a forward that builds a graph has activations to drop."""
        if not (self.checkpoint and torch.is_grad_enabled()):
            return False
        params = (self.fc1_weight, self.fc1_bias, self.fc2_weight, self.fc2_bias)
        return ln_out.requires_grad or any(p is not None and p.requires_grad for p in params)

    def forward(self, inp: torch.Tensor):
        check_input("te.LayerNormMLP", inp, self.hidden_size)
        ln_out = normalize(inp, self.layer_norm_weight, self.layer_norm_bias,
                           self.normalization, self.eps, self.zero_centered_gamma)
        if self._worth_checkpointing(ln_out):
            out = distributed.checkpoint(self._fc1_act_fc2, ln_out, use_reentrant=False)
        else:
            out = self._fc1_act_fc2(ln_out)
        return pack_outputs(out, self.fc2_bias, self.return_bias,
                            ln_out if self.return_layernorm_output else None)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
                f"normalization={self.normalization}, activation={self.activation!r}, "
                f"bias={self.use_bias}, checkpoint={self.checkpoint}"
                + "".join(f", {d}" for d in self.tp_fc1.describe()[1:]))
