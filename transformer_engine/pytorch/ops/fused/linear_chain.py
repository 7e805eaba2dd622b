"""The package's fused operation: a chain ``[norm] -> BasicLinear -> [Bias] ->
[activation -> BasicLinear -> [Bias]]`` computed as te.Linear, te.LayerNormLinear or
te.LayerNormMLP compute it.

NOTE [Operation chains as modules]
    A `BasicLinear` followed by a `Bias` is one FP8 linear with the bias added in the
    GEMM's epilogue (te.Linear's arithmetic, and its bias gradient). A norm before the
    first linear and an activation between two linears run as in te.LayerNormMLP: on
    CUDA, when the fused producers are on (NOTE [Fused producers] in
    module/fused_producers.py), the norm kernel writes the first linear's FP8 input,
    the activation kernel the second linear's, and the activation's backward kernel
    hands the first linear its FP8 output gradient; elsewhere the same functions as
    the unfused operations run. Each linear keeps its own FP8 state (its
    ``prepare_forward``), so a chain with the same weights and a fresh state gives
    te.LayerNormMLP's outputs, gradients and scales bit for bit: every slot of
    te.LayerNormMLP's state has the same slot here (FC1 input and weight in the first
    linear's forward slots 0 and 1, its output gradient in its backward slot 0; FC2's
    in the second linear's), and the delayed-scaling update treats slots one by one.
"""

from __future__ import annotations

import contextlib
from typing import List, Optional

import torch

from ...module.activations import fusable
from ...module.devices import activation_dtype
from ...module.fused_producers import (GradHandoff, act_cast_input, fused_producers_on,
                                       gemm_shapes_ok, norm_cast_input)
from ..basic.activation import ActivationOperation
from ..basic.basic_linear import BasicLinear
from ..basic.bias import Bias
from ..basic.layer_norm import NormOperation
from ..op import FusedOperation

__all__ = ["LinearChain", "fuse_linear_chains"]


class LinearChain(FusedOperation):
    """``[norm] -> linear1 -> [bias1] -> [act -> linear2 -> [bias2]]`` (NOTE [Operation
    chains as modules]); the optional members are None when absent."""

    def __init__(self, *, norm: Optional[NormOperation], linear1: BasicLinear,
                 bias1: Optional[Bias], act: Optional[ActivationOperation] = None,
                 linear2: Optional[BasicLinear] = None, bias2: Optional[Bias] = None):
        members = [norm, linear1, bias1, act, linear2, bias2]
        super().__init__([m for m in members if m is not None])
        # plain attributes (a tuple: not registered twice as submodules)
        self._members = tuple(members)

    def _norm_output(self, x: torch.Tensor, plan1):
        """``(ln_out, its FP8 copy or None)`` (te.LayerNormMLP's norm step)."""
        norm, linear1 = self._members[0], self._members[1]
        norm.check_input(x)
        width = norm.weight.numel()
        if (fused_producers_on(plan1, x)
                and gemm_shapes_ok(x.numel() // width, width, linear1.weight.shape[0])):
            return norm_cast_input(plan1, linear1.fp8_meta, x, norm.weight, norm.bias,
                                   norm._NORMALIZATION, norm.eps, norm.zero_centered_gamma,
                                   activation_dtype(x), write_y=False,
                                   transpose=linear1.weight.requires_grad
                                   and torch.is_grad_enabled())
        return norm.normalize(x), None

    def native_forward(self, x: torch.Tensor, extra_inputs: List[tuple], kwargs: List[dict]):
        norm, linear1, bias1, act, linear2, bias2 = self._members
        x = x.contiguous()      # NOTE [Contiguous module inputs] in module/base.py
        with contextlib.ExitStack() as stack:
            plan1 = stack.enter_context(linear1.prepare_forward(x))
            plan2 = stack.enter_context(linear2.prepare_forward(x)) if linear2 is not None \
                else None
            h, h_fp8 = self._norm_output(x, plan1) if norm is not None else (x, None)
            if act is None:
                out = linear1.linear(h, None if bias1 is None else bias1.bias, plan1,
                                     input_fp8=h_fp8)
            else:
                out = self._mlp(h, h_fp8, plan1, plan2)
        return out, [() for _ in self.basic_ops]

    def _mlp(self, h, h_fp8, plan1, plan2) -> torch.Tensor:
        """linear1 -> act -> linear2, as te.LayerNormMLP's ``_mlp``."""
        _, linear1, bias1, act, linear2, bias2 = self._members
        w1, w2 = linear1.weight, linear2.weight
        act_fused = (fusable(act.activation) and act.glu_interleave_size is None
                     and fused_producers_on(plan2, h)
                     and gemm_shapes_ok(h.numel() // max(w1.shape[1], 1), w1.shape[1],
                                        w1.shape[0], w2.shape[1]))
        handoff = GradHandoff() if act_fused else None
        fc1_out = linear1.linear(h, None if bias1 is None else bias1.bias, plan1,
                                 input_fp8=h_fp8, grad_handoff=handoff)
        act_fp8 = None
        if act_fused:
            act_out, act_fp8 = act_cast_input(
                plan2, linear2.fp8_meta, fc1_out, act.activation,
                transpose=w2.requires_grad and torch.is_grad_enabled(), handoff=handoff,
                fwd_index=0, bwd_index=0, bwd_fp8_meta=linear1.fp8_meta)
        else:
            act_out, _ = act.native_forward(fc1_out, [()], [{}])
        return linear2.linear(act_out, None if bias2 is None else bias2.bias, plan2,
                              input_fp8=act_fp8)


def _take(ops: list, i: int, cls):
    """``ops[i]`` if it is a ``cls`` (exactly one of the package's), else None."""
    return ops[i] if i < len(ops) and isinstance(ops[i], cls) else None


def fuse_linear_chains(ops: list, *, recipe=None) -> list:
    """The package's fusion function (``func(ops, *, recipe)``): each chain of basic
    operations that `LinearChain` computes becomes one."""
    out, i = [], 0
    while i < len(ops):
        j = i
        norm = _take(ops, j, NormOperation)
        j += norm is not None
        linear1 = _take(ops, j, BasicLinear)
        if linear1 is None:
            out.append(ops[i])
            i += 1
            continue
        j += 1
        bias1 = _take(ops, j, Bias)
        j += bias1 is not None
        act = _take(ops, j, ActivationOperation)
        linear2 = _take(ops, j + 1, BasicLinear) if act is not None else None
        bias2 = None
        if linear2 is not None:
            j += 2
            bias2 = _take(ops, j, Bias)
            j += bias2 is not None
        else:
            act = None
        if norm is None and bias1 is None and act is None:
            out.append(ops[i])          # a lone BasicLinear runs as itself
            i += 1
            continue
        out.append(LinearChain(norm=norm, linear1=linear1, bias1=bias1, act=act,
                               linear2=linear2, bias2=bias2))
        i = j
    return out
