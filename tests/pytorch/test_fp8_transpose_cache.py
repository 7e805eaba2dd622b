"""The transpose an FP8 primary weight keeps for the dgrad GEMM (NOTE [Cached FP8
transpose] in tensor/float8_tensor.py): TE's ``_transpose`` / ``_transpose_invalid``,
absent for inference, made by a training forward, kept current by every write."""

import copy

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling
from transformer_engine.pytorch.tensor import Float8Tensor
from helpers import DEVICES

RECIPES = [pytest.param(DelayedScaling(), id="delayed"),
           pytest.param(Float8CurrentScaling(), id="current")]
MODULES = {
    "Linear": lambda d: te.Linear(32, 32, device=d),
    "LayerNormLinear": lambda d: te.LayerNormLinear(32, 32, device=d),
    "LayerNormMLP": lambda d: te.LayerNormMLP(32, 32, device=d),
    "GroupedLinear": lambda d: te.GroupedLinear(1, 32, 32, device=d),
}


def _build(name, recipe, device="cpu"):
    with torch.no_grad(), te.quantized_model_init(enabled=True, recipe=recipe):
        return MODULES[name](device)


def _forward(name, module, x, recipe):
    with te.autocast(recipe=recipe):
        return module(x, [x.shape[0]]) if name == "GroupedLinear" else module(x)


def _fp8_weights(module):
    weights = [p for p in module.parameters() if isinstance(p, Float8Tensor)]
    assert weights
    return weights


def _transposed_bits(p):
    return p._data.t().contiguous().view(torch.uint8)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("name", list(MODULES))
def test_no_transpose_for_inference_one_after_a_training_forward(name, recipe):
    module = _build(name, recipe)
    for p in _fp8_weights(module):
        assert p._transpose is None and p._transpose_invalid
    with torch.inference_mode():
        _forward(name, module, torch.randn(32, 32), recipe)
    with torch.no_grad():
        _forward(name, module, torch.randn(32, 32), recipe)
    for p in _fp8_weights(module):
        assert p._transpose is None and p._transpose_invalid
    x = torch.randn(32, 32, requires_grad=True)
    _forward(name, module, x, recipe).sum().backward()
    for p in _fp8_weights(module):
        assert p._transpose is not None and not p._transpose_invalid
        assert torch.equal(p._transpose.view(torch.uint8), _transposed_bits(p))


@pytest.mark.parametrize("write", ["optimizer", "copy_", "data.copy_"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_writes_keep_the_transpose_current_in_place(recipe, write):
    module = _build("Linear", recipe)
    x = torch.randn(32, 32, requires_grad=True)
    _forward("Linear", module, x, recipe).sum().backward()
    weight = module.weight
    buffer = weight._transpose
    before = buffer.clone()
    new_value = torch.randn(32, 32)
    with torch.no_grad():
        if write == "optimizer":
            torch.optim.SGD(module.parameters(), lr=1.0).step()
        elif write == "copy_":
            weight.copy_(new_value)
        else:
            weight.data.copy_(new_value)
    assert not torch.equal(before.view(torch.uint8), buffer.view(torch.uint8))
    assert weight._transpose is buffer and not weight._transpose_invalid
    assert torch.equal(buffer.view(torch.uint8), _transposed_bits(weight))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES)
def test_dgrad_after_steps_equals_a_fresh_copys(recipe, device):
    """Steps of training on the cached transpose give the dgrad a copy of the module
    (which starts without one) gives, bit for bit; a write into ``_data`` behind the
    tensor's back is caught by the version counter."""
    module = _build("Linear", recipe, device)
    opt = torch.optim.SGD(module.parameters(), lr=0.5)
    for step in range(3):
        if step == 2:
            with torch.no_grad():
                module.weight._data.copy_(torch.randn(32, 32, device=device).to(
                    module.weight._data.dtype))
            assert module.weight._transpose_invalid
        fresh = copy.deepcopy(module)
        assert fresh.weight._transpose is None
        x = torch.randn(32, 32, device=device)
        grads = []
        for m in (module, fresh):
            xi = x.clone().requires_grad_()
            _forward("Linear", m, xi, recipe).square().sum().backward()
            grads.append(xi.grad)
        assert torch.equal(grads[0], grads[1])
        opt.step()
        opt.zero_grad()


def test_marking_stale_remakes_it():
    module = _build("Linear", Float8CurrentScaling())
    x = torch.randn(32, 32, requires_grad=True)
    _forward("Linear", module, x, Float8CurrentScaling()).sum().backward()
    weight = module.weight
    with torch.no_grad():
        weight._transpose.zero_()       # what a client writing the bits itself leaves
    weight._transpose_invalid = True
    assert weight._transpose_invalid
    _forward("Linear", module, x, Float8CurrentScaling()).sum().backward()
    assert not weight._transpose_invalid
    assert torch.equal(weight._transpose.view(torch.uint8), _transposed_bits(weight))


def test_copies_start_without_a_transpose():
    module = _build("Linear", DelayedScaling())
    _forward("Linear", module, torch.randn(32, 32, requires_grad=True),
             DelayedScaling()).sum().backward()
    assert module.weight._transpose is not None
    for copied in (module.weight.clone(), copy.deepcopy(module.weight),
                   module.weight.to(torch.bfloat16)):
        assert isinstance(copied, Float8Tensor)
        assert copied._transpose is None and copied._transpose_invalid


def test_clients_may_drop_or_set_it():
    module = _build("Linear", Float8CurrentScaling())
    x = torch.randn(32, 32, requires_grad=True)
    _forward("Linear", module, x, Float8CurrentScaling()).sum().backward()
    weight = module.weight
    weight._transpose = None                    # what TE's CPU offloading does
    assert weight._transpose is None and weight._transpose_invalid
    bits = _transposed_bits(weight).view(weight._data.dtype)
    weight._transpose = bits                    # own bits: stale until said current
    assert weight._transpose is bits and weight._transpose_invalid
    weight._transpose_invalid = False
    assert not weight._transpose_invalid
    _forward("Linear", module, x, Float8CurrentScaling()).sum().backward()
    assert weight._transpose is bits
