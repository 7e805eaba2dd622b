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

__all__ = ["WeightGradStore", "accumulate_grad", "capture_output_grad"]


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
    """``param.grad += grad`` as autograd accumulates (the first gradient is taken as is)."""
    if param.grad is None:
        param.grad = grad.detach()
    else:
        param.grad = param.grad + grad


class _CaptureGrad(torch.autograd.Function):
    """Identity whose backward hands the gradient passing through to ``sink``."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, sink: Callable[[torch.Tensor], None]):
        ctx.sink = sink
        return y.view_as(y)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        ctx.sink(dy)
        return dy, None


def capture_output_grad(y: torch.Tensor, sink: Callable[[torch.Tensor], None]
                        ) -> torch.Tensor:
    """``y`` whose gradient, when backward reaches it, is handed to ``sink``."""
    return _CaptureGrad.apply(y, sink)


def deferred_linear_wgrad(store: WeightGradStore, x: torch.Tensor, weight: torch.Tensor,
                          out_dtype: torch.dtype) -> Callable[[torch.Tensor], None]:
    """The sink of a high-precision ``F.linear(x, weight.detach(), b)`` output: it
    stores the wgrad GEMM ``dy^T x``, in the operand order and dtype autograd's
    derivative of ``F.linear`` uses (``x`` taken in the activation dtype
    ``out_dtype``, as ``torch.autocast`` gives it), the result rounded to the weight's
    dtype as autograd's cast back does."""
    x2d = x.detach().to(out_dtype).reshape(-1, x.shape[-1])

    def sink(dy: torch.Tensor) -> None:
        dy2d = dy.reshape(-1, dy.shape[-1])

        def compute() -> None:
            accumulate_grad(weight, dy2d.t().mm(x2d).to(weight.dtype))
        store.put(compute)
    return sink


def optional_store(delay: bool) -> Optional[WeightGradStore]:
    return WeightGradStore(True) if delay else None
