"""CUDA graphs against eager execution, FP8 against BF16: ``te.make_graphed_callables``
with the FP8 updates inside the graphs, ``torch.cuda.make_graphed_callables`` for
``torch.nn.Linear`` in bf16, and the bare-GEMM ceiling, measured side by side.

One command (on a Hopper GPU, from the repository root)::

    python3 benchmarks/bench_graphs.py

Part 1, one linear layer (M tokens, K in, N out), forward + backward per step,
median of CUDA-event-timed repeats (``triton.testing.do_bench``): eager and graphed
``te.Linear`` FP8 (``DelayedScaling``, bf16 parameters), eager and graphed
``torch.nn.Linear`` bf16, and the three bare GEMMs in FP8 and bf16 (their ratio is the
ceiling of any FP8 speed-up); plus the host time to enqueue one eager step (the steps
of linear_steps.py, which bench_linear.py times too).
Part 2, ``--layers`` ``te.TransformerLayer`` (``--hidden``, seq ``--seq``, batch 1,
``--dropout``), FP8 (the autocast inside each layer's function) and BF16, eager and
graphed, each with every layer under ``te.checkpoint`` and without: the median time of
a forward + backward step, and its activation memory: the peak of the device memory
the allocator holds during a step (``max_memory_reserved``, after ``empty_cache``: a
graph's pool holds its activations whether or not a tensor is allocated in it) minus
what it holds for the model, its gradients, the AdamW state and the input. ``--kernels``
adds the largest kernels of each graphed step (torch.profiler, after all timings of
the row). The tables are printed last; the JSON goes to ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "benchmarks")]

import torch  # noqa: E402

import transformer_engine.pytorch as te  # noqa: E402
from common import add_out_argument, environment, median_ms, table, write_json  # noqa: E402
from linear_steps import (BF16, bare_gemms, graph_columns, host_wall_us, nn_step,  # noqa: E402
                          parse_shapes, te_step, timed)
from transformer_engine.common.recipe import DelayedScaling  # noqa: E402


def linear_row(m, k, n, timer) -> dict:
    r = {"M": m, "K": k, "N": n}
    r.update(bare_gemms(m, k, n, timer))
    r["ceiling"] = r["bf16_gemms"] / r["fp8_gemms"]
    r["te_fp8_eager"], _ = timed(te_step, timer, m, k, n)
    r["nn_bf16_eager"], _ = timed(nn_step, timer, m, k, n)
    r.update(graph_columns(m, k, n, timer, r["ceiling"]))
    r["eager_fp8_over_bf16"] = r["nn_bf16_eager"] / r["te_fp8_eager"]
    return r


class Model(torch.nn.Module):
    def __init__(self, layers, hidden, fp8, checkpoint, dropout):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            te.TransformerLayer(hidden, 4 * hidden, hidden // 64, hidden_dropout=dropout,
                                attention_dropout=dropout, params_dtype=BF16, device="cuda")
            for _ in range(layers))
        self.fp8, self.checkpoint = fp8, checkpoint
        self.recipe = DelayedScaling()

    def _layer(self, layer, h):
        with te.autocast(enabled=self.fp8, recipe=self.recipe):
            return layer(h)

    def forward(self, x):
        for layer in self.layers:
            if self.checkpoint:
                x = te.checkpoint(self._layer, layer, x, use_reentrant=False)
            else:
                x = self._layer(layer, x)
        return x


def _held() -> int:
    """Device memory the allocator holds once its unused cache is released."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved()


def model_row(args, fp8, graphed, checkpoint) -> dict:
    model = Model(args.layers, args.hidden, fp8, checkpoint, args.dropout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    x = torch.randn(args.seq, 1, args.hidden, device="cuda", dtype=BF16, requires_grad=True)
    dy = torch.randn_like(x)

    def step():
        model(x).backward(dy)
    step()                     # gradients, FP8 state and (next) the AdamW state exist
    optimizer.step()
    base_held, base_allocated = _held(), torch.cuda.memory_allocated()
    if graphed:                # the graphs' pool holds a step's activations from now on
        te.make_graphed_callables(model, (x,))
        _held()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    row = {"precision": "fp8" if fp8 else "bf16", "graphed": graphed, "checkpoint": checkpoint,
           "model_optimizer_GiB": base_allocated / 2 ** 30,
           "act_GiB": (torch.cuda.max_memory_reserved() - base_held) / 2 ** 30,
           "act_allocated_GiB": (torch.cuda.max_memory_allocated() - base_allocated) / 2 ** 30,
           "step_ms": median_ms(step, rep_ms=args.rep_ms), "host_us": host_wall_us(step, 20)}
    if args.kernels and graphed:
        row["kernels"] = kernel_summary(step)
    return row


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


def model_rows(args) -> list:
    rows = []
    for checkpoint in (True, False):
        for fp8 in (True, False):
            for graphed in (False, True):
                rows.append(model_row(args, fp8, graphed, checkpoint))
                _held()            # the row's model and graphs are gone (a cycle: gc)
                print(f"  {({k: v for k, v in rows[-1].items() if k != 'kernels'})}", flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", type=parse_shapes, default=parse_shapes("graphs"),
                   help="comma-separated MxKxN or a named set (default: 'graphs')")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dropout", type=float, default=0.0, help="hidden and attention dropout")
    p.add_argument("--parts", default="linear,model", help="which parts to run")
    p.add_argument("--kernels", action="store_true", help="profile the graphed model steps")
    p.add_argument("--rep-ms", type=float, default=200)
    add_out_argument(p)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_graphs.py: needs a CUDA GPU")
    parts = set(args.parts.split(","))
    timer = lambda fn: median_ms(fn, rep_ms=args.rep_ms)  # noqa: E731
    result = {"env": environment(), "linear": [], "model": None,
              "model_config": {"hidden": args.hidden, "seq": args.seq, "layers": args.layers,
                               "batch": 1, "dropout": args.dropout}}
    rows = []
    for m, k, n in args.shapes if "linear" in parts else []:
        r = linear_row(m, k, n, timer)
        result["linear"].append(r)
        rows.append([f"{m}x{k}x{n}", f"{r['te_fp8_eager']:.3f}", f"{r['te_fp8_graphed']:.3f}",
                     f"{r['nn_bf16_eager']:.3f}", f"{r['nn_bf16_graphed']:.3f}",
                     f"{r['ceiling']:.2f}", f"{r['eager_fp8_over_bf16']:.2f}",
                     f"{r['graphed_te_over_nn']:.2f}", f"{r['graphed_of_ceiling']:.2f}",
                     f"{r['te_fp8_host_us']:.0f}", f"{r['nn_bf16_host_us']:.0f}"])
        print(f"  {rows[-1]}", flush=True)
    if "model" in parts:
        try:
            result["model"] = model_rows(args)
        except Exception as err:      # record why the model part could not run
            result["model_error"] = f"{type(err).__name__}: {err}"
            print("model part failed:", result["model_error"])
    path = write_json(result, "bench_graphs", args.out)
    if rows:
        print("one linear layer, ms per forward+backward step; ratios are bf16 time over FP8 "
              "time; host us: to enqueue one eager step")
        print(table(rows, ["M x K x N", "te eager", "te graphed", "nn eager", "nn graphed",
                           "ceiling", "eager te/nn", "graphed te/nn", "of ceiling",
                           "te host us", "nn host us"]))
    if result["model"]:
        print(f"\n{args.layers} x te.TransformerLayer, hidden {args.hidden}, seq {args.seq}, "
              f"batch 1, dropout {args.dropout}: forward+backward step; activation memory = "
              "peak held during a step minus model, gradients, AdamW state and input")
        print(table([[r["precision"], "te.checkpoint" if r["checkpoint"] else "none",
                      "graphed" if r["graphed"] else "eager", f"{r['step_ms']:.2f}",
                      f"{r['act_GiB']:.2f}", f"{r['model_optimizer_GiB']:.2f}",
                      f"{r['host_us']:.0f}"] for r in result["model"]],
                    ["precision", "checkpoint", "mode", "step ms", "act GiB", "model+opt GiB",
                     "wall us/step"]))
        for r in result["model"]:
            for k in r.get("kernels", [])[:8]:
                print(f"  {r['precision']} graphed, checkpoint {r['checkpoint']}: "
                      f"{k['ms_per_step']:8.3f} ms  x{k['calls_per_step']:<4} {k['kernel']}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
