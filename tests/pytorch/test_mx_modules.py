"""MXFP8BlockScaling and NVFP4BlockScaling in the modules: the GEMMs are the emulated
ones of the quantized operands, bit for bit; te.checkpoint (both modes, autocast
inside and outside) is bitwise equal to no checkpointing; the recipe survives the
``_extra_state`` round trip; torch.compile(fullgraph=True, aot_eager) equals eager."""

import io

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import (Format, MXFP8BlockScaling, NVFP4BlockScaling)
from transformer_engine.pytorch import mx_scaling, nvfp4_scaling
from helpers import DEVICES, REENTRANT

RECIPES = [pytest.param(MXFP8BlockScaling(), id="mxfp8"),
           pytest.param(MXFP8BlockScaling(fp8_format=Format.HYBRID, enable_2d_quantization=True),
                        id="mxfp8-hybrid-2d"),
           pytest.param(NVFP4BlockScaling(), id="nvfp4"),
           pytest.param(NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True,
                                          disable_2d_quantization=True), id="nvfp4-plain")]


def _quantized(recipe, role, x, rowwise, columnwise):
    """The operand copies the recipe makes, through the formats' public functions."""
    if recipe.mxfp8():
        dtype = recipe.fp8_format.value.dtype_bwd if role == "bwd_grad" \
            else recipe.fp8_format.value.dtype_fwd
        rows = 32 if role == "fwd_weight" and recipe.enable_2d_quantization else 1
        row = mx_scaling.mxfp8_quantize(x, dtype, rows) if rowwise else None
        col = None
        if columnwise:
            col = row.t_contiguous() if rows == 32 else mx_scaling.mxfp8_quantize(x.t(), dtype)
        return row, col
    q = getattr(recipe, "fp4_quant_" + role)
    rows = 16 if q.fp4_2d_quantization else 1
    return nvfp4_scaling.cast_nvfp4(x, rows, rowwise, columnwise, q.stochastic_rounding,
                                    q.random_hadamard_transform, count_non_finite=False)


def _mm(a, b):
    out = a.block_dequantize() @ b.block_dequantize().t()
    if isinstance(a, nvfp4_scaling.NVFP4Data):
        out = out * (a.global_scale_inv * b.global_scale_inv)
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES)
def test_linear_gemms_are_the_emulated_gemms_of_the_quantized_operands(device, recipe):
    torch.manual_seed(0)
    layer = te.Linear(64, 48, bias=False, device=device)
    x = torch.randn(32, 64, device=device, requires_grad=True)
    dy = torch.randn(32, 48, device=device)
    with te.autocast(recipe=recipe):
        y = layer(x)
    seed = torch.randint(0, 2 ** 30, ()).item()
    torch.manual_seed(seed)
    y.backward(dy)
    w = layer.weight.detach()
    xq, xt = _quantized(recipe, "fwd_inp", x.detach(), True, True)
    wq, wt = _quantized(recipe, "fwd_weight", w, True, True)
    assert torch.equal(y, _mm(xq, wq))
    torch.manual_seed(seed)         # the stochastic rounding draws of the backward cast
    dyq, dyt = _quantized(recipe, "bwd_grad", dy, True, True)
    assert torch.equal(x.grad, _mm(dyq, wt))
    assert torch.equal(layer.weight.grad, _mm(dyt, xt))
    # and they are close to the high-precision products
    for got, ref in ((y, x @ w.t()), (layer.weight.grad, dy.t() @ x.detach())):
        rel = ((got - ref).norm() / ref.norm()).item()
        assert rel < (0.1 if recipe.mxfp8() else 0.3)      # (E5M2 gradients: ~0.06)


def _build(kind: str, device: str):
    torch.manual_seed(1)
    if kind == "linear":
        return te.Linear(64, 64, device=device), (32, 64)
    if kind == "layernorm_linear":
        return te.LayerNormLinear(64, 64, device=device), (32, 64)
    if kind == "layernorm_mlp":
        return te.LayerNormMLP(64, 128, device=device), (32, 64)
    if kind == "grouped_linear":
        return te.GroupedLinear(2, 64, 64, device=device), (32, 64)
    return te.TransformerLayer(64, 128, 4, hidden_dropout=0.0, attention_dropout=0.0,
                               device=device), (16, 2, 64)


def _step(model, kind, x, recipe, mode, reentrant):
    """One training step: (loss, parameter grads, input grad)."""
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)

    def body(inp):
        if kind == "grouped_linear":
            return model(inp, [12, 20])
        return model(inp)

    def fn(inp):
        if mode == "inside":
            with te.autocast(recipe=recipe):
                return body(inp)
        return body(inp)

    torch.manual_seed(7)
    if mode == "none":
        with te.autocast(recipe=recipe):
            out = body(x)
    elif mode == "inside":
        out = te.checkpoint(fn, x, use_reentrant=reentrant)
    else:
        with te.autocast(recipe=recipe):
            out = te.checkpoint(fn, x, use_reentrant=reentrant)
    loss = out.float().square().mean()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()], x.grad.clone()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES[::2])
@pytest.mark.parametrize("reentrant", REENTRANT)
@pytest.mark.parametrize("mode", ["outside", "inside"])
@pytest.mark.parametrize("kind", ["linear", "layernorm_linear", "layernorm_mlp",
                                  "grouped_linear", "transformer_layer"])
def test_checkpoint_is_bitwise_equal_to_no_checkpointing(device, recipe, reentrant, mode, kind):
    model, shape = _build(kind, device)
    torch.manual_seed(3)
    x = torch.randn(*shape, device=device)
    calls = []
    model.register_forward_hook(lambda *a: calls.append(1))
    ref = _step(model, kind, x, recipe, "none", reentrant)
    assert len(calls) == 1
    got = _step(model, kind, x, recipe, mode, reentrant)
    assert len(calls) == 3          # phase 1 and the recompute ran
    assert torch.equal(got[0], ref[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], ref[1]))
    assert torch.equal(got[2], ref[2])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES)
def test_extra_state_round_trip_keeps_the_recipe(device, recipe):
    layer, _ = _build("layernorm_mlp", device)
    x = torch.randn(32, 64, device=device)
    with te.autocast(recipe=recipe):
        y = layer(x)
    buf = io.BytesIO()
    torch.save(layer.state_dict(), buf)
    buf.seek(0)
    fresh = te.LayerNormMLP(64, 128, device=device)
    fresh.load_state_dict(torch.load(buf))
    assert fresh.fp8_meta["recipe"] == recipe
    with te.autocast(recipe=recipe):
        assert torch.equal(fresh(x), y)


@pytest.mark.parametrize("recipe", RECIPES[::2])
def test_compile_fullgraph_equals_eager(recipe):
    torch._dynamo.reset()
    layer, _ = _build("layernorm_linear", "cpu")
    x = torch.randn(32, 64, requires_grad=True)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    runs = []
    for fn in (layer, compiled):
        x.grad = None
        layer.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        with te.autocast(recipe=recipe):
            y = fn(x)
        y.square().sum().backward()
        runs.append((y.detach(), x.grad.clone(), layer.weight.grad.clone()))
    assert all(torch.equal(a, b) for a, b in zip(*runs))
