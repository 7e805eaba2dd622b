"""Shared helpers of the benchmarks: timing, environment record, JSON output, and where
the JSON goes.

A benchmark writes its JSON to ``benchmarks/out/`` (git-ignored) unless told otherwise
with ``--out``: the committed, recorded results in ``benchmarks/results/`` change only
when asked for (``--out benchmarks/results``)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys

import torch


def median_ms(fn, warmup_ms: float = 50, rep_ms: float = 300) -> float:
    """Median time of ``fn`` in ms, timed with CUDA events after warm-up
    (``triton.testing.do_bench``, which also flushes L2 between repeats)."""
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def environment() -> dict:
    """Card, versions and command, recorded with every result."""
    env = {"card": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "torch": torch.__version__, "cuda": torch.version.cuda,
           "python": platform.python_version(),
           "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
           "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    return env


BENCHMARKS = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(BENCHMARKS, "out")          # git-ignored scratch results


def add_out_argument(parser) -> None:
    """The ``--out`` option every benchmark takes, with the shared default."""
    parser.add_argument("--out", default=DEFAULT_OUT,
                        help="folder for the JSON (default: benchmarks/out, git-ignored; pass "
                             "benchmarks/results to record a result in the repository)")


def write_json(result: dict, name: str, out_dir: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    card = result["env"]["card"].replace(" ", "_")
    path = os.path.join(out_dir, f"{name}_{card}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    return path


def table(rows, header) -> str:
    """A fixed-width text table."""
    cells = [[str(h) for h in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def profile_steps(steps: dict, iters: int = 3) -> dict:
    """GPU side of each step (torch.profiler, after the timed rounds): time the GPU
    was busy (union of kernel intervals) against the span from the first kernel to
    the last, so idle time (the GPU waiting on the host) shows; kernels per step by
    name."""
    from torch.profiler import ProfilerActivity, profile
    report = {}
    for name, step in steps.items():
        step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                step()
                torch.cuda.synchronize()
        kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                         if e.device_type == torch.autograd.DeviceType.CUDA)
        busy, end, counts, kernel_us = 0.0, float("-inf"), {}, {}
        for start, stop, kname in kernels:
            busy += max(0.0, stop - max(start, end))
            end = max(end, stop)
            counts[kname[:120]] = counts.get(kname[:120], 0) + 1
            kernel_us[kname[:120]] = kernel_us.get(kname[:120], 0.0) + (stop - start)
        span = (kernels[-1][1] - kernels[0][0]) if kernels else 0.0
        report[name] = {"gpu_busy_ms": busy / iters / 1e3, "kernels_per_step": len(kernels) / iters,
                        "kernel_counts": {k: c / iters for k, c in counts.items()},
                        "kernel_ms": {k: t / iters / 1e3 for k, t in kernel_us.items()},
                        "span_ms": span / iters / 1e3}
    return report
