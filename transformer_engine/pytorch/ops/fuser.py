"""The operation fuser: how a run of fusible operations is grouped, fused and run;
TE's fusion registries (`register_forward_fusion`, `register_backward_fusion`,
`register_forward_backward_fusion`).

NOTE [Fusion passes]
    As in TE, a fusion function is ``func(ops, *, recipe) -> ops``: it takes the list
    of operations and returns it with runs of basic operations replaced by fused
    operations. The passes: the package's own fusions (fused/), then the registered
    forward-and-backward fusions; on that list the registered forward-only fusions
    make the forward list and the backward-only fusions the backward list. The
    lists are made again when the recipe class, the backward override, the first
    operation that needs a backward, or a delayed recipe's history length changes.

    Running: native operations (NOTE [Two ways an operation runs] in op.py) run one
    after the other in the autograd graph. A run of other operations runs inside one
    autograd Function: their ``fuser_forward`` in order, then their
    ``fuser_backward`` in reverse; a backward-only fused operation is used when all
    its basic operations are in that run, else its basic operations' backwards are.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch

from ..fp8 import FP8GlobalStateManager
from .op import BasicOperation, FusedOperation, FusibleOperation, OperationContext

__all__ = ["OperationFuser", "register_forward_fusion", "register_backward_fusion",
           "register_forward_backward_fusion"]

OperationFusionFunction = Callable[..., List[FusibleOperation]]


def _add(registry: list, func, prepend: bool, api: str) -> None:
    if not callable(func):
        raise TypeError(f"te.ops.{api}: op_fusion_func must be callable func(ops, *, recipe), "
                        f"got {type(func).__name__}")
    if prepend:
        registry.insert(0, func)
    else:
        registry.append(func)


def register_forward_backward_fusion(op_fusion_func: OperationFusionFunction,
                                     prepend: bool = False) -> None:
    """Register a fusion whose fused operations implement both the forward and the
    backward (NOTE [Fusion passes]); ``prepend``: apply it before the others."""
    _add(OperationFuser.forward_backward_fusion_functions, op_fusion_func, prepend,
         "register_forward_backward_fusion")


def register_forward_fusion(op_fusion_func: OperationFusionFunction,
                            prepend: bool = False) -> None:
    """Register a forward-only fusion: its fused operations' forward must save, in each
    basic operation's context, what the basic operations' backwards read."""
    _add(OperationFuser.forward_fusion_functions, op_fusion_func, prepend,
         "register_forward_fusion")


def register_backward_fusion(op_fusion_func: OperationFusionFunction,
                             prepend: bool = False) -> None:
    """Register a backward-only fusion: its fused operations' backward reads what the
    basic operations' forwards saved."""
    _add(OperationFuser.backward_fusion_functions, op_fusion_func, prepend,
         "register_backward_fusion")


def _package_fusions():
    from .fused import PACKAGE_FUSIONS
    return PACKAGE_FUSIONS


def _covered(fused_ops, basic_ops) -> List[Tuple[FusibleOperation, List[int]]]:
    """Each operation of ``fused_ops`` with the indices of the basic operations it
    covers; an error when they do not expand to ``basic_ops`` in order."""
    out, idx = [], 0
    for op in fused_ops:
        members = list(op.basic_ops) if isinstance(op, FusedOperation) else [op]
        idxs = []
        for member in members:
            if idx >= len(basic_ops) or member is not basic_ops[idx]:
                raise RuntimeError(
                    "te.ops: a fusion function returned operations that do not cover the basic "
                    f"operations in order (basic: {[type(o).__name__ for o in basic_ops]}, "
                    f"fused: {[type(o).__name__ for o in fused_ops]})")
            idxs.append(idx)
            idx += 1
        out.append((op, idxs))
    if idx != len(basic_ops):
        raise RuntimeError("te.ops: a fusion function dropped basic operations "
                           f"({[type(o).__name__ for o in basic_ops]} became "
                           f"{[type(o).__name__ for o in fused_ops]})")
    return out


class OperationFuser:
    """Runs a list of fusible operations, fused (NOTE [Fusion passes])."""

    forward_backward_fusion_functions: List[OperationFusionFunction] = []
    forward_fusion_functions: List[OperationFusionFunction] = []
    backward_fusion_functions: List[OperationFusionFunction] = []

    def __init__(self, ops: List[FusibleOperation]):
        basic = []
        for op in ops:
            if not isinstance(op, FusibleOperation):
                raise TypeError(f"te.ops: expected fusible operations, got {type(op).__name__}")
            basic.extend(op.basic_ops if op.is_fused_op else [op])
        self._basic_ops: List[BasicOperation] = basic
        self.num_extra_inputs = sum(op.num_extra_inputs for op in basic)
        self._key = None
        self._forward_ops = self._backward_ops = None

    def _fuse(self, recipe, first_grad: int) -> None:
        key = (type(recipe), getattr(recipe, "backward_override", None), first_grad,
               recipe.amax_history_len if recipe is not None and recipe.delayed() else 0)
        if key == self._key:
            return
        if self._key is None:
            for op in self._basic_ops:
                op.pre_first_fuser_forward()
        ops = list(self._basic_ops)
        for func in _package_fusions():
            ops = func(ops, recipe=recipe)
        for func in OperationFuser.forward_backward_fusion_functions:
            ops = func(ops, recipe=recipe)
        fwd, bwd = list(ops), list(ops)
        for func in OperationFuser.forward_fusion_functions:
            fwd = func(fwd, recipe=recipe)
        for func in OperationFuser.backward_fusion_functions:
            bwd = func(bwd, recipe=recipe)
        self._forward_ops = _covered(fwd, self._basic_ops)
        self._backward_ops = _covered(bwd, self._basic_ops)
        self._key = key

    def _first_needing_grad(self, x, extra) -> int:
        if not torch.is_grad_enabled():
            return len(self._basic_ops)
        if x.requires_grad:
            return 0
        for i, op in enumerate(self._basic_ops):
            if any(p.requires_grad for p in op.parameters()) or \
                    any(t is not None and t.requires_grad for t in extra[i]):
                return i
        return len(self._basic_ops)

    def __call__(self, input: torch.Tensor, *extra_inputs: torch.Tensor,  # noqa: A002
                 basic_op_kwargs: Optional[List[dict]] = None):
        if not torch.is_tensor(input):
            raise TypeError(f"te.ops: the input must be a tensor, got {type(input).__name__}")
        if len(extra_inputs) != self.num_extra_inputs:
            raise ValueError(f"te.ops: expected {self.num_extra_inputs} extra inputs "
                             f"(one per AddExtraInput-like operation), got {len(extra_inputs)}")
        n = len(self._basic_ops)
        if basic_op_kwargs is None:
            basic_op_kwargs = [{} for _ in range(n)]
        extra, pos = [], 0
        for op in self._basic_ops:
            extra.append(tuple(extra_inputs[pos:pos + op.num_extra_inputs]))
            pos += op.num_extra_inputs
        recipe = FP8GlobalStateManager.get_fp8_recipe() \
            if FP8GlobalStateManager.is_fp8_enabled() else None
        first_grad = self._first_needing_grad(input, extra)
        self._fuse(recipe, first_grad)
        for i, op in enumerate(self._basic_ops):
            op.pre_fuser_forward(requires_grad=i >= first_grad)
        x, outs = input, [() for _ in range(n)]
        segment: List[Tuple[FusibleOperation, List[int]]] = []
        for op, idxs in self._forward_ops:
            if op.native_forward is not None:
                x = self._run_generic(segment, x, extra, outs, basic_op_kwargs, first_grad)
                segment = []
                y, op_outs = op.native_forward(x, [extra[i] for i in idxs],
                                               [basic_op_kwargs[i] for i in idxs])
                for i, o in zip(idxs, op_outs):
                    outs[i] = tuple(o)
                x = y
            else:
                segment.append((op, idxs))
        x = self._run_generic(segment, x, extra, outs, basic_op_kwargs, first_grad)
        flat = [t for o in outs for t in o]
        return (x, *flat) if flat else x

    def _run_generic(self, segment, x, extra, outs, kwargs, first_grad):
        if not segment:
            return x
        lo, hi = segment[0][1][0], segment[-1][1][-1] + 1
        bwd = []
        for op, idxs in self._backward_ops:
            if idxs[0] >= lo and idxs[-1] < hi:
                bwd.append((op, idxs))
            elif idxs[-1] >= lo and idxs[0] < hi:     # straddles: the basic backwards
                bwd.extend((self._basic_ops[i], [i]) for i in idxs if lo <= i < hi)
        run = _GenericRun(self._basic_ops, segment, bwd, lo, hi, extra, kwargs,
                          requires_grad=hi > first_grad)
        params = [p for i in range(lo, hi) for p in self._basic_ops[i].parameters()]
        flat_extra = [t for i in range(lo, hi) for t in extra[i]]
        if torch.is_grad_enabled():
            results = _GenericFunction.apply(x, run, *params, *flat_extra)
        else:
            results = _GenericFunction.forward(None, x, run, *params, *flat_extra)
        y, rest = results[0], list(results[1:])
        for i in range(lo, hi):
            k = self._basic_ops[i].num_extra_outputs
            outs[i], rest = tuple(rest[:k]), rest[k:]
        return y


class _GenericRun:
    """The non-tensor arguments of one `_GenericFunction` call."""

    def __init__(self, basic_ops, fwd, bwd, lo, hi, extra, kwargs, requires_grad):
        self.basic_ops, self.fwd, self.bwd, self.lo, self.hi = basic_ops, fwd, bwd, lo, hi
        self.extra, self.kwargs = extra, kwargs
        self.ctxs = [OperationContext(requires_grad) for _ in range(lo, hi)]
        self.num_params = [len(list(basic_ops[i].parameters())) for i in range(lo, hi)]


class _BackwardContext:
    """An operation's context as its backward sees it: the forward's context with the
    saved tensors. A new object, not the forward's context written to: dynamo cannot
    trace a backward that writes to an object made outside it (torch.compile)."""

    def __init__(self, forward_ctx: OperationContext, saved_tensors: tuple):
        self.forward_ctx = forward_ctx
        self.saved_tensors = saved_tensors

    def __getattr__(self, name: str):
        return getattr(self.forward_ctx, name)


class _GenericFunction(torch.autograd.Function):
    """A run of operations that compute their own gradients (NOTE [Fusion passes])."""

    @staticmethod
    def forward(ctx, x, run: _GenericRun, *tensors):
        lo, extra = run.lo, run.extra
        outs = [() for _ in range(lo, run.hi)]
        for op, idxs in run.fwd:
            x, op_outs = op.fuser_forward(
                [run.ctxs[i - lo] for i in idxs], x,
                basic_op_extra_inputs=[extra[i] for i in idxs],
                prev_op_grad_output_quantizer=None, next_op_input_quantizer=None,
                basic_op_kwargs=[run.kwargs[i] for i in idxs])
            for i, o in zip(idxs, op_outs):
                outs[i - lo] = tuple(o)
        if ctx is not None:
            to_save, ranges = [], []
            for c in run.ctxs:
                saved = tuple(c.to_save or ())
                ranges.append((len(to_save), len(to_save) + len(saved)))
                to_save.extend(saved)
                c.to_save = None
            ctx.save_for_backward(*to_save)
            ctx.run, ctx.ranges = run, ranges
            ctx.num_extra_out = [len(o) for o in outs]
        return (x, *[t for o in outs for t in o])

    @staticmethod
    def backward(ctx, dy, *grad_extra_out):
        run, lo = ctx.run, ctx.run.lo
        saved = ctx.saved_tensors
        ctxs = [_BackwardContext(c, saved[a:b]) for c, (a, b) in zip(run.ctxs, ctx.ranges)]
        grad_extra_out, per_op = list(grad_extra_out), []
        for k in ctx.num_extra_out:
            per_op.append(tuple(grad_extra_out[:k]))
            grad_extra_out = grad_extra_out[k:]
        grad_params = [None] * (run.hi - lo)
        grad_extra_in = [None] * (run.hi - lo)
        for op, idxs in reversed(run.bwd):
            dy, gp, ge = op.fuser_backward(
                [ctxs[i - lo] for i in idxs], dy,
                basic_op_grad_extra_outputs=[per_op[i - lo] for i in idxs])
            for i, p, e in zip(idxs, gp, ge):
                grad_params[i - lo], grad_extra_in[i - lo] = p, e
        flat = []
        for j, n in enumerate(run.num_params):
            g = list(grad_params[j] or ())
            flat.extend(g + [None] * (n - len(g)))
        for j in range(run.hi - lo):
            n = run.basic_ops[lo + j].num_extra_inputs
            g = list(grad_extra_in[j] or ())
            flat.extend(g + [None] * (n - len(g)))
        return (dy, None, *flat)
