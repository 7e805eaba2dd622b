"""Megatron Core's ``--fp8-recipe mxfp8`` on the CPU: Megatron builds TE's
``MXFP8BlockScaling`` from its config, and a small GPT from its TE layer spec trains
under Megatron's FP8 context in exactly emulated MXFP8, with full activation recompute
bit-identical to none (losses and gradients), with high-precision and MXFP8 primary
weights; its state dict (MXFP8 weights and the recipe in the extra state) loads into a
fresh GPT bit for bit."""

import pytest
import torch

from transformer_engine.common.recipe import Format, MXFP8BlockScaling
from transformer_engine.pytorch.tensor import QuantizedTensor
from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Tensor
from transformer_engine.pytorch.tensor.nvfp4_tensor import NVFP4Tensor
from helpers import assert_runs_equal
from megatron_helpers import (counted_run, gpt_config, gpt_model, needs_megatron, te_modules_of,
                              train)

pytestmark = needs_megatron

STEPS = 2


def test_megatron_builds_mxfp8_block_scaling(megatron_on_cpu):
    """Megatron's recipe factory turns ``fp8="hybrid", fp8_recipe="mxfp8"`` into TE's
    MXFP8BlockScaling with the hybrid format."""
    from megatron.core import fp8_utils

    recipe = fp8_utils.get_fp8_recipe(gpt_config(fp8_recipe="mxfp8"))
    assert isinstance(recipe, MXFP8BlockScaling) and recipe.mxfp8()
    assert recipe.fp8_format == Format.HYBRID
    assert fp8_utils.get_fp8_align_size(fp8_utils.Fp8Recipe.mxfp8) == 32


def test_mx_tensor_classes_import_from_tes_module_paths():
    """``tensor.mxfp8_tensor`` / ``tensor.nvfp4_tensor`` hold the package's classes."""
    from transformer_engine.pytorch import tensor

    assert MXFP8Tensor is tensor.MXFP8Tensor and NVFP4Tensor is tensor.NVFP4Tensor


@pytest.mark.parametrize("fp8_param", [False, True], ids=["hp-weights", "mxfp8-weights"])
def test_megatron_mxfp8_full_recompute_matches_no_recompute(megatron_on_cpu, fp8_param):
    """Full activation recompute (every layer, through te.distributed.checkpoint) in
    MXFP8 gives bit-identical losses and gradients, step by step, to the same training
    without recompute; the loss differs from a float32 run (MXFP8 really quantized)."""
    from megatron.core import fp8_utils

    config = gpt_config()
    config.fp8 = None
    plain = counted_run(config, 1)      # first: a recompute marks Megatron's RNG tracker set
    ref = counted_run(gpt_config(fp8_recipe="mxfp8", fp8_param=fp8_param), STEPS)
    got = counted_run(gpt_config(fp8_recipe="mxfp8", fp8_param=fp8_param, recompute=True),
                      STEPS)
    assert ref.layer_calls == 2 * STEPS and got.layer_calls == 2 * 2 * STEPS
    assert_runs_equal(ref.record, got.record)
    weights = [p for p in got.model.parameters() if isinstance(p, QuantizedTensor)]
    # QKV, proj, FC1, FC2 of 2 layers
    assert len(weights) == (8 if fp8_param else 0)
    assert all(isinstance(p, MXFP8Tensor) for p in weights)
    # Megatron finds them through TE's module path (its DDP buffers ask)
    assert all(fp8_utils.is_mxfp8tensor(p) for p in weights)
    assert not torch.equal(plain.record[0].loss, ref.record[0].loss)


@pytest.mark.parametrize("fp8_param", [False, True], ids=["hp-weights", "mxfp8-weights"])
def test_mxfp8_gpt_round_trips_through_load_state_dict(megatron_on_cpu, fp8_param):
    """An MXFP8-trained GPT's state dict (the extra state holds the MXFP8 recipe) loads
    into a freshly built one: every parameter (an MXFP8 weight's storage bytes) equal,
    the TE modules' recipe restored, and one more step of each gives the same record."""
    config = gpt_config(fp8_recipe="mxfp8", fp8_param=fp8_param)
    torch.manual_seed(0)
    trained = gpt_model(config)
    train(trained, config, 2)
    torch.manual_seed(5)
    fresh = gpt_model(config)
    result = fresh.load_state_dict(trained.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    for (name, a), b in zip(fresh.named_parameters(), trained.parameters()):
        assert type(a) is type(b), name
        if isinstance(a, QuantizedTensor):
            for x, y in zip(a._storage().values(), b._storage().values()):
                assert (x is None and y is None) or torch.equal(
                    x.view(torch.uint8), y.view(torch.uint8)), name
        else:
            assert torch.equal(a, b), name
    recipes = [m.fp8_meta.get("recipe") for m in te_modules_of(fresh)]
    # QKV, proj, FC1, FC2 of 2 layers hold the trained recipe
    assert sum(r is not None and r.mxfp8() for r in recipes) == 8, recipes
    assert_runs_equal(train(trained, config, 1, seed=9), train(fresh, config, 1, seed=9))
