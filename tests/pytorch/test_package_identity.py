"""The package identity TE's clients read: the distribution's name and version, the
attributes ``import transformer_engine`` makes reachable, and the names Megatron Core
and HF Accelerate import from ``transformer_engine.pytorch.fp8``."""

import importlib.metadata
import importlib.util
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from packaging.version import Version

import transformer_engine
import transformer_engine.pytorch as te
from transformer_engine.common.recipe import (DelayedScaling, Float8BlockScaling,
                                              Float8CurrentScaling, MXFP8BlockScaling,
                                              NVFP4BlockScaling)
from transformer_engine.pytorch import fp8, quantization

from helpers import HAS_CUDA_FP8
from test_docs_snippets import python_blocks

ROOT = Path(__file__).resolve().parents[2]


def _imported_from_source_only() -> bool:
    """True where the package is not installed but found through PYTHONPATH (the GPU
    job runs the tests that way), so there is no distribution metadata to read."""
    try:
        importlib.metadata.distribution("transformer-engine")
        return False
    except importlib.metadata.PackageNotFoundError:
        paths = [Path(p).resolve() for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        return ROOT in paths


needs_install = pytest.mark.skipif(_imported_from_source_only(),
                                   reason="imported from source through PYTHONPATH, not installed")


# ---- version --------------------------------------------------------------------

def test_version_is_pep440_with_the_api_release_and_the_pure_label():
    v = Version(transformer_engine.__version__)
    assert str(v) == transformer_engine.__version__       # already in normal form
    assert v.public == "2.9.0"
    assert v.local == "pure"


@pytest.mark.parametrize("minimum, expected", [("2.9.0", True), ("2.1.0", True), ("1.8.0", True),
                                               ("2.10.0", False), ("3.0.0", False)],
                         ids=lambda v: str(v))
def test_version_compares_as_the_api_release(minimum, expected):
    # Megatron Core's is_te_min_version: Version(te.__version__) >= Version(minimum)
    assert (Version(transformer_engine.__version__) >= Version(minimum)) is expected


# ---- distribution metadata (HF Accelerate's availability check) -------------------

@needs_install
@pytest.mark.parametrize("name", ["transformer-engine", "transformer_engine"])
def test_metadata_found_under_te_distribution_name(name):
    meta = importlib.metadata.metadata(name)
    assert meta["Name"].replace("_", "-").lower() == "transformer-engine"
    assert meta["Version"] == transformer_engine.__version__
    assert importlib.metadata.version(name) == transformer_engine.__version__


@needs_install
def test_find_spec_and_metadata_agree_as_accelerate_checks():
    # accelerate.utils.imports._is_package_available("transformer_engine", "transformer-engine")
    assert importlib.util.find_spec("transformer_engine") is not None
    importlib.metadata.metadata("transformer-engine")


@needs_install
def test_the_documented_metadata_check_runs():
    """docs/package-identity.md: its metadata block runs as printed (here, not in
    test_docs_snippets.py: it needs the installed distribution)."""
    page = ROOT / "docs" / "package-identity.md"
    blocks = [b for b in python_blocks(page) if b.mark == "run-by"]
    assert len(blocks) == 1 and "importlib.metadata.version" in blocks[0].code
    exec(compile("\n" * blocks[0].line + blocks[0].code, str(page), "exec"),
         {"__name__": "docs_package_identity"})


# ---- attribute access after `import transformer_engine` -------------------------

_FRESH_IMPORT = """
import sys
import torch
triton_before = "triton" in sys.modules
import transformer_engine
print(transformer_engine.pytorch.Linear.__module__)
print(transformer_engine.pytorch.fp8.FP8GlobalStateManager.__name__)
print(transformer_engine.common.recipe.Float8CurrentScaling.__name__)
from transformer_engine.pytorch import fp8, fp8_support
print(fp8_support._CPU_FP8_PROBE is None, fp8.FP8GlobalStateManager.is_fp8_enabled())
print(("triton" in sys.modules) == triton_before)
"""


def test_import_transformer_engine_reaches_pytorch_and_common_without_side_effects():
    """In a fresh interpreter (this one has imported the subpackages already)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get(
        "PYTHONPATH") else []))
    out = subprocess.run([sys.executable, "-c", _FRESH_IMPORT], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split()
    assert lines == ["transformer_engine.pytorch.module.linear", "FP8GlobalStateManager",
                     "Float8CurrentScaling",
                     "True", "False",     # the CPU FP8 probe did not run; no autocast on
                     "True"]              # Triton was not imported (unless torch had)


# ---- names Megatron Core and HF Accelerate import from transformer_engine.pytorch.fp8

def test_megatron_module_level_imports():
    # megatron/core/extensions/transformer_engine.py and tensor_parallel/random.py
    from transformer_engine.pytorch.fp8 import FP8GlobalStateManager, fp8_autocast
    assert FP8GlobalStateManager is te.FP8GlobalStateManager
    assert fp8_autocast is te.fp8_autocast
    for method in ("is_fp8_enabled", "get_fp8_recipe", "get_fp8_group",
                   "add_fp8_tensors_to_global_buffer", "reduce_and_update_fp8_tensors"):
        assert callable(getattr(FP8GlobalStateManager, method)), method


def test_check_fp8_support_agrees_with_is_fp8_available():
    ok, reason = fp8.check_fp8_support()
    assert (ok, reason) == te.is_fp8_available(return_reason=True)
    if torch.cuda.is_available():
        assert ok is HAS_CUDA_FP8
    else:
        assert ok is True and reason == ""     # the CPU FP8 GEMM runs in the pinned torch


def test_mxfp8_and_nvfp4_run_where_fp8_runs_and_say_they_are_emulated():
    from transformer_engine.common.recipe import Float8BlockScaling as _Block
    expected = (True, "") if torch.cuda.is_available() else fp8.is_fp8_available(
        return_reason=True, device="cpu")
    assert fp8.check_mxfp8_support() == expected
    assert quantization.check_nvfp4_support() == expected
    for recipe in (MXFP8BlockScaling(), NVFP4BlockScaling()):
        for device in ("cpu",) + (("cuda",) if torch.cuda.is_available() else ()):
            how, why = quantization.recipe_execution(recipe, device)
            assert how == "emulated" and "float32 GEMM" in why
    assert quantization.recipe_execution(_Block(), "cpu")[0] == "emulated"
    with pytest.raises(TypeError, match="recipe_execution: recipe must be"):
        quantization.recipe_execution("mxfp8")


def test_fp8_block_scaling_is_supported_where_torch_has_fp8():
    """Float8BlockScaling is an emulation (float32 GEMMs on dequantized blocks): it runs
    on the CPU wherever the CPU FP8 cast runs, and on any CUDA device."""
    ok, reason = fp8.check_fp8_block_scaling_support()
    expected = (True, "") if torch.cuda.is_available() else te.is_fp8_available(
        return_reason=True, device="cpu")
    assert (ok, reason) == expected and ok is True


@pytest.mark.parametrize("name", ["quantized_model_init", "fp8_model_init"])
def test_model_init_disabled_is_a_no_op(name):
    ctx = getattr(fp8, name)
    assert getattr(te, name) is ctx
    # Megatron inspects these parameters before passing them
    params = inspect.signature(ctx).parameters
    assert {"enabled", "recipe", "preserve_high_precision_init_val"} <= set(params)
    state = fp8.FP8GlobalStateManager.get_fp8_autocast_state()
    torch.manual_seed(7)
    with ctx(enabled=False, recipe=DelayedScaling(), preserve_high_precision_init_val=True):
        inside = te.Linear(16, 32, device="cpu")
        assert fp8.FP8GlobalStateManager.get_fp8_autocast_state() is state
    torch.manual_seed(7)
    plain = te.Linear(16, 32, device="cpu")
    assert inside.weight.dtype == torch.float32
    assert torch.equal(inside.weight, plain.weight)


@pytest.mark.parametrize("name", ["quantized_model_init", "fp8_model_init"])
@pytest.mark.parametrize("recipe", [None, DelayedScaling(), Float8CurrentScaling(),
                                    Float8BlockScaling()],
                         ids=["default", "delayed", "current", "block"])
def test_model_init_enabled_builds_fp8_weights(name, recipe):
    from transformer_engine.pytorch.tensor import Float8BlockwiseQTensor, Float8Tensor
    kwargs = {} if recipe is None else {"recipe": recipe}
    with getattr(fp8, name)(**kwargs):          # TE's default is enabled=True
        assert fp8.FP8GlobalStateManager.with_fp8_parameters()
        layer = te.Linear(16, 32, device="cpu")
    kind = Float8BlockwiseQTensor if isinstance(recipe, Float8BlockScaling) else Float8Tensor
    assert isinstance(layer.weight, kind) and type(layer.bias) is torch.nn.Parameter
    assert not fp8.FP8GlobalStateManager.with_fp8_parameters()


@pytest.mark.parametrize("name", ["quantized_model_init", "fp8_model_init"])
@pytest.mark.parametrize("recipe", [MXFP8BlockScaling(), NVFP4BlockScaling()],
                         ids=["mxfp8", "nvfp4"])
def test_model_init_makes_mx_primary_weights(name, recipe):
    """Both spellings of the FP8-primary-weight context take the emulated MX recipes
    too: the weight is the recipe's quantized tensor, the bias stays a Parameter."""
    from transformer_engine.pytorch.tensor import MXFP8Tensor, NVFP4Tensor
    kind = MXFP8Tensor if isinstance(recipe, MXFP8BlockScaling) else NVFP4Tensor
    with getattr(fp8, name)(enabled=True, recipe=recipe):
        layer = te.Linear(64, 64, device="cpu")
    assert isinstance(layer.weight, kind) and type(layer.bias) is torch.nn.Parameter
    assert not fp8.FP8GlobalStateManager.with_fp8_parameters()


@pytest.mark.parametrize("kwargs, match", [
    ({"enabled": 1}, r"enabled must be a bool, got 1"),
    ({"enabled": False, "recipe": "delayed"}, r"the recipe must be a .*Recipe or None, got str"),
    ({"enabled": False, "preserve_high_precision_init_val": None},
     r"preserve_high_precision_init_val must be a bool, got None"),
], ids=["enabled", "recipe", "preserve"])
def test_model_init_checks_arguments(kwargs, match):
    with pytest.raises(TypeError, match=r"te\.quantized_model_init: " + match):
        fp8.quantized_model_init(**kwargs)
