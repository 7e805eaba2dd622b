"""The backward of an FP8 linear layer under a recipe's ``backward_override``: its
dgrad and wgrad GEMMs in high precision.

NOTE [Backward override]
    TE's recipes (current and block scaling; delayed scaling takes only None) carry
    ``backward_override`` (``NVTE_BACKWARD_OVERRIDE``). None is the FP8 backward: the
    output gradient quantized, FP8 dgrad and wgrad GEMMs (NOTE [GEMM vocabulary] in
    quantize.py). Otherwise the forward GEMM stays FP8 and the backward is computed in
    the activation dtype (the forward's output dtype, the dtype of ``dy``), with ``dy``
    not quantized, so no gradient amax is taken:

    "high_precision"  the forward keeps the operands as they entered it: the input
                      ``x`` and the weight (an FP8 primary weight dequantized);
                      ``dx = dy W`` and ``dW = dy^T x``.
    "dequantized"     the forward keeps the FP8 operands of its own GEMM, rowwise only
                      (no transposed copies are made): ``dx = dy deq(W_fp8)`` and
                      ``dW = dy^T deq(x_fp8)``, the very values the forward multiplied.

    The dgrad is returned in the input's dtype and the wgrad in the weight's, as the
    FP8 backward does; a fused wgrad accumulation adds a float32 wgrad to
    ``weight.main_grad``. The bias gradient is the same in every mode. Every module
    built on `fp8_linear` (``Linear``, ``LayerNormLinear``, ``LayerNormMLP``,
    ``GroupedLinear``, the layers made of them) follows the recipe; TE refuses it in
    ``LayerNormMLP``, which here runs it like the others.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..tensor import QuantizedTensor
from .main_grad import accumulate_into_main_grad

__all__ = ["backward_override", "operands_to_save", "override_grads"]


def backward_override(recipe) -> Optional[str]:
    """The recipe's ``backward_override`` (None for a recipe without the field)."""
    return getattr(recipe, "backward_override", None)


def operands_to_save(mode: str, x: torch.Tensor, weight: torch.Tensor, x_fp8, w_fp8,
                     need_dgrad: bool, need_wgrad: bool):
    """``(x operand, W operand)`` the backward of ``mode`` reads (None where no
    gradient needs it): the high-precision tensors or the forward's FP8 operands."""
    if mode == "high_precision":
        return (x if need_wgrad else None), (weight if need_dgrad else None)
    return (x_fp8 if need_wgrad else None), (w_fp8 if need_dgrad else None)


def _high_precision(operand, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """An operand the backward multiplies, as a plain tensor of ``dtype``."""
    if operand is None:
        return None
    if isinstance(operand, QuantizedTensor):
        return operand.plain(dtype)
    if isinstance(operand, torch.Tensor):
        return operand.detach().to(dtype)
    return operand.dequantize(dtype)        # Float8Data / BlockScaledData


def override_grads(dy: torch.Tensor, x_operand, w_operand, x_dtype: torch.dtype,
                   w_dtype: torch.dtype, main_grad_weight: Optional[torch.Tensor]
                   ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``(dgrad, wgrad)`` of NOTE [Backward override], each None where its operand was
    not kept. ``dy`` [M, N] is in the activation dtype."""
    act = dy.dtype
    dgrad = wgrad = None
    w = _high_precision(w_operand, act)
    if w is not None:
        dgrad = torch.mm(dy, w).to(x_dtype)
    if x_operand is not None:
        if main_grad_weight is None:
            wgrad = torch.mm(dy.t(), _high_precision(x_operand, act)).to(w_dtype)
        else:       # NOTE [Fused wgrad accumulation] in main_grad.py
            wgrad32 = torch.mm(dy.t().to(torch.float32),
                               _high_precision(x_operand, torch.float32))
            wgrad = accumulate_into_main_grad(main_grad_weight, wgrad32)
    return dgrad, wgrad
