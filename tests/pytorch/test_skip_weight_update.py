"""``FP8GlobalStateManager.set_skip_fp8_weight_update_tensor``: the device flag that
replaces ``is_first_microbatch`` in a forward captured in a CUDA graph (NOTE
[Skip-update flag] in module/fp8_operands.py).

On the CPU no graph is captured, so the tests make ``fp8_graph_capturing()`` say so
(the modules ask through the class attribute) and run the flagged path eagerly: a
schedule driven by the flag must be bit-identical to the same schedule driven by
``is_first_microbatch``, with te.checkpoint too. The weights are changed between
micro-batches on purpose, so that keeping the cached FP8 weight and casting it afresh
give different results, and the flag's effect shows.
"""

import copy

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import (DelayedScaling, Float8BlockScaling,
                                              Float8CurrentScaling)
from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
from helpers import (REENTRANT, assert_runs_equal, assert_tensors_equal, capture, cuda_fp8,
                     te_modules)

RECIPES = [pytest.param(DelayedScaling(amax_history_len=4), id="delayed"),
           pytest.param(Float8CurrentScaling(), id="current"),
           pytest.param(Float8BlockScaling(), id="block")]
MODULES = [
    pytest.param(lambda: te.Linear(32, 32, device="cpu"), (), id="linear"),
    pytest.param(lambda: te.LayerNormMLP(32, 64, device="cpu"), (), id="lnmlp"),
    pytest.param(lambda: te.GroupedLinear(2, 32, 32, device="cpu"), ([8, 24],), id="grouped"),
]


@pytest.fixture
def skip_flag():
    """The flag API, with the flag dropped again after the test."""
    try:
        yield FP8GlobalStateManager
    finally:
        FP8GlobalStateManager.reset()


@pytest.fixture
def capturing(monkeypatch):
    """Module forwards behave as inside a CUDA graph capture."""
    monkeypatch.setattr(FP8GlobalStateManager, "fp8_graph_capturing", classmethod(lambda cls: True))


# ---- the API -------------------------------------------------------------------------------

def test_flag_is_one_float32_tensor_filled_in_place(skip_flag):
    assert skip_flag.get_skip_fp8_weight_update_tensor() is None
    skip_flag.set_skip_fp8_weight_update_tensor(True)
    flag = skip_flag.get_skip_fp8_weight_update_tensor()
    assert flag.dtype == torch.float32 and flag.shape == (1,) and flag.item() == 1.0
    pointer = flag.data_ptr()
    skip_flag.set_skip_fp8_weight_update_tensor(False)
    assert skip_flag.get_skip_fp8_weight_update_tensor() is flag and flag.item() == 0.0
    skip_flag.set_skip_fp8_weight_update_tensor(torch.tensor(1.0))
    assert flag.data_ptr() == pointer and flag.item() == 1.0
    skip_flag.reset()
    assert skip_flag.get_skip_fp8_weight_update_tensor() is None


def test_flag_refuses_other_values(skip_flag):
    api = "FP8GlobalStateManager.set_skip_fp8_weight_update_tensor"
    with pytest.raises(TypeError, match=f"{api}: skip must be a bool, a number or a "
                                        "one-element tensor, got str"):
        skip_flag.set_skip_fp8_weight_update_tensor("yes")
    with pytest.raises(ValueError, match=rf"{api}: .*got a torch.float32 tensor of shape \(2,\)"):
        skip_flag.set_skip_fp8_weight_update_tensor(torch.ones(2))
    assert skip_flag.get_skip_fp8_weight_update_tensor() is None


# ---- micro-batch schedules -------------------------------------------------------------------

def _schedule(make, args, recipe, drive, checkpoint=None, steps=2, micro_batches=3):
    """``steps`` optimizer steps of ``micro_batches`` micro-batches each; the weights are
    scaled up before every micro-batch but the first of a step (so a kept FP8 weight
    and a fresh cast differ). ``drive`` is "argument" (is_first_microbatch) or "flag"
    (the skip flag, is_first_microbatch left None). Returns one record per micro-batch
    and the FP8 weight cache's contents after each."""
    torch.manual_seed(0)
    module = make()
    params = list(module.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    gen = torch.Generator().manual_seed(1)
    record, caches = [], []
    for _ in range(steps):
        for mb in range(micro_batches):
            if mb:
                with torch.no_grad():
                    for name, p in module.named_parameters():
                        if "weight" in name and "layer_norm" not in name:
                            p.mul_(1.5)
            first = mb == 0
            kwargs = {"is_first_microbatch": first} if drive == "argument" else {}
            if drive == "flag":
                FP8GlobalStateManager.set_skip_fp8_weight_update_tensor(not first)
            x = torch.randn(32, 32, generator=gen).requires_grad_()

            def forward(inp):
                return module(inp, *args, **kwargs)

            with te.autocast(recipe=recipe):
                out = forward(x) if checkpoint is None else te.checkpoint(
                    forward, x, use_reentrant=checkpoint)
            loss = out.float().pow(2).mean()
            loss.backward()
            record.append(capture(loss, [x], params, te_modules(module)))
            cache = module.fp8_meta.get("fp8_weight_cache", {})
            caches.append([t for gemm in sorted(cache) for w in cache[gemm] if w is not None
                           for t in (w.data.view(torch.uint8).clone(), w.scale_inv.clone())])
        opt.step()
        opt.zero_grad()
    return record, caches


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("make, args", MODULES)
def test_flag_matches_is_first_microbatch(make, args, recipe, skip_flag, capturing):
    """skip=1 reuses the cached FP8 weight as is_first_microbatch=False does, skip=0
    refreshes it as True does: outputs, gradients, FP8 states and the cached FP8
    weights, bit for bit, micro-batch by micro-batch."""
    ref, ref_caches = _schedule(make, args, recipe, "argument")
    got, got_caches = _schedule(make, args, recipe, "flag")
    assert_runs_equal(ref, got)
    for i, (a, b) in enumerate(zip(ref_caches, got_caches)):
        assert_tensors_equal(a, b, f"FP8 weight cache after micro-batch {i}")
    FP8GlobalStateManager.reset()                         # no flag: cast every time
    fresh, _ = _schedule(make, args, recipe, "none")
    assert not torch.equal(fresh[1].loss, got[1].loss)    # the kept weight was used


def test_flag_matches_is_first_microbatch_for_1x128_block_weights(skip_flag, capturing):
    """Weights in 1x128 blocks, whose cache holds a separately quantized columnwise
    copy: both copies follow the flag."""
    make, args = MODULES[0].values
    recipe = Float8BlockScaling(w_block_scaling_dim=1)
    ref, ref_caches = _schedule(make, args, recipe, "argument")
    got, got_caches = _schedule(make, args, recipe, "flag")
    assert_runs_equal(ref, got)
    assert len(got_caches[-1]) == 4            # rowwise and columnwise, bits and scales
    for i, (a, b) in enumerate(zip(ref_caches, got_caches)):
        assert_tensors_equal(a, b, f"FP8 weight cache after micro-batch {i}")


@pytest.mark.parametrize("use_reentrant", REENTRANT)
@pytest.mark.parametrize("make, args", MODULES[:2])
def test_flag_composes_with_checkpoint(make, args, use_reentrant, skip_flag, capturing):
    """The flag-driven schedule under te.checkpoint equals the is_first_microbatch
    schedule without it, bit for bit (the recompute uses the FP8 weights of its phase 1)."""
    recipe = DelayedScaling(amax_history_len=4)
    ref, _ = _schedule(make, args, recipe, "argument")
    got, _ = _schedule(make, args, recipe, "flag", checkpoint=use_reentrant)
    assert_runs_equal(ref, got)


def test_flag_is_ignored_outside_a_graph_capture(skip_flag):
    """Eagerly (no capture), is_first_microbatch decides, whatever the flag holds."""
    make, args = MODULES[0].values
    recipe = DelayedScaling(amax_history_len=4)
    ref, _ = _schedule(make, args, recipe, "argument")
    FP8GlobalStateManager.set_skip_fp8_weight_update_tensor(True)
    got, _ = _schedule(make, args, recipe, "argument")
    assert_runs_equal(ref, got)


def test_first_call_casts_whatever_the_flag(skip_flag, capturing):
    """With no cached FP8 weight yet, skip=1 has nothing to keep: the weight is cast
    and its amax recorded, as for a first micro-batch."""
    layer = te.Linear(32, 32, device="cpu")
    twin = copy.deepcopy(layer)
    x = torch.randn(16, 32)
    FP8GlobalStateManager.set_skip_fp8_weight_update_tensor(True)
    with te.autocast(recipe=DelayedScaling(amax_history_len=4)):
        y = layer(x)
    with te.autocast(recipe=DelayedScaling(amax_history_len=4)):
        y_ref = twin(x, is_first_microbatch=True)
    assert torch.equal(y, y_ref)
    assert torch.equal(layer.fp8_meta["scaling_fwd"].amax_history,
                       twin.fp8_meta["scaling_fwd"].amax_history)
    assert 0 in layer.fp8_meta["fp8_weight_cache"]


# ---- a real capture (GPU) --------------------------------------------------------------------

@cuda_fp8
def test_captured_forward_follows_the_flag_on_replay(skip_flag):
    """A forward captured once replays as is_first_microbatch=False (flag 1: the weight
    changed, the cached FP8 weight is used) and True (flag 0: recast)."""
    torch.manual_seed(0)
    recipe = DelayedScaling(amax_history_len=4)
    layer = te.Linear(64, 64, device="cuda")
    x = torch.randn(32, 64, device="cuda")
    eager = copy.deepcopy(layer)
    with torch.no_grad():
        with te.autocast(recipe=recipe):
            layer(x, is_first_microbatch=True)             # builds the cache
            eager(x, is_first_microbatch=True)
        FP8GlobalStateManager.set_skip_fp8_weight_update_tensor(False)
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.cuda.graph(graph):
            with te.autocast(recipe=recipe):
                y = layer(x)
        torch.cuda.current_stream().wait_stream(stream)
        for skip in (True, False, True):
            layer.weight.mul_(1.5)
            eager.weight.mul_(1.5)
            FP8GlobalStateManager.set_skip_fp8_weight_update_tensor(skip)
            graph.replay()
            with te.autocast(recipe=recipe):
                y_ref = eager(x, is_first_microbatch=not skip)
            assert torch.equal(y, y_ref), f"replay with skip={skip}"
