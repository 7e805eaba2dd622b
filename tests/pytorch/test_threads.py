"""The FP8 autocast state and the recompute position are per thread, as
``torch.autocast``'s is: threads training their own models at the same time get
bit-identical results to the same runs done one after the other; exits that
interleave across threads leave each thread's state as it found it; one thread's
autocast or recompute does not reach another thread's forward.

Models are built outside the threads and data drawn from generators of their own:
torch's default generators are process-wide (module initialization draws from them,
and a recompute replays them), so threads that draw from them at once interfere
whatever this package does."""

import threading

import pytest
import torch
import torch.nn.functional as F

import transformer_engine.pytorch as te
from transformer_engine.pytorch import distributed
from helpers import (RECIPE, REENTRANT, assert_runs_equal, capture, global_state_is_clean, linears,
                     params)


@pytest.fixture
def one_intra_op_thread():
    """CPU reductions may split work by thread count; two Python threads running ops at
    once must not change how each op splits, so pin it."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def _run_in_threads(*targets, timeout=120):
    """Run each target in its own thread; re-raise the first exception."""
    errors = []

    def wrap(fn):
        def run():
            try:
                fn()
            except BaseException as err:    # noqa: BLE001 - re-raised in the caller
                errors.append(err)
        return run
    threads = [threading.Thread(target=wrap(t)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a thread did not finish"
    if errors:
        raise errors[0]


def _train(layers, seed, use_reentrant, steps, barrier=None):
    """Train ``layers`` (built beforehand: construction draws from torch's process-wide
    default generator) with the FP8 autocast opened inside checkpointed regions, on data
    from a generator of their own; returns every step's loss, gradients and FP8 states."""
    opt = torch.optim.SGD(params(layers), lr=0.1)
    gen = torch.Generator().manual_seed(seed)

    def region(h, layer):
        with te.autocast(recipe=RECIPE):
            return torch.relu(layer(h))

    record = []
    for step in range(steps):
        x = (torch.randn(16, 32, generator=gen) * (1 + step % 5)).requires_grad_()
        h = x
        for layer in layers:
            if barrier is not None:
                barrier.wait()              # interleave the threads layer by layer
            h = te.checkpoint(region, h, layer, use_reentrant=use_reentrant)
        loss = h.pow(2).mean()
        loss.backward()
        record.append(capture(loss, [x], params(layers), layers))
        opt.step()
        opt.zero_grad()
    return record


@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_concurrent_training_matches_sequential(use_reentrant, one_intra_op_thread):
    steps = 20
    sequential = [_train(linears(3, seed=seed), seed, use_reentrant, steps) for seed in (1, 2)]
    for _repeat in range(2):
        results = {}
        barrier = threading.Barrier(2)
        models = {seed: linears(3, seed=seed) for seed in (1, 2)}
        _run_in_threads(
            *(lambda s=seed: results.__setitem__(
                s, _train(models[s], s, use_reentrant, steps, barrier)) for seed in (1, 2)))
        assert_runs_equal(sequential[0], results[1])
        assert_runs_equal(sequential[1], results[2])
    assert global_state_is_clean()


def test_interleaved_exits_restore_each_thread(one_intra_op_thread):
    """A enters, B enters, A exits, B exits: each thread ends clean, and afterwards an
    outermost autocast in each thread still updates the scales."""
    order = threading.Barrier(2)
    seen = {}
    layers = {"a": linears(1)[0], "b": linears(1)[0]}

    def body(name, first):
        with te.autocast(recipe=RECIPE):
            order.wait()                    # both inside
            if not first:
                order.wait()                # let the other exit first
        if first:
            order.wait()
        seen[name] = global_state_is_clean()
        layer = layers[name]
        with te.autocast(recipe=RECIPE):
            layer(torch.randn(16, 32) * 3)
        seen[name + "-updated"] = not torch.equal(layer.fp8_meta["scaling_fwd"].scale,
                                                  torch.ones(2))
    _run_in_threads(lambda: body("a", True), lambda: body("b", False))
    assert seen == {"a": True, "b": True, "a-updated": True, "b-updated": True}


def test_thread_without_autocast_runs_high_precision(one_intra_op_thread):
    """While one thread is inside an FP8 autocast, another thread's te.Linear runs in
    high precision (exactly F.linear)."""
    inside, done = threading.Event(), threading.Event()
    (layer,) = linears(1)
    x = torch.randn(16, 32)
    out = {}

    def fp8_thread():
        with te.autocast(recipe=RECIPE):
            inside.set()
            assert done.wait(60)

    def plain_thread():
        assert inside.wait(60)
        try:
            out["fp8_enabled"] = te.FP8GlobalStateManager.is_fp8_enabled()
            out["y"] = layer(x)
        finally:
            done.set()
    _run_in_threads(fp8_thread, plain_thread)
    assert out["fp8_enabled"] is False
    assert torch.equal(out["y"], F.linear(x, layer.weight, layer.bias))


@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_recompute_in_one_thread_does_not_reach_another(use_reentrant, one_intra_op_thread):
    """Thread A holds its recompute open while thread B runs an FP8 training step: B
    sees no recompute phase, and its step equals the same step run alone."""
    in_recompute, b_done = threading.Event(), threading.Event()
    (a_layer,) = linears(1, seed=5)
    b_layers = [linears(1, seed=6)[0] for _ in range(2)]      # built here, not in a thread
    calls = [0]

    def region(h):
        calls[0] += 1
        if calls[0] == 2:                   # the recompute
            in_recompute.set()
            assert b_done.wait(60)
        with te.autocast(recipe=RECIPE):
            return a_layer(h)

    def thread_a():
        y = te.checkpoint(region, torch.randn(16, 32, requires_grad=True),
                          use_reentrant=use_reentrant)
        y.sum().backward()

    def b_step(layer):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(0), requires_grad=True)
        with te.autocast(recipe=RECIPE):
            y = layer(x)
        y.pow(2).mean().backward()
        return capture(None, [x], params([layer]), [layer])

    got = {}

    def thread_b():
        assert in_recompute.wait(60)
        try:
            got["phase"] = distributed.in_fp8_activation_recompute_phase()
            got["step"] = b_step(b_layers[0])
        finally:
            b_done.set()
    _run_in_threads(thread_a, thread_b)
    assert calls[0] == 2 and got["phase"] is False
    alone = b_step(b_layers[1])
    assert_runs_equal([alone], [got["step"]])


def test_autocast_state_is_not_shared_with_a_new_thread():
    with te.autocast(recipe=RECIPE):
        seen = []
        _run_in_threads(lambda: seen.append(
            (te.FP8GlobalStateManager.is_fp8_enabled(),
             te.FP8GlobalStateManager.get_autocast_depth())))
        assert te.FP8GlobalStateManager.is_fp8_enabled()
    assert seen == [(False, 0)]
