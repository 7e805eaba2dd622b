"""What is attached to a quantized parameter (TE's ``get_high_precision_init_val`` /
``clear_high_precision_init_val``, attributes set from outside such as ``main_grad``)
survives the module's ``.cpu()`` / ``.cuda()`` / ``.half()`` / ``.to(dtype)``, which
torch performs on tensor subclasses by swapping their ``__dict__`` out; and the
quantizer protocol TE's clients call (``_get_quantizer().make_empty`` /
``update_quantized``) reproduces a weight from its initial value."""

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import (DelayedScaling, Float8BlockScaling,
                                              Float8CurrentScaling)
from transformer_engine.pytorch.tensor import (Float8BlockwiseQTensor, Float8Tensor,
                                               QuantizedTensor)
import helpers

RECIPES = [pytest.param(DelayedScaling(), id="delayed"),
           pytest.param(Float8CurrentScaling(), id="current"),
           pytest.param(Float8BlockScaling(), id="block")]
MOVES = {
    "cpu": lambda m: m.cpu(),
    "half": lambda m: m.half(),
    "bfloat16": lambda m: m.to(torch.bfloat16),
    "float": lambda m: m.float(),
    "apply": lambda m: m.apply(lambda sub: None),
}


def _kind(recipe):
    return Float8BlockwiseQTensor if recipe.float8_block_scaling() else Float8Tensor


def _module(recipe, device="cpu"):
    with te.quantized_model_init(recipe=recipe, preserve_high_precision_init_val=True):
        return te.Linear(64, 64, device=device)


def _check_moves(recipe, moves, device="cpu", run=True):
    for name, move in moves.items():
        model = _module(recipe, device)
        weight = model.weight
        expected = weight.get_high_precision_init_val()
        weight.probe_attr = "attached-from-outside"
        weight.main_grad = torch.zeros(64, 64)
        model = move(model)
        weight = model.weight
        assert isinstance(weight, _kind(recipe)), name
        assert weight.probe_attr == "attached-from-outside", name
        assert weight.main_grad.shape == (64, 64), name
        assert torch.equal(weight.get_high_precision_init_val(), expected), name
        # the accessors read the surviving parameter, not the one left behind
        weight.clear_high_precision_init_val()
        assert weight.get_high_precision_init_val() is None, name
        assert "_high_precision_init_val" not in weight.__dict__
        if not run:
            continue
        x = torch.randn(16, 64, dtype=weight.dtype, device=weight.device)
        with te.autocast(recipe=recipe):
            assert model(x).dtype == weight.dtype


@pytest.mark.parametrize("recipe", RECIPES)
def test_attributes_survive_module_moves(recipe):
    _check_moves(recipe, MOVES)


@helpers.cuda_fp8
@pytest.mark.parametrize("recipe", RECIPES)
def test_attributes_survive_moves_to_and_from_cuda(recipe):
    """(The forward after a move between devices is not run: a delayed-scaling
    module's scaling state stays where it was made.)"""
    _check_moves(recipe, {"cuda": lambda m: m.cuda(), "cuda-cpu": lambda m: m.cuda().cpu()},
                 run=False)
    _check_moves(recipe, {"on-cuda": lambda m: m.cuda(), "half": lambda m: m.half()},
                 device="cuda")


@pytest.mark.parametrize("recipe", RECIPES)
def test_quantizer_reproduces_the_weight_from_its_initial_value(recipe):
    """TE's check: a tensor made by the weight's quantizer (``make_empty``) and
    written with the initial value (``update_quantized``) dequantizes to the weight."""
    model = _module(recipe)             # (a delayed-scaling weight quantizes with its state)
    weight = model.weight
    assert isinstance(weight, QuantizedTensor)
    init = weight.get_high_precision_init_val()
    assert init.device.type == "cpu"
    quantizer = weight._get_quantizer()
    new = quantizer.make_empty(shape=weight.shape, dtype=weight.dtype, device=weight.device)
    assert type(new) is type(weight) and new.shape == weight.shape
    assert torch.count_nonzero(new.dequantize()) == 0
    quantizer.update_quantized(init.to(weight.device), new)
    assert torch.equal(new.dequantize(dtype=weight.dtype), weight.dequantize(dtype=weight.dtype))
    assert quantizer._get_compatible_recipe() is type(recipe)
