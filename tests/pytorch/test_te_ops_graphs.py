"""te.ops under torch.compile(fullgraph=True) and te.make_graphed_callables: compiled
(on the CPU with the "aot_eager" backend, which runs the aten ops eager runs) and
graphed (CUDA) training steps equal eager ones bit for bit: outputs, input and
parameter gradients, every FP8 scale and amax history, with no recompilation after the
first step. The graphed cases need a CUDA GPU with FP8 and carry a skip mark."""

import contextlib
import copy

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling
from transformer_engine.pytorch import ops
from helpers import (assert_runs_equal, capture, cuda_fp8, cuda_inputs, te_modules,
                     train_steps)

H, FFN, ROWS = 32, 64, 16
RECIPES = {"delayed": DelayedScaling(amax_history_len=4), "current": Float8CurrentScaling()}


class _Square(ops.BasicOperation):
    """An operation written TE's way (op_forward / op_backward): it runs in the fuser's
    own autograd Function, not as a native operation."""

    def op_forward(self, ctx, input_, *, prev_op_grad_output_quantizer=None,
                   next_op_input_quantizer=None):
        ctx.save_for_backward(input_)
        return input_ * input_

    def op_backward(self, ctx, grad_output):
        (x,) = ctx.saved_tensors
        return 2 * x * grad_output, ()


def _make(kind: str, device: str = "cpu", dtype=None):
    torch.manual_seed(0)
    kw = {"device": device, "dtype": dtype}
    if kind == "mlp":        # LayerNorm -> Linear -> GELU -> Linear: one fused chain
        return ops.Sequential(ops.LayerNorm(H, **kw), ops.Linear(H, FFN, **kw), ops.GELU(),
                              ops.Linear(FFN, H, **kw))
    if kind == "residual":   # extra output and extra input: x + 0.5 * linear(rmsnorm(x))
        return ops.Sequential(ops.MakeExtraOutput(), ops.RMSNorm(H, **kw),
                              ops.Linear(H, H, **kw), ops.ConstantScale(0.5),
                              ops.AddExtraInput())
    if kind == "user-op":    # an op_forward / op_backward operation between linears
        return ops.Sequential(ops.Linear(H, H, **kw), _Square(), ops.BasicLinear(H, H, **kw))
    raise ValueError(kind)


def _forward(model, kind, x):
    """The model's output on ``x`` (the residual model: its extra output fed back)."""
    if kind == "residual":
        y, residual = model(x, x)
        return y + residual
    return model(x)


# ---- torch.compile(fullgraph=True), CPU ---------------------------------------------------

@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def _train_compiled(kind, recipe, placement, compiled, steps=3):
    """``steps`` SGD steps; te.autocast ``placement`` "inside" or "outside" the
    (compiled) function. The records, and the graphs compiled after the first step."""
    model = _make(kind)
    autocast = lambda: te.autocast(recipe=recipe)  # noqa: E731

    def fn(x):
        if placement == "inside":
            with autocast():
                return _forward(model, kind, x)
        return _forward(model, kind, x)

    run = torch.compile(fn, fullgraph=True, backend="aot_eager") if compiled else fn
    records, after_first = [], 0
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        x = (torch.randn(ROWS, H, generator=g) * (1 + step)).requires_grad_()
        with autocast() if placement == "outside" else contextlib.nullcontext():
            y = run(x)
        loss = y.float().pow(2).mean()
        loss.backward()
        records.append(capture(loss, [x], list(model.parameters()), te_modules(model)))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-0.01)
                p.grad = None
        if step == 0:
            after_first = _graphs()
    return records, _graphs() - after_first


COMPILED_CASES = [("mlp", r, p) for r in RECIPES for p in ("inside", "outside")] + [
    ("residual", "delayed", "inside"), ("residual", "current", "outside"),
    ("user-op", "delayed", "outside"), ("user-op", "current", "inside")]


@pytest.mark.parametrize("kind, recipe, placement", COMPILED_CASES,
                         ids=["-".join(c) for c in COMPILED_CASES])
def test_compiled_sequential_trains_as_eager(fresh_dynamo, kind, recipe, placement):
    """A te.ops.Sequential compiles whole (fullgraph) and its FP8 training steps equal
    eager ones bit for bit, the FP8 state of every linear operation included."""
    ref, _ = _train_compiled(kind, RECIPES[recipe], placement, compiled=False)
    before = _graphs()
    got, recompiled = _train_compiled(kind, RECIPES[recipe], placement, compiled=True)
    assert _graphs() > before, "nothing was compiled"
    assert_runs_equal(ref, got, "compiled vs eager")
    assert recompiled == 0, f"{recompiled} graph(s) compiled after the first step"
    if recipe == "delayed":
        for m in te_modules(_make(kind)):
            assert isinstance(m, ops.BasicLinear)
        assert ref[-1].states and any(s.fwd.amax_history.count_nonzero() > 0
                                      for s in ref[-1].states)


# ---- te.make_graphed_callables, CUDA -----------------------------------------------------

GRAPH_RECIPES = [pytest.param(RECIPES["delayed"], id="delayed"),
                 pytest.param(RECIPES["current"], id="current")]


@cuda_fp8
@pytest.mark.parametrize("recipe", GRAPH_RECIPES)
@pytest.mark.parametrize("kind", ["mlp", "residual", "user-op"])
def test_graphed_sequential_steps_equal_eager_steps(kind, recipe):
    """A te.ops.Sequential passed to te.make_graphed_callables: graphed training steps
    (FP8 updates captured in the graphs) equal eager ones bit for bit."""
    model = _make(kind, device="cuda", dtype=torch.bfloat16)
    eager_model = copy.deepcopy(model)
    shape = (ROWS, H)

    class Wrapped(torch.nn.Module):
        """The model with its extra input and output folded in (one tensor in, one out,
        as the graphed callable is called)."""

        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return _forward(self.inner, kind, x)

    def eager(m, x):
        with te.autocast(recipe=recipe):
            return m(x)

    ref = train_steps(Wrapped(eager_model), shape, eager, 5)
    wrapped = Wrapped(model)
    graphed = te.make_graphed_callables(wrapped, (cuda_inputs(shape, 0).requires_grad_(),),
                                        enabled=True, recipe=recipe)
    assert graphed is wrapped
    got = train_steps(wrapped, shape, lambda m, x: m(x), 5)
    assert_runs_equal(ref, got)
    if recipe.delayed():
        first = te_modules(model)[0]
        assert first.fp8_meta["scaling_fwd"].amax_history.count_nonzero() > 0
