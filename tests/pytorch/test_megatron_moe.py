"""Megatron Core 0.16.1's Mixture-of-Experts GPT on this package, one process on the CPU:
TE-spec layers with grouped experts (TEGroupedMLP: te.GroupedLinear between
te.Fp8Padding and te.Fp8Unpadding) train in FP8 delayed scaling, full activation
recompute is bit-identical to none, and the grouped layers' FP8 state round-trips
through ``state_dict`` and Megatron's own load hook (``merge_extra_states``, which
calls ``init_fp8_metadata``).

One CUDA call stands in Megatron's MoE path: ``TopKRouter.gating`` moves a CPU router
weight to ``torch.cuda.current_device()``; on a machine without CUDA the tests answer
that call with "cpu". Megatron's distributed checkpointing cannot run here at all (its
save calls ``torch.cuda.synchronize()``).
"""

import importlib.util

import pytest
import torch
import torch.distributed as dist

import transformer_engine.pytorch as te
from helpers import assert_runs_equal, assert_states_equal, capture, fp8_state_snapshot

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None
    or importlib.util.find_spec("megatron.core") is None,
    reason="megatron-core is not installed (pip install --no-deps megatron-core==0.16.1)")

STEPS = 3


@pytest.fixture
def megatron_on_cpu(tmp_path, monkeypatch):
    """A one-rank gloo group and Megatron's parallel state over it, a fresh Megatron RNG
    tracker (a recompute's RNG replay calls its set_states, which marks it initialized
    for every model built later), and the router's device move answered on a machine
    without CUDA; all undone after."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    initialize_rng_tracker(force_reset=True)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        parallel_state.initialize_model_parallel(1, 1)
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        initialize_rng_tracker(force_reset=True)


def _config(recompute: bool):
    from megatron.core.transformer.transformer_config import TransformerConfig

    extra = ({"recompute_granularity": "full", "recompute_method": "uniform",
              "recompute_num_layers": 1} if recompute else {})
    return TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
        params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
        fp8="hybrid", fp8_recipe="delayed", fp8_amax_history_len=4,
        num_moe_experts=2, moe_grouped_gemm=True, moe_router_topk=1,
        moe_router_pre_softmax=True, moe_token_dispatcher_type="allgather",
        moe_ffn_hidden_size=64, add_bias_linear=False, **extra)


def _model(config):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    spec = get_gpt_layer_with_transformer_engine_spec(num_experts=2, moe_grouped_gemm=True)
    return GPTModel(config, spec, vocab_size=128, max_sequence_length=32)


def _train(model, config, steps: int, seed: int = 1):
    """``steps`` SGD steps of one micro-batch in Megatron's FP8 context; one `capture`
    record per step."""
    from megatron.core import fp8_utils

    te_modules = [m for m in model.modules() if isinstance(m, te.TransformerEngineBaseModule)]
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.1)
    gen = torch.Generator().manual_seed(seed)
    record = []
    for _ in range(steps):
        tokens = torch.randint(0, 128, (2, 16), generator=gen)
        labels = torch.randint(0, 128, (2, 16), generator=gen)
        positions = torch.arange(16).unsqueeze(0).expand(2, 16)
        model.set_is_first_microbatch()     # as Megatron's schedule does: recast FP8 weights
        with fp8_utils.get_fp8_context(config):
            loss = model(tokens, positions, attention_mask=None, labels=labels).float().mean()
        loss.backward()
        record.append(capture(loss, [], params, te_modules))
        opt.step()
        opt.zero_grad()
    return record


def _grouped(model):
    return [m for m in model.modules() if isinstance(m, te.GroupedLinear)]


def _moe_run(recompute: bool):
    """Train the MoE GPT; also count the layers' forwards and record the token counts
    per expert that reached Fp8Padding."""
    torch.manual_seed(0)
    config = _config(recompute)
    model = _model(config)
    calls, splits = [0], []
    for layer in model.decoder.layers:
        layer.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        layer.mlp.experts.quantization_padding.register_forward_pre_hook(
            lambda _, args: splits.append(list(args[1])))
    return _train(model, config, STEPS), calls[0], splits, model


def test_moe_gpt_uses_grouped_te_modules(megatron_on_cpu):
    from megatron.core.extensions import transformer_engine as mte

    model = _model(_config(recompute=False))
    experts = model.decoder.layers[0].mlp.experts
    assert isinstance(experts.linear_fc1, mte.TEColumnParallelGroupedLinear)
    assert isinstance(experts.linear_fc2, mte.TERowParallelGroupedLinear)
    assert isinstance(experts.quantization_padding, te.Fp8Padding)
    assert isinstance(experts.quantization_unpadding, te.Fp8Unpadding)
    assert len(_grouped(model)) == 4 and all(g.num_gemms == 2 for g in _grouped(model))


def test_moe_gpt_full_recompute_in_fp8_matches_no_recompute(megatron_on_cpu):
    """recompute_granularity="full" in FP8 delayed scaling: bit-identical losses,
    gradients and FP8 scales and amax histories of every TE module (grouped experts
    included), step by step, to the same training without recompute."""
    ref, ref_calls, ref_splits, model = _moe_run(recompute=False)
    got, calls, splits, _ = _moe_run(recompute=True)
    assert ref_calls == 2 * STEPS and calls == 2 * 2 * STEPS        # every layer recomputed
    assert any(m % 16 for s in ref_splits for m in s), "no expert needed padding"
    # the recompute pads the same token counts again
    assert sorted(map(tuple, splits)) == sorted(map(tuple, ref_splits * 2))
    grouped_scales = [s.fwd.scale for s in ref[-1].states if s.fwd is not None
                      and s.fwd.scale.numel() == 4]
    assert grouped_scales and not all(torch.equal(s, torch.ones(4)) for s in grouped_scales)
    assert all(g.fp8_meta["fp8_checkpoint"] for g in _grouped(model))
    assert_runs_equal(ref, got)


def test_grouped_fp8_state_round_trips_through_megatron_load_hook(megatron_on_cpu,
                                                                  monkeypatch):
    """state_dict() of a trained MoE GPT loads into a fresh one through Megatron's
    ``merge_extra_states`` pre-hook (it calls ``init_fp8_metadata`` first): the grouped
    layers' FP8 states come back bit for bit, and both models train on identically."""
    calls = []
    real = te.TransformerEngineBaseModule.init_fp8_metadata

    def counting(self, num_gemms=1):
        calls.append(num_gemms)
        return real(self, num_gemms)

    monkeypatch.setattr(te.TransformerEngineBaseModule, "init_fp8_metadata", counting)
    config = _config(recompute=False)
    torch.manual_seed(0)
    trained = _model(config)
    _train(trained, config, 2)
    torch.manual_seed(5)
    fresh = _model(config)
    assert all(g.fp8_meta["scaling_fwd"] is None for g in _grouped(fresh))
    result = fresh.load_state_dict(trained.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    assert calls == [2] * 4                            # the hook ran for each grouped layer
    assert_states_equal(fp8_state_snapshot(_grouped(fresh)), fp8_state_snapshot(_grouped(trained)),
                        "grouped layers after the load")
    assert all(g.fp8_meta["fp8_checkpoint"] for g in _grouped(fresh))
    assert_runs_equal(_train(trained, config, 1, seed=9), _train(fresh, config, 1, seed=9))


def test_grouped_fp8_state_round_trips_through_megatron_dist_checkpointing(megatron_on_cpu,
                                                                            monkeypatch,
                                                                            tmp_path):
    """Megatron's distributed checkpointing saves a trained MoE GPT (the grouped
    layers' FP8 extra state split per expert, which unpickles TE's layout) and loads it
    into a fresh one (merged back per layer): every TE module's FP8 state comes back
    bit for bit and both models train on identically."""
    from megatron.core import dist_checkpointing

    if not torch.cuda.is_available():      # its writer synchronizes the device
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
    config = _config(recompute=False)
    torch.manual_seed(0)
    trained = _model(config)
    _train(trained, config, 2)
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    dist_checkpointing.save(trained.sharded_state_dict(), str(checkpoint))
    torch.manual_seed(5)
    fresh = _model(config)
    loaded = dist_checkpointing.load(fresh.sharded_state_dict(), str(checkpoint))
    result = fresh.load_state_dict(loaded, strict=False)
    assert not result.unexpected_keys
    # only extra states of modules that hold no FP8 state may be missing
    assert all(k.endswith("core_attention._extra_state") for k in result.missing_keys), result
    te_trained = [m for m in trained.modules() if isinstance(m, te.TransformerEngineBaseModule)]
    te_fresh = [m for m in fresh.modules() if isinstance(m, te.TransformerEngineBaseModule)]
    assert len(_grouped(fresh)) == 4
    assert_states_equal(fp8_state_snapshot(te_fresh), fp8_state_snapshot(te_trained),
                        "after the distributed load")
    assert_runs_equal(_train(trained, config, 1, seed=9), _train(fresh, config, 1, seed=9))
