"""``transformer_engine.pytorch.tensor.utils``: TE's helpers for a distributed optimizer
that keeps FP8 primary weights sharded, none of them implemented.

Megatron-LM's distributed optimizer with FP8 parameters all-gathered in FP8
(``--fp8-param-gather``), and Megatron-FSDP with FP8 parameters, call these two when they
write the updated master-weight shards back into the FP8 weights; nothing else reaches
them. They refuse, naming the
feature, rather than leave the client with an ImportError of a module it was promised.
The other helpers of TE's module (``post_all_gather_processing``,
``quantize_master_weights``) are deliberately absent: Megatron probes for them and falls
back when they are missing.
"""

from __future__ import annotations

__all__ = ["replace_raw_data", "cast_master_weights_to_fp8"]

_FEATURE = ("FP8 primary weights sharded by a distributed optimizer or FSDP and all-gathered "
            "in FP8 (Megatron-LM's --fp8-param-gather) are not implemented by this package; "
            "train FP8 primary weights with a non-distributed optimizer, or keep the weights "
            "in high precision")


def replace_raw_data(tensor, new_raw_data) -> None:
    """TE: make ``tensor`` (an FP8 weight) keep its bits in ``new_raw_data``, a view of
    the optimizer's all-gather buffer. Not implemented."""
    raise NotImplementedError(f"transformer_engine.pytorch.tensor.utils.replace_raw_data: "
                              f"{_FEATURE}")


def cast_master_weights_to_fp8(model_weights, master_weights, start_offsets, group,
                               *args, **kwargs) -> None:
    """TE: quantize each rank's shard of the master weights into the FP8 weights. Not
    implemented."""
    raise NotImplementedError(f"transformer_engine.pytorch.tensor.utils."
                              f"cast_master_weights_to_fp8: {_FEATURE}")
