"""GroupedLinear's single grouped parameters: one ``weight`` ``[num_gemms, out, in]``
(and one ``bias`` ``[num_gemms, out]``) holding every GEMM's weight (bias).

NOTE [Single grouped parameters]
    TE's ``single_grouped_weight=True`` / ``single_grouped_bias=True`` (gated by the
    environment variable ``NVTE_GROUPED_LINEAR_SINGLE_PARAM``, a positive int) replace
    the per-GEMM parameters ``weight0`` .. ``weight{n-1}`` (``bias0`` ..) with one
    parameter named ``weight`` (``bias``); the per-GEMM attributes then hold None, so
    ``state_dict()`` has the one key. Each forward takes GEMM ``i``'s weight as the view
    ``weight[i]`` (`grouped_slices`), so every GEMM reads exactly the values, and runs
    exactly the casts and GEMMs, of the per-GEMM module: outputs and gradients are the
    same bit for bit. The views' gradients come back stacked into ``weight.grad`` in one
    step (none at all when no view got one, as with ``fuse_wgrad_accumulation``).
    With ``fuse_wgrad_accumulation`` the parameter carries one ``main_grad`` of its
    shape and GEMM ``i`` adds into ``main_grad[i]``; with ``delay_wgrad_compute``
    ``backward_dw()`` adds GEMM ``i``'s gradient into ``weight.grad[i]``. The initial
    values are those of the per-GEMM module: each slice is drawn in GEMM order with the
    same initializer. Loading accepts either layout (a per-GEMM checkpoint into a
    grouped module and back), as TE's does.
"""

from __future__ import annotations

import os
import warnings
from typing import List, Optional

import torch

from ..tensor import QuantizedTensor

__all__ = ["single_param_flags", "per_gemm_init", "grouped_slices", "remap_state_dict"]


def single_param_flags(api: str, weight: bool, bias: bool):
    """TE's gate on ``single_grouped_weight`` / ``single_grouped_bias``: without
    ``NVTE_GROUPED_LINEAR_SINGLE_PARAM`` set to a positive int both fall back to False
    with a warning; with it, they are kept."""
    if not (weight or bias):
        return False, False
    raw = os.environ.get("NVTE_GROUPED_LINEAR_SINGLE_PARAM", "0")
    try:
        enabled = int(raw) > 0
    except ValueError:
        raise ValueError(f"{api}: the environment variable NVTE_GROUPED_LINEAR_SINGLE_PARAM "
                         f"must be an int, got {raw!r}") from None
    if not enabled:
        warnings.warn(f"{api} was built with single_grouped_weight={weight} and "
                      f"single_grouped_bias={bias}, but NVTE_GROUPED_LINEAR_SINGLE_PARAM is not "
                      "set: using one weight (and bias) parameter per GEMM, as TE does",
                      UserWarning, stacklevel=3)
        return False, False
    return weight, bias


class per_gemm_init:
    """Initialize a grouped ``[num_gemms, ...]`` parameter slice by slice with the
    per-GEMM initializer ``init_fn``, in GEMM order: the values (and RNG draws) of the
    per-GEMM parameters. A class, not a closure, so that modules stay picklable."""

    def __init__(self, init_fn):
        self.init_fn = init_fn

    def __call__(self, packed: torch.Tensor) -> None:
        for part in packed.unbind(0):
            self.init_fn(part)


class _Slices(torch.autograd.Function):
    """``packed.unbind(0)`` whose backward stacks the slices' gradients (zeros for a
    slice that got none) or gives None when no slice got one. With ``fused`` (the
    slices' wgrads went into ``main_grad``) a placeholder gradient also sets the
    parameter's ``grad_added_to_main_grad`` (NOTE [Fused wgrad accumulation])."""

    @staticmethod
    def forward(ctx, packed: torch.Tensor, fused: bool):
        ctx.packed, ctx.fused = packed, fused
        ctx.set_materialize_grads(False)        # (a slice without gradient stays None)
        return tuple(packed.unbind(0))

    @staticmethod
    def backward(ctx, *grads):
        if all(g is None for g in grads):
            return None, None
        packed = ctx.packed
        if ctx.fused and hasattr(packed, "grad_added_to_main_grad"):
            packed.grad_added_to_main_grad = True
        zeros = None
        parts = []
        for g in grads:
            if g is None:
                if zeros is None:
                    zeros = torch.zeros(packed.shape[1:], dtype=packed.dtype,
                                        device=packed.device)
                g = zeros
            parts.append(g)
        return torch.stack(parts, 0), None


def grouped_slices(packed: torch.Tensor, fused_main_grad: bool = False,
                   deliver_delayed: bool = False) -> List[torch.Tensor]:
    """GEMM ``i``'s parameter as the view ``packed[i]`` (NOTE [Single grouped
    parameters]). ``fused_main_grad``: each view gets ``main_grad[i]`` of the parameter
    (and Megatron's flag when the parameter has it). ``deliver_delayed``: each view
    names its slot, where a delayed wgrad is accumulated (`delayed_wgrad.accumulate_grad`)."""
    if not (torch.is_grad_enabled() and packed.requires_grad):
        return list(packed.unbind(0))
    if torch.compiler.is_compiling():
        # dynamo traces torch's own unbind (every slice gets a gradient here, so its
        # backward stacks the same values); the per-view attributes it cannot trace
        if fused_main_grad:
            raise NotImplementedError(
                "te.GroupedLinear: a single grouped weight with fuse_wgrad_accumulation=True "
                "under torch.compile is not implemented; run the module eagerly or use "
                "per-GEMM weights (single_grouped_weight=False)")
        return list(packed.unbind(0))
    views = list(_Slices.apply(packed, fused_main_grad))
    main_grad = getattr(packed, "main_grad", None) if fused_main_grad else None
    for i, view in enumerate(views):
        if main_grad is not None:
            view.main_grad = main_grad[i]
            if hasattr(packed, "grad_added_to_main_grad"):
                view.grad_added_to_main_grad = False
        if deliver_delayed:
            view.grouped_grad_slot = (packed, i)
    return views


def _value(t):
    return t.dequantize() if isinstance(t, QuantizedTensor) else t


def remap_state_dict(state_dict: dict, prefix: str, name: str, num_gemms: int,
                     grouped: bool) -> None:
    """Rewrite, in place, ``prefix + name`` (grouped) or ``prefix + name{i}`` (per GEMM)
    entries of ``state_dict`` into the layout this module has (``grouped``): a per-GEMM
    checkpoint loads into a grouped module and back, as in TE. An entry of the other
    layout next to one of this layout is dropped (it would be an unexpected key)."""
    key = prefix + name
    keys = [f"{prefix}{name}{i}" for i in range(num_gemms)]
    has_packed = key in state_dict
    has_parts = all(k in state_dict for k in keys)
    if grouped:
        if not has_packed and has_parts:
            state_dict[key] = torch.stack([_value(state_dict.pop(k)) for k in keys], 0)
        elif has_packed:
            for k in keys:
                state_dict.pop(k, None)
            packed = state_dict[key]
            if name == "bias" and torch.is_tensor(packed) and packed.dim() == 3 \
                    and packed.shape[1] == 1:
                state_dict[key] = packed.squeeze(1)
    elif not has_parts and has_packed:
        packed: Optional[torch.Tensor] = _value(state_dict.pop(key))
        for k, part in zip(keys, packed.unbind(0)):
            state_dict[k] = part.reshape(-1) if name == "bias" else part
    elif has_parts:
        state_dict.pop(key, None)
