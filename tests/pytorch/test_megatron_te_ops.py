"""Megatron Core's layers built on te.ops, in a GPT trained on the CPU in FP8 delayed
scaling through Megatron's own FP8 context (megatron_helpers.py): ``TEActivationOp``
(``use_te_activation_func``), ``TEFusedResidualRMSNorm`` (``fused_residual_rmsnorm``)
and ``TEFusedMLP`` (the layer spec's ``use_te_op_fuser``). Each trains, and full
activation recompute is bit-identical to none, step by step; the fused MLP computes
what Megatron's unfused MLP of the same weights computes."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import transformer_engine.pytorch as te
from helpers import assert_runs_equal, assert_states_equal, fp8_state_snapshot
from megatron_helpers import VOCAB, SEQ, gpt_config, needs_megatron, train

pytestmark = needs_megatron

STEPS = 2

VARIANTS = {
    # Megatron's MLP with te.ops.GELU as its activation
    "activation-op": dict(use_te_activation_func=True),
    # and with te.ops.SwiGLU, FC1 twice as wide
    "swiglu-op": dict(use_te_activation_func=True, gated=True),
    # the RMSNorm in front of the experts (the dense spec fuses its norms into the
    # linears), with the residual as an extra output
    "fused-residual-rmsnorm": dict(fused_residual_rmsnorm=True, moe=True),
    # the whole MLP as one te.ops.Sequential (RMSNorm, linear, bias, GELU, linear, bias)
    "fused-mlp": dict(use_te_op_fuser=True),
    "fused-mlp-swiglu": dict(use_te_op_fuser=True, gated=True),
}


def _config(variant: dict, recompute: bool):
    """`gpt_config` with the variant's fields (validated again by Megatron)."""
    changes = {}
    if variant.get("use_te_activation_func"):
        changes.update(use_te_activation_func=True, bias_activation_fusion=False)
    if variant.get("gated"):
        changes.update(gated_linear_unit=True, activation_func=F.silu)
    if variant.get("fused_residual_rmsnorm") or variant.get("use_te_op_fuser") \
            or variant.get("rmsnorm"):
        changes.update(normalization="RMSNorm")
    if variant.get("fused_residual_rmsnorm"):
        changes.update(fused_residual_rmsnorm=True)
    if variant.get("no_bias"):
        changes.update(add_bias_linear=False)
    return dataclasses.replace(gpt_config(moe=bool(variant.get("moe")), recompute=recompute),
                               **changes)


def _model(config, variant: dict):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    moe = config.num_moe_experts is not None
    spec = get_gpt_layer_with_transformer_engine_spec(
        num_experts=config.num_moe_experts, moe_grouped_gemm=moe,
        use_te_op_fuser=bool(variant.get("use_te_op_fuser")),
        use_te_activation_func=bool(variant.get("use_te_activation_func")))
    torch.manual_seed(0)
    return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=2 * SEQ)


def _te_ops_in(model) -> list:
    """The te.ops operations the model runs (Megatron keeps its fused implementations
    out of the module tree, in a tuple built at the first forward)."""
    found = [m for m in model.modules() if isinstance(m, te.ops.FusibleOperation)]
    for m in model.modules():
        impl = getattr(m, "_fused_impl", None)
        if isinstance(impl, tuple):
            found.extend(op for op in impl[0].modules() if isinstance(op, te.ops.FusibleOperation))
    return found


EXPECTED_OPS = {
    "activation-op": te.ops.GELU, "swiglu-op": te.ops.SwiGLU,
    "fused-residual-rmsnorm": te.ops.MakeExtraOutput, "fused-mlp": te.ops.BasicLinear,
    "fused-mlp-swiglu": te.ops.SwiGLU,
}


def _run(variant: dict, recompute: bool):
    config = _config(variant, recompute)
    model = _model(config, variant)
    return train(model, config, STEPS), model


@pytest.mark.parametrize("name", list(VARIANTS))
def test_te_ops_layers_train_bit_identical_under_full_recompute(megatron_on_cpu, name):
    """The GPT with the Megatron layer named trains with te.ops doing the work, and full
    recompute of every layer gives bit-identical losses, gradients and FP8 state (the
    modules' and the operations' own) to no recompute."""
    variant = VARIANTS[name]
    (ref, ref_model), (got, got_model) = _run(variant, False), _run(variant, True)
    ops = _te_ops_in(ref_model)
    assert any(isinstance(op, EXPECTED_OPS[name]) for op in ops), [type(o) for o in ops]
    assert_runs_equal(ref, got)
    linears = [[op for op in _te_ops_in(m) if isinstance(op, te.ops.BasicLinear)]
               for m in (ref_model, got_model)]
    if variant.get("use_te_op_fuser"):
        assert len(linears[0]) == 4           # FC1 and FC2 of each of the 2 layers
        for op in linears[0]:                 # they ran in FP8: amaxes were recorded
            assert op.fp8_meta["scaling_fwd"].amax_history.abs().sum() > 0
    assert_states_equal(fp8_state_snapshot(linears[0]), fp8_state_snapshot(linears[1]),
                        "te.ops linears")


@pytest.mark.parametrize("variant, unfused", [
    (dict(use_te_op_fuser=True, no_bias=True),
     dict(use_te_activation_func=True, rmsnorm=True, no_bias=True)),
    (VARIANTS["fused-residual-rmsnorm"], dict(moe=True, rmsnorm=True)),
], ids=["fused-mlp", "fused-residual-rmsnorm"])
def test_te_ops_layers_match_megatrons_te_modules(megatron_on_cpu, variant, unfused):
    """``TEFusedMLP`` (one te.ops.Sequential sharing the weights of FC1 and FC2) and
    ``TEFusedResidualRMSNorm`` compute what Megatron's MLP of te.LayerNormLinear and
    te.Linear, and te.RMSNorm, compute: the same losses and gradients bit for bit, and
    the fused MLP's linear operations keep the FP8 state the two modules keep. (The
    reference MLP takes te.ops.GELU too, ``use_te_activation_func``: TEFusedMLP maps
    ``F.gelu`` to TE's tanh GELU; and no biases: Megatron's MLP adds FC1's bias apart
    from the GEMM, the fused operation in its epilogue.)"""
    (ref, ref_model), (got, got_model) = _run(unfused, False), _run(variant, False)
    assert_runs_equal([s._replace(states=[]) for s in ref],
                      [s._replace(states=[]) for s in got])
    if variant.get("use_te_op_fuser"):
        modules = [m for layer in ref_model.decoder.layers
                   for m in (layer.mlp.linear_fc1, layer.mlp.linear_fc2)]
        ops = [op for op in _te_ops_in(got_model) if isinstance(op, te.ops.BasicLinear)]
        assert_states_equal(fp8_state_snapshot(modules), fp8_state_snapshot(ops),
                            "te.ops linears vs te modules")
