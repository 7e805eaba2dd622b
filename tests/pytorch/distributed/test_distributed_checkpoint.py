"""te.checkpoint(..., distribute_saved_activations=True, tp_group=...) on 2 real
processes: the first tensor argument is kept as 1/tp per rank between phase 1 and
the recompute (asserted on the tensor the checkpoint saved) and gathered back for
the recompute; training is bit-identical to the undistributed checkpoint and to no
checkpoint on every rank, FP8 autocast outside or inside the region.
"""

import contextlib

import pytest
import torch
import torch.distributed as dist

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling
from transformer_engine.pytorch import distributed
from dist_utils import launch
from helpers import (assert_runs_equal, assert_states_equal, capture, fp8_state_snapshot,
                     global_state_is_clean)

TP = 2
SEQ, BATCH, K, N = 32, 2, 32, 64
STEPS = 3


class TPBlock(torch.nn.Module):
    """column Linear -> gelu -> row Linear, plus a gate taken from a second input."""

    def __init__(self, rank):
        super().__init__()
        torch.manual_seed(0)
        w1, w2 = torch.randn(N, K) * 0.1, torch.randn(K, N) * 0.1
        self.fc1 = te.Linear(K, N, parallel_mode="column", tp_group=dist.group.WORLD,
                             device="cpu")
        self.fc2 = te.Linear(N, K, parallel_mode="row", tp_group=dist.group.WORLD, device="cpu")
        with torch.no_grad():
            self.fc1.weight.copy_(w1.chunk(TP, 0)[rank])
            self.fc2.weight.copy_(w2.chunk(TP, 1)[rank])

    def forward(self, x, gate, placement, recipe):
        inner = (te.autocast(recipe=recipe, amax_reduction_group=dist.group.WORLD)
                 if placement == "inner" else contextlib.nullcontext())
        with inner:
            return self.fc2(torch.nn.functional.gelu(self.fc1(x))) * torch.sigmoid(gate)


def _run(rank, placement, mode, group_arg="world"):
    """mode: "plain" (no checkpoint), "ckpt" (reentrant), "distributed" (reentrant,
    distribute_saved_activations)."""
    block = TPBlock(rank)
    head = te.Linear(K, K, device="cpu")
    params = list(block.parameters()) + list(head.parameters())
    opt = torch.optim.SGD(params, lr=0.5)
    recipe = DelayedScaling(amax_history_len=3)
    forwards, steps, saved_inputs = [0], [], []

    def region(h, gate):
        forwards[0] += 1
        return block(h, gate, placement, recipe)

    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step)
        x = (torch.randn(SEQ, BATCH, K, generator=g) * 2.0 ** step).requires_grad_()
        gate = torch.randn(SEQ, BATCH, K, generator=g).requires_grad_()
        h = torch.tanh(x)            # the checkpoint's first input is a non-leaf activation
        outer = (te.autocast(recipe=recipe, amax_reduction_group=dist.group.WORLD)
                 if placement == "outer" else contextlib.nullcontext())
        saved = None
        with outer:
            if mode == "plain":
                out = region(h, gate)
            else:
                kwargs = {}
                if mode == "distributed":
                    kwargs = {"distribute_saved_activations": True}
                    if group_arg == "world":
                        kwargs["tp_group"] = dist.group.WORLD
                out = te.checkpoint(region, h, gate, use_reentrant=True, **kwargs)
                first = out.grad_fn.saved_tensors[0]
                saved = {"numel": first.numel(), "nbytes": first.untyped_storage().nbytes(),
                         "second_numel": out.grad_fn.saved_tensors[1].numel()}
            y = head(out)
        loss = y.float().pow(2).mean()
        loss.backward()
        steps.append(capture(loss, [x, gate], params, [block.fc1, block.fc2, head]))
        saved_inputs.append(saved)
        opt.step()
        opt.zero_grad()
    return {"steps": steps, "saved": saved_inputs, "forwards": forwards[0]}


PLACEMENTS = ["outer", "inner"]


def _not_divisible(rank):
    """An odd-sized first input: a clear error before phase 1 touches any FP8 state."""
    layer = te.Linear(16, 16, device="cpu")
    with te.autocast(recipe=DelayedScaling()):
        layer(torch.randn(16, 16))          # give the layer FP8 state
    before = fp8_state_snapshot([layer])
    message = None
    try:
        with te.autocast(recipe=DelayedScaling()):
            te.checkpoint(layer, torch.randn(3, 15, requires_grad=True),
                          distribute_saved_activations=True)
    except ValueError as err:
        message = str(err)
    return {"message": message, "before": before, "after": fp8_state_snapshot([layer]),
            "clean": global_state_is_clean()}


def worker(rank, world_size):
    out = {}
    for placement in PLACEMENTS:
        out[placement] = {mode: _run(rank, placement, mode)
                          for mode in ("plain", "ckpt", "distributed")}
    out["default_group"] = _run(rank, "inner", "distributed", group_arg=None)
    out["not_divisible"] = _not_divisible(rank)
    out["gather"] = distributed.gather_split_1d_tensor(
        distributed.split_tensor_into_1d_equal_chunks(torch.arange(12.).view(3, 4), None),
        None)
    out["clean"] = global_state_is_clean()
    return out


@pytest.fixture(scope="module")
def results():
    return launch(worker, TP)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_distributed_equals_undistributed_and_plain(results, placement):
    for rank, r in enumerate(results):
        runs = r[placement]
        assert runs["plain"]["forwards"] == STEPS
        assert runs["ckpt"]["forwards"] == runs["distributed"]["forwards"] == 2 * STEPS
        assert_runs_equal(runs["plain"]["steps"], runs["distributed"]["steps"],
                          f"rank {rank} distributed vs plain")
        assert_runs_equal(runs["ckpt"]["steps"], runs["distributed"]["steps"],
                          f"rank {rank} distributed vs undistributed")
        assert r["clean"]


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_saved_input_is_one_tp_th(results, placement):
    full = SEQ * BATCH * K
    for rank, r in enumerate(results):
        for step in range(STEPS):
            dist_saved = r[placement]["distributed"]["saved"][step]
            plain_saved = r[placement]["ckpt"]["saved"][step]
            assert plain_saved["numel"] == full
            assert dist_saved["numel"] == full // TP, f"rank {rank} step {step}: {dist_saved}"
            assert dist_saved["nbytes"] == full // TP * 4, "the chunk must own just its slice"
            assert dist_saved["second_numel"] == full      # only the first input is split


def test_default_tp_group_is_the_world(results):
    for r in results:
        assert_runs_equal(r["inner"]["plain"]["steps"], r["default_group"]["steps"],
                          "tp_group=None")


def test_gather_restores_split(results):
    for r in results:
        assert torch.equal(r["gather"], torch.arange(12.))


def test_not_divisible_fails_before_phase_one(results):
    for r in results:
        nd = r["not_divisible"]
        assert nd["message"] is not None and "numel (45, shape (3, 15)) divisible by the " \
            "tensor-parallel size 2" in nd["message"], nd["message"]
        assert_states_equal(nd["after"], nd["before"], "after the refused call")
        assert nd["clean"]


# ---- single process: no process group -------------------------------------------------

def test_needs_an_initialized_group():
    assert not (dist.is_available() and dist.is_initialized())
    layer = te.Linear(16, 16, device="cpu")
    with pytest.raises(RuntimeError, match="te.checkpoint: distribute_saved_activations=True "
                                           "needs an initialized torch.distributed process group"):
        te.checkpoint(layer, torch.randn(16, 16, requires_grad=True),
                      distribute_saved_activations=True)


def test_non_reentrant_ignores_distribution_with_a_warning():
    layer = te.Linear(16, 16, device="cpu")
    with pytest.warns(UserWarning, match="distribute_saved_activations=True is ignored with "
                                         "use_reentrant=False"):
        te.checkpoint(layer, torch.randn(16, 16, requires_grad=True), use_reentrant=False,
                      distribute_saved_activations=True).sum().backward()
