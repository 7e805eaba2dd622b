"""The steps the linear-layer benchmarks time (bench_linear.py, bench_graphs.py): the
bare GEMMs, one forward + backward of ``te.Linear`` FP8 and ``torch.nn.Linear`` bf16,
eager and from CUDA graphs, torchao's FP8 linear, and the host time of a step; and the
shape sets of ``--shapes``. Every step maker returns ``(step, tensors whose .grad a
step fills)``; `prepare` drops those gradients before each step.
"""

from __future__ import annotations

import argparse
import time

import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8BlockScaling
from transformer_engine.pytorch.kernel_config import kernel_config

DEFAULT_SHAPES = [(m, k, n) for m in (4096, 8192, 16384) for k in (4096, 8192)
                  for n in (4096, 8192)]
GRAPH_SHAPES = [(1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096), (4096, 4096, 8192)]
SHAPE_SETS = {"default": DEFAULT_SHAPES, "graphs": GRAPH_SHAPES}
BF16, E4M3, E5M2 = torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2


def parse_shapes(text: str):
    """Comma-separated ``MxKxN`` (positive integers), or a named set of SHAPE_SETS."""
    if text in SHAPE_SETS:
        return list(SHAPE_SETS[text])
    shapes = []
    for item in (s for s in text.split(",") if s):
        dims = item.split("x")
        if len(dims) != 3 or not all(d.isdigit() and int(d) > 0 for d in dims):
            raise argparse.ArgumentTypeError(
                f"a shape is MxKxN with three positive integers (or one of {sorted(SHAPE_SETS)}), "
                f"got {item!r}")
        shapes.append(tuple(int(d) for d in dims))
    return shapes


def _fp8(t, dtype):
    return t.to(dtype)


def bare_gemms(m, k, n, timer):
    """Forward, dgrad and wgrad as bare GEMMs, bf16 and FP8 (ms each)."""
    x = torch.randn(m, k, device="cuda", dtype=BF16)
    w = torch.randn(n, k, device="cuda", dtype=BF16)
    dy = torch.randn(m, n, device="cuda", dtype=BF16)
    one = torch.ones((), device="cuda")
    x8, w8, dy8 = _fp8(x, E4M3), _fp8(w, E4M3), _fp8(dy, E5M2)
    xt8, wt8, dyt8 = x8.t().contiguous(), w8.t().contiguous(), dy8.t().contiguous()
    mm = torch._scaled_mm
    out = {
        "bf16_fwd": timer(lambda: x @ w.t()),
        "bf16_dgrad": timer(lambda: dy @ w),
        "bf16_wgrad": timer(lambda: dy.t() @ x),
        # as te.Linear runs them: fast accumulation in forward only (as TE does)
        "fp8_fwd": timer(lambda: mm(x8, w8.t(), scale_a=one, scale_b=one, out_dtype=BF16,
                                    use_fast_accum=True)),
        "fp8_dgrad": timer(lambda: mm(dy8, wt8.t(), scale_a=one, scale_b=one, out_dtype=BF16)),
        "fp8_wgrad": timer(lambda: mm(dyt8, xt8.t(), scale_a=one, scale_b=one, out_dtype=BF16)),
    }
    out["bf16_gemms"] = out["bf16_fwd"] + out["bf16_dgrad"] + out["bf16_wgrad"]
    out["fp8_gemms"] = out["fp8_fwd"] + out["fp8_dgrad"] + out["fp8_wgrad"]
    return out


def _inputs(m, k, n):
    x = torch.randn(m, k, device="cuda", dtype=BF16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=BF16)
    return x, dy


def nn_step(m, k, n):
    lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=BF16)
    x, dy = _inputs(m, k, n)

    def step():
        lin(x).backward(dy)
    return step, [x, lin.weight]


def te_step(m, k, n, variant="default"):
    """``variant``: "default", "jit" (every Triton launch through the JIT), "unfused"
    (the torch reference casts and update), "block" (Float8BlockScaling, Hopper's
    block-scaled GEMM) or "block_emulated" (Float8BlockScaling, emulated GEMMs)."""
    layer = te.Linear(k, n, bias=False, params_dtype=BF16, device="cuda")
    x, dy = _inputs(m, k, n)
    recipe = Float8BlockScaling() if variant.startswith("block") else DelayedScaling()

    def step():
        with te.autocast(enabled=True, recipe=recipe):
            y = layer(x)
        y.backward(dy)
    if variant == "default":
        return step, [x, layer.weight]

    def step_variant():
        with kernel_config(fused=variant != "unfused", direct_launch=variant != "jit",
                           block_gemm="emulation" if variant == "block_emulated" else "hardware"):
            step()
    return step_variant, [x, layer.weight]


def te_graphed_step(m, k, n):
    """``te.Linear`` FP8 (delayed scaling) forward + backward replayed from the CUDA
    graphs of ``te.make_graphed_callables``."""
    layer = te.Linear(k, n, bias=False, params_dtype=BF16, device="cuda")
    x, dy = _inputs(m, k, n)
    te.make_graphed_callables(layer, (x,), enabled=True, recipe=DelayedScaling())

    def step():
        layer(x).backward(dy)
    return step, [x, layer.weight]


def nn_graphed_step(m, k, n):
    """``torch.nn.Linear`` bf16 forward + backward from ``torch.cuda.make_graphed_callables``."""
    lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=BF16)
    x, dy = _inputs(m, k, n)
    graphed = torch.cuda.make_graphed_callables(lin, (x,))

    def step():
        graphed(x).backward(dy)
    return step, [x, lin.weight]


def torchao_step(m, k, n):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    torch._dynamo.reset()    # a static compile per shape, as a fixed-shape run would get
    model = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False)).to(device="cuda", dtype=BF16)
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("tensorwise"))
    weight = model[0].weight
    model = torch.compile(model)
    x, dy = _inputs(m, k, n)

    def step():
        model(x).backward(dy)
    return step, [x, weight]


def prepare(make, *args, **kw):
    """A step that drops the gradients first (so no variant pays a grad accumulation)."""
    step, params = make(*args, **kw)

    def run():
        for p in params:
            p.grad = None
        step()
    run()
    torch.cuda.synchronize()
    return run


def timed(make, timer, *args, **kw):
    return timer(prepare(make, *args, **kw)), None


def host_wall_us(run, steps: int = 300, warmup: int = 20, wait: bool = True) -> float:
    """Host wall time per step (us) after ``warmup`` steps. ``wait``: over many steps
    with one sync at the end (for a step whose GPU work is negligible, the host cost of
    the step); else up to the last enqueue, without waiting for the GPU, over too few
    steps to fill the launch queue (the host's cost at any shape)."""
    for _ in range(warmup):
        run()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        run()
    if wait:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return elapsed / steps * 1e6


def host_enqueue_us(run, steps: int = 10) -> float:
    """Host time to enqueue one step (us), at any shape (`host_wall_us`, no wait)."""
    return host_wall_us(run, steps, warmup=3, wait=False)


def graph_columns(m, k, n, timer, ceiling: float) -> dict:
    """The CUDA-graph comparison of one shape: graphed te FP8 and graphed nn bf16 (ms),
    their ratio against the bare-GEMM ceiling, and the host time to enqueue one eager
    step of te FP8 and of nn bf16 (us)."""
    out = {"te_fp8_graphed": timed(te_graphed_step, timer, m, k, n)[0],
           "nn_bf16_graphed": timed(nn_graphed_step, timer, m, k, n)[0],
           "te_fp8_host_us": host_enqueue_us(prepare(te_step, m, k, n)),
           "nn_bf16_host_us": host_enqueue_us(prepare(nn_step, m, k, n))}
    out["graphed_te_over_nn"] = out["nn_bf16_graphed"] / out["te_fp8_graphed"]
    out["graphed_of_ceiling"] = out["graphed_te_over_nn"] / ceiling
    return out


GRAPH_HEADER = ["MxKxN", "te graphed", "nn graphed", "ceiling", "graphed te/nn", "of ceiling",
                "eager te/nn", "te host us", "nn host us"]


def graph_row(r: dict) -> list:
    """One row of the CUDA-graph table (GRAPH_HEADER) from a shape's results."""
    return [f"{r['M']}x{r['K']}x{r['N']}", f"{r['te_fp8_graphed']:.3f}",
            f"{r['nn_bf16_graphed']:.3f}", f"{r['ceiling_fp8_over_bf16']:.2f}",
            f"{r['graphed_te_over_nn']:.2f}", f"{r['graphed_of_ceiling']:.2f}",
            f"{r['nn_bf16'] / r['te_fp8']:.2f}", f"{r['te_fp8_host_us']:.0f}",
            f"{r['nn_bf16_host_us']:.0f}"]
