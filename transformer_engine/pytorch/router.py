"""``transformer_engine.pytorch.router``: the names of TE's fused MoE router kernels.

TE fuses the Mixture-of-Experts router's top-k selection, its score computation for
the auxiliary loss and the auxiliary loss itself into CUDA kernels. This package does
not implement them; the names exist because Megatron-LM imports them when its TE
extension loads (and calls them only with its router-fusion option on). Each raises
``NotImplementedError``; the unfused router in the client computes the same thing.
"""

from __future__ import annotations

__all__ = ["fused_topk_with_score_function", "fused_compute_score_for_moe_aux_loss",
           "fused_moe_aux_loss"]


def _refuse(name: str):
    raise NotImplementedError(
        f"transformer_engine.pytorch.router.{name}: the fused MoE router kernels are not "
        "implemented by this package; use the unfused router (in Megatron-LM: leave "
        "moe_router_fusion off)")


def fused_topk_with_score_function(logits, topk, use_pre_softmax, num_groups, group_topk,
                                   scaling_factor, score_function, expert_bias):
    """TE's fused router top-k with its score function; not implemented here."""
    _refuse("fused_topk_with_score_function")


def fused_compute_score_for_moe_aux_loss(logits, topk, score_function):
    """TE's fused score and routing-map computation for the auxiliary loss; not
    implemented here."""
    _refuse("fused_compute_score_for_moe_aux_loss")


def fused_moe_aux_loss(probs, tokens_per_expert, total_num_tokens, num_experts, topk, coeff):
    """TE's fused MoE auxiliary load-balancing loss; not implemented here."""
    _refuse("fused_moe_aux_loss")
