"""``transformer_engine.pytorch.tensor.utils``: TE's helpers for a distributed optimizer
that keeps FP32 master weights sharded over the data-parallel ranks and all-gathers the
FP8 primary weights in FP8 (Megatron-LM's ``--fp8-param-gather``).

NOTE [Sharded FP8 weight updates]
    Megatron's distributed optimizer puts every FP8 primary weight's bits in one flat
    uint8 buffer per bucket (`replace_raw_data`), updates its FP32 master shard of each
    weight, quantizes that shard into its slice of the weight's bits
    (`quantize_master_weights`), all-gathers the buffer, and then lets the weights
    refresh what they derive from their bits (`post_all_gather_processing`). The
    result is the weight a non-sharded optimizer would write, bit for bit, with the
    master weight rounded to the weight's nominal dtype first, as a high-precision
    weight would be before its forward cast:

    - delayed scaling: each rank casts its shard with the module's scale for the
      weight (the same on every rank) and records the shard's amax in the live row
      of the module's amax history; the live amaxes of the weights are then reduced
      with MAX over ``group``, so each rank holds the amax of the whole weight, and
      every weight's ``scale_inv`` becomes ``1 / scale``, also where this rank holds
      no part of its master;
    - current scaling (Float8CurrentScaling): the shards' amaxes are reduced with MAX
      over ``group`` first; each weight's scale is then the one its whole value
      gives (``quantize.current_scale``, the recipe's ``power_2_scale`` and
      ``amax_epsilon``), and each shard is cast with it.

    Only per-tensor FP8 weights (`Float8Tensor`) are implemented; block-scaled
    weights (Float8BlockScaling, MXFP8, NVFP4) are refused with NotImplementedError,
    as are Megatron-FSDP's shard buffers (``fsdp_shard_model_weights``).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Union

import torch

from .. import quantize
from .float8_tensor import CurrentScalingQuantizer, Float8Tensor
from .quantized_tensor import QuantizedTensor

__all__ = ["replace_raw_data", "quantize_master_weights", "cast_master_weights_to_fp8",
           "post_all_gather_processing"]

_PER_TENSOR_ONLY = ("this package implements sharded FP8 weight updates "
                    "(Megatron-LM's --fp8-param-gather) for per-tensor FP8 weights "
                    "(Float8Tensor: DelayedScaling, Float8CurrentScaling) only")


def _refuse_kind(api: str, tensor) -> NotImplementedError:
    return NotImplementedError(
        f"transformer_engine.pytorch.tensor.utils.{api}: {type(tensor).__name__} weights "
        f"are not supported; {_PER_TENSOR_ONLY}")


def replace_raw_data(tensor: QuantizedTensor, new_raw_data: torch.Tensor) -> None:
    """Move an FP8 weight's bits into ``new_raw_data`` (a slice of an optimizer's flat
    uint8 buffer), keeping its value: the bits are copied there and the weight keeps
    them there from now on, so whatever later writes the buffer (an all-gather)
    writes the weight.

    Parameters
    ----------
    tensor : Float8Tensor
        The weight (a parameter, or an alias of one).
    new_raw_data : torch.Tensor
        ``torch.uint8`` (or the weight's FP8 dtype), as many elements as the weight,
        contiguous, on its device.
    """
    api = "transformer_engine.pytorch.tensor.utils.replace_raw_data"
    if not isinstance(tensor, Float8Tensor):
        if isinstance(tensor, QuantizedTensor):
            raise _refuse_kind("replace_raw_data", tensor)
        raise TypeError(f"{api}: tensor must be a Float8Tensor, got {type(tensor).__name__}")
    old = tensor._data
    if not isinstance(new_raw_data, torch.Tensor) \
            or new_raw_data.dtype not in (torch.uint8, old.dtype):
        raise ValueError(f"{api}: The data types of raw data don't match: old dtype="
                         f"{old.dtype} (stored as torch.uint8), new dtype="
                         f"{getattr(new_raw_data, 'dtype', type(new_raw_data).__name__)}")
    if new_raw_data.numel() != old.numel() or not new_raw_data.is_contiguous() \
            or new_raw_data.device != old.device:
        raise ValueError(f"{api}: new_raw_data must be a contiguous tensor of {old.numel()} "
                         f"elements on {old.device}, got {new_raw_data.numel()} elements "
                         f"(contiguous={new_raw_data.is_contiguous()}) on {new_raw_data.device}")
    current = not tensor._transpose_invalid
    with torch.no_grad():
        bits = new_raw_data.detach().view(old.dtype).view(old.shape)
        bits.copy_(old)
    tensor._data = bits
    # a current transpose stays current (the same values), now tied to the new bits
    tensor._transpose_invalid = not current


def quantize_master_weights(model_weights: Sequence[QuantizedTensor],
                            master_weights: Sequence[Optional[torch.Tensor]],
                            start_offsets: Sequence[Optional[int]], group,
                            fsdp_shard_model_weights=None,
                            manual_post_all_gather_processing: bool = False) -> None:
    """Quantize this rank's shard of each master weight into its FP8 weight (NOTE
    [Sharded FP8 weight updates]).

    Parameters
    ----------
    model_weights : list of Float8Tensor
        The FP8 weights, whole on every rank.
    master_weights : list of tensors or None
        This rank's shard of each master weight (flat; typically float32), or None
        where the whole master weight lives on other ranks.
    start_offsets : list of int or None
        Where each shard starts in its weight (flattened).
    group : torch.distributed.ProcessGroup or None
        The data-parallel group the amaxes are reduced over (every rank of it must
        call this with the same weights, in the same order).
    fsdp_shard_model_weights : None
        Megatron-FSDP's shard buffers: not implemented.
    manual_post_all_gather_processing : bool, default False
        True: the caller runs `post_all_gather_processing` after its all-gather (to
        make the transposes then). Either way the weights' cached transposes are
        marked stale here, so a weight whose bits the all-gather writes is never read
        through an old transpose, whether or not the caller runs it (Megatron does
        only with ``overlap_param_gather``).
    """
    api = "transformer_engine.pytorch.tensor.utils.quantize_master_weights"
    if fsdp_shard_model_weights is not None:
        raise NotImplementedError(f"{api}: fsdp_shard_model_weights (Megatron-FSDP with FP8 "
                                  "parameters) is not implemented; use Megatron's distributed "
                                  "optimizer with --fp8-param-gather")
    model_weights, master_weights = list(model_weights), list(master_weights)
    start_offsets = list(start_offsets)
    if not len(model_weights) == len(master_weights) == len(start_offsets):
        raise ValueError(f"{api}: model_weights, master_weights and start_offsets must have "
                         f"the same length, got {len(model_weights)}, {len(master_weights)} "
                         f"and {len(start_offsets)}")
    delayed, current = [], []
    for weight, master, start in zip(model_weights, master_weights, start_offsets):
        if not isinstance(weight, Float8Tensor):
            if isinstance(weight, QuantizedTensor):
                raise _refuse_kind("quantize_master_weights", weight)
            raise TypeError(f"{api}: model_weights must hold Float8Tensors, got "
                            f"{type(weight).__name__}")
        if master is not None:
            _check_fragment(api, weight, master, start)
        quantizer = weight._get_quantizer()
        if isinstance(quantizer, CurrentScalingQuantizer):
            current.append((weight, master, start))
        elif hasattr(quantizer, "scale") and hasattr(quantizer, "amax"):
            delayed.append((weight, master, start))
        else:
            raise TypeError(f"{api}: the quantizer of a model weight must be a delayed-scaling "
                            "one (with scale and amax) or a current-scaling one, got "
                            f"{type(quantizer).__name__}")
    for weight in model_weights:
        # the master weights exist now: the initial value is no longer needed (TE too)
        clear = getattr(weight, "clear_high_precision_init_val", None)
        if clear is not None:
            clear()
    if delayed:
        _delayed_shards(delayed, group)
    if current:
        _current_shards(current, group)
    for weight in model_weights:
        weight._reset_caches()


def cast_master_weights_to_fp8(model_weights, master_weights, start_offsets, group,
                               fsdp_shard_model_weights=None,
                               manual_post_all_gather_processing: bool = False) -> None:
    """TE's earlier name of `quantize_master_weights` (what Megatron Core calls)."""
    quantize_master_weights(model_weights, master_weights, start_offsets, group,
                            fsdp_shard_model_weights, manual_post_all_gather_processing)


def post_all_gather_processing(model_weights: Union[torch.Tensor, List[torch.Tensor]]) -> None:
    """After an all-gather wrote the FP8 weights' bits: remake the cached transpose of
    each `Float8Tensor` that keeps one (the dgrad GEMM's operand), or mark it stale.
    Plain tensors need nothing."""
    if not isinstance(model_weights, (list, tuple)):
        model_weights = [model_weights]
    for weight in model_weights:
        if isinstance(weight, Float8Tensor):
            if weight._transpose is not None:
                weight._create_transpose()
            else:
                weight._reset_caches()
        elif isinstance(weight, QuantizedTensor):
            raise _refuse_kind("post_all_gather_processing", weight)


# ---- the two recipes (NOTE [Sharded FP8 weight updates]) --------------------------------

def _check_fragment(api: str, weight: Float8Tensor, master: torch.Tensor, start) -> None:
    if not isinstance(start, int) or isinstance(start, bool) or start < 0:
        raise ValueError(f"{api}: start_offset must be a non-negative int where "
                         f"master_weight is given, got {start!r}")
    if start + master.numel() > weight.numel():
        raise ValueError(f"{api}: end_offset ({start + master.numel()}) exceeds model_weight "
                         f"numel ({weight.numel()}), start_offset={start}, master_weight "
                         f"numel={master.numel()}")


def _shard_value(weight: Float8Tensor, master: torch.Tensor) -> torch.Tensor:
    """The master shard as the weight's nominal dtype would hold it, as a [1, n] row."""
    return master.detach().to(device=weight.device, dtype=weight.dtype).reshape(1, -1)


def _write_shard(weight: Float8Tensor, start: int, bits: torch.Tensor) -> None:
    with torch.no_grad():
        weight._data.view(-1)[start:start + bits.numel()].copy_(bits.reshape(-1))


def _reduce_max(values: torch.Tensor, group) -> None:
    """MAX all-reduce of ``values`` over ``group`` (nothing to do on one rank)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)


def _delayed_shards(params, group) -> None:
    amax_slots, scales = [], []
    for weight, master, start in params:
        quantizer = weight._get_quantizer()
        amax_slots.append(quantizer.amax)
        scales.append(quantizer.scale)
        if master is not None and master.numel() > 0:
            # the module's scale for the weight; the shard's amax goes into the live row
            _write_shard(weight, start, quantizer.quantize(_shard_value(weight, master)).data)
    with torch.no_grad():
        packed = torch.cat([a.reshape(1) for a in amax_slots])
        _reduce_max(packed, group)
        torch._foreach_copy_(amax_slots, list(packed.split(1)))
        inverses = torch.reciprocal(torch.cat([s.reshape(1) for s in scales]))
        torch._foreach_copy_([w._scale_inv for w, _, _ in params], list(inverses.split(1)))


def _current_shards(params, group) -> None:
    device = params[0][0].device
    values = [None if master is None or master.numel() == 0 else _shard_value(weight, master)
              for weight, master, _ in params]
    with torch.no_grad():
        amaxes = torch.zeros(len(params), dtype=torch.float32, device=device)
        for i, value in enumerate(values):
            if value is not None:
                amaxes[i] = quantize.amax(value)
        _reduce_max(amaxes, group)
        for i, ((weight, _, start), value) in enumerate(zip(params, values)):
            quantizer = weight._get_quantizer()
            # the whole weight's scale, its non-finite amaxes counted as a write counts them
            scale = quantize.current_scale(
                amaxes[i], weight.fp8_dtype, quantizer.power_2_scale, quantizer.amax_epsilon,
                non_finite=quantizer.non_finite(weight))
            weight._scale_inv.copy_(torch.reciprocal(scale).reshape(1))
            if value is not None:
                _write_shard(weight, start, quantize.cast_to_fp8(value, scale,
                                                                 weight.fp8_dtype).data)
