"""`FusedSGD`: TE's SGD with momentum whose step updates all parameters of a group in a
few multi-tensor launches (`multi_tensor.multi_tensor_sgd`)."""

from __future__ import annotations

import warnings
from typing import Iterable, List, Optional

import torch
from torch.optim.optimizer import required

from . import multi_tensor as mt
from .multi_tensor_apply import multi_tensor_applier

__all__ = ["FusedSGD"]


class FusedSGD(torch.optim.Optimizer):
    """SGD with optional momentum, dampening, weight decay and Nesterov momentum, the
    update of ``torch.optim.SGD``: ``buf = momentum * buf + (1 - dampening) * grad``
    (``buf = grad`` on the first step), ``p -= lr * (grad + momentum * buf if nesterov
    else buf)``, with ``weight_decay * p`` added to the gradient first.

    Parameters
    ----------
    params, lr, momentum, dampening, weight_decay, nesterov : as torch.optim.SGD
    wd_after_momentum : bool, default False
        Add the weight decay after the momentum instead (to the update, not the buffer).
    materialize_master_grads : bool, default True
        With apex-style amp master weights (an ``_amp_stash`` on the optimizer): whether
        the gradients are read from the float32 masters (True) or from the float16 model
        parameters (False). Without a stash every parameter is updated from its own
        gradient and this has no effect.
    set_grad_none : bool, optional
        Deprecated (as in TE): pass ``set_to_none`` to `zero_grad` instead.
    """

    def __init__(self, params: Iterable, lr=required, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False, *,
                 wd_after_momentum: bool = False, materialize_master_grads: bool = True,
                 set_grad_none: Optional[bool] = None):
        if lr is not required and lr < 0.0:
            raise ValueError(f"FusedSGD: lr must be >= 0, got {lr}")
        if momentum < 0.0:
            raise ValueError(f"FusedSGD: momentum must be >= 0, got {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"FusedSGD: weight_decay must be >= 0, got {weight_decay}")
        if nesterov and (momentum <= 0.0 or dampening != 0.0):
            raise ValueError("FusedSGD: nesterov=True needs momentum > 0 and dampening == 0, "
                             f"got momentum={momentum}, dampening={dampening}")
        defaults = {"lr": lr, "momentum": momentum, "dampening": dampening,
                    "weight_decay": weight_decay, "nesterov": nesterov}
        super().__init__(params, defaults)
        self.wd_after_momentum = wd_after_momentum
        self.materialize_master_grads = materialize_master_grads
        self.most_recent_scale = 1.0
        self.scale_set_by_backward = False
        first = next((p for g in self.param_groups for p in g["params"]), None)
        device = first.device if first is not None else torch.device("cpu")
        self._dummy_overflow_buf = torch.zeros(1, dtype=torch.int32, device=device)
        self.set_grad_none = set_grad_none
        if set_grad_none is not None:
            warnings.warn("FusedSGD: set_grad_none is deprecated; pass set_to_none to "
                          "zero_grad instead", DeprecationWarning, stacklevel=2)

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("nesterov", False)

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """Drop (``set_to_none``, the default) or zero every gradient."""
        if self.set_grad_none is not None:
            if set_to_none is not None and set_to_none != self.set_grad_none:
                raise ValueError(f"FusedSGD.zero_grad: set_to_none={set_to_none} contradicts "
                                 f"set_grad_none={self.set_grad_none} given at construction")
            set_to_none = self.set_grad_none
        super().zero_grad(set_to_none=True if set_to_none is None else set_to_none)

    def get_momentums(self, params: List[torch.Tensor]):
        """The momentum buffers of ``params`` (created as zeros where missing), and
        whether this is their first step (then the kernel sets them to the gradients)."""
        buffers, first_run = [], True
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.data)
                first_run = True
            else:
                first_run = False
            buffers.append(state["momentum_buffer"])
        return buffers, first_run

    def _launch_sets(self, gid: int, group):
        stash = getattr(self, "_amp_stash", None)
        if stash is not None and hasattr(stash, "fp32_from_fp16_groups"):
            halves, masters = stash.fp16_groups[gid], stash.fp32_from_fp16_groups[gid]
            fp32 = [p for p in stash.fp32_from_fp32_groups[gid] if p.grad is not None]
            source = masters if self.materialize_master_grads else halves
            live = [i for i, p in enumerate(source) if p.grad is not None]
            from_half = [[source[i].grad for i in live], [masters[i] for i in live], None,
                         [halves[i] for i in live]]
            sets = [(from_half, [masters[i] for i in live]),
                    ([[p.grad for p in fp32], fp32, None], fp32)]
        else:
            by_dtype = {}
            for p in group["params"]:
                if p.grad is not None:
                    by_dtype.setdefault(p.dtype, []).append(p)
            sets = [([[p.grad for p in ps], [p.data for p in ps], None], ps)
                    for ps in by_dtype.values()]
        for lists, owners in sets:
            if owners:
                lists[2], first_run = self.get_momentums(owners)
                yield lists, first_run

    def step(self, closure=None):
        """One SGD step of every parameter with a gradient."""
        loss = closure() if closure is not None else None
        for gid, group in enumerate(self.param_groups):
            for lists, first_run in self._launch_sets(gid, group):
                multi_tensor_applier(mt.multi_tensor_sgd, self._dummy_overflow_buf, lists,
                                     group["weight_decay"], group["momentum"],
                                     group["dampening"], group["lr"], group["nesterov"],
                                     first_run, self.wd_after_momentum,
                                     1.0 / self.most_recent_scale)
        self.most_recent_scale = 1.0
        self.scale_set_by_backward = False
        return loss
