"""Parameters and gradients of the TE modules: deferred initialization
(device="meta" then reset_parameters()), initializers under the RNG tracker,
fuse_wgrad_accumulation (main_grad), params_dtype=torch.float16, the glu activation,
is_first_microbatch reaching prepare_forward, LayerNorm's TE arguments. Numbers
against float64 references or, bit for bit, against the same module without the
feature.
"""

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling
from transformer_engine.pytorch.module.base import TransformerEngineBaseModule
from references import assert_close, leaf64

RECIPE = DelayedScaling(amax_history_len=4)


def _rng_tracker():
    tracker = te.CudaRNGStatesTracker(device="cpu")
    tracker.add("model-parallel-rng", 1234)
    tracker.add("expert-parallel-rng", 5678)
    return tracker


# ---- deferred initialization, initializers, RNG tracker ---------------------------------

BUILDERS = {
    "Linear": lambda d: te.Linear(32, 48, device=d, parallel_mode="column"),
    "Linear-split": lambda d: te.Linear(32, 48, parameters_split=("q", "k", "v"), device=d),
    "LayerNormLinear": lambda d: te.LayerNormLinear(32, 48, device=d),
    "LayerNormMLP": lambda d: te.LayerNormMLP(32, 64, activation="geglu", device=d),
    "LayerNorm": lambda d: te.LayerNorm(32, zero_centered_gamma=True, sequence_parallel=True,
                                        device=d),
    "RMSNorm": lambda d: te.RMSNorm(32, device=d),
    "TransformerLayer": lambda d: te.TransformerLayer(64, 128, 4, layer_type="decoder",
                                                      device=d),
}


def _tensors(m):
    return {k: v for k, v in m.state_dict().items() if not k.endswith("_extra_state")}


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_meta_then_reset_parameters_equals_direct_build(kind):
    where = "cuda" if torch.cuda.is_available() else "cpu"    # where meta materializes
    torch.manual_seed(42)
    direct = BUILDERS[kind](where)
    deferred = BUILDERS[kind]("meta")
    assert all(p.is_meta for p in deferred.parameters())
    torch.manual_seed(42)
    for module in deferred.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    a, b = _tensors(direct), _tensors(deferred)
    assert list(a) == list(b)
    for k in a:
        assert b[k].device.type == where and torch.equal(a[k], b[k]), k
    for (n, p), (_, q) in zip(direct.named_parameters(), deferred.named_parameters()):
        assert isinstance(q, torch.nn.Parameter) and q.requires_grad
        for attr in ("tensor_model_parallel", "partition_dim", "sequence_parallel"):
            assert getattr(p, attr, None) == getattr(q, attr, None), (n, attr)


META_BUILDERS = dict(BUILDERS, **{
    "MultiheadAttention": lambda d: te.MultiheadAttention(64, 4, fuse_qkv_params=True,
                                                          params_dtype=torch.bfloat16, device=d),
    "TransformerLayer-fused": lambda d: te.TransformerLayer(
        64, 192, 4, fuse_qkv_params=True, seq_length=16, params_dtype=torch.bfloat16, device=d),
})


def _reachable_tensors(obj, seen=None, path="module"):
    """Every tensor a module holds: parameters, buffers, and tensors in its attributes
    (fp8_meta and the like), through submodules, dicts, lists and our own objects."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if torch.is_tensor(obj):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _reachable_tensors(v, seen, f"{path}[{k!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _reachable_tensors(v, seen, f"{path}[{i}]")
    elif isinstance(obj, torch.nn.Module) or (
            hasattr(obj, "__dict__") and not isinstance(obj, type)
            and type(obj).__module__.startswith("transformer_engine")):
        for k, v in vars(obj).items():
            yield from _reachable_tensors(v, seen, f"{path}.{k}")


@pytest.mark.parametrize("kind", list(META_BUILDERS))
def test_meta_build_holds_only_meta_tensors(kind):
    """A module built on ``meta`` holds no tensor anywhere else (so it allocates nothing
    on the GPU before ``reset_parameters()``), until its first forward."""
    found = list(_reachable_tensors(META_BUILDERS[kind]("meta")))
    assert found and all(t.is_meta for _, t in found), [p for p, t in found if not t.is_meta]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="measures CUDA memory")
@pytest.mark.parametrize("kind", list(META_BUILDERS))
def test_meta_build_allocates_no_cuda_memory(kind):
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    module = META_BUILDERS[kind]("meta")
    assert torch.cuda.memory_allocated() == before
    for m in module.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    assert torch.cuda.memory_allocated() > before
    del module


def test_reset_parameters_reinitializes_in_place():
    torch.manual_seed(3)
    m = te.LayerNormLinear(32, 48, device="cpu")
    before = {k: v.clone() for k, v in _tensors(m).items()}
    params = list(m.parameters())
    with torch.no_grad():
        for p in params:
            p.add_(1.0)
    torch.manual_seed(3)
    m.reset_parameters()
    assert all(a is b for a, b in zip(params, m.parameters()))         # same Parameters
    for k, v in _tensors(m).items():
        assert torch.equal(v, before[k]), k


def test_init_method_and_rng_tracker():
    tracker = _rng_tracker()
    before_default = torch.get_rng_state()
    seen = []
    m = te.Linear(32, 48, init_method=lambda w: seen.append(w.shape) or w.normal_(0.0, 1.0),
                  get_rng_state_tracker=lambda: tracker, device="cpu")
    assert seen == [(48, 32)]
    assert torch.equal(torch.get_rng_state(), before_default)       # default stream untouched
    expected = torch.empty(48, 32).normal_(0.0, 1.0, generator=torch.Generator().manual_seed(1234))
    assert torch.equal(m.weight, expected)                            # the tracker's stream
    assert torch.equal(m.bias, torch.zeros(48))
    named = te.Linear(32, 48, init_method=lambda w: w.normal_(0.0, 1.0),
                      get_rng_state_tracker=lambda: _rng_tracker(),
                      rng_tracker_name="expert-parallel-rng", device="cpu")
    expected = torch.empty(48, 32).normal_(0.0, 1.0, generator=torch.Generator().manual_seed(5678))
    assert torch.equal(named.weight, expected)


# ---- fuse_wgrad_accumulation --------------------------------------------------------------

def _with_main_grad(module, flag=False):
    for name, p in module.named_parameters():
        if name.endswith("weight") and p.dim() == 2:
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
            if flag:
                p.grad_added_to_main_grad = False
    return module


def test_main_grad_accumulates_float32_wgrad_of_bf16_weights():
    torch.manual_seed(0)
    m = _with_main_grad(te.Linear(64, 48, params_dtype=torch.bfloat16, fuse_wgrad_accumulation=True,
                                  device="cpu"))
    xs = [torch.randn(32, 64).bfloat16() for _ in range(2)]
    dys = [torch.randn(32, 48).bfloat16() for _ in range(2)]
    for x, dy in zip(xs, dys):
        m(x).backward(dy)
    assert m.weight.grad is None                                      # no grad_added flag
    ref = sum(dy.double().t() @ x.double() for x, dy in zip(xs, dys))
    assert_close(m.weight.main_grad, ref, 1e-6, "main_grad")          # float32 accumulation
    plain = te.Linear(64, 48, params_dtype=torch.bfloat16, device="cpu")
    plain.load_state_dict(m.state_dict())
    for x, dy in zip(xs, dys):
        plain(x).backward(dy)
    err_bf16 = ((plain.weight.grad.double() - ref).abs().max() / ref.abs().max()).item()
    assert err_bf16 > 1e-4, "the comparison above needs a wgrad that bfloat16 rounds"
    assert torch.equal(m.bias.grad, plain.bias.grad)


@pytest.mark.parametrize("fp8", [False, True], ids=["hp", "fp8"])
@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "LayerNormMLP"])
def test_main_grad_equals_unfused_weight_grad(kind, fp8):
    """float32 weights: main_grad holds, bit for bit, what .grad gets without fusion;
    with Megatron's grad_added_to_main_grad flag, .grad is zeros and the flag is set."""
    build = {"Linear": lambda **kw: te.Linear(64, 48, device="cpu", **kw),
             "LayerNormLinear": lambda **kw: te.LayerNormLinear(64, 48, device="cpu", **kw),
             "LayerNormMLP": lambda **kw: te.LayerNormMLP(64, 32, device="cpu", **kw)}[kind]
    torch.manual_seed(1)
    plain = build()
    fused = _with_main_grad(build(fuse_wgrad_accumulation=True), flag=True)
    fused.load_state_dict(plain.state_dict())
    for step in range(2):
        x = torch.randn(32, 64) * (step + 1)
        for m in (plain, fused):
            with te.autocast(enabled=fp8, recipe=RECIPE):
                out = m(x)
            out.pow(2).sum().backward()
    for (name, p), q in zip(plain.named_parameters(), fused.parameters()):
        if hasattr(q, "main_grad"):
            assert torch.equal(q.main_grad, p.grad), name
            assert q.grad_added_to_main_grad is True
            assert torch.equal(q.grad, torch.zeros_like(q)), name
        else:
            assert torch.equal(q.grad, p.grad), name


def test_fused_wgrad_needs_main_grad_and_one_qkv_weight():
    m = te.Linear(16, 16, fuse_wgrad_accumulation=True, device="cpu")
    with pytest.raises(ValueError, match="accumulates the weight gradient into weight.main_grad, "
                                         "but the weight has none"):
        m(torch.randn(4, 16))
    with torch.no_grad():
        m(torch.randn(4, 16))                                         # no wgrad, no buffer needed
    with pytest.raises(ValueError, match="fuse_wgrad_accumulation=True needs fuse_qkv_params=True"):
        te.TransformerLayer(64, 128, 4, fuse_wgrad_accumulation=True)
    layer = te.TransformerLayer(64, 128, 4, fuse_wgrad_accumulation=True, fuse_qkv_params=True,
                                device="cpu")
    _with_main_grad(layer)
    layer(torch.randn(4, 2, 64)).sum().backward()
    assert all(p.main_grad.abs().sum() > 0 for p in layer.parameters() if hasattr(p, "main_grad"))


# ---- params_dtype=torch.float16 ---------------------------------------------------------

@pytest.mark.parametrize("fp8", [False, True], ids=["hp", "fp8"])
def test_float16_parameters(fp8):
    torch.manual_seed(2)
    ref32 = te.TransformerLayer(64, 128, 4, hidden_dropout=0.0, attention_dropout=0.0,
                                activation="glu", device="cpu")
    half = te.TransformerLayer(64, 128, 4, hidden_dropout=0.0, attention_dropout=0.0,
                               activation="glu", params_dtype=torch.float16, device="cpu")
    assert {p.dtype for p in half.parameters()} == {torch.float16}
    half.load_state_dict(ref32.state_dict())
    x = torch.randn(16, 2, 64)
    with te.autocast(enabled=fp8, recipe=RECIPE):
        y32 = ref32(x)
        y16 = half(x.half())
    assert y16.dtype == torch.float16
    assert_close(y16, y32, 2e-2 if fp8 else 5e-3, "float16 layer against float32 layer")
    y16.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float16 for p in half.parameters())


def test_glu_activation_matches_float64():
    m = te.LayerNormMLP(32, 24, activation="glu", device="cpu")
    x = torch.randn(8, 32, requires_grad=True)
    y = m(x)
    p = {n: leaf64(t) for n, t in m.named_parameters()}
    x64 = leaf64(x)
    mean, var = x64.mean(-1, keepdim=True), x64.var(-1, unbiased=False, keepdim=True)
    h = (x64 - mean) / torch.sqrt(var + 1e-5) * p["layer_norm_weight"] + p["layer_norm_bias"]
    a, b = (h @ p["fc1_weight"].t() + p["fc1_bias"]).chunk(2, dim=-1)
    ref = (torch.sigmoid(a) * b) @ p["fc2_weight"].t() + p["fc2_bias"]    # TE gates the first half
    assert_close(y, ref, 1e-5, "glu")


# ---- is_first_microbatch reaches prepare_forward -----------------------------------------

def test_is_first_microbatch_reaches_prepare_forward(monkeypatch):
    seen = []
    real = TransformerEngineBaseModule.prepare_forward

    def recording(self, inp=None, is_first_microbatch=None):
        seen.append((type(self).__name__, is_first_microbatch))
        return real(self, inp, is_first_microbatch)

    monkeypatch.setattr(TransformerEngineBaseModule, "prepare_forward", recording)
    layer = te.TransformerLayer(64, 128, 4, device="cpu")
    layer(torch.randn(4, 2, 64), is_first_microbatch=True)
    assert seen == [("LayerNormLinear", True), ("Linear", True), ("LayerNormMLP", True)]
    seen.clear()
    te.Linear(16, 16, device="cpu")(torch.randn(2, 16), is_first_microbatch=False)
    assert seen == [("Linear", False)]
    with pytest.raises(TypeError, match="is_first_microbatch must be None, True or False, got 1"):
        te.Linear(16, 16, device="cpu")(torch.randn(2, 16), is_first_microbatch=1)


# ---- LayerNorm's TE arguments --------------------------------------------------------------

def test_layernorm_normalized_shape_and_aliases():
    m = te.LayerNorm((4, 8), eps=1e-3, device="cpu")
    with torch.no_grad():
        m.weight.normal_()
        m.bias.normal_()
    x = torch.randn(3, 4, 8)
    x64 = x.double().reshape(3, 32)
    mean, var = x64.mean(-1, keepdim=True), x64.var(-1, unbiased=False, keepdim=True)
    ref = ((x64 - mean) / torch.sqrt(var + 1e-3)).reshape(3, 4, 8) * m.weight.double() \
        + m.bias.double()
    assert_close(m(x), ref, 1e-6, "LayerNorm over (4, 8)")
    assert te.RMSNorm(hidden_size=16, dtype=torch.bfloat16, device="cpu").weight.dtype == \
        torch.bfloat16
    with pytest.raises(ValueError, match="pass normalized_shape or its older name hidden_size"):
        te.LayerNorm(16, hidden_size=16)
