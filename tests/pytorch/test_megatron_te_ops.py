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
from megatron_helpers import EXPERTS, SEQ, VOCAB, gpt_config, needs_megatron, train

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


# ---- grouped MLPs on te.ops.GroupedLinear and ScaledSwiGLU -------------------------------
#
# Megatron Core 0.19.2 builds these MLPs only for Transformer Engine 2.14 or newer:
# ``TEFusedMLPWithGroupedLinear.__init__`` raises a RuntimeError and
# ``TEGroupedMLP._is_fused_impl_supported`` answers False (then asserts) unless
# ``is_te_min_version("2.14.0")``, and this package reports 2.9.0+pure (docs/megatron.md:
# claiming 2.14 would send Megatron into other 2.14 branches). These tests answer that
# one question True in the two Megatron modules that ask it, and set
# NVTE_CUTEDSL_FUSED_GROUPED_MLP, the switch with which TEGroupedMLP picks TE's fused
# CuTe kernel (here the same operations run unfused), so that Megatron's own code builds
# the operations.


@pytest.fixture
def grouped_mlp_gates(monkeypatch, megatron_on_cpu):
    from megatron.core.extensions import transformer_engine as mte
    from megatron.core.transformer.moe import experts
    from megatron.core.utils import is_te_min_version

    def gate(version, check_equality=True):
        return version == "2.14.0" or is_te_min_version(version, check_equality)

    monkeypatch.setattr(mte, "is_te_min_version", gate)
    monkeypatch.setattr(experts, "is_te_min_version", gate)
    monkeypatch.setenv("NVTE_CUTEDSL_FUSED_GROUPED_MLP", "1")


def _counted(config, spec_kwargs, steps=STEPS, before_train=None):
    """Build a GPT (seed 0, a fresh RNG tracker: a recompute's RNG replay marks it
    initialized), count its decoder layers' forwards, train it."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    initialize_rng_tracker(force_reset=True)
    spec = get_gpt_layer_with_transformer_engine_spec(**spec_kwargs)
    torch.manual_seed(0)
    model = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=2 * SEQ)
    if before_train is not None:
        before_train(model)
    calls = [0]
    for layer in model.decoder.layers:
        layer.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return train(model, config, steps), calls[0], model


def _expert_config(fused: bool, recompute: bool):
    return dataclasses.replace(
        gpt_config(moe=True, recompute=recompute), gated_linear_unit=True,
        activation_func=F.silu, use_te_activation_func=True, bias_activation_fusion=False,
        use_transformer_engine_op_fuser=fused)


def test_grouped_expert_mlp_on_te_ops_matches_unfused_and_recompute(grouped_mlp_gates):
    """Megatron's MoE experts with ``use_transformer_engine_op_fuser``: one
    te.ops.Sequential of GroupedLinear (FC1, sharing the te.GroupedLinear module's
    weights), ScaledSwiGLU (the router probabilities) and GroupedLinear (FC2), in FP8
    delayed scaling. Full recompute is bit-identical to none (losses, gradients, the
    operations' FP8 state), and the run equals Megatron's unfused experts
    (te.GroupedLinear, te.ops.SwiGLU, ``* probs``) bit for bit, the operations' FP8
    state equal to the modules'."""
    spec = dict(num_experts=EXPERTS, moe_grouped_gemm=True, use_te_activation_func=True)
    runs = {name: _counted(_expert_config(fused, recompute), spec)
            for name, fused, recompute in (("unfused", False, False), ("fused", True, False),
                                           ("fused-recompute", True, True))}

    def grouped_ops(model):
        found = []
        for layer in model.decoder.layers:
            seq = layer.mlp.experts._fused_ops[0]
            assert [type(op) for op in seq] == [te.ops.GroupedLinear, te.ops.ScaledSwiGLU,
                                                te.ops.GroupedLinear]
            found += [seq[0], seq[2]]
        return found

    (ref, _, ref_model), (got, calls, model), (rec, rec_calls, rec_model) = runs.values()
    assert calls == 2 * STEPS and rec_calls == 2 * calls            # every layer recomputed
    ops, rec_ops = grouped_ops(model), grouped_ops(rec_model)
    assert all(op.fp8_meta["scaling_fwd"].amax_history.abs().sum() > 0 for op in ops)
    assert_runs_equal(got, rec)
    assert_states_equal(fp8_state_snapshot(ops), fp8_state_snapshot(rec_ops), "recompute")
    assert_runs_equal([s._replace(states=[]) for s in ref], [s._replace(states=[]) for s in got])
    modules = [m for layer in ref_model.decoder.layers
               for m in (layer.mlp.experts.linear_fc1, layer.mlp.experts.linear_fc2)]
    assert_states_equal(fp8_state_snapshot(modules), fp8_state_snapshot(ops), "unfused")


def _dense_config(recompute: bool, grouped: bool):
    # fp8="e4m3": TEFusedMLPWithGroupedLinear runs its MLP under its own
    # MXFP8BlockScaling() (E4M3 both ways); the reference MLP runs under the config's
    return dataclasses.replace(
        gpt_config(recompute=recompute, fp8_recipe="mxfp8"), fp8="e4m3",
        gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm",
        add_bias_linear=False, use_grouped_gemm_for_dense_mlp=grouped)


def _contiguous_glu_rows(weight):
    """FC1's rows of TEFusedMLPWithGroupedLinear (its ScaledSwiGLU takes FC1's output
    in TE's layout of 32-column gate and linear blocks) as contiguous halves."""
    return weight.reshape(-1, 2, 32, weight.shape[-1]).transpose(0, 1).reshape(weight.shape)


def test_dense_mlp_with_grouped_linear_trains_and_matches_fused_mlp(grouped_mlp_gates):
    """``TEFusedMLPWithGroupedLinear`` (``use_grouped_gemm_for_dense_mlp``): the RMSNorm
    operation, then GroupedLinear(num_groups=1) -> ScaledSwiGLU(glu_interleave_size=32)
    -> GroupedLinear(num_groups=1) in Megatron's own MXFP8 autocast. Full recompute is
    bit-identical to none. Against ``TEFusedMLP`` (BasicLinear -> SwiGLU ->
    BasicLinear) whose FC1 holds the same rows in contiguous halves: the same losses
    and FC1 / FC2 weight gradients bit for bit; the gradients below FC1 differ only in
    the order FC1's dgrad sums its permuted rows."""
    spec = dict(use_te_op_fuser=True, use_grouped_gemm_for_dense_mlp=True)
    got, calls, model = _counted(_dense_config(False, True), spec)
    rec, rec_calls, _ = _counted(_dense_config(True, True), spec)
    assert rec_calls == 2 * calls == 4 * STEPS
    seq = model.decoder.layers[0].mlp._fused_impl[0]
    assert [type(op) for op in seq] == [te.ops.GroupedLinear, te.ops.ScaledSwiGLU,
                                        te.ops.GroupedLinear]
    assert seq[1].glu_interleave_size == 32
    assert_runs_equal(got, rec)

    def permute_fc1(reference):
        with torch.no_grad():
            for layer in reference.decoder.layers:
                layer.mlp.linear_fc1.weight.copy_(_contiguous_glu_rows(
                    layer.mlp.linear_fc1.weight))

    ref, _, ref_model = _counted(_dense_config(False, False), dict(use_te_op_fuser=True),
                                 before_train=permute_fc1)
    names = [n for n, p in ref_model.named_parameters() if p.requires_grad]
    for step, (a, b) in enumerate(zip(ref, got)):
        assert torch.equal(a.loss, b.loss), step
        for name, g_ref, g in zip(names, a.param_grads, b.param_grads):
            if name.endswith("mlp.linear_fc1.weight"):
                g = _contiguous_glu_rows(g)
            if step == 0 and name.endswith(("linear_fc1.weight", "linear_fc2.weight")):
                assert torch.equal(g_ref, g), name
            torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-7, msg=name)
