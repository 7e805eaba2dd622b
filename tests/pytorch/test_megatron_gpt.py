"""A Megatron Core GPT (TE layer spec, one process on the CPU) trained in FP8 delayed
scaling through Megatron's own FP8 context: full activation recompute is bit-identical
to none (also across micro-batches and with FP8 primary weights), the FP8 state of every
TE module survives ``load_state_dict`` and Megatron's distributed checkpointing bit for
bit, and the FP8 extra state this package writes unpickles under Megatron's own
allow-list (``megatron.core.safe_globals.SafeUnpickler``). The Mixture-of-Experts GPT:
test_megatron_moe.py."""

import io

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling
from helpers import assert_runs_equal, assert_states_equal, fp8_state_snapshot
from megatron_helpers import (counted_run, fp8_weight_bits, gpt_config, gpt_model,
                              needs_megatron, te_modules_of, train)

pytestmark = needs_megatron

STEPS = 3


def test_megatron_gpt_full_recompute_in_fp8_matches_no_recompute(megatron_on_cpu):
    """Megatron's full activation recompute (recompute_granularity="full") in FP8
    delayed scaling gives bit-identical losses, gradients and FP8 scales and amax
    histories, step by step, to the same training without recompute."""
    ref = counted_run(gpt_config(recompute=False), STEPS)
    got = counted_run(gpt_config(recompute=True), STEPS)
    assert ref.layer_calls == 2 * STEPS and got.layer_calls == 2 * 2 * STEPS   # all recomputed
    first = [s.fwd.scale for s in ref.record[0].states]
    last = [s.fwd.scale for s in ref.record[-1].states]
    assert not all(torch.equal(a, b) for a, b in zip(first, last))           # the scales moved
    assert_runs_equal(ref.record, got.record)


def test_megatron_micro_batches_with_the_fp8_weight_cache_under_full_recompute(
        megatron_on_cpu, monkeypatch):
    """Two micro-batches a step with ``set_is_first_microbatch()``, as Megatron's
    schedule runs them: the second micro-batch (and every recompute) takes the FP8
    weights cast in the first, and full recompute stays bit-identical to none."""
    from transformer_engine.pytorch.module import fp8_operands
    casts = []
    real = fp8_operands.cast_operand

    def counting(x, plan, state, index, dtype, record, role, *args, **kwargs):
        if role == "fwd_weight":
            casts.append(index)
        return real(x, plan, state, index, dtype, record, role, *args, **kwargs)

    monkeypatch.setattr(fp8_operands, "cast_operand", counting)
    ref = counted_run(gpt_config(recompute=False), STEPS, micro_batches=2)
    ref_casts, casts[:] = len(casts), []
    got = counted_run(gpt_config(recompute=True), STEPS, micro_batches=2)
    assert got.layer_calls == 2 * 2 * 2 * STEPS       # 2 layers, 2 micro-batches, recomputed
    # 4 TE modules a layer, 2 layers: their weights cast once a step, not per micro-batch
    assert ref_casts == len(casts) == 8 * STEPS, (ref_casts, len(casts))
    assert_runs_equal(ref.record, got.record)


def test_megatron_fp8_param_trains_under_full_recompute(megatron_on_cpu):
    """``fp8_param=True``: Megatron builds the layers under ``fp8_model_init``, so the TE
    linear weights are FP8 primary weights; training with full recompute equals
    training without it, the FP8 weight bits after the SGD steps included."""
    ref = counted_run(gpt_config(recompute=False, fp8_param=True), STEPS)
    got = counted_run(gpt_config(recompute=True, fp8_param=True), STEPS)
    assert got.layer_calls == 2 * 2 * STEPS
    ref_bits, got_bits = fp8_weight_bits(ref.model), fp8_weight_bits(got.model)
    # 4 TE linear modules a layer (QKV, proj, FC1, FC2), 2 layers
    assert len(ref_bits) == len(got_bits) == 8
    for a, b in zip(ref_bits, got_bits):
        assert torch.equal(a, b)
    assert_runs_equal(ref.record, got.record)


def _trained_and_fresh(config, steps=2):
    torch.manual_seed(0)
    trained = gpt_model(config)
    train(trained, config, steps)
    torch.manual_seed(5)
    fresh = gpt_model(config)
    return trained, fresh


def _assert_same_model(fresh, trained, config, what):
    """Every TE module's FP8 state and every parameter equal bit for bit, and one more
    training step of each gives the same record."""
    assert_states_equal(fp8_state_snapshot(te_modules_of(fresh)),
                        fp8_state_snapshot(te_modules_of(trained)), what)
    for (name, a), b in zip(fresh.state_dict().items(), trained.state_dict().values()):
        if torch.is_tensor(a) and not name.endswith("_extra_state"):
            assert torch.equal(a, b), name
    assert_runs_equal(train(trained, config, 1, seed=9), train(fresh, config, 1, seed=9))


@pytest.mark.parametrize("fp8_param", [False, True], ids=["hp-weights", "fp8-weights"])
def test_fp8_state_round_trips_through_load_state_dict(megatron_on_cpu, fp8_param):
    """``model.load_state_dict(model.state_dict())`` of an FP8-trained Megatron GPT
    loads (after ``import megatron.core`` every pickled tensor names Megatron's
    ``safe_load_from_bytes``) and changes nothing; the same state dict loads into a
    freshly built GPT, whose TE modules then hold the trained FP8 state bit for bit."""
    config = gpt_config(fp8_param=fp8_param)
    trained, fresh = _trained_and_fresh(config)
    before = fp8_state_snapshot(te_modules_of(trained))
    result = trained.load_state_dict(trained.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    assert_states_equal(fp8_state_snapshot(te_modules_of(trained)), before, "reloaded in place")
    with pytest.raises(AssertionError):       # the fresh model's FP8 state is not the trained
        assert_states_equal(fp8_state_snapshot(te_modules_of(fresh)), before)
    result = fresh.load_state_dict(trained.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    _assert_same_model(fresh, trained, config, "after load_state_dict")


def test_fp8_state_round_trips_through_megatron_dist_checkpointing(megatron_on_cpu, tmp_path):
    """Megatron's distributed checkpointing saves a trained GPT's sharded state dict and
    loads it into a freshly built one: every TE module's FP8 state comes back bit for
    bit and both models train on identically."""
    from megatron.core import dist_checkpointing

    config = gpt_config()
    trained, fresh = _trained_and_fresh(config)
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    dist_checkpointing.save(trained.sharded_state_dict(), str(checkpoint))
    loaded = dist_checkpointing.load(fresh.sharded_state_dict(), str(checkpoint))
    result = fresh.load_state_dict(loaded, strict=False)
    assert not result.unexpected_keys
    # only extra states of modules that hold no FP8 state may be missing
    assert all(k.endswith("core_attention._extra_state") for k in result.missing_keys), result
    _assert_same_model(fresh, trained, config, "after the distributed load")


def _te_slots(n: int, roles: int) -> list:
    """Where TE's payload keeps this package's slots (the first ``roles`` roles of each
    of ``n`` GEMMs, GEMM by GEMM): a grouped layer's payload is role by role (NOTE [FP8
    extra state payload]); for one GEMM, the roles in order."""
    return [role * n + gemm for gemm in range(n) for role in range(roles)]


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_payload_unpickles_under_megatrons_allow_list(megatron_on_cpu, moe):
    """Every TE module's FP8 extra state, written after ``import megatron.core``,
    unpickles with Megatron's ``SafeUnpickler`` (the allow-list its grouped-expert
    checkpointing decodes with) into TE's layout holding the module's live state."""
    from megatron.core.safe_globals import SafeUnpickler

    config = gpt_config(moe=moe)
    torch.manual_seed(0)
    model = gpt_model(config)
    train(model, config, 2)
    checked = 0
    for module in te_modules_of(model):
        payload = module.get_extra_state()
        meta = module.fp8_meta
        if meta["scaling_fwd"] is None:           # core attention: no FP8 state, empty
            assert payload.numel() == 0
            continue
        state = SafeUnpickler(io.BytesIO(payload.numpy().tobytes())).load()
        n = getattr(module, "num_gemms", 1)
        assert state["extra_fp8_variables"] == {"num_gemms": n}
        recipe, live_recipe = state["recipe"], meta["recipe"]     # Megatron's TEDelayedScaling
        assert isinstance(recipe, DelayedScaling) and isinstance(live_recipe, DelayedScaling)
        for field in ("fp8_format", "margin", "amax_history_len", "amax_compute_algo"):
            assert getattr(recipe, field) == getattr(live_recipe, field), field
        assert recipe.amax_history_len == 4
        # forward: input and weight of the 3 TE slots a GEMM; backward: grad output of 2
        for direction, roles in (("fwd", 2), ("bwd", 1)):
            live = meta["scaling_" + direction]
            slots = _te_slots(n, roles)
            assert torch.equal(state["scale_" + direction][slots], live.scale)
            assert torch.equal(state["amax_history_" + direction][:, slots], live.amax_history)
        checked += 1
    assert checked == (8 if not moe else 4 + 4)   # QKV, proj (+ FC1, FC2 or 2 grouped) x 2
    assert checked == sum(isinstance(m, (te.Linear, te.LayerNormLinear, te.GroupedLinear))
                          for m in te_modules_of(model))
