"""A training step of 4 x te.TransformerLayer in BF16, FP8 DelayedScaling and FP8
Float8CurrentScaling, eager and graphed (and compiled with ``--compile``): step time,
FP8 / BF16 speed-up and peak device memory, per hidden size.

One command (on a CUDA GPU, from the repository root; about 3 minutes on an H100)::

    python3 benchmarks/bench_transformer_layers.py

The model: ``--layers`` (4) ``te.TransformerLayer(hidden, 4 hidden, hidden / 64 heads)``
with causal self-attention, no dropout, bfloat16 parameters, input ``[seq 2048, batch
2, hidden]`` (``--seq``, ``--batch``), for each ``--hidden`` (1024,2048,4096). A step:
forward (under ``te.autocast`` with the recipe, inside the model's forward, for FP8),
backward of ``out.float().pow(2).mean()``, ``torch.optim.AdamW(fused=True).step()``,
gradients set to None. Modes: ``eager``; ``graphed`` (``te.make_graphed_callables``
of the whole stack, the optimizer step outside the graphs); ``compiled``
(``--compile``: ``torch.compile`` of the stack as it is, nothing else; a row whose
compilation or run fails records the error and the run goes on).

Per row: the mean step time over ``--steps`` (20) timed steps after ``--warmup`` (3)
steps (CUDA events around all of them), the peak device memory allocated during one
step (``max_memory_allocated`` after ``reset_peak_memory_stats``; the model,
gradients, AdamW state and input are in it) and the memory held before it (model,
AdamW state, input; the graphs' pools for graphed rows). FP8 / BF16 is BF16's step
time over the FP8 row's, same hidden size and mode. The table is printed last; the
JSON (card, versions, command, every row) goes to ``--out`` (default benchmarks/out).
``--fused-producers 0`` runs with the fused producer kernels off (NOTE [Fused
producers]), for comparison.

``--profile`` breaks each eager and graphed row down after timing it: the host time
to enqueue the forward, the backward and the optimizer step (median over ``--steps`` steps, each
phase timed on the host without synchronising: where it exceeds the GPU's time the
step is host-bound), then one torch.profiler pass (3 steps): the GPU's busy time per
step (union of kernel intervals), kernel launches per layer and every kernel's GPU
time and calls per step (in the JSON, most time first). A second table prints these.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import traceback

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "benchmarks")]

import torch  # noqa: E402

import transformer_engine.pytorch as te  # noqa: E402
from common import (add_out_argument, environment, profile_steps, table,  # noqa: E402
                    write_json)
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling  # noqa: E402
from transformer_engine.pytorch.kernel_config import kernel_config  # noqa: E402

BF16 = torch.bfloat16
PRECISIONS = ("bf16", "fp8_delayed", "fp8_current")
GiB = 2 ** 30


class Stack(torch.nn.Module):
    """``layers`` TransformerLayers, the FP8 autocast (if any) inside the forward."""

    def __init__(self, layers: int, hidden: int, recipe):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            te.TransformerLayer(hidden, 4 * hidden, hidden // 64, hidden_dropout=0.0,
                                attention_dropout=0.0, self_attn_mask_type="causal",
                                params_dtype=BF16, device="cuda")
            for _ in range(layers))
        self.recipe = recipe

    def forward(self, x):
        with te.autocast(enabled=self.recipe is not None, recipe=self.recipe):
            for layer in self.layers:
                x = layer(x)
        return x


def _recipe(precision: str):
    return {"bf16": None, "fp8_delayed": DelayedScaling(),
            "fp8_current": Float8CurrentScaling()}[precision]


def _release():
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def run_row(args, hidden: int, precision: str, mode: str) -> dict:
    row = {"hidden": hidden, "precision": precision, "mode": mode}
    torch.manual_seed(0)
    model = Stack(args.layers, hidden, _recipe(precision))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    x = torch.randn(args.seq, args.batch, hidden, device="cuda", dtype=BF16, requires_grad=True)
    fn = model
    if mode == "graphed":
        fn = te.make_graphed_callables(model, (x,))
    elif mode == "compiled":
        fn = torch.compile(model)

    def step():
        out = fn(x)
        out.float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        x.grad = None
    start = time.perf_counter()
    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    row["warmup_s"] = time.perf_counter() - start
    row["held_GiB"] = torch.cuda.memory_allocated() / GiB
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    row["peak_GiB"] = torch.cuda.max_memory_allocated() / GiB
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(args.steps):
        step()
    end.record()
    end.synchronize()
    row["step_ms"] = begin.elapsed_time(end) / args.steps
    if args.profile and mode in ("eager", "graphed"):
        _profile_row(row, args, fn, x, optimizer)
    return row


def _profile_row(row: dict, args, fn, x, optimizer) -> None:
    """Host enqueue time per phase and the GPU's side of a step (``--profile``)."""
    phases = {"forward": [], "backward": [], "optimizer": []}
    for _ in range(args.steps):
        t0 = time.perf_counter()
        out = fn(x)
        t1 = time.perf_counter()
        out.float().pow(2).mean().backward()
        t2 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        x.grad = None
        t3 = time.perf_counter()
        phases["forward"].append(t1 - t0)
        phases["backward"].append(t2 - t1)
        phases["optimizer"].append(t3 - t2)
        torch.cuda.synchronize()            # each step's host time alone, queue empty
    row["host_ms"] = {k: 1e3 * statistics.median(v) for k, v in phases.items()}

    def step():
        out = fn(x)
        out.float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        x.grad = None
    prof = profile_steps({"step": step})["step"]
    top = sorted(prof["kernel_ms"].items(), key=lambda kv: -kv[1])   # every kernel
    row["profile"] = {"gpu_busy_ms": prof["gpu_busy_ms"], "span_ms": prof["span_ms"],
                      "kernels_per_step": prof["kernels_per_step"],
                      "kernels_per_layer": prof["kernels_per_step"] / args.layers,
                      "top_kernels": [{"name": k, "ms_per_step": ms,
                                       "calls_per_step": prof["kernel_counts"][k]}
                                      for k, ms in top]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", default="1024,2048,4096")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--precisions", default=",".join(PRECISIONS))
    p.add_argument("--modes", default="eager,graphed", help="comma-separated; may be empty")
    p.add_argument("--compile", action="store_true", help="add torch.compile rows")
    p.add_argument("--fused-producers", type=int, default=1, choices=(0, 1))
    p.add_argument("--profile", action="store_true",
                   help="eager rows: host time per phase, GPU busy time, launches per layer")
    p.add_argument("--name", default="bench_transformer_layers",
                   help="the JSON file's name (before the card)")
    add_out_argument(p)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_transformer_layers.py: needs a CUDA GPU")
    modes = [m for m in args.modes.split(",") if m] + (["compiled"] if args.compile else [])
    precisions = [q for q in args.precisions.split(",") if q]
    result = {"env": environment(), "config": {k: v for k, v in vars(args).items()
                                               if k not in ("out", "name")}, "rows": []}
    with kernel_config(fused_producers=bool(args.fused_producers)):
        for hidden in (int(h) for h in args.hidden.split(",")):
            for mode in modes:
                for precision in precisions:
                    try:
                        row = run_row(args, hidden, precision, mode)
                    except Exception as err:    # record the row's failure, go on
                        row = {"hidden": hidden, "precision": precision, "mode": mode,
                               "error": f"{type(err).__name__}: {str(err)[:500]}",
                               "traceback": traceback.format_exc()[-3000:]}
                    result["rows"].append(row)
                    _release()
                    print(f"  {({k: v for k, v in row.items() if k != 'traceback'})}",
                          flush=True)
    rows = []
    by_key = {(r["hidden"], r["mode"], r["precision"]): r for r in result["rows"]}
    for r in result["rows"]:
        base = by_key.get((r["hidden"], r["mode"], "bf16"), {})
        speedup = (f"{base['step_ms'] / r['step_ms']:.2f}"
                   if "step_ms" in r and "step_ms" in base else "")
        r["fp8_over_bf16"] = float(speedup) if speedup else None
        if "error" in r:
            rows.append([r["hidden"], r["mode"], r["precision"], "error", "", "", "",
                         r["error"][:60]])
        else:
            rows.append([r["hidden"], r["mode"], r["precision"], f"{r['step_ms']:.2f}",
                         speedup, f"{r['peak_GiB']:.2f}", f"{r['held_GiB']:.2f}", ""])
    path = write_json(result, args.name, args.out)
    print(f"{args.layers} x te.TransformerLayer, seq {args.seq}, batch {args.batch}, causal, "
          f"AdamW step; {result['env']['card']}; fused producers "
          f"{'on' if args.fused_producers else 'off'}")
    print(table(rows, ["hidden", "mode", "precision", "step ms", "bf16/this", "peak GiB",
                       "held GiB", "error"]))
    profiled = [r for r in result["rows"] if "profile" in r]
    if profiled:
        print("step, broken down: host enqueue time per phase (median), GPU busy time")
        print(table([[r["hidden"], r["mode"], r["precision"], f"{r['step_ms']:.2f}",
                      f"{r['host_ms']['forward']:.2f}", f"{r['host_ms']['backward']:.2f}",
                      f"{r['host_ms']['optimizer']:.2f}", f"{r['profile']['gpu_busy_ms']:.2f}",
                      f"{r['profile']['kernels_per_layer']:.0f}"] for r in profiled],
                    ["hidden", "mode", "precision", "step ms", "host fwd", "host bwd", "host opt",
                     "GPU busy ms", "kernels/layer"]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
