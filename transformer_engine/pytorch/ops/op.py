"""The operation classes of TE's fusible-operations API: `FusibleOperation`,
`BasicOperation` (one operation, which owns parameters and state), `FusedOperation`
(a run of basic operations computed together), and `OperationContext`.

NOTE [Two ways an operation runs]
    TE's contract for an operation written outside the package is the pair
    ``op_forward(ctx, input_, ...)`` / ``op_backward(ctx, grad_output)`` (or, for
    extra tensors and fused operations, ``fuser_forward`` / ``fuser_backward``): the
    operation saves what it needs in an `OperationContext` and computes its own
    gradients. The fuser (fuser.py) runs a run of such operations inside one autograd
    Function, as TE does.

    The package's own operations are *native*: their ``native_forward`` builds the
    autograd graph through the package's FP8 autograd functions (the FP8 linear of
    te.Linear, the normalization and activation functions and, on CUDA, the fused
    producers of te.LayerNormMLP), so an operation computes exactly what the module it
    mirrors computes, and te.checkpoint's saved-tensor hooks, its recompute stashes,
    CUDA graphs and torch.compile see the same functions they see for the modules.
    Called the TE way (``op_forward`` / ``op_backward``, from a fused operation
    written outside the package), a native operation runs ``native_forward`` on a
    detached input under grad mode and differentiates that small graph.
"""

from __future__ import annotations

from typing import Any, Iterable, List, Optional, Sequence

import torch

__all__ = ["OperationContext", "FusibleOperation", "BasicOperation", "FusedOperation"]


class OperationContext:
    """What one operation call keeps from its forward for its backward (TE's class):
    ``save_for_backward(*tensors)`` in the forward, ``saved_tensors`` in the backward;
    other attributes may be set freely. ``requires_grad``: whether a backward will run."""

    def __init__(self, requires_grad: bool = True):
        self.saved_tensors: Optional[tuple] = None
        self.to_save: Optional[tuple] = None
        self.requires_grad = requires_grad

    def save_for_backward(self, *tensors: Optional[torch.Tensor]) -> None:
        """Keep ``tensors`` for the backward (read there as ``saved_tensors``)."""
        self.to_save = tensors


class FusibleOperation(torch.nn.Module):
    """An operation the fuser of `te.ops.Sequential` may run alone or fused with its
    neighbours (TE's base class). Subclass `BasicOperation` or `FusedOperation`."""

    # the package's autograd-native forward (NOTE [Two ways an operation runs]); None:
    # the operation runs through fuser_forward / fuser_backward
    native_forward = None

    @property
    def is_fused_op(self) -> bool:
        """Whether this operation stands for several basic operations."""
        raise NotImplementedError(f"{type(self).__name__}: subclass BasicOperation or "
                                  "FusedOperation, not FusibleOperation")

    def pre_first_fuser_forward(self) -> None:
        """Hook run once, before the first fuser forward that includes this operation."""

    def pre_fuser_forward(self, *, requires_grad: bool) -> None:
        """Hook run before every fuser forward; ``requires_grad``: a backward will run."""

    def get_input_quantizer(self):
        """TE's quantizer of this operation's input: None here, where FP8 casts are
        made inside the operations that consume FP8 operands (the FP8 linear)."""
        return None

    def get_grad_output_quantizer(self):
        """TE's quantizer of this operation's output gradient: None (see
        `get_input_quantizer`)."""
        return None

    def fuser_forward(self, basic_op_ctxs: List[OperationContext], input_: torch.Tensor, *,
                      basic_op_extra_inputs: Sequence[Sequence[Optional[torch.Tensor]]],
                      prev_op_grad_output_quantizer, next_op_input_quantizer,
                      basic_op_kwargs: List[dict]):
        """Forward of this operation (TE's signature): ``(output, extra outputs of each
        basic operation)``. The quantizer arguments are None in this package."""
        raise NotImplementedError(f"{type(self).__name__}: the forward pass is not implemented "
                                  "(override fuser_forward, or op_forward in a BasicOperation)")

    def fuser_backward(self, basic_op_ctxs: List[OperationContext], grad_output: torch.Tensor,
                       *, basic_op_grad_extra_outputs: Sequence[Sequence[Optional[torch.Tensor]]]):
        """Backward of this operation (TE's signature): ``(grad_input, parameter
        gradients of each basic operation, extra-input gradients of each)``."""
        raise NotImplementedError(f"{type(self).__name__}: the backward pass is not implemented "
                                  "(override fuser_backward, or op_backward in a "
                                  "BasicOperation)")


class BasicOperation(FusibleOperation):
    """One operation: holds its parameters and state, even when a fused operation
    computes it. A subclass defines ``op_forward`` / ``op_backward`` (or
    ``fuser_forward`` / ``fuser_backward`` when it takes ``num_extra_inputs`` extra
    tensors or makes ``num_extra_outputs``)."""

    num_extra_inputs: int = 0
    num_extra_outputs: int = 0

    @property
    def is_fused_op(self) -> bool:
        return False

    def num_quantizers(self, mode: str) -> int:
        """How many FP8 tensors this operation quantizes in ``mode`` ("forward" or
        "backward"): 0 unless a subclass says otherwise."""
        if mode not in ("forward", "backward"):
            raise ValueError(f"{type(self).__name__}.num_quantizers: mode must be 'forward' or "
                             f"'backward', got {mode!r}")
        return 0

    def op_forward(self, ctx: OperationContext, input_: torch.Tensor, *,
                   prev_op_grad_output_quantizer=None, next_op_input_quantizer=None,
                   **kwargs: Any) -> torch.Tensor:
        """The output of this operation on ``input_``; keep what the backward needs in
        ``ctx``. A native operation runs its autograd forward (NOTE [Two ways an
        operation runs])."""
        if self.native_forward is None:
            raise NotImplementedError(f"{type(self).__name__}: op_forward is not implemented")
        x = input_.detach().requires_grad_(ctx.requires_grad and input_.is_floating_point())
        params = [p for p in self.parameters() if p.requires_grad]
        with torch.set_grad_enabled(ctx.requires_grad):
            y, _ = self.native_forward(x, [()], [kwargs])
        ctx.native_graph = (x, params, y) if ctx.requires_grad else None
        return y.detach()

    def op_backward(self, ctx: OperationContext, grad_output: torch.Tensor):
        """``(grad_input, parameter gradients)`` for this operation's output gradient."""
        if self.native_forward is None:
            raise NotImplementedError(f"{type(self).__name__}: op_backward is not implemented")
        x, params, y = ctx.native_graph
        ctx.native_graph = None
        wanted = [x] + params
        grads = torch.autograd.grad(y, wanted, grad_output, allow_unused=True)
        grad_params = [None] * len(list(self.parameters()))
        by_id = {id(p): g for p, g in zip(params, grads[1:])}
        for i, p in enumerate(self.parameters()):
            grad_params[i] = by_id.get(id(p))
        return grads[0], grad_params

    def fuser_forward(self, basic_op_ctxs, input_, *, basic_op_extra_inputs,
                      prev_op_grad_output_quantizer, next_op_input_quantizer, basic_op_kwargs):
        if self.num_extra_inputs or self.num_extra_outputs:
            raise RuntimeError(f"{type(self).__name__}: an operation with extra tensor inputs or "
                               "outputs must override fuser_forward, not op_forward")
        out = self.op_forward(basic_op_ctxs[0], input_,
                              prev_op_grad_output_quantizer=prev_op_grad_output_quantizer,
                              next_op_input_quantizer=next_op_input_quantizer,
                              **basic_op_kwargs[0])
        return out, [()]

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        if self.num_extra_inputs or self.num_extra_outputs:
            raise RuntimeError(f"{type(self).__name__}: an operation with extra tensor inputs or "
                               "outputs must override fuser_backward, not op_backward")
        grad_input, grad_params = self.op_backward(basic_op_ctxs[0], grad_output)
        return grad_input, [grad_params], [()]

    def forward(self, input: torch.Tensor, *extra_inputs: torch.Tensor,  # noqa: A002
                **kwargs: Any):
        """Run this operation alone (through a fuser of one operation)."""
        from .fuser import OperationFuser
        return OperationFuser([self])(input, *extra_inputs, basic_op_kwargs=[kwargs])


class FusedOperation(FusibleOperation):
    """Several consecutive basic operations computed together. It holds no parameters
    or state of its own: those stay in ``basic_ops``.

    Parameters
    ----------
    basic_ops : iterable of BasicOperation
        The operations this one replaces, in order.
    """

    def __init__(self, basic_ops: Iterable[FusibleOperation]):
        super().__init__()
        ops = list(basic_ops)
        if not ops:
            raise ValueError(f"{type(self).__name__}: basic_ops must name at least one "
                             "basic operation, got none")
        for op in ops:
            if not isinstance(op, BasicOperation):
                raise TypeError(f"{type(self).__name__}: basic_ops must be BasicOperation "
                                f"instances, got {type(op).__name__}")
        self.basic_ops = torch.nn.ModuleList(ops)

    @property
    def is_fused_op(self) -> bool:
        return True

    def get_input_quantizer(self):
        return self.basic_ops[0].get_input_quantizer()

    def get_grad_output_quantizer(self):
        return self.basic_ops[-1].get_grad_output_quantizer()

    def pre_first_fuser_forward(self) -> None:
        for op in self.basic_ops:
            op.pre_first_fuser_forward()

    def pre_fuser_forward(self, *, requires_grad: bool) -> None:
        for op in self.basic_ops:
            op.pre_fuser_forward(requires_grad=requires_grad)

    def forward(self, input: torch.Tensor, *extra_inputs: torch.Tensor,  # noqa: A002
                basic_op_kwargs: Optional[List[dict]] = None):
        """Run the basic operations (through a fuser of this one operation)."""
        from .fuser import OperationFuser
        if basic_op_kwargs is None:
            basic_op_kwargs = [{} for _ in self.basic_ops]
        return OperationFuser([self])(input, *extra_inputs, basic_op_kwargs=basic_op_kwargs)
