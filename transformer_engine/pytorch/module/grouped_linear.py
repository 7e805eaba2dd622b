"""te.GroupedLinear: ``num_gemms`` independent linear layers applied to consecutive row
blocks of one input (the experts of a Mixture-of-Experts layer).

Each block goes through the FP8 linear path of ``te.Linear`` (`fp8_linear`) with its
own GEMM index ``i``, so GEMM ``i`` owns the delayed-scaling slots ``[input_i,
weight_i]`` of ``fp8_meta["scaling_fwd"]`` and ``[grad_output_i]`` of
``fp8_meta["scaling_bwd"]``, exactly as a separate ``te.Linear`` owns its slots 0-1
and 0. The GEMMs share the module's one `ForwardPlan`: one registration with the
autocast session and one recompute stash per forward (as LayerNormMLP's two GEMMs do).
The weights (biases) are one parameter per GEMM, or one grouped parameter (NOTE
[Single grouped parameters] in grouped_params.py).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional, Sequence

import torch

from ..tensor_parallel import TensorParallelConfig
from ..utils import check_bool, check_params_dtype, check_positive_int, reject_unsupported
from .base import TransformerEngineBaseModule
from .devices import default_device
from .fp8_linear import fp8_linear
from .grouped_params import grouped_slices, per_gemm_init, remap_state_dict, single_param_flags
from .linear import check_init_args
from .main_grad import check_main_grad
from .params import ParamInit, constant_init, normal_init

__all__ = ["GroupedLinear", "check_m_splits"]

_API = "te.GroupedLinear"


def check_m_splits(m_splits, num_gemms: int, rows: Optional[int], api: str = _API,
                   allow_tensor: bool = False) -> List[int]:
    """``m_splits`` as a list of ``num_gemms`` non-negative ints adding up to ``rows``
    (any sum when ``rows`` is None). ``allow_tensor``: an integer tensor of shape
    ``[num_gemms]`` is read too (``tolist()``: a host sync when it lives on CUDA), as
    TE's GroupedLinear accepts one."""
    if allow_tensor and torch.is_tensor(m_splits):
        if m_splits.is_floating_point() or m_splits.is_complex() \
                or m_splits.dtype == torch.bool or m_splits.shape != (num_gemms,):
            raise TypeError(f"{api}.forward: a tensor m_splits must hold num_gemms={num_gemms} "
                            f"ints (shape ({num_gemms},), an integer dtype), got "
                            f"{m_splits.dtype} of shape {tuple(m_splits.shape)}")
        m_splits = m_splits.tolist()
    if torch.is_tensor(m_splits) or not isinstance(m_splits, (list, tuple)):
        raise TypeError(f"{api}.forward: m_splits must be a list of {num_gemms} ints (call "
                        f".tolist() on a tensor of counts), got {type(m_splits).__name__}")
    splits = list(m_splits)
    if len(splits) != num_gemms or any(isinstance(m, bool) or not isinstance(m, int) or m < 0
                                       for m in splits):
        raise ValueError(f"{api}.forward: m_splits must hold num_gemms={num_gemms} "
                         f"non-negative ints, got {m_splits!r}")
    if rows is not None and sum(splits) != rows:
        raise ValueError(f"{api}.forward: m_splits must add up to the input's rows "
                         f"({rows}), got {splits} (sum {sum(splits)})")
    return splits


class GroupedLinear(TransformerEngineBaseModule):
    """``y_i = x_i W_i^T + b_i`` for the row blocks ``x_i`` of the input given by
    ``m_splits``; each GEMM in FP8 inside an enabled ``te.autocast``. TE's signature.

    Parameters
    ----------
    num_gemms : int
        The number of linear layers (experts): parameters ``weight0`` ..
        ``weight{num_gemms-1}`` of shape ``[out_features, in_features]`` and, with
        ``bias``, ``bias0`` .. ``bias{num_gemms-1}``.
    in_features, out_features : int
    sequence_parallel, tp_group, tp_size, parallel_mode
        Accepted for a tensor-parallel size of 1 (where they split nothing).
        Splitting a GroupedLinear over more ranks is not implemented: a size above 1
        raises ``NotImplementedError`` (Megatron-LM's expert layers split the experts
        themselves and build this module with ``tp_size=1``).
    fuse_wgrad_accumulation : bool, default False
        Each weight gradient goes into ``weight{i}.main_grad`` in float32.
    get_rng_state_tracker, rng_tracker_name, init_method : see `te.Linear`
        Each weight is initialized in turn by ``init_method(weight{i})``.
    bias : bool, default True
    return_bias : bool, default False
        Return ``(out, [bias0, ..])`` unadded instead of adding them (the list holds
        None without ``bias``).
    params_dtype : torch.dtype, optional
    device : torch.device, optional
        CUDA if available, else CPU, when None; ``"meta"`` defers initialization.
    name : str, optional
    delay_wgrad_compute : bool, default False
        The backward computes the input and bias gradients only; ``backward_dw()``
        computes the weight gradients later (NOTE [Delayed wgrad] in delayed_wgrad.py).
    save_original_input : bool, default False
        Keep each GEMM's high-precision input for backward and cast it again there for
        the wgrad (NOTE [Saving the original input] in fp8_linear.py): the same values
        as the default; refused (``ValueError``) with DelayedScaling, as in TE.
    ub_overlap_rs, ub_overlap_ag
        Not implemented: anything but the default raises ``NotImplementedError``.
        ``ub_name`` is accepted (it only names a Userbuffers buffer).
    single_grouped_weight, single_grouped_bias : bool, default False
        TE's single ``weight`` ``[num_gemms, out, in]`` (``bias`` ``[num_gemms,
        out]``) parameter instead of ``weight{i}`` (``bias{i}``), which then hold None
        (NOTE [Single grouped parameters] in grouped_params.py). As in TE, True
        without the environment variable ``NVTE_GROUPED_LINEAR_SINGLE_PARAM`` set to a
        positive int is turned into False with a ``UserWarning``. A single grouped
        weight of FP8 primary weights (``te.quantized_model_init``) is not implemented
        (``NotImplementedError``).
    use_grouped_tensor : bool or None, default None
        Selects TE's native grouped-GEMM kernel; the same arithmetic runs here either
        way, so it is checked (a bool or None) and kept as an attribute only.
    """

    FP8_SLOTS_ROLE_MAJOR = True

    def __init__(self, num_gemms: int, in_features: int, out_features: int,
                 sequence_parallel: bool = False, fuse_wgrad_accumulation: bool = False,
                 tp_group=None, tp_size: int = 1, get_rng_state_tracker: Optional[Callable] = None,
                 rng_tracker_name: Optional[str] = None, init_method: Optional[Callable] = None,
                 bias: bool = True, return_bias: bool = False,
                 params_dtype: Optional[torch.dtype] = None, parallel_mode: Optional[str] = None,
                 device=None, ub_overlap_rs: bool = False, ub_overlap_ag: bool = False,
                 ub_name: Optional[str] = None, delay_wgrad_compute: bool = False,
                 save_original_input: bool = False, single_grouped_weight: bool = False,
                 single_grouped_bias: bool = False, name: Optional[str] = None,
                 use_grouped_tensor: Optional[bool] = None):
        num_gemms = check_positive_int(_API, "num_gemms", num_gemms)
        super().__init__(num_gemms=num_gemms, name=name)
        reject_unsupported(_API, ub_overlap_rs=(ub_overlap_rs, False),
                           ub_overlap_ag=(ub_overlap_ag, False))
        self._init_delay_wgrad(_API, delay_wgrad_compute)
        if use_grouped_tensor is not None and not isinstance(use_grouped_tensor, bool):
            raise TypeError(f"{_API}: use_grouped_tensor must be a bool or None, got "
                            f"{type(use_grouped_tensor).__name__} {use_grouped_tensor!r}")
        self.use_grouped_tensor = bool(use_grouped_tensor)
        self.single_grouped_weight, self.single_grouped_bias = single_param_flags(
            _API, check_bool(_API, "single_grouped_weight", single_grouped_weight),
            check_bool(_API, "single_grouped_bias", single_grouped_bias))
        if self.single_grouped_weight and self._builds_fp8_weights():
            raise NotImplementedError(
                f"{_API}: single_grouped_weight=True with FP8 primary weights "
                "(te.quantized_model_init) is not implemented by this pure-PyTorch Transformer "
                "Engine; build it with single_grouped_weight=False or outside "
                "quantized_model_init")
        # an attribute, as in TE: Megatron-LM sets it after construction
        self.save_original_input = check_bool(_API, "save_original_input", save_original_input)
        self.num_gemms = num_gemms
        self.in_features = check_positive_int(_API, "in_features", in_features)
        self.out_features = check_positive_int(_API, "out_features", out_features)
        self.use_bias = check_bool(_API, "bias", bias)
        self.return_bias = check_bool(_API, "return_bias", return_bias)
        self.fuse_wgrad_accumulation = check_bool(_API, "fuse_wgrad_accumulation",
                                                  fuse_wgrad_accumulation)
        check_init_args(_API, init_method, get_rng_state_tracker, rng_tracker_name)
        dtype = check_params_dtype(_API, params_dtype)
        device = default_device(device)
        self.tp = TensorParallelConfig(_API, parallel_mode, tp_group, tp_size, sequence_parallel)
        self._refuse_split()
        self.get_rng_state_tracker, self.rng_tracker_name = get_rng_state_tracker, rng_tracker_name
        self.ub_name = ub_name
        weight_init = ParamInit(init_method or normal_init, get_rng_state_tracker,
                                rng_tracker_name)
        # TE's parameter order: per GEMM weight{i}, bias{i}; then the grouped ones
        for i in range(num_gemms):
            if self.single_grouped_weight:
                self.register_parameter(f"weight{i}", None)
            else:
                self.register_initialized(
                    f"weight{i}", torch.empty(out_features, in_features, dtype=dtype,
                                              device=device),
                    dataclasses.replace(weight_init,
                                        fp8_weight_index=self.FWD_TENSORS_PER_GEMM * i + 1))
            if self.use_bias and not self.single_grouped_bias:
                self.register_initialized(
                    f"bias{i}", torch.empty(out_features, dtype=dtype, device=device),
                    ParamInit(constant_init(0.0)))
            else:
                self.register_parameter(f"bias{i}", None)
        if self.single_grouped_weight:
            self.register_initialized(
                "weight", torch.empty(num_gemms, out_features, in_features, dtype=dtype,
                                      device=device),
                dataclasses.replace(weight_init, init_fn=per_gemm_init(weight_init.init_fn)))
        if self.use_bias and self.single_grouped_bias:
            self.register_initialized(
                "bias", torch.empty(num_gemms, out_features, dtype=dtype, device=device),
                ParamInit(constant_init(0.0)))
        self._sync_tp_attributes()
        self.reset_parameters(defer_init=device.type == "meta")

    def _refuse_split(self) -> None:
        if self.tp.size > 1:
            raise NotImplementedError(
                f"{_API}: tensor parallelism (parallel_mode={self.tp.parallel_mode!r} with "
                f"tp_size={self.tp.size}) is not implemented by this pure-PyTorch Transformer "
                "Engine; split the experts outside the module and build it with tp_size=1")

    def _sync_tp_attributes(self) -> None:
        """TE's attribute names for the TP settings."""
        self.parallel_mode, self.sequence_parallel = self.tp.parallel_mode, self.tp.sequence_parallel
        self.tp_group, self.tp_size = self.tp.tp_group, self.tp.tp_size

    def set_tensor_parallel_group(self, tp_group) -> None:
        """Attach the tensor-parallel group (only a group that splits nothing is accepted)."""
        self.tp.set_group(tp_group)
        self._sync_tp_attributes()
        self._refuse_split()

    def forward(self, inp: torch.Tensor, m_splits: Sequence[int],
                is_first_microbatch: Optional[bool] = None):
        """``inp: [..., in_features]``, whose rows (all leading dimensions flattened)
        are split into blocks of ``m_splits[i]`` rows (a list, or an integer tensor); block ``i`` goes through
        ``weight{i}`` / ``bias{i}``. Returns ``[..., out_features]`` (and the biases
        with ``return_bias``). ``is_first_microbatch`` as in `te.Linear`."""
        if not torch.is_tensor(inp):
            raise TypeError(f"{_API}: input must be a tensor, got {type(inp).__name__}")
        if inp.dim() == 0 or inp.shape[-1] != self.in_features:
            raise ValueError(f"{_API}: the input's last dimension must be in_features="
                             f"{self.in_features}, got input of shape {tuple(inp.shape)}")
        inp = inp.contiguous()          # NOTE [Contiguous module inputs] in module/base.py
        x2d = inp.reshape(-1, self.in_features)
        splits = check_m_splits(m_splits, self.num_gemms, x2d.shape[0], allow_tensor=True)
        weights, biases = self._gemm_weights(), self._gemm_biases()
        with self.prepare_forward(inp, is_first_microbatch) as plan:
            # an empty block has nothing to cast or scale: its (empty) output comes from
            # the high-precision path, which also gives its weight a zero gradient
            empty_plan = dataclasses.replace(plan, fp8=False, record_amax=False)
            api = self.named_api(_API)
            outs = [fp8_linear(api, x_i, w_i, None if self.return_bias else b_i,
                               plan if x_i.shape[0] else empty_plan, self.fp8_meta, gemm=i,
                               fuse_wgrad_accumulation=self.fuse_wgrad_accumulation,
                               input_name=f"input rows of GEMM {i} (m_splits[{i}]={m})",
                               weight_name=f"weight{i}", wgrad_store=self._forward_wgrad_store(),
                               save_original_input=bool(self.save_original_input))
                    for i, (x_i, w_i, b_i, m) in enumerate(zip(torch.split(x2d, splits),
                                                               weights, biases, splits))]
        out = torch.cat(outs, dim=0).view(*inp.shape[:-1], self.out_features)
        if self.return_bias:
            return out, (self.bias if self.single_grouped_bias and self.use_bias else biases)
        return out

    def _gemm_weights(self) -> List[torch.Tensor]:
        """Each GEMM's weight: ``weight{i}``, or the view ``weight[i]`` of the single
        grouped weight (NOTE [Single grouped parameters] in grouped_params.py)."""
        if not self.single_grouped_weight:
            return [getattr(self, f"weight{i}") for i in range(self.num_gemms)]
        if self.fuse_wgrad_accumulation:
            check_main_grad(_API, self.weight)
        return grouped_slices(self.weight, fused_main_grad=self.fuse_wgrad_accumulation,
                              deliver_delayed=self.need_backward_dw())

    def _gemm_biases(self) -> List[Optional[torch.Tensor]]:
        if not (self.use_bias and self.single_grouped_bias):
            return [getattr(self, f"bias{i}") for i in range(self.num_gemms)]
        return grouped_slices(self.bias)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """Either layout loads: per-GEMM ``weight{i}`` / ``bias{i}`` or the single
        grouped ``weight`` / ``bias`` (NOTE [Single grouped parameters])."""
        remap_state_dict(state_dict, prefix, "weight", self.num_gemms,
                         self.single_grouped_weight)
        if self.use_bias:
            remap_state_dict(state_dict, prefix, "bias", self.num_gemms,
                             self.single_grouped_bias)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return (f"num_gemms={self.num_gemms}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.use_bias}")
