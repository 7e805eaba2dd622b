"""MXFP8 and NVFP4 primary weights (``te.quantized_model_init(recipe=MXFP8BlockScaling()
/ NVFP4BlockScaling())``): MXFP8Tensor / NVFP4Tensor parameters holding the bits the
recipe's weight cast makes, read as they are by the emulated GEMMs of Linear,
LayerNormLinear and LayerNormMLP, written by optimizers and ``load_state_dict`` by
quantizing, recomputed under ``te.checkpoint`` bit for bit, and run only under their
own recipe class."""

import copy
import io

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import (Float8BlockScaling, MXFP8BlockScaling,
                                              NVFP4BlockScaling)
from transformer_engine.pytorch import mx_scaling, nvfp4_scaling
from transformer_engine.pytorch.tensor import (MXFP8Quantizer, MXFP8Tensor, NVFP4Quantizer,
                                               NVFP4Tensor, QuantizedTensor)
from transformer_engine.pytorch.tensor.mx_tensors import rebuild_mx_tensor
import helpers
from helpers import DEVICES, REENTRANT, assert_runs_equal, capture, te_modules

RECIPES = [
    pytest.param(MXFP8BlockScaling(), id="mxfp8-1x32"),
    pytest.param(MXFP8BlockScaling(enable_2d_quantization=True), id="mxfp8-32x32"),
    pytest.param(NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True,
                                   disable_2d_quantization=True), id="nvfp4-1x16"),
    pytest.param(NVFP4BlockScaling(), id="nvfp4-16x16-rht-sr"),
]
_MODULES = {
    "Linear": lambda d: te.Linear(96, 48, device=d),
    "LayerNormLinear": lambda d: te.LayerNormLinear(64, 48, device=d),
    "LayerNormMLP": lambda d: te.LayerNormMLP(64, 96, device=d),
}


def _tensor_class(recipe):
    return MXFP8Tensor if recipe.mxfp8() else NVFP4Tensor


def _weight_cast(recipe, value):
    """The recipe's weight cast of ``value``: (rowwise, columnwise) copies."""
    if recipe.mxfp8():
        return mx_scaling.cast_for_role(recipe, "fwd_weight", value, torch.float8_e4m3fn,
                                        True, True, count_non_finite=False)
    return nvfp4_scaling.cast_for_role(recipe, "fwd_weight", value, True, True,
                                       count_non_finite=False)


def _step(model, recipe, x, seed):
    """One forward and backward; the seed fixes NVFP4's stochastic rounding draws."""
    x = x.clone().requires_grad_()
    torch.manual_seed(seed)
    with te.autocast(recipe=recipe):
        y = model(x)
    loss = y.float().pow(2).mean()
    loss.backward()
    return capture(loss, [x], model.parameters(), te_modules(model))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", list(_MODULES))
@pytest.mark.parametrize("recipe", RECIPES)
def test_training_equals_high_precision_weights_of_the_same_draw(device, kind, recipe):
    """Built from the same draw, a module with quantized weights gives the same
    output and gradients, bit for bit, as one with high-precision weights cast at each
    forward: the weight holds exactly the cast's copies (both of them)."""
    build = _MODULES[kind]
    torch.manual_seed(5)
    plain = build(device)
    torch.manual_seed(5)
    with te.quantized_model_init(recipe=recipe):
        model = build(device)
    quantized = {n: p for n, p in model.named_parameters() if isinstance(p, QuantizedTensor)}
    assert len(quantized) == (2 if kind == "LayerNormMLP" else 1)
    for name, p in quantized.items():
        ref = dict(plain.named_parameters())[name].detach()
        assert type(p) is _tensor_class(recipe) and p.requires_grad and p.shape == ref.shape
        row, col = _weight_cast(recipe, ref)
        got_row, got_col = p.block_operands(True)
        assert torch.equal(p.dequantize(), row.dequantize(ref.dtype)), name
        assert torch.equal(got_col.dequantize(), col.dequantize()), name
    x = torch.randn(24, 96 if kind == "Linear" else 64, device=device)
    assert_runs_equal([_step(plain, recipe, x, 1)], [_step(model, recipe, x, 1)])


def _model(recipe, seed, device):
    torch.manual_seed(seed)
    with te.quantized_model_init(recipe=recipe):
        return torch.nn.ModuleList([te.LayerNormMLP(64, 128, device=device),
                                    te.Linear(64, 64, device=device)])


def _train(model, recipe, checkpointed, use_reentrant, device, autocast_inside, steps=2):
    calls = []

    def forward(x):
        calls.append(1)
        if not autocast_inside:
            return model[1](model[0](x))
        with te.autocast(recipe=recipe):
            return model[1](model[0](x))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    record = []
    for step in range(steps):
        g = torch.Generator(device=device).manual_seed(step)
        x = torch.randn(16, 64, generator=g, device=device).requires_grad_()
        torch.manual_seed(100 + step)
        if autocast_inside:
            y = helpers.maybe_checkpoint(checkpointed, use_reentrant, forward, x)
        else:
            with te.autocast(recipe=recipe):
                y = helpers.maybe_checkpoint(checkpointed, use_reentrant, forward, x)
        loss = y.float().pow(2).mean()
        loss.backward()
        record.append(capture(loss, [x], model.parameters(), te_modules(model)))
        opt.step()
        opt.zero_grad()
    weights = [p.plain() for p in model.parameters() if isinstance(p, QuantizedTensor)]
    return record, weights, len(calls)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("use_reentrant", REENTRANT)
@pytest.mark.parametrize("autocast_inside", [True, False], ids=["autocast-in", "autocast-out"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_checkpointed_training_equals_training_without_it(device, use_reentrant,
                                                          autocast_inside, recipe):
    """Two optimizer steps on quantized weights, under te.checkpoint or not: same
    losses, gradients and written weights, bit for bit; each checkpointed forward is
    recomputed."""
    model = _model(recipe, 0, device)
    twin = copy.deepcopy(model)
    ref, ref_w, ref_calls = _train(model, recipe, False, use_reentrant, device, autocast_inside)
    got, got_w, got_calls = _train(twin, recipe, True, use_reentrant, device, autocast_inside)
    assert (ref_calls, got_calls) == (2, 4)
    assert_runs_equal(ref, got)
    assert len(ref_w) == 3 and all(torch.equal(a, b) for a, b in zip(ref_w, got_w))


@pytest.mark.parametrize("recipe", RECIPES)
def test_optimizer_step_quantizes_into_the_same_weight(recipe):
    """An optimizer's write keeps the parameter object and stores the cast of the new
    value into both copies."""
    with te.quantized_model_init(recipe=recipe):
        model = te.Linear(64, 32, device="cpu")
    w = model.weight
    before = w.dequantize().clone()
    _step(model, recipe, torch.randn(8, 64), 0)
    new_value = before - 0.5 * w.grad
    torch.optim.SGD([w], lr=0.5).step()
    assert model.weight is w and type(w) is _tensor_class(recipe)
    row, col = _weight_cast(recipe, new_value)
    assert torch.equal(w.dequantize(), row.dequantize())
    assert torch.equal(w.block_operands(True)[1].dequantize(), col.dequantize())
    assert not torch.equal(w.dequantize(), before)


@pytest.mark.parametrize("recipe", RECIPES)
def test_state_dict_round_trips_bit_for_bit(recipe):
    model = _model(recipe, 0, "cpu")
    _train(model, recipe, False, False, "cpu", True, steps=1)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    with torch.serialization.safe_globals([rebuild_mx_tensor, _tensor_class(recipe),
                                           MXFP8Quantizer, NVFP4Quantizer]):
        saved = torch.load(buffer, weights_only=True)
    assert type(saved["1.weight"]) is _tensor_class(recipe)
    fresh = _model(recipe, 99, "cpu")
    fresh.load_state_dict(saved)
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert type(p) is type(q), name
        if not isinstance(p, QuantizedTensor):
            assert torch.equal(p, q), name
            continue
        for k, v in p._storage().items():
            w = q._storage()[k]
            if v.dtype.itemsize == 1:      # FP8 bits compared as bytes
                v, w = v.view(torch.uint8), w.view(torch.uint8)
            assert v.dtype == w.dtype and torch.equal(v, w), (name, k)


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_weight_runs_only_under_its_recipe_class(recipe):
    with te.quantized_model_init(recipe=recipe):
        model = te.Linear(32, 32, device="cpu")
    other = NVFP4BlockScaling() if recipe.mxfp8() else MXFP8BlockScaling()
    for wrong in (other, Float8BlockScaling()):
        with pytest.raises(RuntimeError, match="Recipe mismatch"), te.autocast(recipe=wrong):
            model(torch.randn(4, 32))
    out = model(torch.randn(4, 32))        # outside FP8: the dequantized weight
    assert out.shape == (4, 32)


def test_tensors_behave_as_their_dequantized_value():
    with te.quantized_model_init(recipe=MXFP8BlockScaling()):
        model = te.Linear(64, 32, params_dtype=torch.bfloat16, device="cpu")
    w = model.weight
    assert w.dtype == torch.bfloat16 and w.shape == (32, 64)
    value = w.dequantize()
    assert type(value) is torch.Tensor and value.dtype == torch.bfloat16
    assert torch.equal(w * 2, value * 2) and torch.equal(w.t(), value.t())
    assert torch.equal(w.dequantize(torch.float32), value.float())
    clone = copy.deepcopy(w)
    assert type(clone) is MXFP8Tensor and torch.equal(clone.dequantize(), value)


def test_quantizers_and_tensors_check_their_arguments():
    with pytest.raises(TypeError, match="fp8_dtype"):
        MXFP8Quantizer(torch.float16)
    with pytest.raises(NotImplementedError, match="rowwise=False"):
        MXFP8Quantizer(rowwise=False)
    with pytest.raises(NotImplementedError, match="with_rht"):
        NVFP4Quantizer(with_rht=True)
    with pytest.raises(TypeError, match="unexpected keyword"):
        NVFP4Quantizer(with_2d_quantisation=True)
    with pytest.raises(ValueError, match="2-D"):
        MXFP8Quantizer().quantize(torch.zeros(2, 3, 32))
    q = NVFP4Quantizer()
    row, col = q.quantize(torch.randn(16, 32))
    with pytest.raises(TypeError, match="quantizer must be a NVFP4Quantizer"):
        NVFP4Tensor(row, col, torch.float32, MXFP8Quantizer())
    with pytest.raises(TypeError, match="columnwise"):
        NVFP4Tensor(row, row, torch.float32, q)
    with pytest.raises(TypeError, match="nominal dtype"):
        NVFP4Tensor(row, col, torch.int32, q)
    t = NVFP4Quantizer(columnwise=False).make_tensor(q.quantize(torch.randn(16, 32))[:1] + (None,),
                                                     torch.float32)
    with pytest.raises(RuntimeError, match="no columnwise copy"):
        t.block_operands(True)
