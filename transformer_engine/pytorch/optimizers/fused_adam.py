"""`FusedAdam`: TE's Adam / AdamW whose step updates all parameters of a group in a few
multi-tensor launches (NOTE [Multi-tensor paths] in multi_tensor.py), with master
weights, narrow or FP8 states (NOTE [Scaled optimizer states] in adam_states.py),
bfloat16 parameters plus int16 remainders for exact float32 masters, and FP8 (quantized)
parameters updated in place from their float32 masters."""

from __future__ import annotations

import warnings
from itertools import chain
from typing import Dict, Iterable, Optional

import torch

from ..tensor.quantized_tensor import QuantizedTensor
from . import multi_tensor as mt
from .adam_states import (STATE_DTYPES, STATE_NAMES, full_precision, new_state, read_state,
                          write_state)
from .multi_tensor_apply import multi_tensor_applier

__all__ = ["FusedAdam"]


class FusedAdam(torch.optim.Optimizer):
    """Adam (``adam_w_mode=False``: L2 penalty added to the gradient, as
    ``torch.optim.Adam``) or AdamW (``adam_w_mode=True``, the default: decoupled weight
    decay, as ``torch.optim.AdamW``); the update is
    ``p -= lr * (m_hat / (sqrt(v_hat) + eps) [+ weight_decay * p])``.

    Parameters
    ----------
    params : iterable of parameters or dicts of parameter groups
    lr, betas, eps, weight_decay : as torch.optim.AdamW (defaults 1e-3, (0.9, 0.999),
        1e-8, 0)
    amsgrad : bool, default False
        Not supported (True raises), as in TE.
    bias_correction : bool, default True
        Divide the moments by ``1 - beta**step``.
    adam_w_mode : bool, default True
        Decoupled weight decay (AdamW) or L2 regularization (Adam).
    capturable : bool, default False
        Keep ``lr`` and the step count in device tensors and never read them on the host,
        so the step can be captured in a CUDA graph; ``step(grad_scaler=...)`` then skips
        the update on overflow and unscales the gradients.
    master_weights : bool, default False
        Keep a float32 (or ``master_weight_dtype``) master copy of each parameter (state
        ``master_param``); the parameter receives the rounded master. Required for
        quantized (FP8) parameters.
    master_weight_dtype : torch.float32 or torch.float16
    exp_avg_dtype, exp_avg_sq_dtype : torch.float32, torch.bfloat16, torch.float16 or
        torch.uint8 (FP8 E4M3 with a per-tensor scale)
    use_decoupled_grad : bool, default False
        Read gradients from ``param.decoupled_grad`` instead of ``param.grad``.
    store_param_remainders : bool, default False
        With float32 master weights and bfloat16 parameters, keep only the low 16 bits of
        each master (int16): the bfloat16 parameter and its remainder rebuild the float32
        master exactly.
    set_grad_none : bool, optional
        Deprecated (as in TE): pass ``set_to_none`` to `zero_grad` instead.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, *,
                 bias_correction: bool = True, adam_w_mode: bool = True,
                 capturable: bool = False, master_weights: bool = False,
                 master_weight_dtype: torch.dtype = torch.float32,
                 exp_avg_dtype: torch.dtype = torch.float32,
                 exp_avg_sq_dtype: torch.dtype = torch.float32,
                 use_decoupled_grad: bool = False, store_param_remainders: bool = False,
                 set_grad_none: Optional[bool] = None):
        if amsgrad:
            raise ValueError("FusedAdam: amsgrad=True (the AMSGrad variant) is not supported")
        if master_weights and master_weight_dtype not in (torch.float32, torch.float16):
            raise TypeError("FusedAdam: master_weight_dtype must be torch.float32 or "
                            f"torch.float16, got {master_weight_dtype}")
        for name, dtype in (("exp_avg_dtype", exp_avg_dtype),
                            ("exp_avg_sq_dtype", exp_avg_sq_dtype)):
            if dtype not in STATE_DTYPES:
                raise TypeError(f"FusedAdam: {name} must be one of {STATE_DTYPES} "
                                f"(torch.uint8: FP8), got {dtype}")
        if capturable:
            if master_weights and master_weight_dtype != torch.float32:
                raise ValueError("FusedAdam: capturable=True needs float32 master weights")
            if not (exp_avg_dtype == exp_avg_sq_dtype
                    and exp_avg_dtype in (torch.float32, torch.bfloat16)):
                raise ValueError("FusedAdam: capturable=True needs exp_avg_dtype and "
                                 "exp_avg_sq_dtype both torch.float32 or both torch.bfloat16, "
                                 f"got {exp_avg_dtype} and {exp_avg_sq_dtype}")
        if not 0.0 <= float(lr if not isinstance(lr, torch.Tensor) else lr.item()):
            raise ValueError(f"FusedAdam: lr must be >= 0, got {lr}")
        defaults = {"lr": torch.tensor(float(lr), dtype=torch.float32) if capturable else lr,
                    "bias_correction": bias_correction, "betas": tuple(betas), "eps": eps,
                    "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.capturable = capturable
        self.master_weights = master_weights
        self.master_weight_dtype = master_weight_dtype
        self.exp_avg_dtype, self.exp_avg_sq_dtype = exp_avg_dtype, exp_avg_sq_dtype
        self.name_to_dtype_map = {"exp_avg": exp_avg_dtype, "exp_avg_sq": exp_avg_sq_dtype,
                                  "master_param": master_weight_dtype}
        self.use_decoupled_grad = use_decoupled_grad
        self.store_param_remainders = (store_param_remainders and master_weights
                                       and master_weight_dtype == torch.float32)
        if capturable and self.store_param_remainders:
            raise ValueError("FusedAdam: capturable=True does not support "
                             "store_param_remainders=True")
        self._scales: Dict[torch.Tensor, Dict[str, torch.Tensor]] = {}
        first = next((p for g in self.param_groups for p in g["params"]), None)
        device = first.device if first is not None else torch.device("cpu")
        self._dummy_overflow_buf = torch.zeros(1, dtype=torch.int32, device=device)
        if capturable:
            for group in self.param_groups:
                if group["params"]:
                    group["lr"] = torch.as_tensor(group["lr"], dtype=torch.float32).to(
                        group["params"][0].device)
            self._step_supports_amp_scaling = True
        self.set_grad_none = set_grad_none
        if set_grad_none is not None:
            warnings.warn("FusedAdam: set_grad_none is deprecated; pass set_to_none to "
                          "zero_grad instead", DeprecationWarning, stacklevel=2)

    # ---- gradients --------------------------------------------------------------------
    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """Drop (``set_to_none``, the default) or zero every gradient (``.decoupled_grad``
        with ``use_decoupled_grad``)."""
        if self.set_grad_none is not None:
            if set_to_none is not None and set_to_none != self.set_grad_none:
                raise ValueError(f"FusedAdam.zero_grad: set_to_none={set_to_none} contradicts "
                                 f"set_grad_none={self.set_grad_none} given at construction")
            set_to_none = self.set_grad_none
        set_to_none = True if set_to_none is None else set_to_none
        attr = "decoupled_grad" if self.use_decoupled_grad else "grad"
        for p in chain.from_iterable(g["params"] for g in self.param_groups):
            if set_to_none:
                setattr(p, attr, None)
            elif getattr(p, attr, None) is not None:
                getattr(p, attr).zero_()

    def _grad(self, p):
        return getattr(p, "decoupled_grad", None) if self.use_decoupled_grad else p.grad

    # ---- states -----------------------------------------------------------------------
    def _remainders(self, param) -> bool:
        return self.store_param_remainders and param.dtype == torch.bfloat16

    def _initialize_state(self, param, state_name: str, remainders: bool = False) -> None:
        dtype = self.name_to_dtype_map[state_name]
        if remainders:
            self.state[param][state_name] = torch.zeros(param.shape, dtype=torch.int16,
                                                        device=param.device)
            return
        self.state[param][state_name] = new_state(param, dtype)
        if dtype != torch.float32:
            self._scales.setdefault(param, {})[state_name] = torch.ones(
                1, dtype=torch.float32, device=param.device)

    def initialize_state(self, param, store_param_remainders: Optional[bool] = None) -> None:
        """Create the states of ``param``: zero moments and, with master weights, the
        master (the parameter's value; with remainders, zero low halves, the parameter
        being its own rounded master)."""
        if store_param_remainders is None:
            store_param_remainders = self._remainders(param)
        self._initialize_state(param, "exp_avg")
        self._initialize_state(param, "exp_avg_sq")
        if self.master_weights:
            self._initialize_state(param, "master_param", store_param_remainders)
            if not store_param_remainders:
                value = param.dequantize(dtype=torch.float32) \
                    if isinstance(param, QuantizedTensor) else param.detach()
                self.set_scaled_state(param, "master_param",
                                      value.to(full_precision(param)).clone())

    def get_unscaled_state(self, param, state_name: str,
                           skip_unscale: bool = False) -> torch.Tensor:
        """The value of a state of ``param`` (NOTE [Scaled optimizer states]): float32
        (float64 for a float64 parameter); a bfloat16 state stays bfloat16 with
        ``skip_unscale``; int16 remainders as they are."""
        if state_name not in STATE_NAMES:
            raise ValueError(f"FusedAdam.get_unscaled_state: state_name must be one of "
                             f"{STATE_NAMES}, got {state_name!r}")
        stored = self.state[param][state_name]
        dtype = self.name_to_dtype_map[state_name]
        if stored.dtype == torch.int16 or (dtype == torch.bfloat16 and skip_unscale):
            return stored
        value = read_state(stored, dtype, self._scales.get(param, {}).get(state_name))
        return value.float() if value.dtype in (torch.bfloat16, torch.float16) else value

    def set_scaled_state(self, param, state_name: str, unscaled_state: torch.Tensor) -> None:
        """Set a state of ``param`` from its value (float32, float64 for a float64
        parameter, int16 for remainders), scaling it where its dtype needs it."""
        if state_name not in STATE_NAMES:
            raise ValueError(f"FusedAdam.set_scaled_state: state_name must be one of "
                             f"{STATE_NAMES}, got {state_name!r}")
        remainders = state_name == "master_param" and self._remainders(param)
        expected = (torch.int16,) if remainders else (torch.float32, full_precision(param))
        if not isinstance(unscaled_state, torch.Tensor) or unscaled_state.dtype not in expected:
            raise TypeError(f"FusedAdam.set_scaled_state: {state_name} must be a tensor of "
                            f"{' or '.join(map(str, set(expected)))}, got "
                            f"{getattr(unscaled_state, 'dtype', type(unscaled_state).__name__)}")
        if state_name not in self.state[param]:
            self._initialize_state(param, state_name, remainders)
        dtype = self.name_to_dtype_map[state_name]
        write_state(unscaled_state.detach(), self.state[param][state_name], dtype,
                    self._scales.get(param, {}).get(state_name))

    def state_dict(self):
        """torch's state dict with every state as its value (`get_unscaled_state`), so it
        loads into an optimizer of any state dtypes."""
        sd = super().state_dict()
        params = list(chain.from_iterable(g["params"] for g in self.param_groups))
        for index, states in sd["state"].items():
            param = params[index]
            sd["state"][index] = {name: self.get_unscaled_state(param, name).clone()
                                  for name in states if name in STATE_NAMES}
        return sd

    def load_state_dict(self, state_dict) -> None:
        """torch's ``load_state_dict``, then every state re-set from its saved value
        (`set_scaled_state`), in this optimizer's state dtypes."""
        super().load_state_dict(state_dict)
        params = list(chain.from_iterable(g["params"] for g in self.param_groups))
        for index, states in state_dict["state"].items():
            param = params[index]
            self.state[param] = {}
            for name, value in states.items():
                if value is None or name not in STATE_NAMES:
                    continue
                if not (name == "master_param" and self._remainders(param)):
                    value = value.to(full_precision(param))
                self.set_scaled_state(param, name, value.to(param.device))
        if self.capturable:
            for group in self.param_groups:
                if group["params"]:
                    device = group["params"][0].device
                    group["lr"] = torch.as_tensor(group["lr"], dtype=torch.float32).to(device)
                    if "step" in group:
                        group["step"] = torch.as_tensor(group["step"], dtype=torch.int32).to(
                            device).reshape(1)

    # ---- the step ---------------------------------------------------------------------
    def step(self, closure=None, grad_scaler=None):
        """One Adam step of every parameter with a gradient. ``grad_scaler`` (capturable
        only): a ``torch.amp.GradScaler`` whose scale the gradients carry."""
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            self._step_group(group, grad_scaler)
        return loss

    def _step_group(self, group, grad_scaler) -> None:
        params = group["params"]
        device = params[0].device if params else self._dummy_overflow_buf.device
        noop = self._dummy_overflow_buf
        if self.capturable:
            found = (grad_scaler._check_inf_per_device(self)[device] if grad_scaler is not None
                     else torch.zeros(1, device=device))
            noop.copy_(found.reshape(1))
            taken = (noop == 0).to(torch.int32)
            if "step" in group:
                group["step"].add_(taken)       # in place: a captured graph replays it
            else:
                group["step"] = taken.clone()
        else:
            group["step"] = group.get("step", 0) + 1
        if not params:
            return
        lists: Dict[str, list] = {}     # kind -> lists of tensors for one op
        rescale, quantized = [], []
        for p in params:
            if len(self.state[p]) == 0:
                self.initialize_state(p)
            grad = self._grad(p)
            if grad is None:
                continue
            if grad.is_sparse:
                raise TypeError("FusedAdam: sparse gradients are not supported")
            state = self.state[p]
            values = {}
            for name in state:
                dtype = self.name_to_dtype_map[name]
                stored = state[name]
                if dtype in (torch.float16, torch.uint8) and stored.dtype != torch.int16:
                    values[name] = read_state(stored, dtype, self._scales[p][name])
                    rescale.append((values[name], stored, dtype, self._scales[p][name]))
                else:
                    values[name] = stored
            moments = [values["exp_avg"], values["exp_avg_sq"]]
            if isinstance(p, QuantizedTensor):
                if not self.master_weights:
                    raise ValueError(f"FusedAdam: quantized parameters ({type(p).__name__}) "
                                     "need master_weights=True")
                if self.capturable:
                    raise ValueError("FusedAdam: capturable=True does not support quantized "
                                     "parameters (their re-quantization is not captured)")
                master = values["master_param"]
                lists.setdefault("plain", [[], [], [], []])
                for lst, t in zip(lists["plain"], [grad.float(), master, *moments]):
                    lst.append(t)
                quantized.append((p, master))
                continue
            if p.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
                raise TypeError(f"FusedAdam: parameters must be float32, float16, bfloat16, "
                                f"float64 or quantized, got {p.dtype}")
            if self.master_weights and p.dtype != torch.float64:
                kind = "remainder" if self._remainders(p) else "master"
                row = [grad, p.data, *moments, values["master_param"]]
            else:
                kind, row = "plain", [grad, p.data, *moments]
            lists.setdefault(kind, [[] for _ in row])
            for lst, t in zip(lists[kind], row):
                lst.append(t)
        self._apply(group, lists, grad_scaler, device)
        with torch.no_grad():
            for p, master in quantized:
                p.quantize_(master)
        for value, stored, dtype, scale in rescale:
            write_state(value, stored, dtype, scale)

    def _apply(self, group, lists, grad_scaler, device) -> None:
        beta1, beta2 = group["betas"]
        common = (beta1, beta2, group["eps"], group["step"], self.adam_w_mode,
                  1 if group["bias_correction"] else 0, group["weight_decay"])
        if self.capturable:
            inv_scale = (grad_scaler._get_scale_async().double().reciprocal().float()
                         if grad_scaler is not None else torch.ones(1, device=device))
            for tensor_lists in lists.values():
                op = mt.multi_tensor_adam_capturable if len(tensor_lists) == 4 \
                    else mt.multi_tensor_adam_capturable_master
                multi_tensor_applier(op, self._dummy_overflow_buf, tensor_lists, group["lr"],
                                     beta1, beta2, group["eps"], group["step"],
                                     self.adam_w_mode, common[5], group["weight_decay"],
                                     inv_scale)
            return
        for kind, tensor_lists in lists.items():
            op = mt.multi_tensor_adam_param_remainder if kind == "remainder" \
                else mt.multi_tensor_adam
            multi_tensor_applier(op, self._dummy_overflow_buf, tensor_lists, group["lr"],
                                 common[0], common[1], common[2], common[3], common[4],
                                 common[5], common[6])
