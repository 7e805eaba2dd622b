"""Results of this package's ``autograd.Function`` forwards that dynamo can trace
correctly: made by exactly one op.

NOTE [Fresh function results]
    A tensor an ``autograd.Function`` forward returns must be made by exactly one op
    of that forward while dynamo traces it: not changed in place afterwards (``out.add_``)
    and not passed through an op that returns its input unchanged (``.to`` of the same
    dtype, ``.contiguous()`` of a contiguous tensor). torch 2.11's dynamo hands every
    intermediate of a traced forward out of the function as an extra output, so such a
    tensor leaves it twice; autograd then wires its gradient edge to the later copy and
    the function's backward receives zeros for the real one: a silently zero gradient
    (torch 2.12 filters those aliases). `add_into` / `mul_into` change the result in
    place in eager mode (no new buffer) and make a new tensor while dynamo traces
    (Inductor fuses it); `cast_to` skips a cast to the dtype a tensor already has.
    ``test_autograd_functions_return_fresh_tensors`` finds a returned tensor that
    another op of a traced forward also produced, on any torch.
"""

from __future__ import annotations

import torch

__all__ = ["add_into", "mul_into", "cast_to"]


def add_into(out: torch.Tensor, other) -> torch.Tensor:
    """``out + other``: into ``out`` in eager mode, a new tensor while dynamo traces."""
    return out + other if torch.compiler.is_compiling() else out.add_(other)


def mul_into(out: torch.Tensor, other) -> torch.Tensor:
    """``out * other``: into ``out`` in eager mode, a new tensor while dynamo traces."""
    return out * other if torch.compiler.is_compiling() else out.mul_(other)


def cast_to(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)``, no op at all where ``t`` has that dtype."""
    return t if t.dtype == dtype else t.to(dtype)
