"""te.GroupedLinear with TE's single grouped ``weight`` / ``bias`` parameters (NOTE
[Single grouped parameters] in module/grouped_params.py): TE's names, shapes and
state_dict keys, and training bit for bit equal to the per-GEMM-parameter module in
high precision and FP8 (delayed, current, block scaling), with main_grad, delayed
wgrads and te.checkpoint; state_dict round trips between the two layouts."""

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import (DelayedScaling, Float8BlockScaling,
                                              Float8CurrentScaling)
from helpers import (DEVICES, REENTRANT, assert_runs_equal, assert_states_equal, capture,
                     fp8_state_snapshot)

N, K, M = 3, 32, 48
SPLITS = [16, 0, 48]
RECIPES = [pytest.param(None, id="high-precision"),
           pytest.param(DelayedScaling(amax_history_len=4), id="delayed"),
           pytest.param(Float8CurrentScaling(), id="current"),
           pytest.param(Float8BlockScaling(), id="block")]
LAYOUTS = [pytest.param(dict(single_grouped_weight=True, single_grouped_bias=True), id="both"),
           pytest.param(dict(single_grouped_weight=True), id="weight"),
           pytest.param(dict(single_grouped_bias=True), id="bias")]


@pytest.fixture(autouse=True)
def _single_param_env(monkeypatch):
    monkeypatch.setenv("NVTE_GROUPED_LINEAR_SINGLE_PARAM", "1")


def _pair(device, layout, seed=0, **kwargs):
    """A per-GEMM module and a grouped one built from the same seed (so the same
    initial weights), with the same random biases."""
    torch.manual_seed(seed)
    ref = te.GroupedLinear(N, K, M, device=device, **kwargs)
    torch.manual_seed(seed)
    got = te.GroupedLinear(N, K, M, device=device, **layout, **kwargs)
    with torch.no_grad():
        for i in range(N):
            getattr(ref, f"bias{i}").normal_(0.0, 0.1)
        got.load_state_dict(ref.state_dict())
    return ref, got


def _weights(layer):
    if layer.single_grouped_weight:
        return layer.weight
    return torch.stack([getattr(layer, f"weight{i}") for i in range(layer.num_gemms)])


def _packed(layer, name, attr="grad"):
    """A parameter family's ``attr`` (``grad``, ``main_grad``) stacked as ``[N, ...]``."""
    single = layer.single_grouped_weight if name == "weight" else layer.single_grouped_bias
    if single:
        return getattr(getattr(layer, name), attr)
    return torch.stack([getattr(getattr(layer, f"{name}{i}"), attr) for i in range(N)])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_names_shapes_and_state_dict_keys(layout):
    layer = te.GroupedLinear(N, K, M, device="cpu", **layout)
    names = [n for n, _ in layer.named_parameters()]
    shapes = {n: tuple(p.shape) for n, p in layer.named_parameters()}
    if layout.get("single_grouped_weight"):
        assert shapes["weight"] == (N, M, K)
        assert all(getattr(layer, f"weight{i}") is None for i in range(N))
    if layout.get("single_grouped_bias"):
        assert shapes["bias"] == (N, M)
        assert all(getattr(layer, f"bias{i}") is None for i in range(N))
    # TE's order: the surviving per-GEMM parameters, then the grouped ones
    expected = {"both": ["weight", "bias"],
                "weight": [f"bias{i}" for i in range(N)] + ["weight"],
                "bias": [f"weight{i}" for i in range(N)] + ["bias"]}
    kind = ("both" if len(layout) == 2 else
            "weight" if layout.get("single_grouped_weight") else "bias")
    assert names == expected[kind]
    assert list(layer.state_dict()) == names + ["_extra_state"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("device", DEVICES)
def test_training_equals_per_gemm_parameters(device, recipe, layout):
    ref, got = _pair(device, layout)
    assert torch.equal(_weights(ref), _weights(got))      # the same initial values
    for step in range(3):
        x = (torch.randn(sum(SPLITS), K, device=device) * 2.0 ** step)
        runs = []
        for layer in (ref, got):
            x_l = x.clone().requires_grad_()
            with te.autocast(enabled=recipe is not None, recipe=recipe):
                y = layer(x_l, SPLITS)
            y.pow(2).sum().backward()
            runs.append([y.detach(), x_l.grad, _packed(layer, "weight"), _packed(layer, "bias")])
        for what, a, b in zip(("output", "dgrad", "wgrad", "dbias"), *runs):
            assert torch.equal(a, b), f"step {step}: {what} differs"
        assert_states_equal(fp8_state_snapshot([ref]), fp8_state_snapshot([got]), f"step {step}")
    assert torch.count_nonzero(_packed(got, "weight")[1]) == 0       # the empty block
    if recipe is not None and recipe.delayed():
        assert not torch.equal(got.fp8_meta["scaling_fwd"].scale, torch.ones_like(
            got.fp8_meta["scaling_fwd"].scale))


@pytest.mark.parametrize("megatron_flag", [False, True], ids=["plain", "megatron-flag"])
@pytest.mark.parametrize("delay", [False, True], ids=["now", "delayed-wgrad"])
@pytest.mark.parametrize("recipe", [RECIPES[0], RECIPES[2]])
@pytest.mark.parametrize("device", DEVICES)
def test_main_grad_and_delayed_wgrad(device, recipe, delay, megatron_flag):
    """One ``main_grad`` ``[N, out, in]`` on the grouped weight gets GEMM ``i``'s wgrad
    in slice ``i``, as ``weight{i}.main_grad`` does; ``backward_dw()`` delivers
    delayed wgrads to the same values."""
    layout = dict(single_grouped_weight=True, single_grouped_bias=True)
    ref, got = _pair(device, layout, fuse_wgrad_accumulation=True, delay_wgrad_compute=delay)
    main_grad = torch.rand(N, M, K, device=device)
    got.weight.main_grad = main_grad.clone()
    for i in range(N):
        getattr(ref, f"weight{i}").main_grad = main_grad[i].clone()
    if megatron_flag:
        got.weight.grad_added_to_main_grad = False
        for i in range(N):
            getattr(ref, f"weight{i}").grad_added_to_main_grad = False
    for _ in range(2):
        x = torch.randn(sum(SPLITS), K, device=device)
        for layer in (ref, got):
            with te.autocast(enabled=recipe is not None, recipe=recipe):
                y = layer(x, SPLITS)
            y.pow(2).sum().backward()
            layer.backward_dw()
    assert torch.equal(_packed(ref, "weight", "main_grad"), got.weight.main_grad)
    assert not torch.equal(got.weight.main_grad, main_grad)
    assert torch.equal(_packed(ref, "bias"), got.bias.grad)
    if megatron_flag:       # Megatron's zero placeholder and flag, on the one parameter
        assert got.weight.grad_added_to_main_grad
        assert torch.count_nonzero(got.weight.grad) == 0
    else:
        assert got.weight.grad is None


@pytest.mark.parametrize("recipe", RECIPES[:3])
@pytest.mark.parametrize("device", DEVICES)
def test_delayed_wgrad_into_grad(device, recipe):
    layout = dict(single_grouped_weight=True)
    ref, got = _pair(device, layout, delay_wgrad_compute=True)
    for step in range(2):
        x = torch.randn(sum(SPLITS), K, device=device)
        for layer in (ref, got):
            with te.autocast(enabled=recipe is not None, recipe=recipe):
                y = layer(x, SPLITS)
            y.pow(2).sum().backward()
            if step == 0:
                assert _packed_or_none(layer) is None       # nothing before backward_dw
            layer.backward_dw()
    assert torch.equal(_packed(ref, "weight"), got.weight.grad)


def _packed_or_none(layer):
    if layer.single_grouped_weight:
        return layer.weight.grad
    return None if layer.weight0.grad is None else _packed(layer, "weight")


def _checkpoint_run(device, checkpointed, use_reentrant, recipe):
    torch.manual_seed(0)
    layer = te.GroupedLinear(N, K, M, device=device, single_grouped_weight=True,
                             single_grouped_bias=True)
    calls, record = [], []

    def fn(x):
        calls.append(1)
        with te.autocast(recipe=recipe):
            return torch.relu(layer(x, SPLITS))

    for step in range(3):
        x = (torch.randn(sum(SPLITS), K, device=device) * 3.0 ** step).requires_grad_()
        y = te.checkpoint(fn, x, use_reentrant=use_reentrant) if checkpointed else fn(x)
        loss = y.pow(2).sum()
        loss.backward()
        record.append(capture(loss, [x], list(layer.parameters()), [layer]))
        layer.zero_grad()
    return record, len(calls)


@pytest.mark.parametrize("use_reentrant", REENTRANT)
@pytest.mark.parametrize("recipe", RECIPES[1:])
@pytest.mark.parametrize("device", DEVICES)
def test_checkpoint_is_invisible(device, recipe, use_reentrant):
    ref, ref_calls = _checkpoint_run(device, False, use_reentrant, recipe)
    got, got_calls = _checkpoint_run(device, True, use_reentrant, recipe)
    assert (ref_calls, got_calls) == (3, 6)          # the recompute ran every step
    assert_runs_equal(ref, got, "checkpointed single-grouped GroupedLinear")


@pytest.mark.parametrize("device", DEVICES)
def test_state_dict_round_trips_between_layouts(device):
    layout = dict(single_grouped_weight=True, single_grouped_bias=True)
    ref, got = _pair(device, layout)
    with te.autocast(recipe=DelayedScaling(amax_history_len=4)):
        got(torch.randn(sum(SPLITS), K, device=device) * 5.0, SPLITS).sum().backward()
    state = got.state_dict()
    for target_layout in ({}, layout):
        fresh = te.GroupedLinear(N, K, M, device=device, **target_layout)
        fresh.load_state_dict(state)                  # strict: no missing or extra key
        assert torch.equal(_weights(fresh), got.weight)
        assert torch.equal(_packed(fresh, "bias", "data"), got.bias)
        for key in ("scaling_fwd", "scaling_bwd"):
            assert torch.equal(fresh.fp8_meta[key].scale, got.fp8_meta[key].scale)
            assert torch.equal(fresh.fp8_meta[key].amax_history,
                               got.fp8_meta[key].amax_history)
        state_back = fresh.state_dict()
        again = te.GroupedLinear(N, K, M, device=device, **layout)
        again.load_state_dict(state_back)
        assert torch.equal(again.weight, got.weight) and torch.equal(again.bias, got.bias)


def test_return_bias_gives_the_grouped_bias():
    layer = te.GroupedLinear(N, K, M, device="cpu", return_bias=True,
                             single_grouped_weight=True, single_grouped_bias=True)
    out, bias = layer(torch.randn(sum(SPLITS), K), SPLITS)
    assert bias is layer.bias and out.shape == (sum(SPLITS), M)


def test_deferred_init_draws_the_per_gemm_values():
    """A meta-device module materializes on the default device (CUDA where there is
    one) with the values per-GEMM weights built there draw from the same seed."""
    from transformer_engine.pytorch.module.devices import default_device
    torch.manual_seed(0)
    ref = te.GroupedLinear(N, K, M, device=default_device(None))
    layer = te.GroupedLinear(N, K, M, device="meta", single_grouped_weight=True)
    assert layer.weight.is_meta
    torch.manual_seed(0)
    layer.reset_parameters()
    assert layer.weight.device == ref.weight0.device
    assert torch.equal(layer.weight.cpu(), _weights(ref).cpu())


def test_fp8_primary_weights_are_refused():
    with te.quantized_model_init(recipe=Float8CurrentScaling()):
        with pytest.raises(NotImplementedError, match=r"single_grouped_weight=True with FP8 "
                                                      r"primary weights"):
            te.GroupedLinear(N, K, M, device="cpu", single_grouped_weight=True)


def test_torch_compile_equals_eager():
    """fullgraph ``aot_eager`` on the CPU: the same output and gradients as eager."""
    layout = dict(single_grouped_weight=True, single_grouped_bias=True)
    eager, compiled = _pair("cpu", layout)[1], _pair("cpu", layout)[1]

    def step(layer, x):
        with te.autocast(recipe=DelayedScaling(amax_history_len=4)):
            return layer(x, SPLITS)

    x = torch.randn(sum(SPLITS), K)
    runs = []
    for layer, fn in ((eager, step), (compiled, torch.compile(step, backend="aot_eager",
                                                               fullgraph=True))):
        x_l = x.clone().requires_grad_()
        y = fn(layer, x_l)
        y.pow(2).sum().backward()
        runs.append([y.detach(), x_l.grad, layer.weight.grad, layer.bias.grad])
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    assert_states_equal(fp8_state_snapshot([eager]), fp8_state_snapshot([compiled]))
