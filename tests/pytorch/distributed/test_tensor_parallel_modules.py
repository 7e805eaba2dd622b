"""Tensor-parallel te.LayerNormLinear (column) and te.LayerNormMLP (set_parallel_mode)
on 2 real processes against the single-process module built from the same full
parameters, forward and backward, with and without sequence parallelism, in high
precision and FP8.

Unlike te.Linear's test the data are not dyadic (the normalization makes them
arbitrary), so values compare within float32 rounding of a different summation
order, while the FP8 scales and amax histories, taken from tensors that both
layouts compute the same way, compare bit for bit.
"""

import pytest
import torch
import torch.distributed as dist

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling
from dist_utils import launch
from helpers import assert_states_equal, fp8_state_snapshot, global_state_is_clean

TP = 2
SEQ, BATCH, HIDDEN, OUT, FFN = 32, 2, 32, 64, 64
STEPS = 2
RECIPE = DelayedScaling(amax_history_len=2)

CASES = [(kind, sp, precision)
         for kind in ("ln_linear", "ln_mlp-gelu", "ln_mlp-swiglu", "ln_mlp-gelu-checkpoint")
         for sp in (False, True) for precision in ("hp", "fp8")]
CASE_IDS = [f"{k}{'-sp' if sp else ''}-{p}" for k, sp, p in CASES]


def _activation(kind):
    return "swiglu" if "swiglu" in kind else "gelu"


def _build(kind, **tp):
    if kind == "ln_linear":
        return te.LayerNormLinear(HIDDEN, OUT, device="cpu",
                                  **({"parallel_mode": "column", **tp} if tp else {}))
    mlp_tp = {"set_parallel_mode": True, **tp} if tp else {}
    return te.LayerNormMLP(HIDDEN, FFN, activation=_activation(kind), device="cpu",
                           checkpoint=kind.endswith("checkpoint"), **mlp_tp)


def _full_params(kind):
    """Seeded full parameters (the norm's too, so that they matter)."""
    g = torch.Generator().manual_seed(7)
    m = _build(kind)
    out = {}
    for name, p in m.named_parameters():
        base = 1.0 if name == "layer_norm_weight" else 0.0
        out[name] = base + torch.randn(p.shape, generator=g) * 0.1
    return out


def _shard(name, full, rank, gated):
    """This rank's part of a full parameter (or of its gradient)."""
    if name in ("weight", "bias", "fc1_weight", "fc1_bias"):
        if gated and name.startswith("fc1"):
            a, b = full.chunk(2, dim=0)
            return torch.cat([a.chunk(TP, 0)[rank], b.chunk(TP, 0)[rank]])
        return full.chunk(TP, 0)[rank]
    if name == "fc2_weight":
        return full.chunk(TP, 1)[rank]
    return full                                 # norm parameters, fc2_bias: replicated


def _data(kind, step):
    g = torch.Generator().manual_seed(50 + step)
    out_features = OUT if kind == "ln_linear" else HIDDEN
    return (torch.randn(SEQ, BATCH, HIDDEN, generator=g) * 2.0 ** step,
            torch.randn(SEQ, BATCH, out_features, generator=g))


def _local_output(kind, sp, rank, t):
    """This rank's part of an output-shaped tensor: a column layer's local features
    (whole sequence), or the MLP's whole features (this rank's sequence slice with
    sequence parallelism)."""
    if kind == "ln_linear":
        return t.chunk(TP, -1)[rank]
    return t.chunk(TP, 0)[rank] if sp else t


def _local_io(kind, sp, rank, x, g):
    return (x.chunk(TP, 0)[rank] if sp else x), _local_output(kind, sp, rank, g)


def _run(m, kind, fp8, io, group):
    steps = []
    for step in range(STEPS):
        x, g = io(*_data(kind, step))
        x = x.clone().requires_grad_()
        with te.autocast(enabled=fp8, recipe=RECIPE, amax_reduction_group=group):
            y = m(x)
        y.backward(g)
        steps.append({"y": y.detach(), "dx": x.grad,
                      "grads": {n: p.grad.clone() for n, p in m.named_parameters()},
                      "state": fp8_state_snapshot([m])})
        m.zero_grad()
    return steps


def worker(rank, world_size):
    out = {}
    for kind, sp, precision in CASES:
        full = _full_params(kind)
        m = _build(kind, sequence_parallel=sp, tp_group=dist.group.WORLD)
        gated = _activation(kind) == "swiglu"
        with torch.no_grad():
            for name, p in m.named_parameters():
                p.copy_(_shard(name, full[name], rank, gated))
        partial = sorted(n for n, p in m.named_parameters() if getattr(p, "sequence_parallel", False))
        out[(kind, sp, precision)] = {
            "steps": _run(m, kind, precision == "fp8",
                          lambda x, g: _local_io(kind, sp, rank, x, g), dist.group.WORLD),
            "partial": partial}
    errors = {}
    try:
        te.LayerNormLinear(HIDDEN, OUT, parallel_mode="row", tp_group=dist.group.WORLD,
                           device="cpu")
    except ValueError as err:
        errors["row"] = str(err)
    out["errors"], out["clean"] = errors, global_state_is_clean()
    return out


@pytest.fixture(scope="module")
def results():
    return launch(worker, TP)


@pytest.fixture(scope="module")
def references():
    refs = {}
    for kind, _, precision in CASES:
        if (kind, precision) not in refs:
            m = _build(kind)
            with torch.no_grad():
                for name, p in m.named_parameters():
                    p.copy_(_full_params(kind)[name])
            refs[(kind, precision)] = _run(m, kind, precision == "fp8", lambda x, g: (x, g),
                                           None)
    return refs


def _close(got, want, what):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("kind,sp,precision", CASES, ids=CASE_IDS)
def test_module_matches_single_process(results, references, kind, sp, precision):
    gated = _activation(kind) == "swiglu"
    expected_partial = ([] if not sp else
                        sorted(["layer_norm_bias", "layer_norm_weight"]
                               + ([] if kind == "ln_linear" else ["fc2_bias"])))
    for rank, r in enumerate(results):
        case = r[(kind, sp, precision)]
        assert case["partial"] == expected_partial
        for step, (got, ref) in enumerate(zip(case["steps"], references[(kind, precision)])):
            what = f"rank {rank} step {step}"
            _close(got["y"], _local_output(kind, sp, rank, ref["y"]), f"{what} y")
            _close(got["dx"], ref["dx"].chunk(TP, 0)[rank] if sp else ref["dx"], f"{what} dx")
            for name, grad in got["grads"].items():
                if name in case["partial"]:     # partial per rank: summed over the group
                    if rank == 0:
                        total = sum(x[(kind, sp, precision)]["steps"][step]["grads"][name]
                                    for x in results)
                        _close(total, ref["grads"][name], f"{what} summed grad {name}")
                else:
                    _close(grad, _shard(name, ref["grads"][name], rank, gated),
                           f"{what} grad {name}")
            assert_states_equal(got["state"], ref["state"], what)
        assert r["clean"]


def test_fp8_really_ran(references):
    for kind in ("ln_linear", "ln_mlp-gelu"):
        y_hp, y_fp8 = references[(kind, "hp")][1]["y"], references[(kind, "fp8")][1]["y"]
        assert (y_hp - y_fp8).abs().max() > 1e-3 * y_hp.abs().max()


def test_layernorm_linear_refuses_row(results):
    assert "parallel_mode='row' would split the input features" in results[0]["errors"]["row"]


def test_layernorm_mlp_ffn_not_divisible():
    with pytest.raises(ValueError, match="te.LayerNormMLP: ffn_hidden_size=48 must be divisible "
                                         "by tp_size=32"):
        te.LayerNormMLP(HIDDEN, 48, set_parallel_mode=True, tp_size=32, device="cpu")
