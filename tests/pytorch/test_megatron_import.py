"""Megatron Core 0.16.1 against this package: it imports, builds its TE layer spec and
runs a TE-spec TransformerLayer on the CPU; the TE names it only references (fusible
operations, fused router kernels, quantized tensors) refuse to be used."""

import importlib.util

import pytest
import torch
import torch.distributed as dist

import transformer_engine.pytorch as te
from helpers import assert_runs_equal
from transformer_engine.pytorch import ops, router
from transformer_engine.pytorch.tensor import QuantizedTensor

needs_megatron = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None
    or importlib.util.find_spec("megatron.core") is None,
    reason="megatron-core is not installed (pip install --no-deps megatron-core==0.16.1)")

OPS = ["FusibleOperation", "Sequential", "BasicLinear", "Bias", "GELU", "GEGLU", "ReLU", "ReGLU",
       "SiLU", "SwiGLU", "LayerNorm", "RMSNorm", "AllReduce", "ReduceScatter"]


@pytest.mark.parametrize("name", OPS)
def test_fusible_operations_refuse_construction(name):
    cls = getattr(te.ops, name)
    assert cls is getattr(ops, name) and issubclass(cls, torch.nn.Module)
    with pytest.raises(NotImplementedError,
                       match=rf"te\.ops\.{name}: the fusible-operations API is not implemented"):
        cls(16)


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


@needs_megatron
def test_megatron_core_imports_with_te():
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
def test_gpt_layer_spec_uses_te_modules():
    from megatron.core.extensions import transformer_engine as mte
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    spec = get_gpt_layer_with_transformer_engine_spec()
    attention = spec.submodules.self_attention.submodules
    assert attention.linear_qkv is mte.TELayerNormColumnParallelLinear
    assert attention.core_attention is mte.TEDotProductAttention
    assert spec.submodules.mlp.submodules.linear_fc2 is mte.TERowParallelLinear


@pytest.fixture
def single_process_gloo(tmp_path):
    """A one-rank gloo group and Megatron's parallel state over it, and a fresh Megatron
    RNG tracker (a recompute's RNG replay calls its set_states, which marks it
    initialized for every model built later), torn down after."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    initialize_rng_tracker(force_reset=True)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        parallel_state.initialize_model_parallel(1, 1)
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        initialize_rng_tracker(force_reset=True)


@needs_megatron
def test_te_spec_transformer_layer_runs_on_cpu(single_process_gloo):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(0)
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4,
                               use_cpu_initialization=True, params_dtype=torch.float32,
                               hidden_dropout=0.0, attention_dropout=0.0)
    layer = build_module(get_gpt_layer_with_transformer_engine_spec(), config=config,
                         layer_number=1)
    te_layers = [m for m in layer.modules() if isinstance(m, te.TransformerEngineBaseModule)]
    assert len(te_layers) == 4          # qkv, proj, fc1, fc2
    x = torch.randn(8, 2, 64, requires_grad=True)      # [sequence, batch, hidden]
    out, context = layer(x, attention_mask=None)
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


def _megatron_gpt_run(recompute: bool, steps: int = 3, micro_batches: int = 1,
                      fp8_param: bool = False):
    """A 2-layer Megatron GPT from the TE layer spec, FP8 delayed scaling through
    Megatron's own FP8 context, trained ``steps`` SGD steps of ``micro_batches``
    micro-batches each (gradients accumulated; ``set_is_first_microbatch()`` before the
    first, as Megatron's schedule calls it, so later micro-batches reuse the FP8
    weights cast in the first); with ``recompute``, full activation recompute
    (Megatron routes it through te.distributed.checkpoint). Returns per-step losses
    (of the last micro-batch) and gradients, the TE modules' FP8 states, and how often
    the layers' forward ran. ``fp8_param``: Megatron builds the layers under
    ``fp8_model_init`` (FP8 primary weights); the weights' FP8 bits after the last step
    are recorded too."""
    from megatron.core import fp8_utils
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    from helpers import capture, fp8_state_snapshot

    torch.manual_seed(0)
    extra = ({"recompute_granularity": "full", "recompute_method": "uniform",
              "recompute_num_layers": 1} if recompute else {})
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                               use_cpu_initialization=True, params_dtype=torch.float32,
                               hidden_dropout=0.0, attention_dropout=0.0, fp8="hybrid",
                               fp8_recipe="delayed", fp8_amax_history_len=4,
                               fp8_param=fp8_param, **extra)
    model = GPTModel(config, get_gpt_layer_with_transformer_engine_spec(), vocab_size=128,
                     max_sequence_length=32)
    calls = [0]
    for layer in model.decoder.layers:
        layer.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    te_modules = [m for m in model.modules() if isinstance(m, te.TransformerEngineBaseModule)]
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.1)
    gen = torch.Generator().manual_seed(1)
    record, scales_at_forward = [], []
    for _ in range(steps):
        scales_at_forward.append(te_modules[0].fp8_meta["scaling_fwd"].scale.clone()
                                 if te_modules[0].fp8_meta["scaling_fwd"] is not None else None)
        model.set_is_first_microbatch()
        for _ in range(micro_batches):
            tokens = torch.randint(0, 128, (2, 16), generator=gen)
            labels = torch.randint(0, 128, (2, 16), generator=gen)
            positions = torch.arange(16).unsqueeze(0).expand(2, 16)
            with fp8_utils.get_fp8_context(config):
                loss = model(tokens, positions, attention_mask=None, labels=labels).float().mean()
            (loss / micro_batches).backward()
        record.append(capture(loss, [], params, te_modules))
        opt.step()
        opt.zero_grad()
    if fp8_param:
        record.append([p._data.view(torch.uint8).clone() for p in params
                       if fp8_utils.is_float8tensor(p)])
    return record, calls[0], scales_at_forward, fp8_state_snapshot(te_modules)


@needs_megatron
def test_megatron_gpt_full_recompute_in_fp8_matches_no_recompute(single_process_gloo):
    """Megatron's full activation recompute (recompute_granularity="full") in FP8
    delayed scaling gives bit-identical losses, gradients and FP8 scales and amax
    histories, step by step, to the same training without recompute."""
    ref, ref_calls, _, _ = _megatron_gpt_run(recompute=False)
    got, calls, scales, _ = _megatron_gpt_run(recompute=True)
    assert ref_calls == 2 * 3 and calls == 2 * 2 * 3           # every layer recomputed
    assert not torch.equal(scales[1], scales[2])              # the scales moved each step
    assert_runs_equal(ref, got)


@needs_megatron
def test_megatron_micro_batches_with_the_fp8_weight_cache_under_full_recompute(
        single_process_gloo, monkeypatch):
    """Two micro-batches a step with ``set_is_first_microbatch()``, as Megatron's
    schedule runs them: the second micro-batch (and every recompute) takes the FP8
    weights cast in the first, and full recompute stays bit-identical to none."""
    from transformer_engine.pytorch.module import fp8_operands
    casts = []
    real = fp8_operands.cast_operand

    def counting(x, plan, state, index, dtype, record, role, *args, **kwargs):
        if role == "fwd_weight":
            casts.append(index)
        return real(x, plan, state, index, dtype, record, role, *args, **kwargs)

    monkeypatch.setattr(fp8_operands, "cast_operand", counting)
    ref, _, _, _ = _megatron_gpt_run(recompute=False, micro_batches=2)
    ref_casts, casts[:] = len(casts), []
    got, calls, _, _ = _megatron_gpt_run(recompute=True, micro_batches=2)
    assert calls == 2 * 2 * 2 * 3                 # 2 layers, 2 micro-batches, recomputed
    # 4 TE modules a layer, 2 layers: their weights cast once a step, not per micro-batch
    assert ref_casts == len(casts) == 8 * 3, (ref_casts, len(casts))
    assert_runs_equal(ref, got)


@needs_megatron
def test_megatron_fp8_param_trains_under_full_recompute(single_process_gloo):
    """``fp8_param=True``: Megatron builds the layers under ``fp8_model_init``, so the TE
    linear weights are FP8 primary weights; training with full recompute equals
    training without it, the FP8 weight bits after the SGD steps included."""
    ref, _, _, _ = _megatron_gpt_run(recompute=False, fp8_param=True)
    got, calls, _, _ = _megatron_gpt_run(recompute=True, fp8_param=True)
    assert calls == 2 * 2 * 3
    # 4 TE linear modules a layer (QKV, proj, FC1, FC2), 2 layers
    assert len(ref[-1]) == len(got[-1]) == 8
    for a, b in zip(ref[-1], got[-1]):
        assert torch.equal(a, b)
    assert_runs_equal(ref[:-1], got[:-1])
