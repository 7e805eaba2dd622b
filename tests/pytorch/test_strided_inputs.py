"""A module's outputs, gradients and FP8 state do not depend on its input's strides:
a transposed view gives the same bits as its contiguous copy (NOTE [Contiguous module
inputs] in module/base.py), in high precision and in FP8, on the CPU and on CUDA."""

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import Float8CurrentScaling
from helpers import DEVICES, RECIPE, assert_states_equal, fp8_state_snapshot

MODULES = {
    "LayerNorm": lambda d: te.LayerNorm(64, device=d),
    "RMSNorm": lambda d: te.RMSNorm(64, device=d),
    "Linear": lambda d: te.Linear(64, 32, device=d),
    "LayerNormLinear": lambda d: te.LayerNormLinear(64, 32, normalization="RMSNorm", device=d),
    "LayerNormMLP": lambda d: te.LayerNormMLP(64, 96, device=d),
    "GroupedLinear": lambda d: te.GroupedLinear(2, 64, 32, device=d),
}
RECIPES = [pytest.param(None, id="high-precision"), pytest.param(RECIPE, id="delayed"),
           pytest.param(Float8CurrentScaling(), id="current")]
_GEMM_FREE = ("LayerNorm", "RMSNorm")


def _step(module, x, recipe):
    kw = {"m_splits": [16, 32]} if isinstance(module, te.GroupedLinear) else {}
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        out = module(x, **kw)
    out.float().pow(2).sum().backward()
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("kind", list(MODULES))
def test_transposed_input_gives_the_contiguous_inputs_bits(kind, recipe, device):
    if recipe is not None and kind in _GEMM_FREE:
        pytest.skip("no GEMM: FP8 does not touch a norm")
    if isinstance(recipe, Float8CurrentScaling) and kind != "Linear" and device == "cpu":
        pytest.skip("the CPU runs current scaling on te.Linear only (the cast is the same)")
    torch.manual_seed(0)
    strided_module = MODULES[kind](device)
    plain_module = MODULES[kind](device)
    plain_module.load_state_dict(strided_module.state_dict())
    base = torch.randn(64, 48, device=device).requires_grad_()       # [features, tokens]
    strided = base.t()                                               # [tokens, features] view
    plain = strided.detach().contiguous().requires_grad_()
    assert not strided.is_contiguous()
    for _ in range(2):                                 # the second step reads updated scales
        got, want = _step(strided_module, strided, recipe), _step(plain_module, plain, recipe)
        assert torch.equal(got, want)
    assert torch.equal(base.grad.t(), plain.grad)
    for (name, p), q in zip(strided_module.named_parameters(), plain_module.parameters()):
        assert torch.equal(p.grad, q.grad), name
    if recipe is not None:
        assert_states_equal(fp8_state_snapshot([strided_module]),
                            fp8_state_snapshot([plain_module]))
