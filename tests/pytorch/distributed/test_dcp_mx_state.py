"""``torch.distributed.checkpoint`` (DCP) of models trained in MXFP8BlockScaling and
NVFP4BlockScaling on 2 real processes (gloo, CPU, DDP), with high-precision weights and
with MXFP8Tensor / NVFP4Tensor primary weights: loaded into a freshly built model, or
one warmed under another recipe of the same class, the ``_extra_state`` brings back the
saved recipe, every primary weight's bits come back, and the next training step (loss,
parameters) is bit-identical to the uninterrupted run's.

A primary weight is saved as its quantized storage; DCP reads it with
``torch.load(weights_only=True)``, so the load runs under
``torch.serialization.safe_globals`` with the tensor's rebuild function, class and
quantizer (module docstring of tensor/mx_tensors.py)."""

import tempfile

import pytest
import torch
import torch.distributed as dist

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import Format, MXFP8BlockScaling, NVFP4BlockScaling
from dist_utils import launch
from helpers import global_state_is_clean

WORLD = 2
RECIPES = {
    "mxfp8": (MXFP8BlockScaling(fp8_format=Format.HYBRID), MXFP8BlockScaling()),
    "nvfp4": (NVFP4BlockScaling(),
              NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True)),
}
"""Per recipe kind: the recipe trained and saved, and the one a warmed target ran."""
WEIGHTS = ["hp", "primary"]
TARGETS = ["fresh", "warmed"]


def _build(recipe, primary: bool, seed: int):
    torch.manual_seed(seed)
    with te.quantized_model_init(enabled=primary, recipe=recipe):
        model = torch.nn.Sequential(te.LayerNormMLP(64, 64, device="cpu"),
                                    te.Linear(64, 32, device="cpu"))
    return model, torch.nn.parallel.DistributedDataParallel(model)


def _train(wrapped, recipe, steps: int, seed: int, rank: int):
    """``steps`` SGD steps on this rank's data (NVFP4's stochastic rounding draws seeded
    per step); the losses."""
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(seed * 100 + rank)
    losses = []
    for step in range(steps):
        x = torch.randn(32, 64, generator=g)
        torch.manual_seed(seed * 1000 + step)
        with te.autocast(recipe=recipe):
            loss = wrapped(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    return losses


def _bits(model) -> list:
    """Every parameter's stored value: a primary weight's quantized storage tensors
    (as bytes), any other parameter's values."""
    from transformer_engine.pytorch.tensor import QuantizedTensor
    out = []
    for p in model.parameters():
        if isinstance(p, QuantizedTensor):
            out += [t.detach().reshape(-1).view(torch.uint8).clone()
                    for t in p._storage().values() if t is not None]
        else:
            out.append(p.detach().clone())
    return out


def _safe_globals():
    from transformer_engine.pytorch.tensor.mx_tensors import (MXFP8Quantizer, MXFP8Tensor,
                                                              NVFP4Quantizer, NVFP4Tensor,
                                                              rebuild_mx_tensor)
    return torch.serialization.safe_globals(
        [rebuild_mx_tensor, MXFP8Tensor, MXFP8Quantizer, NVFP4Tensor, NVFP4Quantizer])


def worker(rank, world_size):
    import torch.distributed.checkpoint as dcp
    from transformer_engine.pytorch.tensor import QuantizedTensor
    holder = [tempfile.mkdtemp(prefix="dcp-mx-") if rank == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    out = {}
    for kind, (recipe, other) in RECIPES.items():
        for weights in WEIGHTS:
            primary = weights == "primary"
            path = f"{holder[0]}/{kind}-{weights}"
            model, wrapped = _build(recipe, primary, seed=11)
            _train(wrapped, recipe, 2, seed=1, rank=rank)
            dcp.save(wrapped.state_dict(), checkpoint_id=path)
            at_save = _bits(model)
            expect = {"loss": _train(wrapped, recipe, 1, seed=3, rank=rank),
                      "bits": _bits(model)}
            quantized = sum(isinstance(p, QuantizedTensor) for p in model.parameters())
            for target in TARGETS:
                model, wrapped = _build(recipe if target == "fresh" else other, primary,
                                        seed=5)
                if target == "warmed":
                    _train(wrapped, other, 1, seed=2, rank=rank)
                state = wrapped.state_dict()
                with _safe_globals():
                    dcp.load(state, checkpoint_id=path)
                wrapped.load_state_dict(state)
                out[(kind, weights, target)] = {
                    "loaded": _equal(_bits(model), at_save),
                    "recipes": [m.fp8_meta["recipe"] == recipe for m in model],
                    "loss": _train(wrapped, recipe, 1, seed=3, rank=rank),
                    "bits": _bits(model), "expect": expect, "quantized": quantized}
    out["clean"] = global_state_is_clean()
    return out


def _equal(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def results():
    return launch(worker, WORLD, timeout_s=120)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("kind", list(RECIPES))
def test_dcp_restores_mx_recipes_and_weights_bit_for_bit(results, kind, weights, target):
    for rank, r in enumerate(results):
        got = r[(kind, weights, target)]
        # LayerNormMLP's FC1, FC2 and the Linear's weight
        assert got["quantized"] == (3 if weights == "primary" else 0)
        assert got["loaded"], f"rank {rank}: parameters after the load"
        assert got["recipes"] == [True, True], f"rank {rank}: saved recipe not restored"


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("kind", list(RECIPES))
def test_training_continues_bit_identically(results, kind, weights, target):
    for rank, r in enumerate(results):
        got = r[(kind, weights, target)]
        assert _equal(got["loss"], got["expect"]["loss"]), f"rank {rank}: next loss"
        assert _equal(got["bits"], got["expect"]["bits"]), f"rank {rank}: parameters"
        assert r["clean"]
