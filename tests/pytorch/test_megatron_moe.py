"""Megatron Core's Mixture-of-Experts GPT on this package, one process on the CPU:
TE-spec layers with grouped experts (TEGroupedMLP: te.GroupedLinear between
te.Fp8Padding and te.Fp8Unpadding) train in FP8 delayed scaling, full activation
recompute is bit-identical to none (also with FP8 primary weights), and every TE
module's FP8 state round-trips through ``state_dict`` and Megatron's own load hook
(``merge_extra_states``, which calls ``init_fp8_metadata``) and through Megatron's
distributed checkpointing (which splits a grouped layer's extra state per expert and
merges it back, unpickling it with its own allow-list).

Megatron's MoE modules are written for CUDA (the router moves its weight to
``torch.cuda.current_device()``): megatron_helpers.pin_cuda_bound_modules_to_cpu answers
those look-ups with "cpu" on every machine.
"""

import torch

import transformer_engine.pytorch as te
from helpers import assert_runs_equal, assert_states_equal, fp8_state_snapshot
from megatron_helpers import (EXPERTS, counted_run, fp8_weight_bits, gpt_config, gpt_model,
                              needs_megatron, te_modules_of, train)

pytestmark = needs_megatron

STEPS = 3


def _grouped(model):
    return [m for m in model.modules() if isinstance(m, te.GroupedLinear)]


def test_moe_gpt_uses_grouped_te_modules(megatron_on_cpu):
    from megatron.core.extensions import transformer_engine as mte

    model = gpt_model(gpt_config(moe=True))
    experts = model.decoder.layers[0].mlp.experts
    assert isinstance(experts.linear_fc1, mte.TEColumnParallelGroupedLinear)
    assert isinstance(experts.linear_fc2, mte.TERowParallelGroupedLinear)
    assert isinstance(experts.quantization_padding, te.Fp8Padding)
    assert isinstance(experts.quantization_unpadding, te.Fp8Unpadding)
    assert len(_grouped(model)) == 4 and all(g.num_gemms == EXPERTS for g in _grouped(model))
    assert all(p.device.type == "cpu" for p in model.parameters())


def _record_splits(splits: list):
    """A hook for `counted_run`: the token counts per expert that reach each layer's
    Fp8Padding go into ``splits``, as they come."""
    def on_build(model):
        for layer in model.decoder.layers:
            layer.mlp.experts.quantization_padding.register_forward_pre_hook(
                lambda _, args: splits.append(tuple(args[1])))
    return on_build


def test_moe_gpt_full_recompute_in_fp8_matches_no_recompute(megatron_on_cpu):
    """recompute_granularity="full" in FP8 delayed scaling: bit-identical losses,
    gradients and FP8 scales and amax histories of every TE module (grouped experts
    included), step by step, to the same training without recompute; the recompute pads
    the same token counts again."""
    splits = {False: [], True: []}

    def run(recompute):
        return counted_run(gpt_config(moe=True, recompute=recompute), STEPS,
                           on_build=_record_splits(splits[recompute]))

    ref, got = run(False), run(True)
    assert ref.layer_calls == 2 * STEPS and got.layer_calls == 2 * 2 * STEPS   # all recomputed
    assert any(m % 16 for s in splits[False] for m in s), "no expert needed padding"
    assert sorted(splits[True]) == sorted(splits[False] * 2)
    grouped_scales = [s.fwd.scale for s in ref.record[-1].states
                      if s.fwd is not None and s.fwd.scale.numel() == 2 * EXPERTS]
    assert len(grouped_scales) == 4 and not all(torch.equal(s, torch.ones(2 * EXPERTS))
                                                for s in grouped_scales)
    assert all(g.fp8_meta["fp8_checkpoint"] for g in _grouped(ref.model))
    assert_runs_equal(ref.record, got.record)


def test_moe_gpt_fp8_param_trains_under_full_recompute(megatron_on_cpu):
    """``fp8_param=True``: the grouped experts' weights (one per expert) are FP8 primary
    weights too, and full recompute trains bit-identical to none, the FP8 weight bits
    after the SGD steps included."""
    ref = counted_run(gpt_config(moe=True, recompute=False, fp8_param=True), STEPS)
    got = counted_run(gpt_config(moe=True, recompute=True, fp8_param=True), STEPS)
    assert got.layer_calls == 2 * 2 * STEPS
    ref_bits, got_bits = fp8_weight_bits(ref.model), fp8_weight_bits(got.model)
    # a layer: QKV, proj, and 2 grouped layers of one weight per expert
    assert len(ref_bits) == len(got_bits) == 2 * (2 + 2 * EXPERTS)
    for a, b in zip(ref_bits, got_bits):
        assert torch.equal(a, b)
    assert_runs_equal(ref.record, got.record)


def _trained_and_fresh(config):
    torch.manual_seed(0)
    trained = gpt_model(config)
    train(trained, config, 2)
    torch.manual_seed(5)
    fresh = gpt_model(config)
    assert all(g.fp8_meta["scaling_fwd"] is None for g in _grouped(fresh))
    return trained, fresh


def test_grouped_fp8_state_round_trips_through_megatron_load_hook(megatron_on_cpu,
                                                                  monkeypatch):
    """state_dict() of a trained MoE GPT loads into itself unchanged and into a fresh
    one through Megatron's ``merge_extra_states`` pre-hook (it calls
    ``init_fp8_metadata`` first): every TE module's FP8 state comes back bit for bit,
    and both models train on identically."""
    calls = []
    real = te.TransformerEngineBaseModule.init_fp8_metadata

    def counting(self, num_gemms=1):
        calls.append(num_gemms)
        return real(self, num_gemms)

    monkeypatch.setattr(te.TransformerEngineBaseModule, "init_fp8_metadata", counting)
    config = gpt_config(moe=True)
    trained, fresh = _trained_and_fresh(config)
    before = fp8_state_snapshot(te_modules_of(trained))
    result = trained.load_state_dict(trained.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    assert_states_equal(fp8_state_snapshot(te_modules_of(trained)), before, "reloaded in place")
    calls.clear()
    result = fresh.load_state_dict(trained.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    assert calls == [EXPERTS] * 4                       # the hook ran for each grouped layer
    assert_states_equal(fp8_state_snapshot(te_modules_of(fresh)),
                        fp8_state_snapshot(te_modules_of(trained)), "after the load")
    assert all(g.fp8_meta["fp8_checkpoint"] for g in _grouped(fresh))
    assert_runs_equal(train(trained, config, 1, seed=9), train(fresh, config, 1, seed=9))


def test_grouped_fp8_state_round_trips_through_megatron_dist_checkpointing(megatron_on_cpu,
                                                                            tmp_path):
    """Megatron's distributed checkpointing saves a trained MoE GPT (the grouped
    layers' FP8 extra state split per expert, which unpickles TE's layout) and loads it
    into a fresh one (merged back per layer): every TE module's FP8 state comes back
    bit for bit and both models train on identically."""
    from megatron.core import dist_checkpointing

    config = gpt_config(moe=True)
    trained, fresh = _trained_and_fresh(config)
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    dist_checkpointing.save(trained.sharded_state_dict(), str(checkpoint))
    loaded = dist_checkpointing.load(fresh.sharded_state_dict(), str(checkpoint))
    result = fresh.load_state_dict(loaded, strict=False)
    assert not result.unexpected_keys
    # only extra states of modules that hold no FP8 state may be missing
    assert all(k.endswith("core_attention._extra_state") for k in result.missing_keys), result
    assert len(_grouped(fresh)) == 4
    assert_states_equal(fp8_state_snapshot(te_modules_of(fresh)),
                        fp8_state_snapshot(te_modules_of(trained)), "after the distributed load")
    assert_runs_equal(train(trained, config, 1, seed=9), train(fresh, config, 1, seed=9))
