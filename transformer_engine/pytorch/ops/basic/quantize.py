"""``te.ops.Quantize``: rounds a tensor (and, optionally, its gradient) to FP8 values
under ``te.autocast``; outside an FP8 autocast, the identity.

TE's operation hands the next operation an FP8 tensor. Operations here take
high-precision tensors, so the output is the FP8 cast dequantized to the input's
dtype: the same values, held wider. The casts are te.Linear's input and
output-gradient casts (forward slot 0, backward slot 0 of this operation's
``fp8_meta``), with their delayed-scaling state, recompute stashes and updates.
"""

from __future__ import annotations

import torch

from ... import torch_compile
from ...amax_update import request_backward_update
from ...module.base import TransformerEngineBaseModule
from ...module.fp8_operands import cast_operand
from ...utils import check_bool
from ..op import BasicOperation

__all__ = ["Quantize"]


def _round_trip(x: torch.Tensor, plan, state, index: int, dtype, record: bool,
                role: str) -> torch.Tensor:
    x2d = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    q, _ = cast_operand(x2d.contiguous(), plan, state, index, dtype, record, role)
    return q.dequantize(x.dtype).reshape(x.shape)


class _QuantizeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plan, fp8_meta, forward, backward):
        ctx.plan, ctx.fp8_meta, ctx.backward = plan, fp8_meta, backward
        if not forward:
            return x.view_as(x)
        return _round_trip(x, plan, plan.fwd_state, 0, plan.recipe.fp8_format.value.dtype_fwd,
                           plan.record_amax, "fwd_inp")

    @staticmethod
    def backward(ctx, dy):
        plan = ctx.plan
        if not ctx.backward:
            return dy, None, None, None, None
        state = ctx.fp8_meta["scaling_bwd"] if plan.delayed else None
        dx = _round_trip(dy, plan, state, 0, plan.recipe.fp8_format.value.dtype_bwd, True,
                         "bwd_grad")
        if plan.session is not None:
            request_backward_update(plan.session)
        elif plan.bwd_update_gemm == 0:
            torch_compile.backward_update(ctx.fp8_meta, plan.recipe, plan.group)
        return dx, None, None, None, None


class Quantize(BasicOperation, TransformerEngineBaseModule):
    """Round to FP8 values under an enabled ``te.autocast`` (see the module docstring).

    Parameters
    ----------
    forward : bool, default True
        Round the output.
    backward : bool, default False
        Round the input gradient.
    """

    def __init__(self, forward: bool = True, backward: bool = False):
        super().__init__(num_gemms=1)
        self._quantize_forward = check_bool("te.ops.Quantize", "forward", forward)
        self._quantize_backward = check_bool("te.ops.Quantize", "backward", backward)

    def _meta_device(self) -> torch.device:
        """A Quantize op has no parameters: its FP8 state lives where its input is."""
        device = getattr(self, "_input_device", None)
        return device if device is not None else super()._meta_device()

    def num_quantizers(self, mode: str) -> int:
        super().num_quantizers(mode)
        return int(self._quantize_forward if mode == "forward" else self._quantize_backward)

    def native_forward(self, x, extra_inputs, kwargs):
        if not x.is_floating_point():
            raise TypeError(f"te.ops.Quantize: input must be a floating-point tensor, got "
                            f"dtype {x.dtype}")
        x = x.contiguous()
        self._input_device = x.device
        with self.prepare_forward(x) as plan:
            if not plan.fp8 or x.numel() == 0:
                return x, [()]
            return _QuantizeFunction.apply(x, plan, self.fp8_meta, self._quantize_forward,
                                           self._quantize_backward), [()]

    def extra_repr(self) -> str:
        return f"forward={self._quantize_forward}, backward={self._quantize_backward}"
