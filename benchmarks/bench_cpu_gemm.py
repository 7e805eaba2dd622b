"""CPU FP8 GEMM time per operand pair and shape: ``torch._scaled_mm`` against the
exact upcast GEMM the package uses on the CPU (NOTE [CPU FP8 GEMM] in quantize.py),
with float32 ``F.linear`` on the same shape as the yardstick.

One command, on the CPU machine, from the repository root::

    python3 benchmarks/bench_cpu_gemm.py

For each shape (M tokens, K in, N out) and each operand pair the package's GEMMs
use (E4M3 x E4M3 forward with ``Format.E4M3`` / ``HYBRID``, E5M2 x E4M3 dgrad and
wgrad with ``HYBRID``), it times ``a @ b^T`` with ``a: [M, K]``, ``b: [N, K]`` as the
median of wall-clock repeats. A ``torch._scaled_mm`` call that oneDNN runs on its
reference kernel can take seconds; it is timed once (``--max-s`` caps how many
seconds one call may take before the remaining repeats of that cell are skipped).
The JSON (CPU model, torch version, shapes, medians, command) goes to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "benchmarks")]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common import add_out_argument, environment, table, write_json  # noqa: E402
from transformer_engine.pytorch import quantize  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
PAIRS = {"e4m3xe4m3": (E4M3, E4M3), "e4m3xe5m2": (E4M3, E5M2), "e5m2xe4m3": (E5M2, E4M3)}
# The main job's GEMMs (16 x 128 tokens, hidden 128, FFN 512) and larger ones.
DEFAULT_SHAPES = [(2048, 128, 384), (2048, 128, 512), (2048, 512, 128), (2048, 768, 768)]


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "amx_tile" in f.read()
    except OSError:
        return False


def time_ms(fn, repeats: int, max_s: float) -> float:
    """Median wall time of ``fn`` in ms; one warm-up call, then repeats while a call
    stays under ``max_s`` seconds."""
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    if first > max_s:
        return first * 1e3
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def gemm_fn(kind: str, a: quantize.Float8Data, b: quantize.Float8Data):
    if kind == "upcast":
        return lambda: quantize.upcast_gemm(a, b, torch.float32, None)
    return lambda: torch._scaled_mm(a.data, b.data.t(), scale_a=a.scale_inv, scale_b=b.scale_inv,
                                    out_dtype=torch.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in DEFAULT_SHAPES),
                        help="comma-separated MxKxN")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--max-s", type=float, default=2.0,
                        help="a call slower than this is timed once")
    add_out_argument(parser)
    args = parser.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s]
    torch.manual_seed(0)
    rows, results = [], []
    for m, k, n in shapes:
        x, w = torch.randn(m, k), torch.randn(n, k)
        linear_ms = time_ms(lambda x=x, w=w: F.linear(x, w), args.repeats, args.max_s)
        for pair, (a_dtype, b_dtype) in PAIRS.items():
            a = quantize.cast_to_fp8(x, torch.tensor([1.0]), a_dtype)
            b = quantize.cast_to_fp8(w, torch.tensor([1.0]), b_dtype)
            cell = {"M": m, "K": k, "N": n, "pair": pair, "f32_linear_ms": linear_ms}
            for kind in ("scaled_mm", "upcast"):
                cell[f"{kind}_ms"] = time_ms(gemm_fn(kind, a, b), args.repeats, args.max_s)
            results.append(cell)
            rows.append([f"{m}x{k}x{n}", pair, f"{cell['scaled_mm_ms']:.2f}",
                         f"{cell['upcast_ms']:.2f}", f"{linear_ms:.2f}",
                         f"{cell['scaled_mm_ms'] / cell['upcast_ms']:.1f}"])
            print(f"  {rows[-1]}", flush=True)
    env = environment()
    amx = has_amx()
    env.update(card="CPU_AMX" if amx else "CPU", cpu=cpu_model(), amx=amx,
               threads=torch.get_num_threads())
    print(f"\n{env['cpu']} (AMX: {env['amx']}), {env['threads']} threads, torch {env['torch']}")
    print(table(rows, ["M x K x N", "pair", "_scaled_mm ms", "upcast ms", "f32 linear ms",
                       "scaled/upcast"]))
    path = write_json({"env": env, "results": results}, "bench_cpu_gemm", args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
