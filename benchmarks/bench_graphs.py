"""CUDA graphs against eager execution, FP8 against BF16: ``te.make_graphed_callables``
with the FP8 updates inside the graphs, ``torch.cuda.make_graphed_callables`` for
``torch.nn.Linear`` in bf16, and the bare-GEMM ceiling, measured side by side.

One command (on a Hopper GPU, from the repository root)::

    python3 benchmarks/bench_graphs.py

Part 1, one linear layer (M tokens, K in, N out), forward + backward per step,
median of CUDA-event-timed repeats (``triton.testing.do_bench``): eager and graphed
``te.Linear`` FP8 (``DelayedScaling``, bf16 parameters), eager and graphed
``torch.nn.Linear`` bf16, and the three bare GEMMs in FP8 and bf16 (their ratio is the
ceiling of any FP8 speed-up); plus the host time of one eager step.
Part 2, 8 ``te.TransformerLayer`` (``--hidden``, seq ``--seq``, batch 1, dropout 0),
each layer checkpointed with the FP8 autocast inside the checkpointed function:
step time and peak activation memory, eager and graphed, FP8 and BF16.
The table is printed last; the JSON goes to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "benchmarks")]

import torch  # noqa: E402

import transformer_engine.pytorch as te  # noqa: E402
from bench_linear import bare_gemms, parse_shapes  # noqa: E402
from common import environment, median_ms, table, write_json  # noqa: E402
from transformer_engine.common.recipe import DelayedScaling  # noqa: E402

BF16 = torch.bfloat16


def linear_steps(m, k, n):
    """Step functions ``name -> fn`` for one linear layer."""
    recipe = DelayedScaling()
    x = torch.randn(m, k, device="cuda", dtype=BF16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=BF16)
    te_eager = te.Linear(k, n, bias=False, params_dtype=BF16, device="cuda")
    te_graphed = te.Linear(k, n, bias=False, params_dtype=BF16, device="cuda")
    te.make_graphed_callables(te_graphed, (x,), enabled=True, recipe=recipe)
    nn_eager = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=BF16)
    nn_graphed = torch.cuda.make_graphed_callables(
        torch.nn.Linear(k, n, bias=False, device="cuda", dtype=BF16), (x,))

    def te_eager_step():
        with te.autocast(recipe=recipe):
            y = te_eager(x)
        y.backward(dy)
    return {"te_fp8_eager": te_eager_step,
            "te_fp8_graphed": lambda: te_graphed(x).backward(dy),
            "nn_bf16_eager": lambda: nn_eager(x).backward(dy),
            "nn_bf16_graphed": lambda: nn_graphed(x).backward(dy)}


def host_us(fn, steps=200) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return host / steps * 1e6


class Model(torch.nn.Module):
    def __init__(self, layers, hidden, fp8):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            te.TransformerLayer(hidden, 4 * hidden, hidden // 64, hidden_dropout=0.0,
                                attention_dropout=0.0, params_dtype=BF16, device="cuda")
            for _ in range(layers))
        self.fp8 = fp8
        self.recipe = DelayedScaling()

    def _layer(self, layer, h):
        with te.autocast(enabled=self.fp8, recipe=self.recipe):
            return layer(h)

    def forward(self, x):
        for layer in self.layers:
            x = te.checkpoint(self._layer, layer, x, use_reentrant=False)
        return x


def model_row(hidden, seq, layers, rep_ms, fp8, graphed) -> dict:
    torch.cuda.empty_cache()
    model = Model(layers, hidden, fp8)
    x = torch.randn(seq, 1, hidden, device="cuda", dtype=BF16, requires_grad=True)
    dy = torch.randn_like(x)

    def step():
        model(x).backward(dy)
    step()                               # gradients and FP8 state exist from here on
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    if graphed:                          # the graphs' pool holds a step's activations
        te.make_graphed_callables(model, (x,))
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
    return {"precision": "fp8" if fp8 else "bf16", "graphed": graphed,
            "step_ms": median_ms(step, rep_ms=rep_ms), "peak_act_GiB": peak,
            "host_us": host_us(step, 20), "kernels": kernel_summary(step)}


def kernel_summary(step, steps: int = 3, top: int = 12) -> list:
    """GPU time per kernel name over ``steps`` steps (torch.profiler), the largest first."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / steps / 1e3, e.count // steps)
            for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda r: -r[1])
    return [{"kernel": k[:80], "ms_per_step": round(ms, 3), "calls_per_step": n}
            for k, ms, n in rows[:top]]


def model_rows(hidden, seq, layers, rep_ms):
    rows = []
    for fp8 in (True, False):
        for graphed in (False, True):
            rows.append(model_row(hidden, seq, layers, rep_ms, fp8, graphed))
            print(f"  {({k: v for k, v in rows[-1].items() if k != 'kernels'})}", flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", type=parse_shapes,
                   default=parse_shapes("1024x1024x1024,2048x2048x2048,4096x4096x4096"))
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rep-ms", type=float, default=200)
    p.add_argument("--out", default=os.path.join(_ROOT, "benchmarks", "results"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_graphs.py: needs a CUDA GPU")
    timer = lambda fn: median_ms(fn, rep_ms=args.rep_ms)  # noqa: E731
    result = {"env": environment(), "linear": [], "model": None,
              "model_config": {"hidden": args.hidden, "seq": args.seq, "layers": args.layers,
                               "batch": 1}}
    rows = []
    for m, k, n in args.shapes:
        gemms = bare_gemms(m, k, n, timer)
        steps = linear_steps(m, k, n)
        r = {"M": m, "K": k, "N": n, "bf16_gemms": gemms["bf16_gemms"],
             "fp8_gemms": gemms["fp8_gemms"]}
        for name, fn in steps.items():
            r[name] = timer(fn)
        r["te_eager_host_us"] = host_us(steps["te_fp8_eager"])
        r["nn_eager_host_us"] = host_us(steps["nn_bf16_eager"])
        ceiling = r["bf16_gemms"] / r["fp8_gemms"]
        graphed_ratio = r["nn_bf16_graphed"] / r["te_fp8_graphed"]
        r["ceiling"], r["graphed_fp8_over_bf16"] = ceiling, graphed_ratio
        r["eager_fp8_over_bf16"] = r["nn_bf16_eager"] / r["te_fp8_eager"]
        result["linear"].append(r)
        rows.append([f"{m}x{k}x{n}", f"{r['te_fp8_eager']:.3f}", f"{r['te_fp8_graphed']:.3f}",
                     f"{r['nn_bf16_eager']:.3f}", f"{r['nn_bf16_graphed']:.3f}",
                     f"{ceiling:.2f}", f"{r['eager_fp8_over_bf16']:.2f}", f"{graphed_ratio:.2f}",
                     f"{graphed_ratio / ceiling:.2f}", f"{r['te_eager_host_us']:.0f}",
                     f"{r['nn_eager_host_us']:.0f}"])
        print(f"  {rows[-1]}", flush=True)
    try:
        result["model"] = model_rows(args.hidden, args.seq, args.layers, args.rep_ms)
    except Exception as err:      # record why the model part could not run
        result["model_error"] = f"{type(err).__name__}: {err}"
        print("model part failed:", result["model_error"])
    path = write_json(result, "bench_graphs", args.out)
    print(table(rows, ["M x K x N", "te eager", "te graphed", "nn eager", "nn graphed",
                       "ceiling", "eager ratio", "graphed ratio", "of ceiling", "te host us",
                       "nn host us"]))
    if result["model"]:
        print(table([[r["precision"], r["graphed"], f"{r['step_ms']:.2f}",
                      f"{r['peak_act_GiB']:.2f}", f"{r['host_us']:.0f}"] for r in result["model"]],
                    ["precision", "graphed", "step ms", "peak act GiB", "host us/step"]))
        for r in result["model"]:
            if r["graphed"]:
                print(f"top kernels, {r['precision']} graphed:")
                for k in r["kernels"][:8]:
                    print(f"  {k['ms_per_step']:8.3f} ms  x{k['calls_per_step']:<4} {k['kernel']}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
