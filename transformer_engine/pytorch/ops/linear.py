"""``te.ops.Linear``: a `BasicLinear` and, with ``bias=True``, a `Bias`, as one fused
operation (te.Linear's arithmetic: NOTE [Operation chains as modules] in
fused/linear_chain.py)."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..utils import check_bool
from .basic.basic_linear import BasicLinear
from .basic.bias import Bias
from .fused.linear_chain import LinearChain

__all__ = ["Linear"]


class Linear(LinearChain):
    """``y = x W^T + b``. TE's signature; the parameters are ``weight`` and ``bias``
    (also reachable as ``basic_ops[0].weight`` and ``basic_ops[1].bias``, TE's
    state_dict keys). Tensor parallelism is not implemented
    (``tensor_parallel_mode`` must be None).

    Parameters
    ----------
    in_features, out_features : int
    bias : bool, default True
    device, dtype, tensor_parallel_mode, tensor_parallel_group, sequence_parallel,
    rng_state_tracker_function, accumulate_into_main_grad
        As for `BasicLinear`.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True, device=None,
                 dtype: Optional[torch.dtype] = None, tensor_parallel_mode: Optional[str] = None,
                 tensor_parallel_group=None, sequence_parallel: bool = False,
                 rng_state_tracker_function: Optional[Callable] = None,
                 accumulate_into_main_grad: bool = False):
        linear = BasicLinear(in_features, out_features, device=device, dtype=dtype,
                             tensor_parallel_mode=tensor_parallel_mode,
                             tensor_parallel_group=tensor_parallel_group,
                             sequence_parallel=sequence_parallel,
                             rng_state_tracker_function=rng_state_tracker_function,
                             accumulate_into_main_grad=accumulate_into_main_grad)
        use_bias = check_bool("te.ops.Linear", "bias", bias)
        bias_op = Bias(out_features, device=device, dtype=dtype) if use_bias else None
        super().__init__(norm=None, linear1=linear, bias1=bias_op)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_parameter("weight", linear.weight)
        self.register_parameter("bias", None if bias_op is None else bias_op.bias)

    def register_parameter(self, name: str, param) -> None:
        """Keep ``weight`` / ``bias`` and the basic operations' parameters the same
        tensors (assigning one assigns the other, as in TE)."""
        super().register_parameter(name, param)
        members = getattr(self, "_members", None)
        if members is None:
            return
        if name == "weight":
            members[1].weight = param
        elif name == "bias" and members[2] is not None:
            members[2].bias = param
