"""Tensor-parallel te.Linear on 2 real processes against a single-process te.Linear
built from the same full weights, forward and backward, bit for bit.

Bitwise equality across a different summation order needs exact float32 sums: the
weights, inputs and output gradients are small dyadic numbers, and the FP8 recipe
scales by powers of two, so every product and partial sum is exact and the FP8
casts round the same elements the same way on every layout. The inputs are not all
FP8-representable, so the FP8 runs differ from the high-precision ones (checked).

Also: the TP pair (column -> row, with and without sequence parallelism) trains
identically with and without checkpointing on every rank, inner autocast included.
"""

import contextlib

import pytest
import torch
import torch.distributed as dist

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling
from dist_utils import CollectiveCounter, launch
from helpers import (assert_runs_equal, assert_states_equal, capture, fp8_state_snapshot,
                     global_state_is_clean)

TP = 2
SEQ, BATCH, K, N = 32, 2, 32, 64
STEPS = 2


def _pow2_scale(amax, scale, fp8_max, recipe):
    """Largest power of two with amax * scale <= fp8_max (old scale where amax is 0)."""
    new = torch.exp2(torch.floor(torch.log2(fp8_max / amax)))
    return torch.where((amax > 0) & torch.isfinite(amax), new, scale)


def _recipe(reduce_amax=True):
    return DelayedScaling(amax_history_len=2, scaling_factor_compute_algo=_pow2_scale,
                          reduce_amax=reduce_amax)


def _dyadic(shape, denominator, bound, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-bound, bound + 1, shape, generator=g).float() / denominator


def _halves(size, second):
    """1 on the first half of a dimension, ``second`` on the other (so the TP shards,
    and the sequence-parallel shards, see different amaxes)."""
    return torch.cat([torch.ones(size // 2), torch.full((size // 2,), second)])


def _full_params():
    w = _dyadic((N, K), 8, 16, 1) * _halves(N, 0.25)[:, None] * _halves(K, 0.5)[None, :]
    return w, _dyadic((N,), 8, 16, 2)


def _step_data(step):
    """The full input and output gradient of a step (the same on every rank)."""
    x = _dyadic((SEQ, BATCH, K), 16, 32, 10 + step) * 2.0 ** step
    g = _dyadic((SEQ, BATCH, N), 16, 32, 20 + step)
    return (x * _halves(SEQ, 0.25)[:, None, None] * _halves(K, 0.5),
            g * _halves(SEQ, 0.5)[:, None, None] * _halves(N, 0.25))


def _cols(t, rank, size):
    return t.chunk(TP, dim=-1)[rank] if size > 1 else t


def _seq(t, rank):
    return t.chunk(TP, dim=0)[rank]


def _local_input(x, mode, sp, rank):
    if mode == "column":
        return _seq(x, rank) if sp else x
    return _cols(x, rank, TP)


def _local_grad(g, mode, sp, rank):
    if mode == "column":
        return _cols(g, rank, TP)
    return _seq(g, rank) if sp else g


def _run_linear(m, x_for_step, g_for_step, fp8, recipe, group):
    steps = []
    for step in range(STEPS):
        x, g = _step_data(step)
        x = x_for_step(x).clone().requires_grad_()
        with te.autocast(enabled=fp8, recipe=recipe, amax_reduction_group=group):
            y = m(x)
        y.backward(g_for_step(g))
        steps.append({"y": y.detach(), "dx": x.grad, "dw": m.weight.grad.clone(),
                      "db": m.bias.grad.clone(), "state": fp8_state_snapshot([m])})
        m.zero_grad()
    return steps


CASES = [(mode, sp, precision) for mode in ("column", "row") for sp in (False, True)
         for precision in ("hp", "fp8")]
CASE_IDS = [f"{m}{'-sp' if sp else ''}-{p}" for m, sp, p in CASES]


def _tp_linear(rank, mode, sp, late_group=False):
    w, b = _full_params()
    if late_group:      # TE's tp_size + set_tensor_parallel_group path
        m = te.Linear(K, N, parallel_mode=mode, sequence_parallel=sp, tp_size=TP, device="cpu")
        m.set_tensor_parallel_group(dist.group.WORLD)
    else:
        m = te.Linear(K, N, parallel_mode=mode, sequence_parallel=sp,
                      tp_group=dist.group.WORLD, device="cpu")
    with torch.no_grad():
        if mode == "column":
            m.weight.copy_(w.chunk(TP, 0)[rank])
            m.bias.copy_(b.chunk(TP, 0)[rank])
        else:
            m.weight.copy_(w.chunk(TP, 1)[rank])
            m.bias.copy_(b)
    return m


def _linear_cases(rank):
    out = {}
    for i, (mode, sp, precision) in enumerate(CASES):
        m = _tp_linear(rank, mode, sp, late_group=(i == 0))
        out[(mode, sp, precision)] = {
            "steps": _run_linear(m, lambda x: _local_input(x, mode, sp, rank),
                                 lambda g: _local_grad(g, mode, sp, rank),
                                 precision == "fp8", _recipe(), dist.group.WORLD),
            "weight_shape": tuple(m.weight.shape), "bias_sp": getattr(m.bias, "sequence_parallel",
                                                                       False)}
    # FP8 without amax reduction: the TP ranks' scales are local.
    m = _tp_linear(rank, "column", False)
    out["no_reduce"] = _run_linear(m, lambda x: x, lambda g: _cols(g, rank, TP), True,
                                   _recipe(reduce_amax=False), dist.group.WORLD)
    return out


def _errors():
    found = {}
    try:
        te.Linear(K, N, parallel_mode="column", tp_group=dist.group.WORLD, tp_size=4,
                  device="cpu")
    except ValueError as err:
        found["tp_size_mismatch"] = str(err)
    m = te.Linear(K, N, parallel_mode="column", tp_size=4, device="cpu")
    try:
        m.set_tensor_parallel_group(dist.group.WORLD)
    except ValueError as err:
        found["late_group_mismatch"] = str(err)
    m = te.Linear(K, N, parallel_mode="row", sequence_parallel=True, tp_group=dist.group.WORLD,
                  device="cpu")
    try:
        m(torch.randn(3, 2, K // TP))
    except ValueError as err:
        found["sp_seq_not_divisible"] = str(err)
    return found


# ---- the TP pair, with and without checkpointing ---------------------------------------

class TPBlock(torch.nn.Module):
    """column Linear -> gelu -> row Linear, the Megatron-style MLP split."""

    def __init__(self, rank, sp):
        super().__init__()
        torch.manual_seed(0)
        w1, w2 = torch.randn(N, K) * 0.1, torch.randn(K, N) * 0.1
        self.fc1 = te.Linear(K, N, parallel_mode="column", sequence_parallel=sp,
                             tp_group=dist.group.WORLD, device="cpu")
        self.fc2 = te.Linear(N, K, parallel_mode="row", sequence_parallel=sp,
                             tp_group=dist.group.WORLD, device="cpu")
        with torch.no_grad():
            self.fc1.weight.copy_(w1.chunk(TP, 0)[rank])
            self.fc2.weight.copy_(w2.chunk(TP, 1)[rank])

    def forward(self, x, placement, recipe):
        if placement == "inner":
            with te.autocast(recipe=recipe, amax_reduction_group=dist.group.WORLD):
                return self.fc2(torch.nn.functional.gelu(self.fc1(x)))
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def _block_run(rank, sp, placement, checkpoint, use_reentrant):
    block = TPBlock(rank, sp)
    head = te.Linear(K, K, device="cpu")
    params = list(block.parameters()) + list(head.parameters())
    opt = torch.optim.SGD(params, lr=0.5)
    recipe = DelayedScaling(amax_history_len=3)
    forwards, steps, calls = [0], [], []

    def region(h):
        forwards[0] += 1
        return block(h, placement, recipe)

    with CollectiveCounter() as counter:
        for step in range(3):
            g = torch.Generator().manual_seed(100 * step + (rank if sp else 0))
            x = (torch.randn(SEQ // TP if sp else SEQ, BATCH, K, generator=g)
                 * 2.0 ** step).requires_grad_()
            outer = (te.autocast(recipe=recipe, amax_reduction_group=dist.group.WORLD)
                     if placement == "outer" else contextlib.nullcontext())
            with outer:
                h = te.checkpoint(region, x, use_reentrant=use_reentrant) if checkpoint \
                    else region(x)
                y = head(torch.tanh(h))
            loss = y.float().pow(2).mean()
            loss.backward()
            steps.append(capture(loss, [x], params, [block.fc1, block.fc2, head]))
            calls.append(counter.take())
            opt.step()
            opt.zero_grad()
    return {"steps": steps, "calls": calls, "forwards": forwards[0]}


BLOCK_CASES = [(sp, placement, reentrant) for sp in (False, True)
               for placement in ("outer", "inner") for reentrant in (True, False)]
BLOCK_IDS = [f"{'sp-' if sp else ''}{p}-{'reentrant' if r else 'non-reentrant'}"
             for sp, p, r in BLOCK_CASES]


def worker(rank, world_size):
    out = {"linear": _linear_cases(rank), "errors": _errors(), "blocks": {}}
    for case in BLOCK_CASES:
        sp, placement, reentrant = case
        out["blocks"][case] = {"plain": _block_run(rank, sp, placement, False, reentrant),
                               "ckpt": _block_run(rank, sp, placement, True, reentrant)}
    out["clean"] = global_state_is_clean()
    return out


@pytest.fixture(scope="module")
def results():
    return launch(worker, TP)


# ---- the single-process reference -------------------------------------------------------

def _reference(precision, recipe=None):
    w, b = _full_params()
    m = te.Linear(K, N, device="cpu")
    with torch.no_grad():
        m.weight.copy_(w)
        m.bias.copy_(b)
    return _run_linear(m, lambda x: x, lambda g: g, precision == "fp8", recipe or _recipe(),
                       None)


@pytest.fixture(scope="module")
def references():
    return {p: _reference(p) for p in ("hp", "fp8")}


def _expected_local(ref, mode, sp, rank):
    """What rank ``rank`` of a TP layer should hold, from the full reference."""
    if mode == "column":
        return {"y": _cols(ref["y"], rank, TP), "dx": _seq(ref["dx"], rank) if sp else ref["dx"],
                "dw": ref["dw"].chunk(TP, 0)[rank], "db": ref["db"].chunk(TP, 0)[rank]}
    return {"y": _seq(ref["y"], rank) if sp else ref["y"], "dx": _cols(ref["dx"], rank, TP),
            "dw": ref["dw"].chunk(TP, 1)[rank], "db": ref["db"]}


@pytest.mark.parametrize("mode,sp,precision", CASES, ids=CASE_IDS)
def test_linear_matches_single_process(results, references, mode, sp, precision):
    for rank, r in enumerate(results):
        case = r["linear"][(mode, sp, precision)]
        assert case["weight_shape"] == ((N // TP, K) if mode == "column" else (N, K // TP))
        for step, (got, ref) in enumerate(zip(case["steps"], references[precision])):
            want = _expected_local(ref, mode, sp, rank)
            for key in ("y", "dx", "dw"):
                assert torch.equal(got[key], want[key]), (
                    f"rank {rank} step {step} {key}: max |diff| "
                    f"{(got[key] - want[key]).abs().max()}")
            if mode == "row" and sp:
                # Each rank's bias gradient covers its own tokens: summed over the group
                # (the parameter is marked sequence_parallel for that).
                assert case["bias_sp"]
                if rank == 0:
                    total = sum(x["linear"][(mode, sp, precision)]["steps"][step]["db"]
                                for x in results)
                    assert torch.equal(total, want["db"]), f"step {step}: summed bias grad"
            else:
                assert torch.equal(got["db"], want["db"]), f"rank {rank} step {step}: db"


@pytest.mark.parametrize("mode,sp", [(m, s) for m in ("column", "row") for s in (False, True)],
                         ids=["column", "column-sp", "row", "row-sp"])
def test_fp8_states_match_single_process(results, references, mode, sp):
    """With the amax reduction over the TP group every rank ends each step with the
    scales and amax histories a single process holding the full tensors has."""
    for step in range(STEPS):
        ref = references["fp8"][step]["state"]
        for rank, r in enumerate(results):
            got = r["linear"][(mode, sp, "fp8")]["steps"][step]["state"]
            assert_states_equal(got, ref, f"rank {rank} step {step}")
        assert not torch.equal(ref[0].fwd.scale, torch.ones(2)), "scales never moved"


def test_fp8_really_ran(references):
    for step in range(STEPS):
        assert not torch.equal(references["fp8"][step]["y"], references["hp"][step]["y"])


def test_without_reduction_tp_scales_differ(results):
    """reduce_amax=False: each rank scales by its own weight shard's amax."""
    s0 = results[0]["linear"]["no_reduce"][0]["state"][0].fwd.scale
    s1 = results[1]["linear"]["no_reduce"][0]["state"][0].fwd.scale
    assert torch.equal(s0[0], s1[0])            # the input is replicated
    assert not torch.equal(s0[1], s1[1])        # the weight shards differ


def test_tp_argument_errors_in_workers(results):
    errors = results[0]["errors"]
    assert "tp_size=4 does not match the size of tp_group (2)" in errors["tp_size_mismatch"]
    assert "split for tp_size=4, but the group has 2 ranks" in errors["late_group_mismatch"]
    assert "make the sequence length divisible by tp_size=2" in errors["sp_seq_not_divisible"]


@pytest.mark.parametrize("sp,placement,use_reentrant", BLOCK_CASES, ids=BLOCK_IDS)
def test_tp_block_checkpoint_invariance_on_every_rank(results, sp, placement, use_reentrant):
    for rank, r in enumerate(results):
        case = r["blocks"][(sp, placement, use_reentrant)]
        plain, ckpt = case["plain"], case["ckpt"]
        assert plain["forwards"] == 3 and ckpt["forwards"] == 6      # the recompute ran
        assert_runs_equal(plain["steps"], ckpt["steps"], f"rank {rank}")
        # The recompute adds TP collectives (its forward) but no amax reduction.
        max_calls = lambda calls: [c for c in calls if c[0] == "RedOpType.MAX"]
        for step, (a, b) in enumerate(zip(plain["calls"], ckpt["calls"], strict=True)):
            assert max_calls(a) == max_calls(b), f"rank {rank} step {step}: amax reductions"
        assert r["clean"]
    # The TP ranks share their FP8 block scales (the amax reduction spans the group).
    for step in range(3):
        states = [r["blocks"][(sp, placement, use_reentrant)]["ckpt"]["steps"][step].states
                  for r in results]
        for i in (0, 1):
            assert torch.equal(states[0][i].fwd.scale, states[1][i].fwd.scale)


# ---- argument checks, single process (no process group) ---------------------------------

def _compiled_row_worker(rank, world_size):
    """A row-parallel te.Linear, eager and compiled (``aot_eager``), in high precision
    and FP8: output and gradients of one step each."""
    out = {}
    for precision in ("hp", "fp8"):
        runs = []
        for compiled in (False, True):
            torch.manual_seed(0)
            m = te.Linear(K, N, parallel_mode="row", tp_group=dist.group.WORLD, device="cpu")
            recipe = DelayedScaling(amax_history_len=2)

            def fn(x):
                with te.autocast(enabled=precision == "fp8", recipe=recipe):
                    return m(x)

            run = torch.compile(fn, fullgraph=True, backend="aot_eager") if compiled else fn
            x = _dyadic((SEQ * BATCH, K // TP), 16, 32, 20 + rank).requires_grad_()
            y = run(x)
            y.pow(2).sum().backward()
            runs.append([y.detach(), x.grad, m.weight.grad, m.bias.grad])
        out[precision] = runs
    return out


def test_compiled_row_parallel_trains_as_eager():
    """The row-parallel output's all-reduce inside a compiled function: the same output
    and gradients as eager on every rank (under torch 2.11 an all-reduce done in place
    on the autograd function's result zeroed the input gradient, NOTE [Fresh function
    results] in function_results.py)."""
    for rank, out in enumerate(launch(_compiled_row_worker, TP)):
        for precision, (eager, compiled) in out.items():
            assert eager[1].abs().sum() > 0, "the input gradient is zero in eager mode"
            for name, a, b in zip(("y", "dx", "dw", "db"), eager, compiled):
                assert torch.equal(a, b), f"rank {rank} {precision}: {name} differs"


def test_bad_parallel_mode():
    with pytest.raises(ValueError, match=r"te.Linear: parallel_mode must be one of .* got 'Column'"):
        te.Linear(K, N, parallel_mode="Column", device="cpu")


def test_features_not_divisible():
    with pytest.raises(ValueError, match="te.Linear: out_features=30 must be divisible by tp_size=4"):
        te.Linear(K, 30, parallel_mode="column", tp_size=4, device="cpu")
    with pytest.raises(ValueError, match="te.Linear: in_features=30 must be divisible by tp_size=4"):
        te.Linear(30, N, parallel_mode="row", tp_size=4, device="cpu")


def test_tp_group_type():
    with pytest.raises(TypeError, match="te.Linear: tp_group must be a torch.distributed.ProcessGroup"):
        te.Linear(K, N, parallel_mode="column", tp_group="world", device="cpu")


def test_forward_without_group_says_how_to_fix():
    m = te.Linear(K, N, parallel_mode="column", tp_size=2, device="cpu")
    assert m.weight.shape == (N // 2, K) and m.weight.partition_dim == 0
    with pytest.raises(ValueError, match=r"no tp_group; pass tp_group= or call "
                                         r"set_tensor_parallel_group\(group\)"):
        m(torch.randn(16, K))


def test_tp_size_one_is_plain_linear():
    """parallel_mode with tp_size=1 communicates nothing and computes a plain linear."""
    torch.manual_seed(0)
    m = te.Linear(K, N, parallel_mode="row", sequence_parallel=True, device="cpu")
    x = torch.randn(16, K, dtype=torch.float64)
    y = m(x.float())
    want = x @ m.weight.detach().double().t() + m.bias.detach().double()
    torch.testing.assert_close(y.double(), want, rtol=1e-6, atol=1e-6)
