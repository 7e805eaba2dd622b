"""HF Accelerate's Transformer Engine FP8 path, unchanged, against this package.

``Accelerator(mixed_precision="fp8", kwargs_handlers=[TERecipeKwargs(...)])`` finds TE
by its distribution metadata; ``prepare(model, optimizer)`` swaps ``nn.Linear`` /
``nn.LayerNorm`` for ``te.Linear`` / ``te.LayerNorm`` (``convert_model``), wraps the
forward in ``torch.autocast(bfloat16)`` and, around that, in ``te.fp8_autocast`` with a
``DelayedScaling`` built from the kwargs (``apply_fp8_autowrap``). Each test compares
against the same training written by hand with ``te.fp8_autocast``, bit for bit:
losses, gradients, FP8 states and the weights after each optimizer step.
"""

import copy
import os
from typing import NamedTuple

import pytest
import torch
from torch import nn

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Format, MXFP8BlockScaling
from helpers import (DEVICES, assert_runs_equal, assert_states_equal, assert_tensors_equal, capture,
                     fp8_state_snapshot, te_modules)

accelerate = pytest.importorskip("accelerate", reason="HF Accelerate is a test dependency "
                                 "of the CPU job (setup.py extra 'test')")
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402
from accelerate.utils import TERecipeKwargs, has_transformer_engine_layers  # noqa: E402
from accelerate.utils import imports as accelerate_imports  # noqa: E402

if not accelerate_imports.is_transformer_engine_available():
    pytest.skip("transformer_engine has no distribution metadata here (imported from source, "
                "not installed)", allow_module_level=True)

STEPS = 8
RECIPE_KWARGS = {"fp8_format": "HYBRID", "amax_history_len": 16, "amax_compute_algo": "max"}
RECIPE = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16, amax_compute_algo="max")


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Accelerate keeps process-wide singletons and reads ACCELERATE_* variables:
    start each test from none and leave none behind."""
    saved_env = dict(os.environ)
    for key in [k for k in os.environ if k.startswith("ACCELERATE_")]:
        del os.environ[key]
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    os.environ.clear()
    os.environ.update(saved_env)


class Net(nn.Module):
    """Linear layers (with and without bias), a LayerNorm, and nesting; every
    dimension a multiple of 16 (``convert_model`` converts only those)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(32, 64)
        self.block = nn.Sequential(nn.LayerNorm(64, eps=1e-6), nn.Linear(64, 64, bias=False),
                                   nn.GELU())
        self.out = nn.Linear(64, 16)

    def forward(self, x):
        return self.out(self.block(self.inp(x)))


def make_task(device):
    torch.manual_seed(0)
    model = Net().to(device)
    x = torch.randn(64, 32, device=device)
    teacher = torch.randn(32, 16, device=device) / 32 ** 0.5
    return model, x, torch.tanh(2 * x @ teacher)


def convert_by_hand(model: nn.Module) -> nn.Module:
    """``nn.Linear`` -> ``te.Linear`` and ``nn.LayerNorm`` -> ``te.LayerNorm`` with the
    same parameters, written independently of accelerate's ``convert_model``."""
    for name, child in model.named_children():
        if isinstance(child, nn.Linear):
            new = te.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                            params_dtype=child.weight.dtype, device=child.weight.device)
        elif isinstance(child, nn.LayerNorm):
            new = te.LayerNorm(child.normalized_shape[0], eps=child.eps,
                               params_dtype=child.weight.dtype, device=child.weight.device)
        else:
            convert_by_hand(child)
            continue
        with torch.no_grad():
            new.weight.copy_(child.weight)
            if child.bias is not None:
                new.bias.copy_(child.bias)
        setattr(model, name, new)
    return model


class History(NamedTuple):
    """A training run: its steps, and the weights after each optimizer step."""

    steps: list
    weights: list


def train_steps(model, optimizer, step_loss, backward):
    """STEPS steps of ``step_loss()``, recorded after each backward and optimizer step."""
    history = History([], [])
    for _ in range(STEPS):
        loss = step_loss()
        backward(loss)
        history.steps.append(capture(loss, [], model.parameters(), te_modules(model)))
        optimizer.step()
        optimizer.zero_grad()
        history.weights.append([p.detach().clone() for p in model.parameters()])
    return history


def prepare_with_accelerate(device, **recipe_kwargs):
    model, x, y = make_task(device)
    original = copy.deepcopy(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    accelerator = Accelerator(mixed_precision="fp8", cpu=device == "cpu",
                              kwargs_handlers=[TERecipeKwargs(**recipe_kwargs)])
    assert accelerator.device.type == device
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, original, model, optimizer, (x, y)


def train_with_accelerate(device, **recipe_kwargs):
    accelerator, original, model, optimizer, (x, y) = prepare_with_accelerate(device,
                                                                              **recipe_kwargs)
    history = train_steps(model, optimizer, lambda: nn.functional.mse_loss(model(x), y),
                          accelerator.backward)
    return original, model, history, (x, y)


def train_by_hand(original, x, y, fp8_enabled):
    """What accelerate's wrappers amount to: FP8 autocast around a bfloat16
    torch.autocast, outputs back to float32."""
    model = convert_by_hand(copy.deepcopy(original))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)

    def step_loss():
        with te.fp8_autocast(enabled=fp8_enabled, fp8_recipe=RECIPE):
            with torch.autocast(x.device.type, dtype=torch.bfloat16):
                out = model(x)
        return nn.functional.mse_loss(out.float(), y)

    return model, train_steps(model, optimizer, step_loss, lambda loss: loss.backward())


def assert_histories_equal(a, b):
    assert len(a.steps) == len(b.steps) == STEPS
    assert_runs_equal(a.steps, b.steps)
    for step, (weights_a, weights_b) in enumerate(zip(a.weights, b.weights)):
        assert_tensors_equal(weights_a, weights_b, f"step {step}: weights after the step")


@pytest.mark.parametrize("device", DEVICES)
def test_prepare_converts_to_te_modules(device):
    _, original, model, optimizer, _ = prepare_with_accelerate(device, **RECIPE_KWARGS)
    kinds = [type(m) for m in model.modules()]
    assert kinds.count(te.Linear) == 3 and kinds.count(te.LayerNorm) == 1
    assert nn.Linear not in kinds and nn.LayerNorm not in kinds
    assert has_transformer_engine_layers(model)
    assert model.block[0].eps == 1e-6 and model.block[1].bias is None
    # the TE modules hold the original parameters, and the optimizer steps them
    assert_tensors_equal(list(model.parameters()), list(original.parameters()), "parameters")
    assert [p for g in optimizer.param_groups for p in g["params"]] == list(model.parameters())


@pytest.mark.parametrize("device", DEVICES)
def test_training_matches_hand_written_fp8_autocast_bit_for_bit(device):
    original, model, history, (x, y) = train_with_accelerate(device, **RECIPE_KWARGS)
    _, by_hand = train_by_hand(original, x, y, fp8_enabled=True)
    assert_histories_equal(history, by_hand)
    # accelerate built the DelayedScaling recipe from the kwargs, and each module used it
    assert all(m.fp8_meta["recipe"] == RECIPE for m in te_modules(model))

    losses = [s.loss.item() for s in history.steps]
    assert losses[-1] < 0.3 * losses[0], losses

    # The forward ran in FP8: scales moved from 1 and the amax histories filled up ...
    for m in te_modules(model):
        fwd, bwd = m.fp8_meta["scaling_fwd"], m.fp8_meta["scaling_bwd"]
        assert (fwd.scale != 1).all() and (bwd.scale != 1).all()
        for amaxes in (fwd.amax_history, bwd.amax_history):   # one row recorded per step
            assert int((amaxes > 0).all(dim=1).sum()) == STEPS, amaxes
    # ... and the same training without FP8 gives other numbers.
    _, high_precision = train_by_hand(original, x, y, fp8_enabled=False)
    assert not torch.equal(history.steps[0].loss, high_precision.steps[0].loss)


@pytest.mark.parametrize("use_during_eval", [False, True], ids=["fp8_off_in_eval", "fp8_in_eval"])
@pytest.mark.parametrize("device", DEVICES)
def test_eval_forward_follows_use_autocast_during_eval(device, use_during_eval):
    original, model, _, (x, y) = train_with_accelerate(
        device, use_autocast_during_eval=use_during_eval, **RECIPE_KWARGS)
    reference, _ = train_by_hand(original, x, y, fp8_enabled=True)
    model.eval()
    reference.eval()
    with torch.no_grad():
        out = model(x)
        with te.fp8_autocast(enabled=use_during_eval, fp8_recipe=RECIPE):
            with torch.autocast(x.device.type, dtype=torch.bfloat16):
                expected = reference(x).float()
    assert out.dtype == torch.float32
    assert torch.equal(out, expected)
    assert_states_equal(fp8_state_snapshot(te_modules(model)),
                        fp8_state_snapshot(te_modules(reference)), "after the eval forward")


def test_mxfp8_request_trains_with_the_emulated_recipe():
    assert accelerate_imports.is_transformer_engine_mxfp8_available() is True
    model, x, y = make_task("cpu")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    accelerator = Accelerator(mixed_precision="fp8", cpu=True,
                              kwargs_handlers=[TERecipeKwargs(use_mxfp8_block_scaling=True)])
    model, optimizer = accelerator.prepare(model, optimizer)
    seen = []
    for m in model.modules():
        if isinstance(m, te.TransformerEngineBaseModule):
            m.register_forward_pre_hook(
                lambda mod, args: seen.append(te.FP8GlobalStateManager.get_fp8_recipe()))
    loss = torch.nn.functional.mse_loss(model(x).float(), y)
    accelerator.backward(loss)
    optimizer.step()
    assert seen and all(isinstance(r, MXFP8BlockScaling) for r in seen)
    assert torch.isfinite(loss)
