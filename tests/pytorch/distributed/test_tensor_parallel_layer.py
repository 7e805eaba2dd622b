"""Tensor-parallel te.TransformerLayer (set_parallel_mode=True) on 2 real processes
against the single-process layer built from the same full parameters, forward and
backward, with and without sequence parallelism, with TE's split QKV parameters and
with the fused interleaved QKV weight: the attention heads split over the ranks
(QKV and FC1 column-parallel, PROJ and FC2 row-parallel).

Values compare within float32 rounding of a different summation order.
"""

import pytest
import torch
import torch.distributed as dist

import transformer_engine.pytorch as te
from dist_utils import launch
from helpers import global_state_is_clean

TP = 2
SEQ, BATCH, HIDDEN, FFN, HEADS, GROUPS = 8, 2, 32, 64, 4, 2
D = HIDDEN // HEADS
CASES = [(fused, sp) for fused in (False, True) for sp in (False, True)]
CASE_IDS = [f"{'fused-qkv' if f else 'split-qkv'}{'-sp' if sp else ''}" for f, sp in CASES]

# Parameters split along dim 0 (column-parallel), along dim 1 (row-parallel); the rest
# (norms, the row layers' biases) are replicated.
_COLUMN = ("query_weight", "key_weight", "value_weight", "query_bias", "key_bias",
           "value_bias", "layernorm_qkv.weight", "layernorm_qkv.bias", "fc1_weight", "fc1_bias")
_ROW = ("proj.weight", "fc2_weight")


def _build(fused, **tp):
    return te.TransformerLayer(HIDDEN, FFN, HEADS, num_gqa_groups=GROUPS, hidden_dropout=0.0,
                               attention_dropout=0.0, fuse_qkv_params=fused, device="cpu",
                               **({"set_parallel_mode": True, **tp} if tp else {}))


def _full_params(fused):
    g = torch.Generator().manual_seed(11)
    return {name: (1.0 if name.endswith("layer_norm_weight") else 0.0)
            + 0.2 * torch.randn(p.shape, generator=g)
            for name, p in _build(fused).named_parameters()}


def _shard(name, full, rank):
    if name.endswith(_COLUMN):
        return full.chunk(TP, 0)[rank]       # fused interleaved: whole key/value groups
    if name.endswith(_ROW):
        return full.chunk(TP, 1)[rank]
    return full


def _data():
    g = torch.Generator().manual_seed(5)
    return torch.randn(SEQ, BATCH, HIDDEN, generator=g), torch.randn(SEQ, BATCH, HIDDEN, generator=g)


def _run(m, x, dy):
    x = x.clone().requires_grad_()
    y = m(x)
    y.backward(dy)
    return {"y": y.detach(), "dx": x.grad,
            "grads": {n: p.grad.clone() for n, p in m.named_parameters()},
            "partial": sorted(n for n, p in m.named_parameters()
                              if getattr(p, "sequence_parallel", False))}


def worker(rank, world_size):
    out = {}
    x, dy = _data()
    for fused, sp in CASES:
        full = _full_params(fused)
        m = _build(fused, sequence_parallel=sp, tp_group=dist.group.WORLD)
        with torch.no_grad():
            for name, p in m.named_parameters():
                p.copy_(_shard(name, full[name], rank))
        local = (lambda t: t.chunk(TP, 0)[rank]) if sp else (lambda t: t)
        out[(fused, sp)] = _run(m, local(x), local(dy))
    out["clean"] = global_state_is_clean()
    return out


@pytest.fixture(scope="module")
def results():
    return launch(worker, TP)


def _close(got, want, what):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("fused,sp", CASES, ids=CASE_IDS)
def test_layer_matches_single_process(results, fused, sp):
    m = _build(fused)
    full = _full_params(fused)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(full[name])
    ref = _run(m, *_data())
    for rank, r in enumerate(results):
        got = r[(fused, sp)]
        local = (lambda t: t.chunk(TP, 0)[rank]) if sp else (lambda t: t)
        what = f"rank {rank}"
        _close(got["y"], local(ref["y"]), f"{what} y")
        _close(got["dx"], local(ref["dx"]), f"{what} dx")
        if sp:      # the replicated parameters only saw this rank's tokens
            assert got["partial"] and all("norm" in n or n.endswith(("proj.bias", "fc2_bias"))
                                          for n in got["partial"])
        for name, grad in got["grads"].items():
            if name in got["partial"]:
                if rank == 0:
                    total = sum(x[(fused, sp)]["grads"][name] for x in results)
                    _close(total, ref["grads"][name], f"summed grad {name}")
            else:
                _close(grad, _shard(name, ref["grads"][name], rank), f"{what} grad {name}")
        assert r["clean"]
