"""``te.ops.Bias``: adds a learned bias over the last dimension."""

from __future__ import annotations

from typing import Optional

import torch

from ...module.devices import default_device
from ...module.params import ParameterInitMixin, ParamInit, constant_init
from ...utils import check_bool, check_params_dtype, check_positive_int, reject_unsupported
from ..op import BasicOperation

__all__ = ["Bias"]


class Bias(BasicOperation, ParameterInitMixin):
    """``y = x + b`` (``b`` starts at 0). After a `BasicLinear` the two run as one FP8
    linear with a fused bias, as te.Linear does. TE's signature.

    Parameters
    ----------
    size : int
    device, dtype : as for `BasicLinear`
    tensor_parallel, tensor_parallel_group
        Tensor parallelism is not implemented: ``tensor_parallel`` must be False.
    """

    def __init__(self, size: int, *, device=None, dtype: Optional[torch.dtype] = None,
                 tensor_parallel: bool = False, tensor_parallel_group=None):
        super().__init__()
        api = "te.ops.Bias"
        reject_unsupported(api, tensor_parallel=(check_bool(api, "tensor_parallel",
                                                            tensor_parallel), False))
        self.size = check_positive_int(api, "size", size)
        self.tensor_parallel_group = tensor_parallel_group
        device = default_device(device)
        self.register_initialized(
            "bias", torch.empty(size, dtype=check_params_dtype(api, dtype), device=device),
            ParamInit(constant_init(0.0)))
        self.reset_parameters(defer_init=device.type == "meta")

    def native_forward(self, x, extra_inputs, kwargs):
        if x.shape[-1] != self.bias.shape[0]:
            raise ValueError(f"te.ops.Bias: the input's last dimension must be size="
                             f"{self.bias.shape[0]}, got input of shape {tuple(x.shape)}")
        return x + self.bias.to(x.dtype), [()]

    def extra_repr(self) -> str:
        return f"size={self.size}"
