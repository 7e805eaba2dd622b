"""Modules under ``torch.autocast`` (with and without an FP8 autocast inside it): the
output has the autocast dtype, the input's gradient the input's dtype and the float32
parameters float32 gradients, as TE's modules give (their GEMMs produce the autocast
dtype; TransformerLayer casts its input to it, so its residuals follow)."""

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from helpers import DEVICES

RECIPES = [None, recipe.DelayedScaling(), recipe.Float8CurrentScaling(),
           recipe.Float8BlockScaling()]
RECIPE_IDS = ["no-fp8", "delayed", "current", "block"]


def _modules():
    return {
        "Linear": lambda: te.Linear(32, 32, device="cpu"),
        "LayerNormLinear": lambda: te.LayerNormLinear(32, 32, device="cpu"),
        "LayerNormMLP": lambda: te.LayerNormMLP(32, 64, device="cpu"),
        "GroupedLinear": lambda: te.GroupedLinear(2, 32, 32, device="cpu"),
        "TransformerLayer": lambda: te.TransformerLayer(32, 64, 2, hidden_dropout=0.1,
                                                        attention_dropout=0.1, device="cpu"),
    }


def _call(name, module, x):
    if name == "GroupedLinear":
        return module(x, [16, 16])
    if name == "TransformerLayer":
        mask = torch.randint(2, (1, 1, 16, 16), dtype=torch.bool)
        return module(x.view(16, 2, 32), attention_mask=mask)
    return module(x)


CASES = ([(name, False) for name in _modules()]
         + [("TransformerLayer", True)])      # TE's AMP test freezes the weights too


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("fp8_recipe", RECIPES, ids=RECIPE_IDS)
@pytest.mark.parametrize("name, frozen", CASES,
                         ids=[n + ("-frozen-weights" if f else "") for n, f in CASES])
def test_output_has_the_autocast_dtype(name, fp8_recipe, dtype, frozen):
    module = _modules()[name]()
    assert all(p.dtype == torch.float32 for p in module.parameters())
    if frozen:
        for p in module.parameters():
            p.requires_grad_(False)
    x = torch.randn(32, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=dtype):
        with te.autocast(enabled=fp8_recipe is not None, recipe=fp8_recipe):
            y = _call(name, module, x)
        loss = y.float().sum()
    loss.backward()
    assert y.dtype == dtype
    assert x.grad is not None and x.grad.dtype == torch.float32
    for pname, p in module.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.dtype == torch.float32, pname


@pytest.mark.parametrize("fp8_recipe", [None, recipe.DelayedScaling(), recipe.Float8CurrentScaling()],
                         ids=["no-fp8", "delayed", "current"])
@pytest.mark.parametrize("device", DEVICES)
def test_transformer_layer_on_each_device(device, fp8_recipe):
    """TE's AMP sanity check on the layer: output in the autocast dtype, float32
    input and parameter gradients (on CUDA the FP8 GEMMs are real)."""
    layer = te.TransformerLayer(64, 256, 4, params_dtype=torch.float32, device=device)
    x = torch.randn(32, 2, 64, device=device, requires_grad=True)
    mask = torch.randint(2, (1, 1, 32, 32), dtype=torch.bool, device=device)
    with torch.autocast(device, dtype=torch.bfloat16):
        with te.autocast(enabled=fp8_recipe is not None, recipe=fp8_recipe):
            y = layer(x, attention_mask=mask)
        loss = y.sum()
    loss.backward()
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.float32
    assert all(p.grad.dtype == torch.float32 for p in layer.parameters())
