"""te.Linear, and the initializer checks the TE modules share. Its FP8 path, which
the other modules reuse, is `fp8_linear` (fp8_linear.py)."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..tensor_parallel import TensorParallelConfig
from ..utils import check_bool, check_params_dtype, check_positive_int, reject_unsupported
from .base import TransformerEngineBaseModule
from .devices import default_device
from .fp8_linear import fp8_linear
from .params import (ParamInit, joined_parameter, normal_init, register_linear_params,
                     split_parameters)

__all__ = ["Linear", "check_init_args", "local_parts"]


def check_init_args(api: str, init_method, get_rng_state_tracker, rng_tracker_name) -> None:
    """The initializer arguments TE modules share."""
    if init_method is not None and not callable(init_method):
        raise TypeError(f"{api}: init_method must be a callable init_method(weight) or None, "
                        f"got {type(init_method).__name__}")
    if get_rng_state_tracker is not None and not callable(get_rng_state_tracker):
        raise TypeError(f"{api}: get_rng_state_tracker must be a callable returning a "
                        f"CudaRNGStatesTracker, got {type(get_rng_state_tracker).__name__}")
    if rng_tracker_name is not None and not isinstance(rng_tracker_name, str):
        raise TypeError(f"{api}: rng_tracker_name must be a str or None, got {rng_tracker_name!r}")


def local_parts(tp: TensorParallelConfig, parts):
    """``split_parameters`` parts with their rows split over a column-parallel group."""
    if tp.parallel_mode != "column" or tp.size == 1:
        return parts
    return [(prefix, tp.local_features(f"the rows of {prefix}weight" if prefix else
                                       "out_features", rows)) for prefix, rows in parts]


class Linear(TransformerEngineBaseModule):
    """``y = x W^T + b``, in FP8 inside an enabled ``te.autocast``. TE's signature.

    Parameters
    ----------
    in_features, out_features : int
    sequence_parallel : bool, default False
        With ``parallel_mode``: activations outside the layer pair are split along
        dim 0 (column all-gathers its input, row reduce-scatters its output).
    fuse_wgrad_accumulation : bool, default False
        Add the weight gradient into ``weight.main_grad`` in float32 instead of
        ``weight.grad`` (NOTE [Fused wgrad accumulation] in main_grad.py).
    tp_group : torch.distributed.ProcessGroup, optional
        The tensor-parallel group; its size is the TP size.
    tp_size : int, default 1
        The TP size when the group is formed later: call
        ``set_tensor_parallel_group(group)`` before the first forward.
    get_rng_state_tracker : callable, optional
        Returns a `CudaRNGStatesTracker`; the weights are initialized under its
        ``fork(rng_tracker_name)`` (``fork()`` when the name is None).
    rng_tracker_name : str, optional
    init_method : callable, optional
        ``init_method(weight)``; normal(0, 0.023) when None. Biases start at 0.
    bias : bool, default True
    return_bias : bool, default False
        Return ``(x W^T, b)`` instead of adding the bias, so it can be fused later.
    params_dtype : torch.dtype, optional
        float32, bfloat16 or float16; ``torch.get_default_dtype()`` when None.
    parallel_mode : None | "column" | "row", default None
        "column": the weight and bias hold ``out_features / tp`` rows and the output
        is this rank's slice of the features (not gathered). "row": the weight holds
        ``in_features / tp`` columns, the input is this rank's slice of the
        features, the output is summed over the group and the full bias added
        after. See NOTE [Tensor-parallel layouts] in ``tensor_parallel.py``; in FP8
        the autocast's ``amax_reduction_group`` must span the TP group.
    parameters_split : tuple of str or dict of str -> int, optional
        Expose the weight (and bias) as several parameters split along dim 0, named
        ``<name>_weight`` / ``<name>_bias`` (all weights registered before all
        biases, as TE does); the forward uses their concatenation.
    device : torch.device, optional
        CUDA if available, else CPU, when None. ``"meta"`` defers initialization to
        ``reset_parameters()`` (NOTE [Parameter initialization] in params.py).
    name : str, optional
        TE's module name (for messages).
    save_original_input : bool, default False
        Save the high-precision input for backward instead of its FP8 copy, and cast it
        again there for the wgrad GEMM (NOTE [Saving the original input]); not with
        DelayedScaling (``ValueError``). An attribute, which may be set later.
    delay_wgrad_compute : bool, default False
        The backward computes the input and bias gradients only; ``backward_dw()``
        computes the weight gradient later (NOTE [Delayed wgrad] in
        delayed_wgrad.py). Not with ``parameters_split``.
    ub_overlap_ag, ub_overlap_rs, ub_overlap_rs_dgrad, ub_bulk_dgrad, ub_bulk_wgrad,
    symmetric_ar_type
        Not implemented: anything but the default raises ``NotImplementedError``.
        ``ub_name`` is accepted (it only names a Userbuffers buffer).
    """

    def __init__(self, in_features: int, out_features: int, sequence_parallel: bool = False,
                 fuse_wgrad_accumulation: bool = False, tp_group=None, tp_size: int = 1,
                 get_rng_state_tracker: Optional[Callable] = None,
                 rng_tracker_name: Optional[str] = None, init_method: Optional[Callable] = None,
                 bias: bool = True, return_bias: bool = False,
                 params_dtype: Optional[torch.dtype] = None, parallel_mode: Optional[str] = None,
                 parameters_split=None, device=None, ub_overlap_ag: bool = False,
                 ub_overlap_rs: bool = False, ub_overlap_rs_dgrad: bool = False,
                 ub_bulk_dgrad: bool = False, ub_bulk_wgrad: bool = False,
                 ub_name: Optional[str] = None, delay_wgrad_compute: bool = False,
                 symmetric_ar_type: Optional[str] = None, save_original_input: bool = False,
                 name: Optional[str] = None):
        super().__init__(num_gemms=1, name=name)
        api = "te.Linear"
        reject_unsupported(api, ub_overlap_ag=(ub_overlap_ag, False),
                        ub_overlap_rs=(ub_overlap_rs, False),
                        ub_overlap_rs_dgrad=(ub_overlap_rs_dgrad, False),
                        ub_bulk_dgrad=(ub_bulk_dgrad, False), ub_bulk_wgrad=(ub_bulk_wgrad, False),
                        symmetric_ar_type=(symmetric_ar_type, None))
        # an attribute, as in TE: Megatron-LM sets it after construction
        self.save_original_input = check_bool(api, "save_original_input", save_original_input)
        self.in_features = check_positive_int(api, "in_features", in_features)
        self.out_features = check_positive_int(api, "out_features", out_features)
        self.use_bias = check_bool(api, "bias", bias)
        self.return_bias = check_bool(api, "return_bias", return_bias)
        self.fuse_wgrad_accumulation = check_bool(api, "fuse_wgrad_accumulation",
                                                  fuse_wgrad_accumulation)
        check_init_args(api, init_method, get_rng_state_tracker, rng_tracker_name)
        dtype = check_params_dtype(api, params_dtype)
        device = default_device(device)
        self.tp = TensorParallelConfig(api, parallel_mode, tp_group, tp_size, sequence_parallel)
        parts = split_parameters(api, parameters_split, out_features)
        if parameters_split is not None and self.fuse_wgrad_accumulation:
            raise NotImplementedError(f"{api}: fuse_wgrad_accumulation=True with parameters_split "
                                      "is not implemented (one weight.main_grad per module); "
                                      "use one weight")
        self._init_delay_wgrad(api, delay_wgrad_compute, parameters_split is not None)
        local_in = (self.tp.local_features("in_features", in_features)
                    if parallel_mode == "row" else in_features)
        self.get_rng_state_tracker, self.rng_tracker_name = get_rng_state_tracker, rng_tracker_name
        self.ub_name, self.symmetric_ar_type = ub_name, symmetric_ar_type
        weight_init = ParamInit(init_method or normal_init, get_rng_state_tracker, rng_tracker_name)
        self.weight_names, self.bias_names = register_linear_params(
            self, local_parts(self.tp, parts), local_in, self.use_bias, dtype, device, weight_init)
        for w, b in zip(self.weight_names, self.bias_names):
            self.tp.mark_params(getattr(self, w), getattr(self, b))
        self._sync_tp_attributes()
        self.reset_parameters(defer_init=device.type == "meta")

    def _sync_tp_attributes(self) -> None:
        """TE's attribute names for the TP settings (plain attributes: Megatron's
        subclasses assign some of them themselves)."""
        self.parallel_mode, self.sequence_parallel = self.tp.parallel_mode, self.tp.sequence_parallel
        self.tp_group, self.tp_size = self.tp.tp_group, self.tp.tp_size

    def set_tensor_parallel_group(self, tp_group) -> None:
        """Attach the tensor-parallel group (for a module built with ``tp_size``)."""
        self.tp.set_group(tp_group)
        self._sync_tp_attributes()

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None,
                fp8_output: bool = False, fp8_grad: bool = False):
        """``inp W^T + b``; ``is_first_microbatch`` as in TE (FP8 weight caching across
        micro-batches, NOTE [FP8 weight cache] in fp8_operands.py). ``fp8_output`` /
        ``fp8_grad`` (FP8 tensors out of the module) are not implemented."""
        api = "te.Linear"
        if not (fp8_output is False and fp8_grad is False):
            reject_unsupported(f"{api}.forward", fp8_output=(fp8_output, False),
                               fp8_grad=(fp8_grad, False))
        if not torch.is_tensor(inp):
            raise TypeError(f"{api}: input must be a tensor, got {type(inp).__name__}")
        inp = inp.contiguous()          # NOTE [Contiguous module inputs] in module/base.py
        with self.prepare_forward(inp, is_first_microbatch) as plan:
            weight = joined_parameter(self, self.weight_names)
            bias = joined_parameter(self, self.bias_names)
            inp = self.tp.column_input(inp)
            row = self.tp.parallel_mode == "row"
            fused_bias = None if (self.return_bias or row) else bias
            out = fp8_linear(self.named_api(api), inp, weight, fused_bias, plan, self.fp8_meta,
                             fuse_wgrad_accumulation=self.fuse_wgrad_accumulation,
                             save_original_input=bool(self.save_original_input),
                             wgrad_store=self._forward_wgrad_store())
            out = self.tp.row_output(out)
        if self.return_bias:
            return out, bias
        if row and bias is not None:
            out = out + bias.to(out.dtype)
        return out

    def extra_repr(self) -> str:
        return ", ".join((f"in_features={self.in_features}", f"out_features={self.out_features}",
                          f"bias={self.use_bias}") + self.tp.describe())
