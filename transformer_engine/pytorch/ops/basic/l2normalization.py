"""TE's ``L2Normalization`` operation: each vector over the last dimension scaled to
unit L2 norm, ``y = x / sqrt(sum(x**2) + eps)``, with no parameters.

Computed in float32 and rounded once to the input's dtype (as TE computes it); the
gradient is autograd's through the same float32 expression. It is the one operation
of TE's fusible-operations API built here, because `MultiheadAttention` uses it as
the query/key normalization ``qk_norm_type="L2Normalization"``; it runs as an
ordinary module (``op(x)``), not inside a ``te.ops.Sequential``.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...utils import check_eps

__all__ = ["L2Normalization"]


class L2Normalization(torch.nn.Module):
    """``y = x / sqrt(sum(x**2, dim=-1) + eps)``, parameter-free.

    Parameters
    ----------
    eps : float, default 1e-6
        Added to the sum of squares.
    seq_length, micro_batch_size : int, optional
        TE's JIT warm-up hints: accepted, no effect here.
    """

    def __init__(self, *, eps: float = 1e-6, seq_length: Optional[int] = None,
                 micro_batch_size: Optional[int] = None) -> None:
        super().__init__()
        self.eps = check_eps("te.ops.L2Normalization", eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_tensor(x) or not x.is_floating_point():
            raise TypeError("te.ops.L2Normalization: the input must be a floating-point tensor, "
                            f"got {x.dtype if torch.is_tensor(x) else type(x).__name__}")
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.square().sum(dim=-1, keepdim=True) + self.eps)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"eps={self.eps}"
