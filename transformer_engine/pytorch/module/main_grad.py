"""``fuse_wgrad_accumulation``: the weight gradient accumulated into ``weight.main_grad``.

NOTE [Fused wgrad accumulation]
    Megatron-LM's distributed optimizer gives every parameter a ``main_grad`` buffer
    (float32, or the parameter's dtype) and reads gradients from there, not from
    ``.grad``. With ``fuse_wgrad_accumulation=True`` a TE module's backward computes
    the wgrad GEMM in float32 and adds it into ``weight.main_grad`` (one rounding, into
    the buffer's dtype), so a bfloat16 weight's gradient is never rounded to bfloat16
    on the way. What autograd then receives for the weight follows TE: when the
    weight carries Megatron's ``grad_added_to_main_grad`` flag the flag is set and a
    zero gradient is returned (Megatron's hook discards it); otherwise no gradient
    (``weight.grad`` stays None). Bias and input gradients are unchanged.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .devices import activation_dtype, no_autocast

__all__ = ["check_main_grad", "accumulate_into_main_grad", "linear_into_main_grad",
           "main_grad_placeholder"]

_MAIN_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_main_grad(api: str, weight: torch.Tensor) -> None:
    """A forward that will build a wgrad needs ``weight.main_grad`` to add it into."""
    if not (torch.is_grad_enabled() and weight.requires_grad):
        return
    main_grad = getattr(weight, "main_grad", None)
    if not torch.is_tensor(main_grad):
        raise ValueError(f"{api}: fuse_wgrad_accumulation=True accumulates the weight gradient "
                         "into weight.main_grad, but the weight has none; give each weight a "
                         f"main_grad buffer of its shape {tuple(weight.shape)} (Megatron's "
                         "DistributedDataParallel does) or build the module with "
                         "fuse_wgrad_accumulation=False")
    if main_grad.shape != weight.shape or main_grad.dtype not in _MAIN_GRAD_DTYPES \
            or main_grad.device != weight.device:
        raise ValueError(f"{api}: weight.main_grad must be a float32, bfloat16 or float16 tensor "
                         f"of the weight's shape {tuple(weight.shape)} on {weight.device}, got "
                         f"{main_grad.dtype} of shape {tuple(main_grad.shape)} on "
                         f"{main_grad.device}")


def accumulate_into_main_grad(weight: torch.Tensor, wgrad32: torch.Tensor
                              ) -> Optional[torch.Tensor]:
    """``weight.main_grad += wgrad32``; returns what autograd gets for the weight
    (NOTE [Fused wgrad accumulation])."""
    weight.main_grad.add_(wgrad32)
    return main_grad_placeholder(weight)


def main_grad_placeholder(weight: torch.Tensor) -> Optional[torch.Tensor]:
    """What autograd gets for a weight whose wgrad goes into ``main_grad`` (NOTE [Fused
    wgrad accumulation]), with Megatron's flag set where it has one."""
    if hasattr(weight, "grad_added_to_main_grad"):
        weight.grad_added_to_main_grad = True
        return torch.zeros_like(weight)
    return None


class _LinearIntoMainGrad(torch.autograd.Function):
    """``y = x W^T + b`` in high precision whose wgrad goes into ``W.main_grad``.

    The operands are taken in the activation dtype (the ``torch.autocast`` dtype when
    autocast is on, as ``F.linear`` would); the wgrad GEMM runs on them upcast to
    float32, where their products are exact and the sum is accumulated in float32.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                out_dtype: torch.dtype, wgrad_store=None):
        with no_autocast(x.device.type):
            x_c, w_c = x.to(out_dtype), weight.to(out_dtype)
            b_c = bias.to(out_dtype) if bias is not None else None
            y = F.linear(x_c, w_c, b_c)
        ctx.save_for_backward(x_c, w_c)
        ctx.weight, ctx.x_dtype, ctx.wgrad_store = weight, x.dtype, wgrad_store
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x_c, w_c = ctx.saved_tensors
        dgrad = wgrad = dbias = None
        with no_autocast(dy.device.type):
            dy2d = dy.reshape(-1, dy.shape[-1])
            if ctx.needs_input_grad[0]:
                dgrad = (dy @ w_c).to(ctx.x_dtype)
            if ctx.needs_input_grad[1]:
                x2d, weight = x_c.reshape(-1, x_c.shape[-1]), ctx.weight

                def wgrad_into_main_grad():
                    wgrad32 = dy2d.t().to(torch.float32) @ x2d.to(torch.float32)
                    return accumulate_into_main_grad(weight, wgrad32)
                if ctx.wgrad_store is None:
                    wgrad = wgrad_into_main_grad()
                else:       # NOTE [Delayed wgrad] in delayed_wgrad.py
                    ctx.wgrad_store.put(wgrad_into_main_grad)
                    wgrad = main_grad_placeholder(weight)
            if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
                dbias = dy2d.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        return dgrad, wgrad, dbias, None, None


def linear_into_main_grad(x: torch.Tensor, weight: torch.Tensor,
                          bias: Optional[torch.Tensor], wgrad_store=None) -> torch.Tensor:
    """The high-precision linear of a module built with ``fuse_wgrad_accumulation``
    (its wgrad deferred into ``wgrad_store`` when given: NOTE [Delayed wgrad])."""
    return _LinearIntoMainGrad.apply(x, weight, bias, activation_dtype(x), wgrad_store)
