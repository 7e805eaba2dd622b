"""TransformerEngineBaseModule: the per-module FP8 state and the forward prologue
that ties a module to the FP8 autocast and to activation recompute."""

from __future__ import annotations

import types
import warnings
from typing import Optional

import torch

from ...common.recipe import DelayedScaling, Recipe
from .. import delayed_scaling, distributed, non_finite, recompute, torch_compile
from ..fp8 import RECOMPUTE_STASH_KEY, FP8GlobalStateManager
from ..kernel_config import get_kernel_config
from ..model_init import model_init_state
from ..scaling import ScalingState
from ..tensor import Float8Tensor, QuantizedTensor
from ..utils import check_bool
from . import extra_state, fp8_params
from .delayed_wgrad import WeightGradStore
from .devices import default_device
from .forward_plan import ForwardPlan, ForwardScope
from .params import ParameterInitMixin

__all__ = ["TransformerEngineBaseModule"]


# NOTE [Contiguous module inputs]
#     Every TE module (the GEMM modules and the norms) makes its input contiguous
#     before anything reads it, as TE's prepare_forward does. A strided input (a
#     transposed view) would otherwise take other kernels (a GEMM with a transposed
#     operand, a reduction in another order) and give other bits, in high precision
#     and in FP8 alike; so outputs and gradients never depend on the input's strides.


def _no_stash_swapped_in(module) -> recompute.RecomputeStateError:
    return recompute.RecomputeStateError(
        f"{module.named_api('te.' + type(module).__name__)}: the recompute found no FP8 stash in "
        "fp8_meta after FP8GlobalStateManager.get_old_fp8_meta_tensors_for_recompute(fp8_meta); "
        "a wrapper installed on that hook must call the original. Refusing to recompute with "
        "the live (already updated) scales.")


class TransformerEngineBaseModule(ParameterInitMixin):
    """Base of TE modules: owns ``fp8_meta`` (``"recipe"``, ``"scaling_fwd"``,
    ``"scaling_bwd"``) for its ``num_gemms`` GEMMs: forward tensors are
    ``[input, weight]`` per GEMM, backward tensors ``[grad_output]`` per GEMM.
    Parameters are registered with their initializers and ``reset_parameters()``
    (re)initializes them (NOTE [Parameter initialization] in params.py). Built under
    ``te.quantized_model_init``, the GEMM weights are FP8 primary weights
    (``primary_weights_in_fp8``; NOTE [FP8 primary weights] in fp8_params.py).
    ``name`` is TE's debugging name; errors about the FP8 state quote it."""

    FWD_TENSORS_PER_GEMM = 2
    BWD_TENSORS_PER_GEMM = 1
    # TE orders a grouped module's saved FP8 slots role by role (NOTE [FP8 extra state
    # payload] in extra_state.py)
    FP8_SLOTS_ROLE_MAJOR = False

    def __init__(self, num_gemms: int = 1, name: Optional[str] = None):
        super().__init__()
        if name is not None and not isinstance(name, str):
            raise TypeError(f"{type(self).__name__}: name must be a str or None, "
                            f"got {type(name).__name__}")
        self.name = name
        self.fp8 = False
        self.fp8_calibration = False
        # "fp8_checkpoint": the module has FP8 state worth saving (TE's key; Megatron-LM
        # reads it when it splits a grouped module's extra state)
        self.fp8_meta = {"recipe": None, "scaling_fwd": None, "scaling_bwd": None,
                         "num_gemms": num_gemms, "fp8_checkpoint": False}
        # what a compiled forward reads and cannot make (NOTE [torch.compile])
        get_kernel_config()
        non_finite.make_compiled_counter("cpu")
        torch_compile.PENDING.add(self)
        torch_compile.MODULES.add(self)
        # NOTE [Delayed wgrad] in delayed_wgrad.py: a module that delays its wgrad has a
        # WeightGradStore here; the hooks run after backward_dw()
        self.wgrad_store = None
        self.wgrad_accumulation_and_reduce_hooks = []
        init = model_init_state()
        # the model-init recipe (None: high-precision weights)
        self.fp8_weight_recipe = init.recipe
        self.preserve_high_precision_init_val = init.preserve_high_precision_init_val

    # ---- delayed weight gradients (NOTE [Delayed wgrad] in delayed_wgrad.py) -----------
    def need_backward_dw(self) -> bool:
        """TE's query: whether this module delays its wgrad (``backward_dw()`` has work)."""
        store = self.__dict__.get("wgrad_store")
        return store is not None and store.delay_wgrad_compute()

    def _init_delay_wgrad(self, api: str, delay_wgrad_compute, split: bool = False) -> None:
        """The constructor's ``delay_wgrad_compute``: a `WeightGradStore` when True (not
        with ``parameters_split``: one wgrad per GEMM weight)."""
        if check_bool(api, "delay_wgrad_compute", delay_wgrad_compute):
            if split:
                raise NotImplementedError(f"{api}: delay_wgrad_compute=True with "
                                          "parameters_split is not implemented; use one weight")
            self.wgrad_store = WeightGradStore(True)

    def _forward_wgrad_store(self) -> Optional[WeightGradStore]:
        """The store this forward's GEMMs defer their wgrads to (None: no delay)."""
        if not self.need_backward_dw():
            return None
        if torch.compiler.is_compiling():
            raise NotImplementedError(
                f"{self.named_api(type(self).__name__)}: delay_wgrad_compute=True under "
                "torch.compile is not implemented (the deferred wgrad GEMMs are a side "
                "effect of the backward a compiled graph cannot have); run the module "
                "eagerly or build it with delay_wgrad_compute=False")
        return self.wgrad_store

    def backward_dw(self) -> None:
        """Compute the weight gradients the backwards since the last call deferred
        (``delay_wgrad_compute=True``), oldest first, and deliver them where the
        undelayed backward would have; then run the hooks of
        `register_wgrad_accumulation_and_reduce_hooks`. Nothing for other modules."""
        if not self.need_backward_dw():
            return
        self.wgrad_store.run_all()
        for hook in self.wgrad_accumulation_and_reduce_hooks:
            hook()

    def register_wgrad_accumulation_and_reduce_hooks(self, hook) -> None:
        """TE's hook list: ``hook()`` runs at the end of each `backward_dw` (Megatron
        reduces the weight gradients there)."""
        if not callable(hook):
            raise TypeError(f"{self.named_api(type(self).__name__)}."
                            "register_wgrad_accumulation_and_reduce_hooks: hook must be "
                            f"callable, got {type(hook).__name__}")
        self.wgrad_accumulation_and_reduce_hooks.append(hook)

    # ---- FP8 primary weights (NOTE [FP8 primary weights]) ---------------------------
    @property
    def primary_weights_in_fp8(self) -> bool:
        """TE's attribute: the GEMM weights are FP8 primary weights."""
        return self.fp8_weight_recipe is not None

    def _builds_fp8_weights(self) -> bool:
        return self.primary_weights_in_fp8

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)
        self._make_compiled_counter()
        return out

    def _make_compiled_counter(self) -> None:
        device = self._meta_device()
        if device.type != "meta":
            non_finite.make_compiled_counter(device)

    def _after_reset_parameters(self, fp8_weights) -> None:
        self._make_compiled_counter()
        if fp8_weights:
            if self.fp8_meta["recipe"] is None:
                self._adopt_recipe(self.fp8_weight_recipe)
            fp8_params.quantize_weights(self, self.fp8_weight_recipe,
                                        self.preserve_high_precision_init_val, fp8_weights)

    def fp8_weight_state(self) -> ScalingState:
        """The delayed-scaling state FP8 primary weights are quantized with (made from
        the model-init recipe if the module has none)."""
        state = self.fp8_meta["scaling_fwd"]
        if state is None:
            self.init_fp8_meta_tensors(self.fp8_weight_recipe)
            state = self.fp8_meta["scaling_fwd"]
        return state

    def _apply(self, fn, *args, **kwargs):
        """``nn.Module._apply`` (``.to``, ``.half()``, ``.cuda()``, ``.cpu()``), keeping
        what was attached to a quantized parameter. torch moves a tensor subclass with
        ``torch.utils.swap_tensors``, which exchanges the parameter's whole
        ``__dict__``: its FP8 data comes over, and everything set on it from outside
        (``get_high_precision_init_val``, ``main_grad``, tensor-parallel marks) would
        be left on the discarded tensor. Methods bound to the old tensor are bound to
        the surviving one."""
        kept = {name: (param, dict(param.__dict__)) for name, param in self._parameters.items()
                if isinstance(param, QuantizedTensor)}
        out = super()._apply(fn, *args, **kwargs)
        for name, (old, attrs) in kept.items():
            new = self._parameters.get(name)
            if new is None:
                continue
            for key, value in attrs.items():
                if key in new.__dict__:
                    continue            # the moved tensor's own state
                if isinstance(value, types.MethodType) and value.__self__ is old:
                    value = types.MethodType(value.__func__, new)
                setattr(new, key, value)
        return out

    def __setstate__(self, state) -> None:
        # pickling leaves a Float8Tensor's quantizer behind: bind this module's again
        super().__setstate__(state)
        # a copy is a module of its own for compiled code (NOTE [torch.compile])
        torch_compile.MODULES.add(self)
        meta = self.__dict__.get("fp8_meta")
        if meta is not None and meta.get("scaling_fwd") is None:
            torch_compile.PENDING.add(self)
        if self.__dict__.get("fp8_weight_recipe") is not None:
            for name, init in self._init_table().items():
                param = self._parameters.get(name)
                if isinstance(param, Float8Tensor) and init.fp8_weight_index is not None:
                    param._quantizer = fp8_params.weight_quantizer(
                        self, self.fp8_weight_recipe, init.fp8_weight_index, param.fp8_dtype)

    def named_api(self, api: str) -> str:
        """``api`` (e.g. ``"te.Linear"``) with this module's ``name`` when it has one,
        for error messages."""
        name = getattr(self, "name", None)
        return api if not isinstance(name, str) else f"{api}(name={name!r})"

    # ---- FP8 state ----------------------------------------------------------------
    def _meta_device(self) -> torch.device:
        for p in self.parameters():
            return p.device
        return default_device(None)

    def init_fp8_meta_tensors(self, recipe: DelayedScaling) -> None:
        """Fresh delayed-scaling state (scale 1, empty history) sized for ``recipe``."""
        n = self.fp8_meta["num_gemms"]
        device = self._meta_device()
        length = recipe.amax_history_len
        self.fp8_meta["scaling_fwd"] = ScalingState.new(n * self.FWD_TENSORS_PER_GEMM, length, device)
        self.fp8_meta["scaling_bwd"] = ScalingState.new(n * self.BWD_TENSORS_PER_GEMM, length, device)
        torch_compile.PENDING.discard(self)

    def _adopt_recipe(self, recipe: Recipe) -> None:
        """Keep the state (fresh if there is none); a history of another length than
        the recipe's is resized, keeping the scales and the most recent amaxes
        (`delayed_scaling.resize_amax_history`), never discarded. A recipe of an
        unrelated class (neither a subclass of the other) than the module's last one
        warns, as TE's modules do when they rebuild their quantizers; so does a new history
        length for FP8 primary weights, quantized with the resized state from then on."""
        old = self.fp8_meta["recipe"]
        if old is not None and not (isinstance(recipe, type(old)) or isinstance(old, type(recipe))):
            warnings.warn(f"{self.named_api(type(self).__name__)}: Recipe type changed from "
                          f"{type(old).__name__} to {type(recipe).__name__}. This may affect "
                          "model behavior.", UserWarning, stacklevel=4)
        self.fp8_meta["recipe"] = recipe
        self.fp8_meta["fp8_checkpoint"] = True
        if recipe.delayed():
            state = self.fp8_meta["scaling_fwd"]
            if state is None:
                self.init_fp8_meta_tensors(recipe)
            elif state.amax_history.shape[0] != recipe.amax_history_len:
                if self.primary_weights_in_fp8:
                    warnings.warn("Quantizer is being updated, this may affect model behavior",
                                  UserWarning, stacklevel=4)
                for key in ("scaling_fwd", "scaling_bwd"):
                    s = self.fp8_meta[key]
                    history = delayed_scaling.resize_amax_history(s.amax_history,
                                                                  recipe.amax_history_len)
                    self.fp8_meta[key] = ScalingState(s.scale.clone(), s.scale_inv.clone(), history)

    def _take_autocast_state(self):
        """``(fp8, calibrating, recipe)`` of this thread's FP8 autocast, as this module
        runs under it, set on the module (``fp8``, ``fp8_calibration``, the recipe
        adopted); ``recipe`` is None when neither FP8 nor delayed-scaling calibration
        is on."""
        autocast = FP8GlobalStateManager.get_fp8_autocast_state()
        fp8 = autocast.enabled
        calibrating = autocast.calibrating and not fp8
        recipe = FP8GlobalStateManager.get_checked_fp8_recipe() if (fp8 or calibrating) else None
        if calibrating and not recipe.delayed():
            recipe, calibrating = None, False
        if torch.compiler.is_compiling():
            return self._take_traced_autocast_state(fp8, calibrating, recipe)
        if self.fp8 is not fp8 or self.fp8_calibration is not calibrating:
            self.fp8, self.fp8_calibration = fp8, calibrating     # nn.Module.__setattr__ is slow
        if recipe is not None and self.fp8_meta["recipe"] is not recipe:
            self._adopt_recipe(recipe)
        return fp8, calibrating, recipe

    def _take_traced_autocast_state(self, fp8: bool, calibrating: bool, recipe):
        """`_take_autocast_state` while dynamo traces (NOTE [torch.compile] in
        torch_compile.py): the flags are stored without being read (no guard on
        them); the modules without FP8 state get it for real before this module's is
        read; the recipe is compared by fields (a guard on fields, not on objects)."""
        if recipe is None:
            # compared first: no write (a side effect) where nothing changes, so that a
            # high-precision module may run inside torch.utils.checkpoint
            if self.fp8 != fp8 or self.fp8_calibration != calibrating:
                self.fp8, self.fp8_calibration = fp8, calibrating
            return fp8, calibrating, recipe
        if torch_compile.inside_higher_order_op():
            raise NotImplementedError(
                f"{self.named_api(type(self).__name__)}: an FP8 forward traced by "
                "torch.compile inside torch.utils.checkpoint (or another higher-order op) is "
                "not supported: its FP8 state updates are side effects that such a region "
                "may not have. Checkpoint the compiled function with te.checkpoint instead, "
                "or keep the region in high precision")
        torch_compile.check_compilable_recipe(recipe)
        # (the FP8-weight recipe check of eager calls asks each weight's quantizer, which
        # dynamo cannot: a mismatch shows in the eager calls and at the weights' writes)
        self.fp8, self.fp8_calibration = fp8, calibrating      # written, not read: no guard
        torch_compile.prepare_pending_modules(recipe)   # before this trace reads fp8_meta
        # written, not read: no guard on what the module held before
        self.fp8_meta["recipe"] = recipe
        self.fp8_meta["fp8_checkpoint"] = True
        if recipe.delayed():
            state = self.fp8_meta["scaling_fwd"]
            if state is None or state.amax_history.shape[0] != recipe.amax_history_len:
                raise NotImplementedError(
                    f"{self.named_api(type(self).__name__)}: torch.compile: this module's "
                    "delayed-scaling state "
                    + ("is missing" if state is None else
                       f"has amax_history_len={state.amax_history.shape[0]}")
                    + f" where the recipe has {recipe.amax_history_len}; a compiled function "
                    "cannot make or resize it (its backward updates it): run one forward with "
                    "this recipe eagerly first")
        return fp8, calibrating, recipe

    def init_fp8_metadata(self, num_gemms: int = 1) -> None:
        """TE's hook: take this thread's FP8 autocast state as a forward would at its
        start (``fp8``, ``fp8_calibration``, the recipe and, for delayed scaling, the
        scaling state made if missing). Outside an autocast it only records that FP8
        is off. ``num_gemms`` must be this module's own (Megatron-LM passes it)."""
        if num_gemms != self.fp8_meta["num_gemms"]:
            raise ValueError(f"{self.named_api(type(self).__name__)}.init_fp8_metadata: "
                             f"num_gemms must be this module's {self.fp8_meta['num_gemms']}, "
                             f"got {num_gemms!r}")
        self._take_autocast_state()

    def prepare_forward(self, inp: Optional[torch.Tensor] = None,
                        is_first_microbatch: Optional[bool] = None) -> ForwardScope:
        """Decide how this call uses FP8 and do its recompute bookkeeping; a context
        manager that yields a `ForwardPlan`.

        Phase 1 of a checkpoint stashes the forward state; the recompute swaps the
        stash in for the duration of the forward and puts the live state back after.
        ``is_first_microbatch`` is checked and handed on in the plan (NOTE [FP8 weight
        cache] in fp8_operands.py); while a CUDA graph is captured and the skip-update
        tensor is set, that tensor decides instead (NOTE [Skip-update flag]).
        """
        if is_first_microbatch is not None and not isinstance(is_first_microbatch, bool):
            raise TypeError(f"{type(self).__name__}.forward: is_first_microbatch must be None, "
                            f"True or False, got {is_first_microbatch!r}")
        if torch.compiler.is_compiling():
            return self._prepare_traced_forward(is_first_microbatch)
        fp8, calibrating, recipe = self._take_autocast_state()
        if recipe is not None and self.fp8_weight_recipe is not None:
            fp8_params.check_weight_recipes(self, recipe)
        plan = ForwardPlan(fp8=fp8, recipe=recipe, record_amax=False,
                           is_first_microbatch=is_first_microbatch)
        skip = FP8GlobalStateManager.get_skip_fp8_weight_update_tensor()
        if skip is not None and fp8 and FP8GlobalStateManager.fp8_graph_capturing():
            plan.is_first_microbatch, plan.skip_weight_update = False, skip
        swapped = False
        if distributed.in_fp8_activation_recompute_phase():
            plan.recomputing = True
            plan.replay = recompute.replay_flags()
            if fp8 and plan.delayed:
                # the hooks return nothing (TE's signatures): the stash comes in fp8_meta
                FP8GlobalStateManager.get_old_fp8_meta_tensors_for_recompute(self.fp8_meta)
                swapped = True
                entry = self.fp8_meta.get(RECOMPUTE_STASH_KEY)
                if entry is None:
                    FP8GlobalStateManager.restore_fp8_meta_tensors(self.fp8_meta)
                    raise _no_stash_swapped_in(self)
                plan.session, plan.stash = entry.session, entry
        elif plan.delayed:
            if recompute.is_training_forward():
                plan.record_amax = True
                FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(self.fp8_meta)
                if fp8:
                    plan.session = FP8GlobalStateManager.current_session()
            if distributed.is_fp8_activation_recompute_enabled():
                FP8GlobalStateManager.copy_forward_fp8_meta_tensors_for_recompute(self.fp8_meta)
                plan.stash = self.fp8_meta.pop(RECOMPUTE_STASH_KEY, None)
        if plan.delayed:
            plan.fwd_state = self.fp8_meta["scaling_fwd"]
        return ForwardScope(plan, self.fp8_meta if swapped else None)

    def _prepare_traced_forward(self, is_first_microbatch: Optional[bool]) -> ForwardScope:
        """`prepare_forward` while dynamo traces (NOTE [torch.compile] in
        torch_compile.py): the same plan; the session bookkeeping, the recompute
        stash and the backward update become graph ops or trace-time decisions."""
        non_finite.note_compiled_use()
        if is_first_microbatch is not None:     # before this trace reads fp8_meta
            torch_compile.prepare_weight_caches()
        fp8, calibrating, recipe = self._take_autocast_state()
        plan = ForwardPlan(fp8=fp8, recipe=recipe, record_amax=False,
                           is_first_microbatch=is_first_microbatch, traced=True)
        if not plan.delayed:
            plan.recomputing = distributed.in_fp8_activation_recompute_phase()
            return ForwardScope(plan, None)
        autocast = FP8GlobalStateManager.get_fp8_autocast_state()
        session, plan.group = autocast.session, autocast.group
        live = self.fp8_meta["scaling_fwd"]
        if distributed.in_fp8_activation_recompute_phase():
            plan.recomputing = True
            if fp8:
                # The first forward's state, read and written as the first forward did
                # (the copy, the amaxes into the stash's own history): the same graph,
                # so the same tensors saved for backward (a non-reentrant checkpoint
                # hands the recompute's saved tensors to the first forward's backward).
                plan.fwd_state = torch_compile.forward_state(
                    torch_compile.recompute_state(self.fp8_meta))
                plan.record_amax = True
        else:
            plan.record_amax = recompute.is_training_forward()
            if distributed.is_fp8_activation_recompute_enabled():
                torch_compile.stash_in_frame(self.fp8_meta, live)
            plan.fwd_state = torch_compile.forward_state(live) if fp8 else live
        first = True
        register = plan.record_amax and not plan.recomputing
        if session.traced:
            first = torch_compile.join_traced_session(session, self.fp8_meta, recipe,
                                                      plan.group, register)
        elif register:
            torch_compile.register_in_session(session, self.fp8_meta, recipe, plan.group)
        if fp8 and first:
            plan.bwd_update_gemm = self._first_fp8_gemm()
        return ForwardScope(plan, None)

    def _first_fp8_gemm(self) -> int:
        """The GEMM whose backward runs last in a call of this module (its first)."""
        return 0

    # ---- FP8 state in state_dict (NOTE [FP8 extra state payload]) -------------------
    def get_extra_state(self) -> torch.Tensor:
        """The FP8 state (recipe, scales, amax histories) as a uint8 tensor in TE's
        layout, so that it travels in ``state_dict()`` (NOTE [FP8 extra state
        payload]); an `ExtraStateTensor`, which ``torch.distributed.checkpoint`` loads
        into a model of any FP8 state (NOTE [FP8 extra state in distributed
        checkpoints])."""
        return extra_state.save_fp8_state(self.fp8_meta, self._fp8_layout())

    def _fp8_layout(self) -> extra_state.Layout:
        return extra_state.Layout(self.fp8_meta["num_gemms"], self.FWD_TENSORS_PER_GEMM,
                                  self.BWD_TENSORS_PER_GEMM, self.FP8_SLOTS_ROLE_MAJOR)

    def set_extra_state(self, state) -> None:
        """Load what `get_extra_state` wrote: all of it after checking all of it, or
        nothing (a ``ValueError`` naming this module says what is wrong). A saved
        history length that differs from a later recipe is adapted at that forward."""
        api = self.named_api(type(self).__name__)
        loaded = extra_state.load_fp8_state(state, f"{api}.set_extra_state", self._fp8_layout())
        if loaded is None:
            return
        device = self._meta_device()
        fwd, bwd = (None if s is None else ScalingState(s.scale.to(device), s.scale_inv.to(device),
                                                        s.amax_history.to(device))
                    for s in (loaded.scaling_fwd, loaded.scaling_bwd))
        self.fp8_meta.update(recipe=loaded.recipe, scaling_fwd=fwd, scaling_bwd=bwd,
                             fp8_checkpoint=loaded.recipe is not None or fwd is not None)
        if fwd is not None:
            torch_compile.PENDING.discard(self)
