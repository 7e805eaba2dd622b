"""The cost of the emulated MX-family recipes per layer: one ``te.Linear`` and one
``te.LayerNormMLP`` forward+backward in BF16 (no autocast), ``Float8BlockScaling``,
``MXFP8BlockScaling`` and ``NVFP4BlockScaling`` (both with and without the Hadamard
transform and stochastic rounding), on whatever device is there.

One command (from the repository root; on a GPU, or on the CPU with small shapes)::

    python3 benchmarks/bench_mx_recipes.py                      # GPU defaults
    python3 benchmarks/bench_mx_recipes.py --tokens 512 --hidden 512 --ffn 1024

MXFP8 and NVFP4 are emulated exactly (dequantize, float32 GEMM): expect them slower
than BF16 everywhere, which is what this measures. On CUDA the median of CUDA-event
timed repeats after warm-up (``common.median_ms``); on the CPU the median wall time of
``--repeats`` steps after two warm-up steps. The table is printed last; the JSON
(card, versions, shapes, medians, command) goes to ``--out`` (default
``benchmarks/out``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "benchmarks")]

import torch  # noqa: E402

from common import add_out_argument, environment, median_ms, table, write_json  # noqa: E402
import transformer_engine.pytorch as te  # noqa: E402
from transformer_engine.common.recipe import (Float8BlockScaling, MXFP8BlockScaling,  # noqa: E402
                                              NVFP4BlockScaling)

RECIPES = {
    "bf16": None,
    "fp8_block": Float8BlockScaling(),
    "mxfp8": MXFP8BlockScaling(),
    "nvfp4": NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True),
    "nvfp4_rht_sr": NVFP4BlockScaling(disable_rht=False, disable_stochastic_rounding=False),
}


def _step(module, recipe, x):
    def run():
        x.grad = None
        for p in module.parameters():
            p.grad = None
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            y = module(x)
        y.backward(torch.ones_like(y))
    return run


def _cpu_median_ms(fn, repeats: int) -> float:
    fn()
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--ffn", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=5, help="CPU: timed steps per case")
    parser.add_argument("--recipes", default=",".join(RECIPES))
    add_out_argument(parser)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    h, f, m = args.hidden, args.ffn, args.tokens
    layers = {"Linear": te.Linear(h, h, params_dtype=torch.bfloat16, device=device),
              "LayerNormMLP": te.LayerNormMLP(h, f, params_dtype=torch.bfloat16, device=device)}
    x = torch.randn(m, h, dtype=torch.bfloat16, device=device, requires_grad=True)
    flops = {"Linear": 6 * m * h * h, "LayerNormMLP": 12 * m * h * f}
    results, rows = [], []
    for layer, module in layers.items():
        base = None
        for name in args.recipes.split(","):
            step = _step(module, RECIPES[name], x)
            ms = median_ms(step) if device == "cuda" else _cpu_median_ms(step, args.repeats)
            base = ms if name == "bf16" else base
            results.append({"layer": layer, "recipe": name, "ms": ms})
            rows.append((layer, name, f"{ms:.2f}", f"{flops[layer] / ms / 1e9:.3f}",
                         f"{ms / base:.2f}" if base else "-"))
    result = {"env": environment(), "device": device, "threads": torch.get_num_threads(),
              "shapes": {"tokens": m, "hidden": h, "ffn": f}, "results": results}
    path = write_json(result, "bench_mx_recipes", args.out)
    print(table(rows, ("layer", "recipe", "ms", "TFLOP/s", "x bf16")))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
