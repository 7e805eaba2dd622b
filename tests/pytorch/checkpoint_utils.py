"""Helpers shared by the checkpoint robustness tests: the global state they
check, bitwise run comparison, and small te.Linear stacks."""

import gc
from typing import NamedTuple

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling
from transformer_engine.pytorch import distributed
from transformer_engine.pytorch import global_state as te_global_state
from transformer_engine.pytorch.fp8 import _AutocastState
from utils import assert_states_equal, assert_tensors_equal, fp8_state_snapshot

REENTRANT = [pytest.param(True, id="reentrant"), pytest.param(False, id="non-reentrant")]
RECIPE = DelayedScaling(amax_history_len=4)
STASH_KEY = "global_fp8_buffer_pos_fwd_recompute"


class StateRecord(NamedTuple):
    """This thread's FP8 autocast / recompute state, frames named by id (so that a
    record keeps no frame alive). Compare with ==; compare ``autocast`` by identity
    too where it matters."""

    region: bool
    phase: bool
    frames: tuple
    training_under_no_grad: bool
    autocast: _AutocastState
    mode_hook_users: int


def global_state() -> StateRecord:
    s = te_global_state.snapshot()
    return StateRecord(s.recompute.region, s.recompute.phase,
                       tuple((id(f), r) for f, r in s.recompute.frames),
                       s.recompute.training_under_no_grad, s.autocast, s.mode_hook_users)


CLEAN = StateRecord(False, False, (), False, _AutocastState(), 0)


def stash_count():
    gc.collect()
    return distributed.recompute_stash_count()


def queries():
    return (distributed.is_fp8_activation_recompute_enabled(),
            distributed.in_fp8_activation_recompute_phase())


def fwd_scale(module):
    state = module.fp8_meta["scaling_fwd"]
    return None if state is None else state.scale.clone()


def maybe_checkpoint(checkpointed, use_reentrant, fn, *args, **kwargs):
    if checkpointed:
        return te.checkpoint(fn, *args, use_reentrant=use_reentrant, **kwargs)
    return fn(*args, **kwargs)


def capture(loss, leaves, modules):
    """What a step produced: loss, gradients of ``leaves``, every module's FP8 state."""
    return {"loss": None if loss is None else loss.detach().clone(),
            "grads": [None if t.grad is None else t.grad.clone() for t in leaves],
            "states": fp8_state_snapshot(modules)}


def assert_runs_equal(ref, got):
    assert len(ref) == len(got)
    for step, (a, b) in enumerate(zip(ref, got)):
        if a["loss"] is not None or b["loss"] is not None:
            assert torch.equal(a["loss"], b["loss"]), f"step {step}: loss {a['loss']} vs {b['loss']}"
        assert_tensors_equal(a["grads"], b["grads"], f"step {step}: grads")
        assert_states_equal(a["states"], b["states"], f"step {step}: FP8 state")


def linears(n, features=32, seed=0, device="cpu"):
    """``n`` te.Linear layers with their delayed-scaling state already made (scale 1,
    empty history: what their first FP8 forward would make), so scales can be read
    before the first forward."""
    torch.manual_seed(seed)
    layers = [te.Linear(features, features, device=device) for _ in range(n)]
    for layer in layers:
        layer.fp8_meta["recipe"] = RECIPE
        layer.init_fp8_meta_tensors(RECIPE)
    return layers


def params(modules):
    return [p for m in modules for p in m.parameters()]
