"""Delayed-scaling amax reduction across real processes (gloo on loopback).

Every rank trains the same three-layer net on its own data (scaled by rank, so each
rank sees different amaxes) and, after each step, its optimizer step makes the
weights differ too. With ``reduce_amax`` every rank must end each step with the
amaxes a MAX over the group gives (checked against each rank's own amaxes, taken
independently with plain torch) and identical scales, through one all-reduce per
update; without it the scales stay local. Also: subgroups as amax reduction groups
(4 ranks), and checkpointing invariance on every rank.
"""

import contextlib

import pytest
import torch
import torch.distributed as dist

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling
from dist_utils import CollectiveCounter, launch
from helpers import assert_runs_equal, capture, fp8_state_snapshot, global_state_is_clean, params

HIDDEN, TOKENS, STEPS, N_MODULES = 32, 16, 3, 3
HISTORY = 4
FP8_MAX_FWD, FP8_MAX_BWD = 448.0, 57344.0      # Format.HYBRID


def _data(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(TOKENS, HIDDEN, generator=g) * (rank + 1) * 2.0 ** step


def _build():
    torch.manual_seed(0)                        # the same initial weights on every rank
    return [te.Linear(HIDDEN, HIDDEN, device="cpu") for _ in range(N_MODULES)]


def _train_recorded(rank, recipe, autocast):
    """STEPS steps; per step the local amaxes (plain torch), the FP8 states after the
    step, and the all_reduce calls made by the forward and by the backward."""
    modules = _build()
    opt = torch.optim.SGD(params(modules), lr=0.1)
    steps = []
    with CollectiveCounter() as counter:
        for step in range(STEPS):
            fwd_local = torch.zeros(N_MODULES, 2)
            bwd_local = torch.zeros(N_MODULES)
            h = _data(rank, step).requires_grad_()
            with autocast(recipe):
                for i, m in enumerate(modules):
                    fwd_local[i, 0] = h.detach().abs().max()
                    fwd_local[i, 1] = m.weight.detach().abs().max()
                    h = m(h)
                    h.register_hook(lambda g, i=i: bwd_local.__setitem__(i, g.abs().max()))
                    h = torch.tanh(h)
            fwd_calls = counter.take()
            h.float().pow(2).mean().backward()
            bwd_calls = counter.take()
            steps.append({"fwd_local": fwd_local, "bwd_local": bwd_local,
                          "states": fp8_state_snapshot(modules),
                          "fwd_calls": fwd_calls, "bwd_calls": bwd_calls})
            opt.step()
            opt.zero_grad()
    return {"steps": steps, "clean": global_state_is_clean()}


# ---- checkpointing invariance on every rank -------------------------------------------

def _invariance_run(rank, placement, checkpoint, use_reentrant):
    torch.manual_seed(0)
    modules = [te.Linear(HIDDEN, HIDDEN, device="cpu") for _ in range(4)]
    pre, a, b, post = modules
    opt = torch.optim.SGD(params(modules), lr=0.5)
    recipe = DelayedScaling(amax_history_len=3)
    calls, forwards, steps = [], [0], []

    def region(h):
        forwards[0] += 1
        if placement == "inner":
            with te.autocast(recipe=recipe, amax_reduction_group=dist.group.WORLD):
                return b(torch.relu(a(h)))
        return b(torch.relu(a(h)))

    with CollectiveCounter() as counter:
        for step in range(STEPS):
            x = _data(rank, step).requires_grad_()
            outer = (te.autocast(recipe=recipe) if placement == "outer"
                     else contextlib.nullcontext())
            with outer:
                h = pre(x)
                h = (te.checkpoint(region, h, use_reentrant=use_reentrant) if checkpoint
                     else region(h))
                y = post(torch.tanh(h))
            loss = y.float().pow(2).mean()
            loss.backward()
            calls.append(counter.take())
            steps.append(capture(loss, [x], params(modules), modules))
            opt.step()
            opt.zero_grad()
    return {"steps": steps, "calls": calls, "forwards": forwards[0]}


INVARIANCE_CASES = [(placement, reentrant) for placement in ("outer", "inner")
                    for reentrant in (True, False)]


def _invariance(rank):
    out = {}
    for placement, reentrant in INVARIANCE_CASES:
        out[(placement, reentrant)] = {
            "plain": _invariance_run(rank, placement, False, reentrant),
            "ckpt": _invariance_run(rank, placement, True, reentrant)}
    out["clean"] = global_state_is_clean()
    return out


# ---- the workers ---------------------------------------------------------------------

def _world(recipe):
    return te.autocast(recipe=recipe, amax_reduction_group=dist.group.WORLD)


def _default_group(recipe):
    return te.autocast(recipe=recipe)           # None: the default (world) group


def worker_2(rank, world_size):
    return {
        "reduce": _train_recorded(rank, DelayedScaling(amax_history_len=HISTORY), _world),
        "reduce_default_group": _train_recorded(rank, DelayedScaling(amax_history_len=HISTORY),
                                                _default_group),
        "local": _train_recorded(rank, DelayedScaling(amax_history_len=HISTORY,
                                                      reduce_amax=False), _world),
        "invariance": _invariance(rank),
    }


SUBGROUPS = [[0, 1], [2, 3]]


def worker_4(rank, world_size):
    groups = [dist.new_group(ranks) for ranks in SUBGROUPS]   # every rank makes every group
    mine = groups[rank // 2]
    sub = lambda recipe: te.fp8_autocast(fp8_recipe=recipe, fp8_group=mine)
    return {
        "reduce": _train_recorded(rank, DelayedScaling(amax_history_len=HISTORY), _world),
        "local": _train_recorded(rank, DelayedScaling(amax_history_len=HISTORY,
                                                      reduce_amax=False), _world),
        "subgroup": _train_recorded(rank, DelayedScaling(amax_history_len=HISTORY), sub),
    }


@pytest.fixture(scope="module")
def results():
    cache = {}

    def get(world_size):
        if world_size not in cache:
            cache[world_size] = launch(worker_2 if world_size == 2 else worker_4, world_size)
        return cache[world_size]
    return get


WORLD_SIZES = [2, 4]


# ---- helpers for the checks ------------------------------------------------------------

def _reduced_row(state):
    """The amaxes the update just used: the live row, rolled to the end of the history."""
    return state.amax_history[-1]


def _check_reduced(per_rank, ranks_of, max_values):
    """Every rank's last amax row is the MAX over its group's local amaxes, its scales
    equal its group's, and the scale is fp8_max / max(history) (the "max" algorithm)."""
    for step in range(STEPS):
        for rank, run in enumerate(per_rank):
            group = ranks_of(rank)
            for i in range(N_MODULES):
                for direction, local_key, fp8_max in (("fwd", "fwd_local", max_values[0]),
                                                      ("bwd", "bwd_local", max_values[1])):
                    state = getattr(run["steps"][step]["states"][i], direction)
                    expected = torch.stack([per_rank[r]["steps"][step][local_key][i]
                                            for r in group]).amax(0).reshape(-1)
                    assert torch.equal(_reduced_row(state), expected), (
                        f"step {step} rank {rank} module {i} {direction}: reduced amaxes "
                        f"{_reduced_row(state)} != max over ranks {group} {expected}")
                    other = getattr(per_rank[group[0]]["steps"][step]["states"][i], direction)
                    assert torch.equal(state.scale, other.scale), (
                        f"step {step} module {i} {direction}: rank {rank} scale {state.scale} "
                        f"!= rank {group[0]} scale {other.scale}")
                    want = (fp8_max / state.amax_history.double().amax(0)).float()
                    torch.testing.assert_close(state.scale, want, rtol=1e-6, atol=0)


# ---- the tests -----------------------------------------------------------------------

@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reduced_amaxes_and_identical_scales(results, world_size):
    per_rank = [r["reduce"] for r in results(world_size)]
    _check_reduced(per_rank, lambda rank: list(range(world_size)), (FP8_MAX_FWD, FP8_MAX_BWD))
    # The ranks really saw different amaxes: the reduction changed rank 0's.
    for step in range(STEPS):
        local0 = per_rank[0]["steps"][step]["fwd_local"]
        reduced0 = torch.stack([_reduced_row(st.fwd)
                                for st in per_rank[0]["steps"][step]["states"]])
        assert (local0 < reduced0).any(), f"step {step}: rank 0 saw the largest amaxes"
    assert all(r["clean"] for r in per_rank)


def test_default_group_is_the_world(results):
    per_rank = [r["reduce_default_group"] for r in results(2)]
    _check_reduced(per_rank, lambda rank: [0, 1], (FP8_MAX_FWD, FP8_MAX_BWD))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_one_all_reduce_per_update(results, world_size):
    """One MAX all-reduce of all modules' amaxes per update, not one per module."""
    for rank, r in enumerate(results(world_size)):
        for step, s in enumerate(r["reduce"]["steps"]):
            assert s["fwd_calls"] == [("RedOpType.MAX", world_size, N_MODULES * 2)], (
                f"rank {rank} step {step}: forward collectives {s['fwd_calls']}")
            assert s["bwd_calls"] == [("RedOpType.MAX", world_size, N_MODULES)], (
                f"rank {rank} step {step}: backward collectives {s['bwd_calls']}")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reduce_amax_false_keeps_scales_local(results, world_size):
    per_rank = [r["local"] for r in results(world_size)]
    for step in range(STEPS):
        for rank, run in enumerate(per_rank):
            s = run["steps"][step]
            assert s["fwd_calls"] == [] and s["bwd_calls"] == [], f"rank {rank}: collectives"
            for i in range(N_MODULES):
                assert torch.equal(_reduced_row(s["states"][i].fwd), s["fwd_local"][i])
                assert torch.equal(_reduced_row(s["states"][i].bwd), s["bwd_local"][i:i + 1])
        scales = [run["steps"][step]["states"][0].fwd.scale for run in per_rank]
        assert not torch.equal(scales[0], scales[-1]), f"step {step}: scales did not stay local"


def test_subgroups_reduce_within_their_group(results):
    """4 ranks, amax reduction groups {0, 1} and {2, 3} (through fp8_autocast's
    fp8_group): identical scales within a group, different across groups."""
    per_rank = [r["subgroup"] for r in results(4)]
    _check_reduced(per_rank, lambda rank: SUBGROUPS[rank // 2], (FP8_MAX_FWD, FP8_MAX_BWD))
    for rank, run in enumerate(per_rank):
        assert run["steps"][0]["fwd_calls"] == [("RedOpType.MAX", 2, N_MODULES * 2)], rank
    for step in range(STEPS):
        a = per_rank[0]["steps"][step]["states"][0].fwd.scale
        b = per_rank[2]["steps"][step]["states"][0].fwd.scale
        assert not torch.equal(a, b), f"step {step}: the two groups ended with equal scales"


@pytest.mark.parametrize("placement,use_reentrant", INVARIANCE_CASES,
                         ids=[f"{p}-{'reentrant' if r else 'non-reentrant'}"
                              for p, r in INVARIANCE_CASES])
def test_checkpoint_invariance_on_every_rank(results, placement, use_reentrant):
    per_rank = results(2)
    for rank, r in enumerate(per_rank):
        case = r["invariance"][(placement, use_reentrant)]
        plain, ckpt = case["plain"], case["ckpt"]
        assert plain["forwards"] == STEPS and ckpt["forwards"] == 2 * STEPS   # recompute ran
        assert_runs_equal(plain["steps"], ckpt["steps"], f"rank {rank}")
        assert ckpt["calls"] == plain["calls"], f"rank {rank}: collectives differ"
        assert all(len(c) == 2 for c in plain["calls"])     # one forward, one backward update
        assert r["invariance"]["clean"]
    # ... and the ranks were really reduced together (their data differ).
    for step in range(STEPS):
        s0 = per_rank[0]["invariance"][(placement, use_reentrant)]["ckpt"]["steps"][step]
        s1 = per_rank[1]["invariance"][(placement, use_reentrant)]["ckpt"]["steps"][step]
        assert torch.equal(s0.states[1].fwd.scale, s1.states[1].fwd.scale)
        assert not torch.equal(s0.loss, s1.loss)


# ---- under torch.compile ---------------------------------------------------------------

def _compiled_vs_eager(rank, world_size):
    """Per autocast placement ("inside", "outside" the compiled function): the FP8
    states after each of STEPS steps, eager and compiled (aot_eager: the eager ops)."""
    recipe = DelayedScaling(amax_history_len=HISTORY)
    group = dist.group.WORLD
    results = {}
    for placement in ("inside", "outside"):
        for compiled in (False, True):
            modules = _build()

            def fn(x):
                with (te.autocast(recipe=recipe, amax_reduction_group=group)
                      if placement == "inside" else contextlib.nullcontext()):
                    for m in modules:
                        x = torch.tanh(m(x))
                    return x

            run = torch.compile(fn, fullgraph=True, backend="aot_eager") if compiled else fn
            states = []
            for step in range(STEPS):
                x = _data(rank, step).requires_grad_()
                with (te.autocast(recipe=recipe, amax_reduction_group=group)
                      if placement == "outside" else contextlib.nullcontext()):
                    y = run(x)
                y.float().pow(2).mean().backward()
                states.append(fp8_state_snapshot(modules))
            results[placement, compiled] = states
    return results


def test_compiled_training_reduces_amaxes_as_eager():
    """torch.compile(fullgraph=True) with the amax-reduction group of te.autocast
    (opened inside or outside the compiled function): every rank's FP8 state after
    every step equals the eager run's bit for bit (the ranks see different amaxes, so
    a missing reduction would differ), and the ranks agree."""
    from helpers import assert_states_equal
    per_rank = launch(_compiled_vs_eager, 2, timeout_s=300)
    for rank, results in enumerate(per_rank):
        for placement in ("inside", "outside"):
            for step, (eager, compiled) in enumerate(zip(results[placement, False],
                                                         results[placement, True])):
                assert_states_equal(eager, compiled, f"rank {rank} {placement} step {step}")
    for placement in ("inside", "outside"):
        for a, b in zip(per_rank[0][placement, True], per_rank[1][placement, True]):
            for x, y in zip(a, b):
                assert torch.equal(x.fwd.scale, y.fwd.scale)
