"""``delay_wgrad_compute``: a module's backward computes the input (and bias) gradients
only, and ``module.backward_dw()`` computes the weight gradients later.

NOTE [Delayed wgrad]
    A module built with ``delay_wgrad_compute=True`` (TE's argument; pipeline
    schedules use it to fill bubbles) keeps, in each backward, what its wgrad GEMM
    reads (the FP8 ``dy^T`` and ``x^T`` operands, or the high-precision ``dy`` and
    ``x``) in its `WeightGradStore` instead of running that GEMM, and gives autograd
    no weight gradient (with ``fuse_wgrad_accumulation``, what it gives without the
    delay: nothing, or Megatron's zero placeholder). ``module.backward_dw()`` then
    runs every pending wgrad GEMM, oldest first, the same GEMM on the same operands
    as the undelayed backward, and delivers each result where that backward would
    have: added into ``weight.main_grad`` with ``fuse_wgrad_accumulation``, else
    accumulated into ``weight.grad`` as autograd accumulates. So after
    ``backward_dw()`` every gradient equals the undelayed run's bit for bit. Bias
    gradients are computed in the backward itself (from ``dy``, which it has). Then
    the hooks of ``register_wgrad_accumulation_and_reduce_hooks`` run (Megatron's
    gradient reduction).
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Optional

import torch
import torch.nn.functional as F

__all__ = ["WeightGradStore", "accumulate_grad", "deferred_linear"]


class WeightGradStore:
    """The pending wgrad computations of one module, oldest first (TE's name). Each is
    a closure that computes one GEMM's weight gradient and delivers it."""

    def __init__(self, delay_wgrad_compute: bool):
        self._delay = bool(delay_wgrad_compute)
        self._pending = deque()

    def delay_wgrad_compute(self) -> bool:
        """TE's query: whether the module defers its wgrad GEMMs."""
        return self._delay

    def put(self, compute: Callable[[], None]) -> None:
        self._pending.append(compute)

    def pending(self) -> int:
        """How many wgrad computations wait for ``backward_dw()``."""
        return len(self._pending)

    def run_all(self) -> None:
        """Run every pending computation, oldest first."""
        while self._pending:
            self._pending.popleft()()


def accumulate_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """``param.grad += grad`` as autograd accumulates (the first gradient is taken as is).
    A slice of a single grouped parameter accumulates into its slot of the parameter's
    gradient (NOTE [Single grouped parameters] in grouped_params.py)."""
    slot = getattr(param, "grouped_grad_slot", None)
    if slot is not None:
        packed, index = slot
        if packed.grad is None:
            packed.grad = torch.zeros_like(packed)
        packed.grad[index] += grad
        return
    if param.grad is None:
        param.grad = grad.detach()
    else:
        param.grad = param.grad + grad


class _DeferredLinearWgrad(torch.autograd.Function):
    """Identity on ``y``, the output of ``F.linear(x, weight.detach(), bias)``, whose
    backward stores the wgrad GEMM of that linear in ``store``. ``x_c`` is the input
    in the activation dtype, saved for backward like any activation (so a checkpoint
    drops and recomputes it)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, x_c: torch.Tensor, weight: torch.Tensor,
                store: WeightGradStore):
        ctx.save_for_backward(x_c)
        ctx.weight, ctx.store = weight, store
        return y.view_as(y)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (x_c,) = ctx.saved_tensors
        x2d, dy2d = x_c.reshape(-1, x_c.shape[-1]), dy.reshape(-1, dy.shape[-1])
        weight = ctx.weight

        def compute() -> None:
            # the GEMM autograd's derivative of F.linear runs for the weight (the same
            # operands and layouts: the same bits), rounded to the weight's dtype as
            # autograd's cast back from the autocast dtype does
            accumulate_grad(weight, dy2d.t().mm(x2d).to(weight.dtype))
        ctx.store.put(compute)
        return dy, None, None, None


def deferred_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                    weight_value: torch.Tensor, store: WeightGradStore,
                    act_dtype: torch.dtype) -> torch.Tensor:
    """``F.linear(x, weight_value, bias)`` in high precision whose wgrad goes to
    ``store`` for ``weight`` (``weight_value``: the weight's value, e.g. an FP8
    primary weight dequantized); input and bias gradients come from autograd's own
    derivative of ``F.linear``, as without the delay."""
    y = F.linear(x, weight_value.detach(), bias)
    return _DeferredLinearWgrad.apply(y, x.detach().to(act_dtype), weight, store)
