"""te.make_graphed_callables: graphed training steps equal eager ones bit for bit
(losses, input and parameter gradients, every module's scale, scale_inv and amax
history), with the FP8 updates captured inside the graphs (NOTE [Graphed FP8 state]);
what cannot be captured fails at capture time with a clear error; Megatron's pipeline
schedule (``_order``, reused buffers) equals the same calls run eagerly. Argument checks
and the pipeline schedule run on the CPU (with CUDA graphs stood in for by reruns of the
captured work, `RerunCapture`); the rest needs a CUDA GPU with FP8."""

import copy

import numpy as np
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling
from transformer_engine.pytorch import graph as te_graph
from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
from helpers import (RECIPE, RerunCapture, assert_runs_equal, capture, cuda_fp8,
                     cuda_inputs, describe_difference, te_modules, train_steps)

RECIPES = [pytest.param(RECIPE, id="delayed"), pytest.param(Float8CurrentScaling(), id="current")]
STEPS = 5


# ---- arguments (CPU) ---------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, error, match", [
    ({"enabled": 1}, TypeError, r"enabled must be a bool or a tuple of 1 bools \(one per "
                                r"callable\), got 1"),
    ({"recipe": "delayed"}, TypeError, "recipe must be a transformer_engine.common.recipe"),
    ({"num_warmup_iters": -1}, ValueError, "num_warmup_iters must be an int >= 0"),
    ({"enabled": True, "num_warmup_iters": 0}, ValueError, "must be >= 1 with FP8"),
    ({"cache_quantized_params": True}, ValueError,
     "cache_quantized_params=True caches FP8 weights, so it needs enabled=True"),
    ({"_order": [1, 1, -1, -1]}, ValueError, r"sample_args must hold one tuple \(or list\) "
     r"of tensors per graph \(2: 1 callables x 2 micro-batches of _order\), got tuple of 1"),
    ({"_reuse_graph_input_output_buffers": True}, ValueError,
     "_reuse_graph_input_output_buffers=True shares buffers along a pipeline schedule, so it "
     "needs _order"),
    ({"clone_param_grads_on_return": 1}, TypeError,
     "clone_param_grads_on_return must be a bool, got 1"),
    ({"capture_time_hooks": [{"forward_hook": {}}]}, ValueError,
     r"capture_time_hooks\[0\] has unexpected keys \['forward_hook'\]"),
    ({"capture_time_hooks": [None, None]}, ValueError,
     r"capture_time_hooks must hold one entry per callable \(1\)"),
    ({"pre_warmup_hook": 3}, TypeError, "pre_warmup_hook must be callable or None"),
], ids=["enabled-int", "recipe-str", "warmup-negative", "warmup-zero-fp8", "weight-cache",
        "order-samples", "reuse-without-order", "clone-int",
        "hook-key", "hooks-count", "pre-hook"])
def test_bad_arguments(kwargs, error, match):
    lin = te.Linear(16, 16, device="cpu")
    with pytest.raises(error, match=match):
        te.make_graphed_callables(lin, (torch.randn(16, 16),), **kwargs)


def test_bad_pipeline_schedules():
    """A malformed ``_order`` / ``_num_layers_per_chunk`` is refused before any warm-up,
    saying what is wrong (one test: the cases share the cost of a test's set-up)."""
    lin = te.Linear(16, 16, device="cpu")
    cases = [
        ({"_order": [1, -1, -1]}, ValueError,
         r"must run every model chunk 1..1 as many times forward as backward"),
        ({"_order": [-1, 1]}, ValueError, r"runs backward 0 of chunk 1 before its forward 0"),
        ({"_order": [1, 3, -3, -1]}, ValueError, r"forwards \[1, 0, 1\], backwards \[1, 0, 1\]"),
        ({"_order": [1, 2, -2, -1]}, ValueError,
         "_order has 2 model chunks, which do not split the 1 callables evenly"),
        ({"_order": [1, -1, -0.5]}, NotImplementedError, "weight-gradient graph"),
        ({"_order": [1, -1.0]}, ValueError, "_order entries must be non-zero ints"),
        ({"_order": []}, ValueError, "_order must be a non-empty list"),
        ({"_order": [1, -1], "_num_layers_per_chunk": 2}, ValueError,
         r"_num_layers_per_chunk=2 must be positive and add up to the number of callables \(1\)"),
        ({"_order": [1, -1], "_num_layers_per_chunk": [1, 1]}, ValueError,
         r"_num_layers_per_chunk must be an int or 1 ints"),
        ({"_num_layers_per_chunk": 1}, ValueError, "_num_layers_per_chunk is only used with _order"),
    ]
    for kwargs, error, match in cases:
        with pytest.raises(error, match=match):
            te.make_graphed_callables(lin, (torch.randn(16, 16),), **kwargs)


def test_deprecated_spellings_warn_and_must_agree():
    lin = te.Linear(16, 16, device="cpu")
    with pytest.warns(DeprecationWarning, match="fp8_enabled is deprecated; use enabled"):
        with pytest.raises((RuntimeError, ValueError)):
            te.make_graphed_callables(lin, (torch.randn(16, 16),), fp8_enabled=True,
                                      fp8_recipe=DelayedScaling())
    with pytest.warns(DeprecationWarning):
        with pytest.raises(ValueError, match="enabled=False and its deprecated spelling "
                                             "fp8_enabled=True disagree"):
            te.make_graphed_callables(lin, (torch.randn(16, 16),), enabled=False,
                                      fp8_enabled=True)


def test_sample_args_must_match_the_callables():
    lin = te.Linear(16, 16, device="cpu")
    with pytest.raises(ValueError, match=r"one tuple \(or list\) of tensors per callable "
                                         r"\(2\), got tuple of 1"):
        te.make_graphed_callables((lin, lin), (torch.randn(16, 16),))
    with pytest.raises(TypeError, match=r"sample_args\[0\] must be a tuple or list of tensors"):
        te.make_graphed_callables(lin, (torch.randn(16, 16), 3))
    with pytest.raises(TypeError, match=r"sample_args\[0\] must be a tuple or list of tensors"):
        te.make_graphed_callables(lin, [torch.randn(16, 16), 3])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_cpu_only_machine_refuses_clearly():
    lin = te.Linear(16, 16, device="cpu")
    with pytest.raises(RuntimeError, match="CUDA graphs need a CUDA device"):
        te.make_graphed_callables(lin, (torch.randn(16, 16),), enabled=True)


# ---- eager equivalence (GPU) -------------------------------------------------------------

def _build(kind):
    torch.manual_seed(11)
    kw = {"params_dtype": torch.bfloat16, "device": "cuda"}
    if kind == "Linear":
        return te.Linear(64, 64, **kw), (32, 64)
    if kind == "LayerNormMLP":
        return te.LayerNormMLP(64, 128, **kw), (32, 64)
    return te.TransformerLayer(64, 128, 4, hidden_dropout=0.0, attention_dropout=0.0,
                               self_attn_mask_type="causal", **kw), (16, 2, 64)


def _train(model, shape, run, steps=STEPS, accumulate=False):
    return train_steps(model, shape, run, steps, accumulate)


@cuda_fp8
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP", "TransformerLayer"])
def test_graphed_steps_equal_eager_steps(kind, recipe):
    model, shape = _build(kind)
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
    if recipe.delayed():
        first = te_modules(model)[0]
        assert first.fp8_meta["scaling_fwd"].amax_history.count_nonzero() > 0


@cuda_fp8
@pytest.mark.parametrize("fp8", [pytest.param(False, id="bf16"), pytest.param(True, id="fp8")])
def test_graphed_steps_under_torch_autocast_equal_eager_steps(fp8):
    """Float32 parameters under torch.autocast(bfloat16), the loss's backward outside the
    autocast (as torch advises): the captured backward runs outside it too, and every
    gradient equals the eager one bit for bit. The math attention computes in float32
    inside; its backward, run under the autocast, would be recast to bfloat16."""
    torch.manual_seed(11)
    model = torch.nn.Sequential(
        te.TransformerLayer(64, 128, 4, hidden_dropout=0.0, attention_dropout=0.0,
                            self_attn_mask_type="causal", device="cuda"),
        te.LayerNorm(64, device="cuda"), te.Linear(64, 64, device="cuda"))
    eager_model = copy.deepcopy(model)
    shape = (16, 2, 64)

    def eager(m, x):
        with torch.autocast("cuda", dtype=torch.bfloat16), te.autocast(enabled=fp8,
                                                                       recipe=RECIPE):
            return m(x)

    def graphed(m, x):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return m(x)

    with sdpa_kernel(SDPBackend.MATH):
        ref = _train(eager_model, shape, eager)
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            te.make_graphed_callables(model, (cuda_inputs(shape, 0).requires_grad_(),),
                                      enabled=fp8, recipe=RECIPE)
        got = _train(model, shape, graphed)
    assert_runs_equal(ref, got)


@cuda_fp8
def test_gradient_accumulation_into_grad():
    """Two graphed backwards into the same .grad accumulate like eager ones (the graph's
    static gradient buffers are not aliased by .grad)."""
    model, shape = _build("Linear")
    eager_model = copy.deepcopy(model)

    def eager(m, x):
        with te.autocast(recipe=RECIPE):
            return m(x)

    ref = _train(eager_model, shape, eager, steps=3, accumulate=True)
    te.make_graphed_callables(model, (cuda_inputs(shape, 0).requires_grad_(),), enabled=True,
                              recipe=RECIPE)
    got = _train(model, shape, lambda m, x: m(x), steps=3, accumulate=True)
    assert_runs_equal(ref, got)


def _micro_batch_run(model, run, recipe, steps=3):
    """SGD steps of two micro-batches each; between them the weights are scaled in
    place, which only a cast afresh would see: the second micro-batch must use the FP8
    weights cast at the first (``is_first_microbatch=False``)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    record = []
    for step in range(steps):
        for micro in range(2):
            x = cuda_inputs((32, 64), 10 * step + micro).requires_grad_()
            y = run(model, x, micro == 0)
            loss = y.float().pow(2).mean()
            loss.backward()
            if micro == 0:
                with torch.no_grad():
                    model.fc1_weight.mul_(1.5)
        record.append(capture(loss, [x], model.parameters(), te_modules(model)))
        opt.step()
        opt.zero_grad()
    return record


@cuda_fp8
@pytest.mark.parametrize("recipe", RECIPES)
def test_cached_fp8_weights_across_micro_batches_equal_eager(recipe):
    """cache_quantized_params=True: each call's is_first_microbatch reaches the replay,
    which casts the weights afresh (True) or selects the cached FP8 weights (False),
    as eager is_first_microbatch does, bit for bit."""
    model, _ = _build("LayerNormMLP")
    eager_model, uncached_model = copy.deepcopy(model), copy.deepcopy(model)

    def eager(m, x, first):
        with te.autocast(recipe=recipe):
            return m(x, is_first_microbatch=first)

    try:
        ref = _micro_batch_run(eager_model, eager, recipe)
        # the run tells caching from casting every micro-batch
        uncached = _micro_batch_run(uncached_model, lambda m, x, first: eager(m, x, True),
                                    recipe)
        assert not torch.equal(uncached[0].loss, ref[0].loss)
        graphed = te.make_graphed_callables(model, (cuda_inputs((32, 64), 0).requires_grad_(),),
                                            enabled=True, recipe=recipe,
                                            cache_quantized_params=True)
        got = _micro_batch_run(model, lambda m, x, first: m(x, is_first_microbatch=first),
                               recipe)
        assert_runs_equal(ref, got)
        with pytest.raises(TypeError, match="takes is_first_microbatch=True"):
            graphed(cuda_inputs((32, 64), 0))
    finally:
        FP8GlobalStateManager.reset()           # the skip-update tensor stays set otherwise


class CheckpointedBlock(torch.nn.Module):
    """Two layers, each checkpointed with the FP8 autocast opened inside the
    checkpointed function: this project's pattern."""

    def __init__(self, use_reentrant):
        super().__init__()
        kw = {"params_dtype": torch.bfloat16, "device": "cuda"}
        self.a, self.b = te.LayerNormMLP(64, 128, **kw), te.Linear(64, 64, **kw)
        self.use_reentrant = use_reentrant

    def _layer(self, layer, h):
        with te.autocast(recipe=RECIPE):
            return layer(h)

    def forward(self, x):
        h = te.checkpoint(self._layer, self.a, x, use_reentrant=self.use_reentrant)
        return te.checkpoint(self._layer, self.b, torch.relu(h), use_reentrant=self.use_reentrant)


@cuda_fp8
def test_checkpoint_inside_a_graphed_callable():
    """Non-reentrant te.checkpoint with the FP8 autocast inside: the recompute is
    captured in the backward graph, and the graphed run equals the eager one."""
    torch.manual_seed(3)
    model = CheckpointedBlock(use_reentrant=False)
    eager_model = copy.deepcopy(model)
    shape = (32, 64)
    ref = _train(eager_model, shape, lambda m, x: m(x))
    te.make_graphed_callables(model, (cuda_inputs(shape, 0).requires_grad_(),))
    got = _train(model, shape, lambda m, x: m(x))
    assert_runs_equal(ref, got)


@cuda_fp8
def test_reentrant_checkpoint_inside_a_graphed_callable_is_refused():
    """The reentrant recompute runs a nested backward, which the graphs'
    torch.autograd.grad pass cannot run: a clear error in the warm-up, before any
    capture, and the FP8 state the warm-up touched is put back (fresh: zero history)."""
    model = CheckpointedBlock(use_reentrant=True)
    with pytest.raises(RuntimeError, match=r"te.checkpoint\(use_reentrant=True\) does not work "
                                           r"with torch.autograd.grad"):
        te.make_graphed_callables(model, (cuda_inputs((32, 64), 0).requires_grad_(),))
    histories = [m.fp8_meta[k].amax_history for m in te_modules(model)
                 for k in ("scaling_fwd", "scaling_bwd") if k in m.fp8_meta]
    assert histories and all(not h.any() for h in histories)


@cuda_fp8
def test_tuple_of_callables_shares_one_pool():
    torch.manual_seed(5)
    kw = {"params_dtype": torch.bfloat16, "device": "cuda"}
    a, b = te.Linear(64, 64, **kw), te.Linear(64, 64, **kw)
    ea, eb = copy.deepcopy(a), copy.deepcopy(b)
    x0 = cuda_inputs((32, 64), 0).requires_grad_()
    ga, gb = te.make_graphed_callables((a, b), ((x0,), (a(x0).detach().requires_grad_(),)),
                                       enabled=True, recipe=RECIPE)

    def run(pair, graphed):
        def step(_, x):
            if graphed:
                return pair[1](pair[0](x))
            with te.autocast(recipe=RECIPE):
                return pair[1](pair[0](x))
        return step
    holder = torch.nn.ModuleList([ea, eb])
    ref = _train(holder, (32, 64), run((ea, eb), False))
    got = _train(torch.nn.ModuleList([ga, gb]), (32, 64), run((ga, gb), True))
    assert_runs_equal(ref, got)


@cuda_fp8
def test_eval_and_no_grad_run_eagerly():
    model, shape = _build("Linear")
    te.make_graphed_callables(model, (cuda_inputs(shape, 0).requires_grad_(),), enabled=True,
                              recipe=RECIPE)
    x = cuda_inputs(shape, 1)
    with torch.no_grad():
        y = model(x)
        with te.autocast(recipe=RECIPE):
            ref = model.eager(x) if hasattr(model, "eager") else model.forward.eager(x)
    assert torch.equal(y, ref)


# ---- Megatron's pipeline schedule: _order (CPU with graphs stood in for, and GPU) ------------

CHUNKS, LAYERS, MICRO = 2, 2, 3
ORDERS = {
    # Megatron's convert_schedule_table_to_order(3, 2, get_schedule_table(3, 2, 3))
    "megatron": [1, 1, 1, 2, -2, 2, -2, 2, -2, -1, -1, -1],
    # TE's interleaved test: chunk 1's third forward takes chunk 2's freed buffers
    "te": [1, 2, 1, 2, -2, -1, 1, 2, -2, -1, -2, -1],
}
PRECISIONS = {"fp32": (torch.float32, False, False), "bf16": (torch.bfloat16, False, False),
              "fp8": (torch.bfloat16, True, False), "fp8-cached": (torch.float32, True, True)}


def _pipeline_layers(dtype, device):
    torch.manual_seed(5)
    return torch.nn.ModuleList(te.Linear(32, 32, params_dtype=dtype, device=device)
                               for _ in range(CHUNKS * LAYERS))


def _pipeline_run(layers, order, call, dtype, device, steps=2):
    """SGD steps of the schedule ``order``: chunk c's forward of micro-batch m runs its
    layers in turn through ``call(layer, m, x)``, its backward is one ``backward`` of the
    chunk's output. Per step: each chunk output (copied at once: a reused buffer may be
    overwritten after its backward), input and parameter gradients, weights and FP8
    states."""
    record = []
    for step in range(steps):
        gen = torch.Generator(device=device).manual_seed(step)
        def draw():
            return torch.randn(16, 32, generator=gen, device=device).to(dtype) * (1 + step)
        inputs = {key: draw().requires_grad_() for key in np.ndindex(CHUNKS, MICRO)}
        grads = {key: draw() for key in np.ndindex(CHUNKS, MICRO)}
        outputs, kept, done = {}, [], {1: [0] * CHUNKS, -1: [0] * CHUNKS}
        for entry in order:
            chunk, way = abs(entry) - 1, 1 if entry > 0 else -1
            m = done[way][chunk]
            done[way][chunk] += 1
            if way > 0:
                h = inputs[chunk, m]
                for lay in range(LAYERS):
                    h = call(chunk * LAYERS + lay, m, h)
                outputs[chunk, m] = h
                kept.append(h.detach().clone())
            else:
                outputs.pop((chunk, m)).backward(grads[chunk, m])
        states = [(k, f, getattr(m.fp8_meta[k], f).clone()) for m in layers
                  for k in ("scaling_fwd", "scaling_bwd") if m.fp8_meta.get(k) is not None
                  for f in ("scale", "scale_inv", "amax_history")]
        record.append(kept + [inputs[key].grad for key in sorted(inputs)]
                      + [p.grad.clone() for p in layers.parameters()] + [s[2] for s in states])
        with torch.no_grad():           # an SGD step (torch.optim would import dynamo: slow)
            for p in layers.parameters():
                p.sub_(0.1 * p.grad)
                p.grad = None
        record[-1] += [p.detach().clone() for p in layers.parameters()]
    return record


def _assert_pipeline_runs_equal(ref, got, what):
    for step, (a, b) in enumerate(zip(ref, got, strict=True)):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert torch.equal(x, y), f"{what} step {step}, tensor {i}: {describe_difference(x, y)}"


def _graph_pipeline(layers, order, dtype, device, fp8, cached, reuse, monkeypatch):
    """The layers graphed along ``order``, one callable per (layer, micro-batch); on the
    CPU with `RerunCapture` standing in for CUDA graphs (returned too)."""
    backend = None
    if device == "cpu":
        backend = RerunCapture()
        monkeypatch.setattr(te_graph, "_capture_backend", lambda pool: backend)
    samples = tuple((torch.ones(16, 32, device=device, dtype=dtype, requires_grad=True),)
                    for _ in range(CHUNKS * LAYERS * MICRO))
    graphs = te.make_graphed_callables(tuple(layers), samples, num_warmup_iters=1,
                                       allow_unused_input=True, _order=order, enabled=fp8,
                                       recipe=RECIPE if fp8 else None,
                                       cache_quantized_params=cached,
                                       _reuse_graph_input_output_buffers=reuse)
    return graphs, backend


def _pipeline_cases():
    """On the CPU both orders in FP8, the Megatron order in the other precisions (keeps
    the file fast); on a GPU every combination."""
    return [pytest.param(order, precision, device, id=f"{order}-{precision}-{device}",
                         marks=cuda_fp8 if device == "cuda" else ())
            for device in ("cpu", "cuda") for order in ORDERS for precision in PRECISIONS
            if device == "cuda" or (order == "te") == (precision == "fp8")]


@pytest.mark.parametrize("order, precision, device", _pipeline_cases())
def test_pipeline_schedule_equals_eager(order, precision, device, monkeypatch):
    """2 model chunks of 2 te.Linear layers, 3 micro-batches, an interleaved _order: each
    (layer, micro-batch) gets its own graphs, captured and replayed along the schedule,
    and two SGD steps give every chunk output, input and parameter gradient, weight and
    FP8 scale / amax history bit for bit as the same calls run eagerly in the same
    order (each forward its own outermost autocast, as a graphed forward is), with
    reused buffers and without. With cached FP8 weights each call passes
    ``is_first_microbatch`` (the first micro-batch casts, the others take that cast)."""
    dtype, fp8, cached = PRECISIONS[precision]
    initial = _pipeline_layers(dtype, device)

    def eager_call(layers, every_time=False):
        def call(layer, m, x):
            kwargs = {"is_first_microbatch": m == 0 or every_time} if cached else {}
            with te.autocast(enabled=fp8, recipe=RECIPE):
                return layers[layer](x, **kwargs)
        return call

    eager_layers = copy.deepcopy(initial)
    ref = _pipeline_run(eager_layers, ORDERS[order], eager_call(eager_layers), dtype, device)
    for reuse in (False, True):
        graphed_layers = copy.deepcopy(initial)
        graphs, backend = _graph_pipeline(graphed_layers, ORDERS[order], dtype, device, fp8,
                                          cached, reuse, monkeypatch)
        assert len(graphs) == CHUNKS * LAYERS * MICRO
        called = []

        def graphed(layer, m, x):       # called as Megatron calls them (keywords and all)
            g = graphs[(layer // LAYERS) * LAYERS * MICRO + m * LAYERS + layer % LAYERS]
            called.append(g)
            return g(x, is_first_microbatch=m == 0, packed_seq_params=None)

        try:
            got = _pipeline_run(graphed_layers, ORDERS[order], graphed, dtype, device)
            _assert_pipeline_runs_equal(ref, got, f"reuse={reuse}")
            if backend is not None:     # each call replayed the graphs of its own callable
                replayed = [graphs_ for kind, graphs_ in backend.log if kind == "forward"]
                assert replayed == [g.graphs for g in called]
                assert sum(kind == "backward" for kind, _ in backend.log) == len(called)
        finally:
            FP8GlobalStateManager.reset()       # the skip-update tensor stays set otherwise
            for g in graphs:
                g.reset()
        assert all(layer.forward.__func__ is type(layer).forward for layer in graphed_layers)
    if cached:                          # the flag reached the replays: casting every time differs
        fresh = copy.deepcopy(initial)
        uncached = _pipeline_run(fresh, ORDERS[order], eager_call(fresh, every_time=True),
                                 dtype, device)
        assert not all(torch.equal(a, b) for a, b in zip(uncached[0], ref[0]))


def test_reused_buffers_follow_the_schedule(monkeypatch):
    """Reused buffers along Megatron's order: chunk 2's later micro-batches take the
    static inputs of its first one (freed by its backward), chunk 1's keep their own;
    all backwards share one gradient-output buffer. A call out of the schedule that
    would overwrite inputs a pending backward still reads is refused."""
    layers = _pipeline_layers(torch.float32, "cpu")
    graphs, _ = _graph_pipeline(layers, ORDERS["megatron"], torch.float32, "cpu", False, False,
                                True, monkeypatch)
    inputs = [g.static_inputs[0] for g in graphs]
    assert [[j for j in range(12) if inputs[j] is inputs[i]] for i in (6, 7)] == \
        [[6, 8, 10], [7, 9, 11]]
    assert len({id(t) for t in inputs[:6]}) == 6
    assert len({id(g.static_grad_outputs) for g in graphs}) == 1
    x = torch.randn(16, 32, requires_grad=True)
    graphs[6](x)
    with pytest.raises(RuntimeError, match=r"graph 8 \(callable 2, micro-batch 1\) shares its "
                                           r"static input buffers with graph 6 \(callable 2, "
                                           r"micro-batch 0\), whose backward has not run"):
        graphs[8](x)


# ---- what cannot be captured (GPU) ---------------------------------------------------------

@cuda_fp8
def test_cpu_sample_tensor_is_refused():
    model, _ = _build("Linear")
    with pytest.raises(RuntimeError, match=r"sample_args\[0\]\[0\] is on cpu"):
        te.make_graphed_callables(model, (torch.randn(32, 64),), enabled=True)


@cuda_fp8
def test_host_sync_in_the_callable_fails_at_capture():
    model, shape = _build("Linear")

    def syncing(x):
        y = model(x)
        if y.float().sum().item() > 1e30:           # a host synchronization
            y = y * 2
        return y

    with pytest.raises(RuntimeError, match="capturing the forward of callable 0 failed"):
        te.make_graphed_callables(syncing, (cuda_inputs(shape, 0).requires_grad_(),), enabled=True)
    # The failed capture leaves no generator marked as capturing: random ops still run.
    assert torch.randn(4, device="cuda").isfinite().all()


@cuda_fp8
def test_gloo_amax_group_is_refused():
    dist = torch.distributed
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model, shape = _build("Linear")
        with pytest.raises(RuntimeError, match="'gloo' backend, whose collectives cannot be "
                                               "captured"):
            te.make_graphed_callables(model, (cuda_inputs(shape, 0).requires_grad_(),), enabled=True,
                                      amax_reduction_group=dist.group.WORLD)
    finally:
        dist.destroy_process_group()
