"""te.make_graphed_callables with MXFP8BlockScaling and NVFP4BlockScaling (exactly
emulated): graphed training steps equal eager ones bit for bit (losses, input and
parameter gradients), with high-precision weights and with MXFP8Tensor / NVFP4Tensor
primary weights that the optimizer rewrites in place between replays. NVFP4's
stochastic rounding draws from the device generator, whose seed and offset a replay
reads, so each step reseeds it in both runs. The graph tests need a CUDA GPU; on a
machine without one the MX recipes reach the device refusal."""

import copy

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import Format, MXFP8BlockScaling, NVFP4BlockScaling
from transformer_engine.pytorch.tensor import MXFP8Tensor, NVFP4Tensor
from helpers import assert_runs_equal, capture, cuda_inputs, te_modules

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="CUDA graphs need a CUDA GPU")

RECIPES = [
    pytest.param(MXFP8BlockScaling(fp8_format=Format.HYBRID), id="mxfp8-1x32"),
    pytest.param(MXFP8BlockScaling(enable_2d_quantization=True), id="mxfp8-32x32"),
    pytest.param(NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True,
                                   disable_2d_quantization=True), id="nvfp4-1x16"),
    pytest.param(NVFP4BlockScaling(), id="nvfp4-16x16-rht-sr"),
]
STEPS = 4


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
@pytest.mark.parametrize("recipe", RECIPES)
def test_cpu_only_machine_refuses_mx_recipes_for_the_device(recipe):
    """The MX recipes pass the argument checks; the refusal is the missing device."""
    lin = te.Linear(64, 64, device="cpu")
    with pytest.raises(RuntimeError, match="CUDA graphs need a CUDA device"):
        te.make_graphed_callables(lin, (torch.randn(32, 64),), enabled=True, recipe=recipe)


def _build(kind, recipe, primary):
    torch.manual_seed(11)
    kw = {"params_dtype": torch.bfloat16, "device": "cuda"}
    with te.quantized_model_init(enabled=primary, recipe=recipe):
        if kind == "Linear":
            return te.Linear(64, 64, **kw), (32, 64)
        if kind == "LayerNormMLP":
            return te.LayerNormMLP(64, 128, **kw), (32, 64)
        return te.TransformerLayer(64, 128, 4, hidden_dropout=0.0, attention_dropout=0.0,
                                   self_attn_mask_type="causal", **kw), (32, 2, 64)


def _train(model, shape, run):
    """STEPS SGD steps on `cuda_inputs`, the device generator reseeded before each
    forward; one record per step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    record = []
    for step in range(STEPS):
        x = cuda_inputs(shape, step).requires_grad_()
        torch.cuda.manual_seed(1000 + step)
        loss = run(model, x).float().pow(2).mean()
        loss.backward()
        record.append(capture(loss, [x], model.parameters(), te_modules(model)))
        opt.step()
        opt.zero_grad()
    return record


def _graphed_equals_eager(kind, recipe, primary):
    model, shape = _build(kind, recipe, primary)
    eager_model = copy.deepcopy(model)

    def eager(m, x):
        with te.autocast(recipe=recipe):
            return m(x)

    ref = _train(eager_model, shape, eager)
    graphed = te.make_graphed_callables(model, (cuda_inputs(shape, 0).requires_grad_(),),
                                        enabled=True, recipe=recipe)
    assert graphed is model
    got = _train(model, shape, lambda m, x: m(x))
    assert_runs_equal(ref, got)
    return model


@needs_cuda
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP", "TransformerLayer"])
def test_graphed_mx_steps_equal_eager_steps(kind, recipe):
    _graphed_equals_eager(kind, recipe, primary=False)


@needs_cuda
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP"])
def test_graphed_mx_primary_weights_equal_eager(kind, recipe):
    """MX primary weights: the replays read the storage the optimizer rewrote."""
    model = _graphed_equals_eager(kind, recipe, primary=True)
    cls = MXFP8Tensor if recipe.mxfp8() else NVFP4Tensor
    weights = [p for p in model.parameters() if isinstance(p, cls)]
    assert len(weights) == (1 if kind == "Linear" else 2)
