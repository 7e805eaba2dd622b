"""``torch.distributed.checkpoint`` (DCP) of FP8 state on 2 real processes (gloo, CPU),
under DDP and FSDP2 (``fully_shard``): saved from a trained model and loaded into a
freshly built one (through ``state_dict`` or DCP's ``get/set_model_state_dict``), or
one warmed with another history length, every module's FP8
state comes back bit for bit on every rank, and the next training step (loss,
parameters, FP8 state) is bit-identical to the uninterrupted run's (NOTE [FP8 extra
state in distributed checkpoints] in module/extra_state.py)."""

import tempfile

import pytest
import torch
import torch.distributed as dist

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling
from dist_utils import launch
from helpers import global_state_is_clean

WORLD = 2
RECIPE_LEN = 3
MODES = ["ddp", "fsdp2"]
# "api": fresh, through torch.distributed.checkpoint.state_dict's get/set_model_state_dict
TARGETS = ["fresh", "warmed", "api"]


def _build(mode):
    """The same model on every rank (seeded), wrapped for ``mode``: ``(model, wrapped)``."""
    torch.manual_seed(11)
    model = torch.nn.Sequential(te.LayerNormMLP(16, 32, device="cpu"),
                                te.Linear(16, 16, device="cpu"))
    if mode == "ddp":
        return model, torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, model


def _train(wrapped, recipe, steps, seed, rank):
    """``steps`` SGD steps on this rank's data; the losses."""
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(seed * 100 + rank)
    losses = []
    for step in range(steps):
        x = torch.randn(16, 16, generator=g) * (1.0 + step)
        with te.autocast(recipe=recipe, amax_reduction_group=dist.group.WORLD):
            loss = wrapped(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    return losses


def _fp8_state(model):
    out = []
    for m in model:
        for key in ("scaling_fwd", "scaling_bwd"):
            s = m.fp8_meta[key]
            out += [s.scale.clone(), s.scale_inv.clone(), s.amax_history.clone()]
    return out


def _params(model):
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for p in model.parameters()]


def worker(rank, world_size):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    recipe = DelayedScaling(amax_history_len=RECIPE_LEN)
    holder = [tempfile.mkdtemp(prefix="dcp-fp8-") if rank == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    out = {}
    for mode in MODES:
        path = f"{holder[0]}/{mode}"
        model, wrapped = _build(mode)
        _train(wrapped, recipe, 2, seed=1, rank=rank)
        dcp.save(wrapped.state_dict(), checkpoint_id=path)
        dcp.save(get_model_state_dict(wrapped), checkpoint_id=path + "-api")
        at_save = _fp8_state(model)
        expect = _train(wrapped, recipe, 1, seed=3, rank=rank)
        out[mode] = {"at_save": at_save, "loss": expect, "state": _fp8_state(model),
                     "params": _params(model)}
        for target in TARGETS:
            model, wrapped = _build(mode)
            if target == "warmed":
                _train(wrapped, DelayedScaling(amax_history_len=5), 1, seed=2, rank=rank)
            if target == "api":
                state = get_model_state_dict(wrapped)
                dcp.load(state, checkpoint_id=path + "-api")
                set_model_state_dict(wrapped, state)
            else:
                state = wrapped.state_dict()
                dcp.load(state, checkpoint_id=path)
                wrapped.load_state_dict(state)
            loaded = _fp8_state(model)
            recipes_ok = all(m.fp8_meta["recipe"] == recipe for m in model)
            loss = _train(wrapped, recipe, 1, seed=3, rank=rank)
            out[(mode, target)] = {"loaded": loaded, "recipes": recipes_ok, "loss": loss,
                                   "state": _fp8_state(model), "params": _params(model)}
    out["clean"] = global_state_is_clean()
    return out


@pytest.fixture(scope="module")
def results():
    return launch(worker, WORLD, timeout_s=120)


def _equal(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("mode", MODES)
def test_dcp_load_restores_fp8_state_bit_for_bit(results, mode, target):
    for rank, r in enumerate(results):
        got = r[(mode, target)]
        assert _equal(got["loaded"], r[mode]["at_save"]), f"rank {rank}: FP8 state after load"
        assert got["recipes"], f"rank {rank}: the saved recipe was not restored"
    # the amax reduction keeps the ranks' FP8 state equal, so one saved copy serves all
    assert _equal(results[0][mode]["at_save"], results[1][mode]["at_save"])


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("mode", MODES)
def test_training_continues_bit_identically(results, mode, target):
    for rank, r in enumerate(results):
        got, expect = r[(mode, target)], r[mode]
        assert _equal(got["loss"], expect["loss"]), f"rank {rank}: loss of the next step"
        assert _equal(got["params"], expect["params"]), f"rank {rank}: parameters"
        assert _equal(got["state"], expect["state"]), f"rank {rank}: FP8 state one step later"
        assert r["clean"]
