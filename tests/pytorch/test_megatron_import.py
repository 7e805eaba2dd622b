"""Megatron Core (the pinned release, qa/megatron_requirements.txt) against this
package: it imports, reads the TE version this package claims and takes the branches
that version selects, and its TE layer spec builds a TransformerLayer of this package's
modules that runs on the CPU; the TE names it only references (fusible operations, fused
router kernels) refuse to be used, naming the feature, and its FP8-parameter all-gather
helpers reach TE's tensor.utils. Training a GPT: test_megatron_gpt.py and test_megatron_moe.py."""

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from packaging.version import Version

import transformer_engine
import transformer_engine.pytorch as te
from megatron_helpers import ClientTimeout, deadline, needs_megatron
from transformer_engine.common.recipe import Float8BlockScaling
from transformer_engine.pytorch import ops, router
from transformer_engine.pytorch.tensor import QuantizedTensor

OPS = ["FusibleOperation", "Sequential", "BasicLinear", "Bias", "GELU", "GEGLU", "ReLU", "ReGLU",
       "SiLU", "SwiGLU", "LayerNorm", "RMSNorm", "AllReduce", "ReduceScatter", "MakeExtraOutput"]


@pytest.mark.parametrize("name", OPS)
def test_fusible_operation_names_resolve(name):
    """The names Megatron-LM's class bodies reference are te.ops's modules; the
    tensor-parallel collectives refuse construction (not implemented for operations)."""
    cls = getattr(te.ops, name)
    assert cls is getattr(ops, name) and issubclass(cls, torch.nn.Module)
    if name in ("AllReduce", "ReduceScatter"):
        with pytest.raises(NotImplementedError, match=rf"te\.ops\.{name}: tensor-parallel"):
            cls(None)


@pytest.mark.parametrize("name, args", [
    ("fused_topk_with_score_function", (None, 2, False, None, None, None, "softmax", None)),
    ("fused_compute_score_for_moe_aux_loss", (None, 2, "softmax")),
    ("fused_moe_aux_loss", (None, None, 8, 4, 2, 0.01)),
], ids=["topk", "aux-loss-scores", "aux-loss"])
def test_fused_router_kernels_refuse(name, args):
    with pytest.raises(NotImplementedError, match=rf"router\.{name}: the fused MoE router kernels"):
        getattr(router, name)(*args)


def test_only_fp8_primary_weights_are_quantized_tensors():
    layer = te.LayerNormMLP(32, 64, device="cpu")
    assert issubclass(QuantizedTensor, torch.Tensor)
    assert not any(isinstance(p, QuantizedTensor) for p in layer.parameters())
    with te.quantized_model_init():
        fp8_layer = te.LayerNormMLP(32, 64, device="cpu")
    assert [n for n, p in fp8_layer.named_parameters() if isinstance(p, QuantizedTensor)] == [
        "fc1_weight", "fc2_weight"]


def test_client_deadline_turns_a_hang_into_a_failure():
    """The deadline every Megatron test runs under raises in a wait that would never end
    (a stalled worker or collective), and puts back the SIGALRM handler it found."""
    import signal
    before = signal.getsignal(signal.SIGALRM)
    disarm = deadline(0.2, "a hung client")
    try:
        with pytest.raises(ClientTimeout, match=r"a hung client: did not finish within 0\.2 s"):
            threading.Event().wait()
    finally:
        disarm()
    assert signal.getsignal(signal.SIGALRM) is before


def test_client_deadline_ends_a_process_stuck_outside_python():
    """Where the deadline's exception cannot be raised (the main thread never returns to
    Python: here SIGALRM is blocked), the process dumps its stacks and exits non-zero
    after the grace period, so the test file fails instead of stalling CI."""
    tests = Path(__file__).parent
    script = ("import signal, time\n"
              "from megatron_helpers import deadline\n"
              "signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])\n"
              "deadline(0.2, 'stuck', grace=0.3)\n"
              "time.sleep(60)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tests), str(tests.parent.parent)]))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=50)
    assert done.returncode != 0
    # the dump names where the main thread was stuck
    assert "Timeout" in done.stderr and 'File "<string>", line 5' in done.stderr, done.stderr


@needs_megatron
def test_megatron_core_imports_with_te(client_deadline):
    import megatron.core  # noqa: F401
    from megatron.core import fp8_utils
    from megatron.core.extensions import transformer_engine as mte

    assert mte.HAVE_TE and issubclass(mte.TEGroupedLinear, te.GroupedLinear)
    assert issubclass(mte.TELayerNormColumnParallelLinear, te.LayerNormLinear)
    assert mte.fused_moe_aux_loss is router.fused_moe_aux_loss
    assert fp8_utils.FP8_TENSOR_CLASS is QuantizedTensor
    assert not fp8_utils.is_float8tensor(torch.nn.Parameter(torch.zeros(2)))
    with te.quantized_model_init():
        assert fp8_utils.is_float8tensor(te.Linear(16, 16, device="cpu").weight)


@needs_megatron
def test_megatron_reads_the_te_version_this_package_claims(client_deadline):
    """Megatron's ``is_te_min_version`` sees ``transformer_engine.__version__``: the
    branches gated on TE 2.9 or older are taken, those on 2.10 and newer are not
    (docs/megatron.md lists what each needs)."""
    from megatron.core.utils import get_te_version, is_te_min_version

    assert get_te_version() == Version(transformer_engine.__version__) == Version("2.9.0+pure")
    assert is_te_min_version("2.9.0") and is_te_min_version("2.7.0.dev0")
    assert not is_te_min_version("2.10.0") and not is_te_min_version("2.14.0")


TE_LAYER_MODULES = {"self_attention.linear_qkv": te.LayerNormLinear,
                    "self_attention.core_attention": te.DotProductAttention,
                    "self_attention.linear_proj": te.Linear,
                    "mlp.linear_fc1": te.LayerNormLinear,
                    "mlp.linear_fc2": te.Linear}


@needs_megatron
def test_te_spec_transformer_layer_runs_on_this_package(megatron_on_cpu):
    """What Megatron builds from ``get_gpt_layer_with_transformer_engine_spec()`` (the
    behaviour, not the spec object): a TransformerLayer whose attention and MLP are this
    package's modules (the layer norms fused into the QKV and FC1 GEMMs, no separate
    norm), each of which runs in the layer's forward; a causal layer whose output and
    gradients are finite."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(0)
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4,
                               use_cpu_initialization=True, params_dtype=torch.float32,
                               hidden_dropout=0.0, attention_dropout=0.0)
    layer = build_module(get_gpt_layer_with_transformer_engine_spec(), config=config,
                         layer_number=1)
    modules = dict(layer.named_modules())
    for name, cls in TE_LAYER_MODULES.items():
        assert isinstance(modules[name], cls), (name, type(modules[name]))
    norms = [n for n, m in modules.items()
             if isinstance(m, (torch.nn.LayerNorm, te.LayerNorm, te.RMSNorm))]
    assert norms == [], norms           # both norms live inside the LayerNormLinear GEMMs
    ran = []
    for name in TE_LAYER_MODULES:
        modules[name].register_forward_hook(lambda m, *_, name=name: ran.append(name))
    x = torch.randn(8, 2, 64, requires_grad=True)      # [sequence, batch, hidden]
    out, context = layer(x, attention_mask=None)
    assert sorted(ran) == sorted(TE_LAYER_MODULES)
    assert out.shape == x.shape and context is None and torch.isfinite(out).all()
    out.pow(2).sum().backward()
    assert torch.isfinite(x.grad).all()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in layer.parameters())
    # causal: the first position's output does not depend on later positions
    x2 = x.detach().clone()
    x2[1:] += 1.0
    with torch.no_grad():
        out2, _ = layer(x2, attention_mask=None)
    assert torch.equal(out2[0], out.detach()[0]) and not torch.equal(out2[1], out.detach()[1])


@needs_megatron
def test_te_rng_tracker_states_reach_megatron(megatron_on_cpu):
    """``use_te_rng_tracker``: Megatron's tracker is this package's CudaRNGStatesTracker,
    and on TE >= 1.5 Megatron's ``get_all_rng_states()`` returns TE's
    ``get_all_rng_states()``: the tracker's own named generators (which its CUDA-graph
    code registers with each graph)."""
    from megatron.core.extensions.transformer_engine import TECudaRNGStatesTracker
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.initialize_rng_tracker(use_te_rng_tracker=True, force_reset=True)
    tracker = mrandom.get_cuda_rng_tracker()
    assert isinstance(tracker, TECudaRNGStatesTracker)
    tracker.add("model-parallel-rng", 1234)
    tracker.add("expert-parallel-rng", 4321)
    states = mrandom.get_all_rng_states()
    assert states is tracker.states_ and sorted(states) == ["expert-parallel-rng",
                                                            "model-parallel-rng"]
    device = tracker.device          # CUDA where there is a GPU, as TE's tracker
    with tracker.fork("model-parallel-rng"):
        drawn = torch.rand(4, device=device)
    seeded = torch.Generator(device=device).manual_seed(1234)
    assert torch.equal(drawn, torch.rand(4, device=device, generator=seeded))
    tracker.set_states(tracker.get_states())
    assert mrandom.get_all_rng_states() is tracker.states_


@needs_megatron
def test_fp8_param_gather_helpers_reach_te_tensor_utils(megatron_on_cpu):
    """Megatron's FP8-parameter all-gather helpers (``--fp8-param-gather``, the TE >= 2.2
    branch) run on this package's ``tensor.utils``: ``modify_underlying_storage`` moves
    an FP8 weight's bits into the optimizer's uint8 buffer, ``quantize_param_shard``
    casts a master shard into its slice with the module's scale, and the
    ``post_all_gather_processing`` Megatron imported is TE's; block-scaled weights are
    refused, naming the feature. Two ranks through the distributed optimizer:
    test_megatron_optimizers.py."""
    from megatron.core import fp8_utils
    from megatron.core.parallel_state import get_data_parallel_group
    from transformer_engine.pytorch.tensor import utils as tensor_utils

    assert fp8_utils.te_post_all_gather_processing is tensor_utils.post_all_gather_processing
    with te.quantized_model_init():
        layer = te.Linear(16, 16, device="cpu")
    w = layer.weight
    bits = w._data.view(torch.uint8).clone()
    buffer = torch.zeros(256, dtype=torch.uint8)
    fp8_utils.modify_underlying_storage(w, buffer.view(16, 16))
    assert w._data.data_ptr() == buffer.data_ptr() and torch.equal(buffer, bits.reshape(-1))
    master = torch.randn(256) * 0.1
    fp8_utils.quantize_param_shard([w], [master[64:]], [64], get_data_parallel_group())
    fp8_utils.post_all_gather_processing([w])
    scale = layer.fp8_meta["scaling_fwd"].scale[1]
    cast = torch.clamp(master[64:] * scale, -448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(buffer[64:], cast.view(torch.uint8))
    assert torch.equal(buffer[:64], bits.reshape(-1)[:64])
    assert torch.equal(w._scale_inv, (1 / scale).reshape(1))
    with te.quantized_model_init(recipe=Float8BlockScaling()):
        block = te.Linear(128, 128, device="cpu").weight
    with pytest.raises(NotImplementedError,
                       match=r"replace_raw_data: Float8BlockwiseQTensor weights are not "
                             r"supported.*--fp8-param-gather"):
        fp8_utils.modify_underlying_storage(block, torch.zeros(128, 128, dtype=torch.uint8))
