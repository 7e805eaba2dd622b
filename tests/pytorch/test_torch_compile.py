"""TE modules under torch.compile(fullgraph=True): compiled training equals eager training
bit for bit (outputs, gradients, every module's FP8 state after every step), with no
recompilation after the first step (NOTE [torch.compile] in torch_compile.py).

On the CPU the backend is "aot_eager": dynamo and AOTAutograd trace what Inductor would
get, and the graph runs the same aten ops as eager, so the arithmetic is the same. The
Inductor cases (same FP8 bits for Inductor-generated casts, CUDA graphs, max-autotune)
need a GPU and carry a skip mark.
"""

import contextlib

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import (DelayedScaling, Float8BlockScaling,
                                              Float8CurrentScaling)
from transformer_engine.pytorch import FP8GlobalStateManager
from transformer_engine.pytorch import custom_ops  # noqa: F401  (the ops opcheck checks)
from transformer_engine.pytorch.attention.rope import RotaryPositionEmbedding
from helpers import DEVICES, HAS_CUDA_FP8, assert_runs_equal, capture, te_modules

H, FFN, HEADS, SEQ, BATCH = 32, 64, 2, 8, 2
TOKENS = SEQ * BATCH
RECIPES = {"delayed": DelayedScaling(amax_history_len=4), "current": Float8CurrentScaling(),
           "block": Float8BlockScaling()}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch and counts its own graphs."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def graphs() -> int:
    """Graphs dynamo has compiled so far in this process."""
    return counters["stats"]["unique_graphs"]


class AllModules(torch.nn.Module):
    """Every TE module the package has, in one forward (with the kwargs users pass)."""

    def __init__(self, layer: bool, device="cpu"):
        super().__init__()
        self.norm = te.LayerNorm(H, device=device)
        self.rms = te.RMSNorm(H, zero_centered_gamma=True, device=device)
        self.qkv = te.LayerNormLinear(H, 3 * H, normalization="RMSNorm", device=device)
        self.dpa = te.DotProductAttention(HEADS, H // HEADS, attn_mask_type="causal")
        self.proj = te.Linear(H, H, return_bias=True, device=device)
        self.mlp = te.LayerNormMLP(H, FFN, activation="swiglu", device=device)
        self.experts = te.GroupedLinear(2, H, H, device=device)
        self.mha = te.MultiheadAttention(H, HEADS, attn_mask_type="causal", fuse_qkv_params=True,
                                         device=device)
        self.layer = (te.TransformerLayer(H, FFN, HEADS, hidden_dropout=0.0,
                                          attention_dropout=0.0, self_attn_mask_type="causal",
                                          device=device) if layer else None)
        self.rotary = RotaryPositionEmbedding(H // HEADS)(SEQ).to(device) if layer else None

    def forward(self, x, is_first_microbatch=None):
        h = self.rms(self.norm(x))
        q, k, v = self.qkv(h).view(SEQ, BATCH, 3, HEADS, H // HEADS).unbind(2)
        out, bias = self.proj(self.dpa(q, k, v).view(TOKENS, H))
        h = h + out + bias
        h = h + self.mlp(h, is_first_microbatch=is_first_microbatch)
        h = h + self.experts(h, [TOKENS // 2, TOKENS // 2])
        h = h + self.mha(h.view(SEQ, BATCH, H)).view(TOKENS, H)
        if self.layer is not None:
            h = self.layer(h.view(SEQ, BATCH, H), rotary_pos_emb=self.rotary).view(TOKENS, H)
        return h


def train(make, recipe, placement: str, compiled: bool, steps: int = 3, micro_batches=1):
    """``steps`` training steps of ``make()`` (SGD between steps); one record per step.
    ``placement``: where ``te.autocast`` is opened, "inside" or "outside" the compiled
    function. Returns the records and the graphs compiled after the first step."""
    torch.manual_seed(0)
    model = make()
    autocast = (lambda: te.autocast(recipe=recipe)) if recipe is not None \
        else contextlib.nullcontext

    def fn(x, first):
        if placement == "inside":
            with autocast():
                return model(x, is_first_microbatch=first)
        return model(x, is_first_microbatch=first)

    run = torch.compile(fn, fullgraph=True, backend="aot_eager") if compiled else fn
    records, after_first = [], None
    for step in range(steps):
        for mb in range(micro_batches):
            g = torch.Generator().manual_seed(100 + 10 * step + mb)
            x = (torch.randn(TOKENS, H, generator=g) * (1 + step)).requires_grad_()
            first = None if micro_batches == 1 else mb == 0
            with autocast() if placement == "outside" else contextlib.nullcontext():
                y = run(x, first)
            loss = y.float().pow(2).mean()
            loss.backward()
        records.append(capture(loss, [x], list(model.parameters()), te_modules(model)))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-0.01)
                p.grad = None
        if step == 0:
            after_first = graphs()
    return records, graphs() - after_first


def assert_compiled_equals_eager(make, recipe, placement, **kwargs):
    ref, _ = train(make, recipe, placement, compiled=False, **kwargs)
    before = graphs()
    got, recompiled = train(make, recipe, placement, compiled=True, **kwargs)
    assert graphs() > before, "nothing was compiled"
    assert_runs_equal(ref, got, "compiled vs eager")
    assert recompiled == 0, f"{recompiled} graph(s) compiled after the first step"


# ---- every module, every recipe ---------------------------------------------------------

@pytest.mark.parametrize("recipe", [None, *RECIPES], ids=lambda r: r or "bf16")
def test_every_module_compiles_whole_and_trains_as_eager(recipe):
    """All TE modules in one fullgraph compiled forward (TransformerLayer too, with
    delayed scaling), autocast inside the compiled function."""
    assert_compiled_equals_eager(lambda: AllModules(layer=recipe == "delayed"),
                                 RECIPES.get(recipe), "inside")


class Chain(torch.nn.Module):
    """TE modules in sequence, each taking ``is_first_microbatch``."""

    def __init__(self, *modules):
        super().__init__()
        self.chain = torch.nn.ModuleList(modules)

    def forward(self, x, is_first_microbatch=None):
        for m in self.chain:
            x = m(x, is_first_microbatch=is_first_microbatch)
        return x


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_autocast_outside_the_compiled_function(recipe):
    """The session of an eager autocast takes the compiled modules for its forward
    update; their backward state updates in the backward graph."""
    make = lambda: Chain(te.LayerNormMLP(H, FFN, device="cpu"), te.Linear(H, H, device="cpu"))
    assert_compiled_equals_eager(make, RECIPES[recipe], "outside")


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_fp8_weight_cache_across_micro_batches(recipe):
    """``is_first_microbatch`` True then False within each step: one graph each."""
    make = lambda: Chain(te.LayerNormMLP(H, FFN, device="cpu"))
    assert_compiled_equals_eager(make, RECIPES[recipe], "inside", micro_batches=2)


def test_clamped_swiglu_compiles_whole():
    """The clamped SwiGLU (Python-float parameters, clamps) in one fullgraph forward."""
    make = lambda: Chain(te.LayerNormMLP(H, FFN, activation="clamped_swiglu",  # noqa: E731
                                         activation_params={"limit": 0.5, "alpha": 1.5},
                                         device="cpu"))
    assert_compiled_equals_eager(make, RECIPES["delayed"], "inside")


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_fp8_primary_weights(recipe):
    """Modules built under quantized_model_init: the compiled GEMMs read the FP8
    weights, the optimizer writes them eagerly between steps."""
    def make():
        with te.quantized_model_init(recipe=RECIPES[recipe]):
            return Chain(te.LayerNormMLP(H, FFN, device="cpu"), te.Linear(H, H, device="cpu"))
    assert_compiled_equals_eager(make, RECIPES[recipe], "inside")


# ---- what each traced autograd function returns ------------------------------------------

def reused_results(gm: torch.fx.GraphModule) -> list:
    """The tensors an ``autograd.Function`` forward in dynamo's graph ``gm`` returns that
    another op of that forward also produced (an in-place op, or one that returned its
    input unchanged): NOTE [Fresh function results] in function_results.py. Read from the
    example values dynamo records for each node of the forward's subgraph."""
    import operator
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or "autograd_function_apply" not in str(node.target):
            continue
        forward = getattr(gm, node.args[0].target)
        outputs = next(n for n in forward.graph.nodes if n.op == "output").args[0][0]
        outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        for index in {user.args[1] for user in node.users if user.target is operator.getitem}:
            returned = outputs[index]
            value = returned.meta.get("example_value")
            for other in forward.graph.nodes:
                if other is not returned and value is not None \
                        and other.meta.get("example_value") is value:
                    where = other.meta.get("stack_trace", "").strip().splitlines()[-2:]
                    found.append(f"{returned.name} is also {other.name}: {' / '.join(where)}")
    return found


ON_CUDA = pytest.param("cuda", marks=pytest.mark.skipif(
    not HAS_CUDA_FP8, reason="the CUDA paths need a GPU with FP8 (compute capability 8.9+)"))


@pytest.mark.parametrize("path", ["upcast", "scaled_mm", ON_CUDA])
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_autograd_functions_return_fresh_tensors(recipe, path):
    """No TE autograd function (every module, rotary attention) returns a tensor that
    another op of its traced forward also produced: under torch 2.11 that silently
    zeroes the gradient. Checked on the graph dynamo traces, so it holds on every torch
    (the bit-for-bit tests above catch the zero gradients only on an affected torch).
    ``path="scaled_mm"``: the CUDA GEMM path (padding, ``torch._scaled_mm``) on the
    CPU; ``"cuda"``: everything on the GPU."""
    if recipe == "block" and path == "scaled_mm":
        pytest.skip("block scaling on the CPU emulates its GEMM whatever cpu_gemm says")
    from transformer_engine.pytorch.kernel_config import kernel_config
    device = "cuda" if path == "cuda" else "cpu"
    model = AllModules(layer=True, device=device)
    problems, functions = [], [0]

    def backend(gm, example_inputs):
        functions[0] += sum("autograd_function_apply" in str(n.target) for n in gm.graph.nodes)
        problems.extend(reused_results(gm))
        return gm.forward

    def fn(x):
        with te.autocast(recipe=RECIPES[recipe]):
            return model(x)

    with kernel_config(cpu_gemm="scaled_mm" if path == "scaled_mm" else "upcast"):
        torch.compile(fn, fullgraph=True, backend=backend)(
            torch.randn(TOKENS, H, device=device, requires_grad=True))
    assert functions[0] > 0, "no autograd function was traced: nothing was checked"
    assert not problems, "returned tensors made twice:\n" + "\n".join(problems)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
def test_attention_output_is_contiguous_whatever_the_sdpa_layout(fmt, device):
    """te.DotProductAttention returns a contiguous ``[s, b, h*d]`` (``[b, s, h*d]``)
    output, as TE's, so the caller's ``.view`` works in eager and under dynamo's fake
    tensors. SDPA's output memory is ``[b, s, h, d]`` on CUDA's fused backends and
    follows the query's layout on the CPU: inputs laid out in the other format's order
    (``[b, s, h, d]`` memory for sbhd) give on the CPU the strided result CUDA gives
    (``(8, 2, 32)`` with strides ``(32, 256, 1)`` for sbhd). Compiled (aot_eager)
    equals eager bit for bit, forward and input gradients."""
    dpa = te.DotProductAttention(HEADS, H // HEADS, attn_mask_type="causal", qkv_format=fmt)
    other_order = (BATCH, SEQ) if fmt == "sbhd" else (SEQ, BATCH)
    g = torch.Generator().manual_seed(4)
    data = [torch.randn(*other_order, HEADS, H // HEADS, generator=g).to(device)
            for _ in range(3)]

    def fn(q, k, v):
        return dpa(q, k, v).view(TOKENS, H)

    runs = []
    for run in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
        qkv = [t.clone().requires_grad_() for t in data]
        out = run(*(t.transpose(0, 1) for t in qkv))     # fmt's shape, the other's memory
        out.pow(2).sum().backward()
        runs.append([out.detach()] + [t.grad for t in qkv])
    eager, compiled = runs
    assert dpa(*(t.transpose(0, 1) for t in data)).is_contiguous()
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


# ---- guards: what recompiles and what does not -------------------------------------------

@pytest.mark.parametrize("placement", ["inside", "outside"])
def test_recipe_objects_with_equal_fields_share_a_graph(placement):
    """A new recipe object with the fields of the last one runs the same graph; a
    changed field compiles once (it takes effect at the next autocast entry)."""
    layer = te.Linear(H, H, device="cpu")
    current = {"recipe": DelayedScaling(amax_history_len=4)}

    def fn(x):
        if placement == "inside":
            with te.autocast(recipe=current["recipe"]):
                return layer(x)
        return layer(x)

    run = torch.compile(fn, fullgraph=True, backend="aot_eager")

    def step():
        x = torch.randn(TOKENS, H, requires_grad=True)
        with te.autocast(recipe=current["recipe"]) if placement == "outside" \
                else contextlib.nullcontext():
            y = run(x)
        y.sum().backward()
        return layer.fp8_meta["scaling_fwd"].scale.clone()

    step()
    compiled = graphs()
    step()
    current["recipe"] = DelayedScaling(amax_history_len=4)
    step()
    assert graphs() == compiled, "an equal recipe object recompiled"
    current["recipe"].margin = 1
    before_margin = layer.fp8_meta["scaling_fwd"].scale.clone()
    after_margin = step()
    assert graphs() == compiled + 1, "a changed recipe field must compile once"
    step()
    assert graphs() == compiled + 1
    # the new margin is in force: the forward update halved the scales it computed
    assert torch.all(after_margin <= before_margin)


# ---- the seed's pattern: a compiled layer function under te.checkpoint ----------------------

@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("placement", ["inside", "outside"])
def test_checkpointed_compiled_layers_train_as_without_checkpointing(use_reentrant, placement):
    """Each layer function opens te.autocast inside (or runs under one outside), is
    compiled once, and is called through te.checkpoint for every layer: the recompute
    runs (counted), uses the first forward's scales, and training is bit-identical to
    the same compiled functions without checkpointing."""
    recipe = RECIPES["delayed"]

    def run(checkpointed):
        torch.manual_seed(0)
        layers = [te.Linear(H, H, device="cpu"), te.Linear(H, H, device="cpu")]

        def layer_fn(x, layer):
            if placement == "inside":
                with te.autocast(recipe=recipe):
                    return layer(x)
            return layer(x)

        compiled = torch.compile(layer_fn, fullgraph=True, backend="aot_eager")
        calls = [0]

        def counted(x, layer):
            calls[0] += 1
            return compiled(x, layer)

        records = []
        for step in range(3):
            x = (torch.randn(TOKENS, H) * (1 + step)).requires_grad_()
            with te.autocast(recipe=recipe) if placement == "outside" \
                    else contextlib.nullcontext():
                h = x
                for layer in layers:
                    h = (te.checkpoint(counted, h, layer, use_reentrant=use_reentrant)
                         if checkpointed else counted(h, layer))
            loss = h.float().pow(2).mean()
            loss.backward()
            records.append(capture(loss, [x], [p for m in layers for p in m.parameters()],
                                   layers))
            for p in (p for m in layers for p in m.parameters()):
                p.grad = None
            if step == 0:
                after_first = graphs()
        return records, calls[0], graphs() - after_first

    ref, ref_calls, _ = run(False)
    got, calls, recompiled = run(True)
    assert calls == 2 * ref_calls, "the recompute did not run"
    assert_runs_equal(ref, got, "checkpointed vs not")
    assert recompiled == 0


def test_torch_utils_checkpoint_inside_a_compiled_function():
    """torch.utils.checkpoint (non-reentrant) around TE modules inside the compiled
    function: high precision traces and trains as eager; an FP8 forward there cannot be
    traced (its state updates are side effects) and says so."""
    from torch.utils.checkpoint import checkpoint

    def make():
        torch.manual_seed(0)
        return te.LayerNormMLP(H, FFN, device="cpu")

    eager, compiled = make(), make()
    run = torch.compile(lambda m, x: checkpoint(m, x, use_reentrant=False), fullgraph=True,
                        backend="aot_eager")
    for model, fn in ((eager, lambda m, x: m(x)), (compiled, run)):
        x = torch.randn(TOKENS, H, requires_grad=True, generator=torch.Generator().manual_seed(1))
        fn(model, x).pow(2).mean().backward()
    for a, b in zip(eager.parameters(), compiled.parameters()):
        assert torch.equal(a.grad, b.grad)
    with pytest.raises(Exception, match="inside torch.utils.checkpoint"):
        with te.autocast(recipe=RECIPES["delayed"]):
            run(compiled, torch.randn(TOKENS, H, requires_grad=True))


# ---- what cannot compile says so ----------------------------------------------------------

def test_what_cannot_compile_raises_a_clear_error():
    layer = te.Linear(H, H, device="cpu")
    x = torch.randn(TOKENS, H, requires_grad=True)

    def checkpoint_inside(x):
        return te.checkpoint(layer, x, use_reentrant=False)

    with pytest.raises(Exception, match="te.checkpoint inside a function compiled"):
        torch.compile(checkpoint_inside, fullgraph=True, backend="aot_eager")(x)
    custom = DelayedScaling(amax_history_len=4, amax_compute_algo=lambda h: h.amax(dim=0))

    def callable_algo(x):
        with te.autocast(recipe=custom):
            return layer(x)

    with pytest.raises(Exception, match="callable amax_compute_algo"):
        torch.compile(callable_algo, fullgraph=True, backend="aot_eager")(x)
    mlp = te.LayerNormMLP(H, FFN, checkpoint=True, device="cpu")
    with pytest.raises(Exception, match="te.checkpoint inside a function compiled"):
        torch.compile(mlp, fullgraph=True, backend="aot_eager")(x)
    freqs = RotaryPositionEmbedding(H // HEADS)(2 * SEQ)
    t = torch.randn(SEQ, BATCH, HEADS, H // HEADS)
    rotate = torch.compile(lambda t, starts: te.apply_rotary_pos_emb(
        t, freqs, start_positions=starts), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="apply_rotary_pos_emb with start_positions cannot"):
        rotate(t, torch.tensor([1, 3]))


# ---- FP8 semantics: non-finite amaxes, calibration ------------------------------------------

def test_non_finite_amax_keeps_scales_as_in_eager():
    """A NaN in one step's input: the compiled update keeps that step's scales and
    counts the event, as eager does; the next finite step updates as usual."""
    recipe = RECIPES["delayed"]

    def run(compiled):
        torch.manual_seed(0)
        layer = te.Linear(H, H, device="cpu")

        def fn(x):
            with te.autocast(recipe=recipe):
                return layer(x)

        f = torch.compile(fn, fullgraph=True, backend="aot_eager") if compiled else fn
        FP8GlobalStateManager.reset_non_finite_amax_count()
        states = []
        for step in range(3):
            x = torch.randn(TOKENS, H) * (1 + step)
            if step == 1:
                x[0, 0] = float("nan")
            f(x.requires_grad_()).sum().backward()
            states.append([getattr(layer.fp8_meta[k], f_).clone() for k in ("scaling_fwd",)
                           for f_ in ("scale", "scale_inv", "amax_history")])
        count = FP8GlobalStateManager.get_non_finite_amax_count()
        FP8GlobalStateManager.reset_non_finite_amax_count()
        return states, count

    with pytest.warns(RuntimeWarning, match="NaN or infinite amax"):
        ref, ref_count = run(False)
    got, count = run(True)
    assert count == ref_count > 0
    for a, b in zip(ref, got):
        for s, t in zip(a, b):
            assert torch.equal(s, t)


def test_calibration_records_amaxes_as_in_eager():
    recipe = RECIPES["delayed"]

    def run(compiled):
        torch.manual_seed(0)
        layer = te.Linear(H, H, device="cpu")

        def fn(x):
            with te.autocast(enabled=False, calibrating=True, recipe=recipe):
                return layer(x)

        f = torch.compile(fn, fullgraph=True, backend="aot_eager") if compiled else fn
        for step in range(2):
            f((torch.randn(TOKENS, H) * (1 + step)).requires_grad_()).sum().backward()
        return layer.fp8_meta["scaling_fwd"]

    ref, got = run(False), run(True)
    assert got.amax_history.abs().sum() > 0
    for f_ in ("scale", "scale_inv", "amax_history"):
        assert torch.equal(getattr(ref, f_), getattr(got, f_))


# ---- the custom ops ----------------------------------------------------------------------

def test_custom_ops_pass_opcheck():
    """The ``transformer_engine`` ops' fake implementations agree with the real ones
    (the fake-tensor check: torch's other checks compute on the FP8 tensors, which the
    CPU cannot)."""
    ops = torch.ops.transformer_engine
    x = torch.randn(TOKENS, H)
    scale = torch.tensor([2.0, 4.0])
    torch.library.opcheck(ops.scale_snapshot, (scale,))
    history = torch.zeros(4, 2)
    torch.library.opcheck(ops.cast_transpose,
                          (x, scale, 1, torch.float8_e4m3fn, history, True, True),
                          test_utils=("test_faketensor",))
    ops.cast_transpose(x, scale, 1, torch.float8_e4m3fn, history, True, True)
    assert history[0, 1] == x.abs().max(), "the cast records its amax in the history slot"
    a = x.to(torch.float8_e4m3fn)
    b = torch.randn(H, H).to(torch.float8_e4m3fn)
    one = torch.ones(1)
    torch.library.opcheck(ops.fp8_gemm, (a, one, b, one, torch.float32, None, False),
                          test_utils=("test_faketensor",))


# ---- Inductor on the GPU --------------------------------------------------------------------

needs_cuda_fp8 = pytest.mark.skipif(not HAS_CUDA_FP8, reason="Inductor FP8 cases need a CUDA "
                                    "GPU with FP8 (compute capability 8.9+)")


def _gpu_train(recipe, mode, compiled, steps=4):
    torch.manual_seed(0)
    model = te.LayerNormMLP(256, 1024, params_dtype=torch.bfloat16, device="cuda")

    def fn(x):
        with te.autocast(recipe=recipe):
            return model(x)

    f = torch.compile(fn, fullgraph=True, mode=mode) if compiled else fn
    out = []
    for step in range(steps):
        g = torch.Generator(device="cuda").manual_seed(100 + step)
        x = (torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, generator=g)
             * (1 + step)).requires_grad_()
        y = f(x)
        loss = y.float().pow(2).mean()
        loss.backward()
        out.append((loss.detach().clone(), model.fp8_meta["scaling_fwd"].scale.clone(),
                    model.fp8_meta["scaling_bwd"].scale.clone(),
                    model.fp8_meta["scaling_fwd"].amax_history.clone()))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-0.01)
                p.grad = None
    return out


@needs_cuda_fp8
@pytest.mark.parametrize("mode", ["default", "max-autotune-no-cudagraphs", "reduce-overhead"])
def test_inductor_training_tracks_eager(mode):
    """Inductor-compiled FP8 training of a LayerNormMLP follows eager's: every step's
    loss within 2e-2 relative and every forward and backward scale within 2% (Inductor
    fuses the high-precision ops around the GEMMs, which changes their rounding, so the
    amaxes and scales are not bit-identical), and the scales do update, also with CUDA
    graphs ("reduce-overhead")."""
    import torch._inductor.config as inductor_config
    recipe = DelayedScaling(amax_history_len=4)
    ref = _gpu_train(recipe, mode, compiled=False)
    # max-autotune benchmarks Inductor's Triton GEMM templates against cuBLAS for every
    # GEMM (about 300 s of this test on an H100); ATen's choices alone keep the mode's
    # code path and the same arithmetic
    with inductor_config.patch(max_autotune_gemm_backends="ATEN"):
        got = _gpu_train(recipe, mode, compiled=True)
    for step, (a, b) in enumerate(zip(ref, got)):
        assert torch.allclose(a[0], b[0], rtol=2e-2), f"step {step}: loss {a[0]} vs {b[0]}"
        for i in (1, 2):
            assert torch.allclose(a[i], b[i], rtol=2e-2), f"step {step}: scales {a[i]} vs {b[i]}"
    assert not torch.equal(got[0][1], got[-1][1]), "the forward scales never updated"


@needs_cuda_fp8
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("producer", [False, True], ids=["cast", "gelu+cast"])
def test_inductor_casts_give_eager_fp8_bits(dtype, producer):
    """A delayed-scaling cast that Inductor generates from quantize.py's reference ops,
    alone or fused into its producer (a GELU), against the eager path's cast (the Triton
    kernel) of the same input and scale: the same FP8 bits (data and transpose) and the
    same amax. A 16-bit producer is rounded to its dtype before the cast, as in eager
    (``emulate_precision_casts``)."""
    import torch._inductor.config as inductor_config
    from transformer_engine.pytorch import quantize
    torch.manual_seed(0)
    x = torch.randn(1024, 512, device="cuda", dtype=dtype) * 50
    scale = torch.tensor([3.0], device="cuda")

    def cast(x, history):
        h = torch.nn.functional.gelu(x, approximate="tanh") if producer else x
        q, q_t = quantize.cast_transpose_unchecked(h, scale, torch.float8_e4m3fn, 0, history,
                                                   True, True)
        return q.data, q_t.data

    history_eager = torch.zeros(4, 1, device="cuda")
    history_compiled = torch.zeros(4, 1, device="cuda")
    ref = cast(x, history_eager)
    with inductor_config.patch(emulate_precision_casts=True):
        got = torch.compile(cast, fullgraph=True)(x, history_compiled)
    for a, b in zip(ref, got):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert torch.equal(history_eager, history_compiled)


def test_a_deep_copied_module_compiles():
    """A copy (deepcopy, pickle) gets its FP8 state made at the first trace too."""
    import copy
    layer = copy.deepcopy(te.Linear(H, H, device="cpu"))
    run = torch.compile(lambda m, x: m(x), fullgraph=True, backend="aot_eager")
    with te.autocast(recipe=RECIPES["delayed"]):
        run(layer, torch.randn(TOKENS, H, requires_grad=True)).sum().backward()
    assert layer.fp8_meta["scaling_fwd"].amax_history.abs().sum() > 0
