"""``te.ops.BasicLinear``: ``y = x W^T`` with the FP8 linear of te.Linear.

Its FP8 state is te.Linear's: ``fp8_meta["scaling_fwd"]`` slots ``[input, weight]``,
``fp8_meta["scaling_bwd"]`` slot ``[grad_output]``, taken from ``te.autocast`` by
`TransformerEngineBaseModule.prepare_forward` (so delayed scaling registers with the
autocast session, stashes for te.checkpoint and updates as a module does), and
saved as ``_extra_state`` in the state_dict in the layout te.Linear writes.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from ...module.base import TransformerEngineBaseModule
from ...module.devices import default_device
from ...module.fp8_linear import fp8_linear
from ...module.params import ParamInit
from ...utils import check_bool, check_params_dtype, check_positive_int, reject_unsupported
from ..op import BasicOperation

__all__ = ["BasicLinear"]


def _kaiming_uniform(weight: torch.Tensor) -> None:
    """torch.nn.Linear's weight initialization (TE's default for BasicLinear)."""
    torch.nn.init.kaiming_uniform_(weight, a=math.sqrt(5))


class BasicLinear(BasicOperation, TransformerEngineBaseModule):
    """``y = x W^T`` (``torch.nn.Linear`` without bias); FP8 GEMMs inside an enabled
    ``te.autocast``, for every recipe te.Linear takes. TE's signature.

    Parameters
    ----------
    in_features, out_features : int
    device : torch.device, optional
        CUDA if available, else CPU; ``"meta"`` defers initialization.
    dtype : torch.dtype, optional
        The weight's dtype (``torch.get_default_dtype()`` when None).
    tensor_parallel_mode, tensor_parallel_group, sequence_parallel
        Tensor parallelism is not implemented for operations: ``tensor_parallel_mode``
        must be None (``NotImplementedError`` otherwise).
    rng_state_tracker_function : callable, optional
        The weight is initialized under its tracker's ``fork()``.
    accumulate_into_main_grad : bool, default False
        The weight gradient goes into ``weight.main_grad`` in float32 (Megatron-LM).
    userbuffers_options : dict, optional
        Not implemented: must be None.
    """

    def __init__(self, in_features: int, out_features: int, *, device=None,
                 dtype: Optional[torch.dtype] = None, tensor_parallel_mode: Optional[str] = None,
                 tensor_parallel_group=None, sequence_parallel: bool = False,
                 rng_state_tracker_function: Optional[Callable] = None,
                 accumulate_into_main_grad: bool = False,
                 userbuffers_options: Optional[dict] = None):
        super().__init__(num_gemms=1)
        api = "te.ops.BasicLinear"
        reject_unsupported(api, tensor_parallel_mode=(tensor_parallel_mode, None),
                           userbuffers_options=(userbuffers_options, None))
        self.in_features = check_positive_int(api, "in_features", in_features)
        self.out_features = check_positive_int(api, "out_features", out_features)
        self.sequence_parallel = check_bool(api, "sequence_parallel", sequence_parallel)
        self.tensor_parallel_group = tensor_parallel_group
        self._accumulate_into_main_grad = check_bool(api, "accumulate_into_main_grad",
                                                     accumulate_into_main_grad)
        if rng_state_tracker_function is not None and not callable(rng_state_tracker_function):
            raise TypeError(f"{api}: rng_state_tracker_function must be callable or None, "
                            f"got {type(rng_state_tracker_function).__name__}")
        dtype = check_params_dtype(api, dtype)
        device = default_device(device)
        self.register_initialized(
            "weight", torch.empty(out_features, in_features, dtype=dtype, device=device),
            ParamInit(_kaiming_uniform, rng_state_tracker_function, fp8_weight_index=1))
        self.reset_parameters(defer_init=device.type == "meta")

    def num_quantizers(self, mode: str) -> int:
        """Two forward FP8 tensors (input, weight), one backward (grad_output)."""
        super().num_quantizers(mode)
        return 2 if mode == "forward" else 1

    def linear(self, x: torch.Tensor, bias: Optional[torch.Tensor], plan, input_fp8=None,
               grad_handoff=None) -> torch.Tensor:
        """``x W^T (+ bias)`` under ``plan`` (one of this operation's `prepare_forward`)."""
        return fp8_linear("te.ops.BasicLinear", x, self.weight, bias, plan, self.fp8_meta,
                          fuse_wgrad_accumulation=self._accumulate_into_main_grad,
                          input_fp8=input_fp8, grad_handoff=grad_handoff)

    def native_forward(self, x, extra_inputs, kwargs):
        x = x.contiguous()      # NOTE [Contiguous module inputs] in module/base.py
        with self.prepare_forward(x) as plan:
            return self.linear(x, None, plan), [()]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"
