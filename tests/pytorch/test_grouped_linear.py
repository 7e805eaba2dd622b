"""te.GroupedLinear: float64 references, bit-identity with separate te.Linear layers,
checkpoint invariance, and the arguments it refuses."""

import warnings

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling
from transformer_engine.pytorch import quantize
from helpers import (DEVICES, REENTRANT, STASH_KEY, assert_runs_equal, assert_tensors_equal, capture,
                     te_modules)
from references import deq

SPLITS = [16, 32, 0, 16]
RECIPES = [pytest.param(DelayedScaling(amax_history_len=4), id="delayed"),
           pytest.param(Float8CurrentScaling(), id="current")]


def _grouped(n=4, k=32, m=48, bias=True, seed=0):
    torch.manual_seed(seed)
    layer = te.GroupedLinear(n, k, m, bias=bias, device="cpu")
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.startswith("bias"):
                p.normal_(0.0, 0.1)
    return layer


def _reference(layer, x, splits, dequantize=None):
    """float64 ``x_i W_i^T + b_i`` block by block; ``dequantize(i, x_i, w_i)`` gives the
    FP8 operands' values instead of the operands."""
    outs = []
    for i, x_i in enumerate(torch.split(x.detach().double(), splits)):
        w_i = getattr(layer, f"weight{i}").detach().double()
        if dequantize is not None and x_i.shape[0]:
            x_i, w_i = dequantize(i, x_i, w_i)
        b_i = getattr(layer, f"bias{i}")
        outs.append(x_i @ w_i.T + (0.0 if b_i is None else b_i.detach().double()))
    return torch.cat(outs)


def test_parameters_are_named_per_gemm():
    layer = _grouped(n=3, bias=True)
    assert sorted(n for n, _ in layer.named_parameters()) == sorted(
        ["weight0", "weight1", "weight2", "bias0", "bias1", "bias2"])
    assert all(getattr(layer, f"weight{i}").shape == (48, 32) for i in range(3))
    assert layer.fp8_meta["num_gemms"] == 3
    no_bias = _grouped(n=2, bias=False)
    assert no_bias.bias0 is None and no_bias.bias1 is None
    assert [n for n, _ in no_bias.named_parameters()] == ["weight0", "weight1"]


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_high_precision_matches_float64(bias):
    layer = _grouped(bias=bias)
    x = torch.randn(sum(SPLITS), 32, requires_grad=True)
    y = layer(x, SPLITS)
    ref = _reference(layer, x, SPLITS)
    assert y.shape == (64, 48)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    y.sum().backward()
    assert torch.equal(layer.weight2.grad, torch.zeros_like(layer.weight2))   # the empty block
    w64 = [getattr(layer, f"weight{i}").detach().double() for i in range(4)]
    dx_ref = torch.cat([torch.ones(m, 48, dtype=torch.float64) @ w
                        for m, w in zip(SPLITS, w64)])
    torch.testing.assert_close(x.grad.double(), dx_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_m_splits_may_be_an_integer_tensor(device):
    """TE's GroupedLinear takes m_splits as a list or an int64 tensor (on the host or
    the device): the same blocks either way."""
    layer = _grouped().to(device)
    x = torch.randn(64, 32, device=device)
    want = layer(x, SPLITS)
    for splits in (torch.tensor(SPLITS), torch.tensor(SPLITS, device=device, dtype=torch.int32)):
        assert torch.equal(layer(x, splits), want)


def test_leading_dimensions_are_flattened_into_rows():
    layer = _grouped()
    x = torch.randn(8, 8, 32)
    y = layer(x, SPLITS)
    assert y.shape == (8, 8, 48)
    assert torch.equal(y.reshape(64, 48), layer(x.reshape(64, 32), SPLITS))


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_matches_float64_on_fp8_operands(recipe):
    layer = _grouped()
    x = torch.randn(sum(SPLITS), 32)
    fmt = recipe.fp8_format.value
    if recipe.delayed():
        layer.fp8_meta["recipe"] = recipe
        layer.init_fp8_meta_tensors(recipe)
        scales = layer.fp8_meta["scaling_fwd"].scale.clone()

    def dequantize(i, x_i, w_i):
        x_i, w_i = x_i.float(), w_i.float()
        if recipe.delayed():
            sx, sw = scales[2 * i:2 * i + 1], scales[2 * i + 1:2 * i + 2]
        else:
            sx, sw = (quantize.current_scale(quantize.amax(t), fmt.dtype_fwd) for t in (x_i, w_i))
        return deq(x_i, sx, fmt.dtype_fwd), deq(w_i, sw, fmt.dtype_fwd)

    with te.autocast(recipe=recipe):
        y = layer(x, SPLITS)
    ref = _reference(layer, x, SPLITS, dequantize)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    # and FP8 did round: the high-precision product differs
    assert not torch.allclose(y.double(), _reference(layer, x, SPLITS), rtol=1e-4, atol=1e-4)


def _separate_linears(grouped):
    linears = []
    for i in range(grouped.num_gemms):
        lin = te.Linear(grouped.in_features, grouped.out_features, device="cpu")
        with torch.no_grad():
            lin.weight.copy_(getattr(grouped, f"weight{i}"))
            lin.bias.copy_(getattr(grouped, f"bias{i}"))
        linears.append(lin)
    return linears


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_training_is_bit_identical_to_separate_linears(recipe):
    splits = [16, 32, 16]
    grouped = _grouped(n=3)
    linears = _separate_linears(grouped)
    for step in range(3):
        x = (torch.randn(64, 32) * 2.0 ** step).requires_grad_()
        x2 = x.detach().clone().requires_grad_()
        with te.autocast(recipe=recipe):
            y = grouped(x, splits)
        with te.autocast(recipe=recipe):
            y2 = torch.cat([lin(x_i) for lin, x_i in zip(linears, torch.split(x2, splits))])
        assert torch.equal(y, y2), f"step {step}: outputs differ"
        y.pow(2).sum().backward()
        y2.pow(2).sum().backward()
        assert torch.equal(x.grad, x2.grad), f"step {step}: input grads differ"
        for i, lin in enumerate(linears):
            assert_tensors_equal([getattr(grouped, f"weight{i}").grad, getattr(grouped, f"bias{i}").grad],
                                 [lin.weight.grad, lin.bias.grad], f"step {step} gemm {i}")
            if recipe.delayed():
                for key, per_gemm in (("scaling_fwd", 2), ("scaling_bwd", 1)):
                    g, s = grouped.fp8_meta[key], lin.fp8_meta[key]
                    cols = slice(per_gemm * i, per_gemm * (i + 1))
                    assert torch.equal(g.scale[cols], s.scale), f"step {step} gemm {i} {key}"
                    assert torch.equal(g.amax_history[:, cols], s.amax_history)
    if recipe.delayed():     # the scales moved off 1, so the comparison covered updates
        assert not torch.equal(grouped.fp8_meta["scaling_fwd"].scale, torch.ones(6))


def _checkpoint_run(checkpointed, use_reentrant, steps=3):
    layer = _grouped(n=3)
    calls = []
    splits = [16, 16, 32]

    def fn(x):
        calls.append(1)
        with te.autocast(recipe=DelayedScaling(amax_history_len=4)):
            return torch.relu(layer(x, splits))

    record = []
    for step in range(steps):
        x = (torch.randn(64, 32) * 3.0 ** step).requires_grad_()
        y = te.checkpoint(fn, x, use_reentrant=use_reentrant) if checkpointed else fn(x)
        loss = y.pow(2).sum()
        loss.backward()
        record.append(capture(loss, [x], list(layer.parameters()), te_modules(layer)))
        layer.zero_grad()
    return record, len(calls), layer


@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_checkpoint_is_invisible(use_reentrant):
    ref, ref_calls, _ = _checkpoint_run(False, use_reentrant)
    got, got_calls, layer = _checkpoint_run(True, use_reentrant)
    assert (ref_calls, got_calls) == (3, 6)          # the recompute ran every step
    assert STASH_KEY in layer.fp8_meta
    assert_runs_equal(ref, got, "checkpointed GroupedLinear")


def test_extra_state_round_trip():
    layer = _grouped(n=2)
    with te.autocast(recipe=DelayedScaling(amax_history_len=4)):
        layer(torch.randn(32, 32) * 5.0, [16, 16]).sum().backward()
        layer(torch.randn(32, 32), [16, 16])
    fresh = _grouped(n=2, seed=1)
    fresh.load_state_dict(layer.state_dict())
    for key in ("scaling_fwd", "scaling_bwd"):
        assert torch.equal(fresh.fp8_meta[key].scale, layer.fp8_meta[key].scale)
        assert torch.equal(fresh.fp8_meta[key].amax_history, layer.fp8_meta[key].amax_history)
    assert fresh.fp8_meta["scaling_fwd"].scale.shape == (4,)


@pytest.mark.parametrize("m_splits, error, match", [
    ([16, 16, 16], ValueError, r"m_splits must hold num_gemms=4"),
    ([16, 16, 16, 8], ValueError, r"must add up to the input's rows \(64\)"),
    ([16, -16, 32, 32], ValueError, r"non-negative ints"),
    (torch.tensor([16.0, 16, 16, 16]), TypeError, r"a tensor m_splits must hold num_gemms=4 "
                                                   r"ints"),
    (torch.tensor([[16, 16, 16, 16]]), TypeError, r"shape \(4,\)"),
    ((16, 16, 16, "16"), ValueError, r"non-negative ints"),
], ids=["count", "sum", "negative", "float-tensor", "tensor-shape", "str"])
def test_bad_m_splits(m_splits, error, match):
    with pytest.raises(error, match=match):
        _grouped()(torch.randn(64, 32), m_splits)


@pytest.mark.parametrize("kwargs, match", [
    (dict(ub_overlap_ag=True), r"ub_overlap_ag=True is not implemented"),
    (dict(ub_overlap_rs=True), r"ub_overlap_rs=True is not implemented"),
    (dict(parallel_mode="column", tp_size=2), r"tensor parallelism \(parallel_mode='column' "
                                              r"with tp_size=2\) is not implemented"),
], ids=["ub-ag", "ub-rs", "tensor-parallel"])
def test_unimplemented_arguments(kwargs, match):
    with pytest.raises(NotImplementedError, match=match):
        te.GroupedLinear(2, 32, 32, device="cpu", **kwargs)


def test_trivial_tensor_parallel_arguments_are_accepted():
    layer = te.GroupedLinear(2, 32, 32, parallel_mode="row", tp_size=1, sequence_parallel=True,
                             device="cpu")
    assert (layer.parallel_mode, layer.tp_size, layer.sequence_parallel) == ("row", 1, True)
    x = torch.randn(32, 32)
    torch.testing.assert_close(layer(x, [16, 16]).double(), _reference(layer, x, [16, 16]),
                               rtol=1e-5, atol=1e-5)


def test_bad_input():
    layer = _grouped(n=2)
    with pytest.raises(ValueError, match=r"last dimension must be in_features=32"):
        layer(torch.randn(32, 16), [16, 16])
    with pytest.raises(ValueError, match=r"num_gemms must be a positive int"):
        te.GroupedLinear(0, 32, 32, device="cpu")


# ---- TE's single-grouped-parameter and grouped-tensor switches ---------------------------

@pytest.mark.parametrize("use_grouped_tensor", [None, False, True])
def test_grouped_switches_off_change_nothing(use_grouped_tensor, monkeypatch):
    """``single_grouped_weight=False, single_grouped_bias=False`` (TE's defaults) and any
    ``use_grouped_tensor`` (a kernel choice in TE) build and train the same layer: per-GEMM
    parameters, the same FP8 step bit for bit, no warning."""
    monkeypatch.setenv("NVTE_GROUPED_LINEAR_SINGLE_PARAM", "1")
    runs = []
    for kwargs in ({}, dict(single_grouped_weight=False, single_grouped_bias=False,
                            use_grouped_tensor=use_grouped_tensor)):
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            layer = te.GroupedLinear(4, 32, 48, device="cpu", **kwargs)
        assert [n for n, _ in layer.named_parameters()][:2] == ["weight0", "bias0"]
        assert (layer.single_grouped_weight, layer.single_grouped_bias) == (False, False)
        assert layer.use_grouped_tensor is bool(kwargs.get("use_grouped_tensor"))
        x = torch.randn(sum(SPLITS), 32, requires_grad=True)
        with te.autocast(recipe=DelayedScaling(amax_history_len=4)):
            y = layer(x, SPLITS)
        loss = y.float().pow(2).sum()
        loss.backward()
        runs.append([capture(loss, [x], list(layer.parameters()), [layer])])
    assert_runs_equal(runs[0], runs[1], "explicit defaults against none,")


@pytest.mark.parametrize("kwargs", [dict(single_grouped_weight=True, single_grouped_bias=True),
                                    dict(single_grouped_weight=True),
                                    dict(single_grouped_bias=True)],
                         ids=["both", "weight", "bias"])
def test_single_grouped_params_need_the_environment_variable(kwargs, monkeypatch):
    """As in TE: without NVTE_GROUPED_LINEAR_SINGLE_PARAM the request falls back to
    per-GEMM parameters with a warning (test_grouped_linear_single_param.py covers the
    single grouped parameters it builds when set)."""
    monkeypatch.delenv("NVTE_GROUPED_LINEAR_SINGLE_PARAM", raising=False)
    with pytest.warns(UserWarning, match=r"single_grouped_weight=.* but "
                                         r"NVTE_GROUPED_LINEAR_SINGLE_PARAM is not set"):
        layer = te.GroupedLinear(2, 32, 32, device="cpu", **kwargs)
    assert (layer.single_grouped_weight, layer.single_grouped_bias) == (False, False)
    assert sorted(n for n, _ in layer.named_parameters()) == ["bias0", "bias1",
                                                               "weight0", "weight1"]


def test_bad_grouped_switches(monkeypatch):
    with pytest.raises(TypeError, match=r"use_grouped_tensor must be a bool or None, got str"):
        te.GroupedLinear(2, 32, 32, device="cpu", use_grouped_tensor="yes")
    with pytest.raises(TypeError, match=r"single_grouped_weight must be a bool"):
        te.GroupedLinear(2, 32, 32, device="cpu", single_grouped_weight=1)
    monkeypatch.setenv("NVTE_GROUPED_LINEAR_SINGLE_PARAM", "yes")
    with pytest.raises(ValueError, match=r"NVTE_GROUPED_LINEAR_SINGLE_PARAM must be an int, "
                                         r"got 'yes'"):
        te.GroupedLinear(2, 32, 32, device="cpu", single_grouped_weight=True)
