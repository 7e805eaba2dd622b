"""Print the README's performance tables (reStructuredText) from recorded results.

    python3 benchmarks/summarize.py [--card NVIDIA_H200]

Reads ``benchmarks/results/bench_linear_<card>.json``, ``bench_checkpoint_<card>.json``
and ``bench_checkpoint_batch4_<card>.json`` (written by the two benchmark scripts) and prints
each table with the run it came from, so that the README quotes the JSON exactly.
Runs anywhere (no GPU needed).
"""

from __future__ import annotations

import argparse
import json
import os

_RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def rst_table(header, rows) -> str:
    cells = [[str(h) for h in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    rule = "  ".join("=" * w for w in widths)
    fmt = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([rule, fmt(cells[0]), rule] + [fmt(r) for r in cells[1:]] + [rule])


def _run(env: dict) -> str:
    return (f"{env['card']}, torch {env['torch']}, Triton {env.get('triton')}"
            + (f", torchao {env['torchao']}" if env.get("torchao") else "")
            + f"; ``{env['command']}``, {env['date_utc']}")


def linear_tables(r: dict) -> str:
    out = [f"te.Linear forward+backward, TFLOP/s = 6MKN / median step time ({_run(r['env'])})", ""]
    rows = []
    for x in r["results"]:
        tf = x["tflops"]
        rows.append([f"{x['M']}x{x['K']}x{x['N']}", f"{tf['bf16_gemms']:.0f}", f"{tf['fp8_gemms']:.0f}",
                     f"{tf['nn_bf16']:.0f}", f"{tf['te_fp8']:.0f}",
                     f"{tf['te_fp8_jit']:.0f}" if "te_fp8_jit" in tf else "",
                     f"{tf['te_fp8_unfused']:.0f}" if "te_fp8_unfused" in tf else "",
                     f"{tf['torchao_fp8']:.0f}" if "torchao_fp8" in tf else "",
                     f"{x['ceiling_fp8_over_bf16']:.2f}", f"{x['te_over_nn']:.2f}",
                     f"{x['te_over_torchao']:.2f}" if "te_over_torchao" in x else ""])
    out.append(rst_table(["M x K x N", "bf16 GEMMs", "FP8 GEMMs", "nn bf16", "te FP8", "te JIT",
                          "te unfused", "torchao", "ceiling", "te/nn", "te/ao"], rows))
    tiny = r.get("tiny_256", {})
    if tiny:
        out += ["", "Host time of one step at 256x256x256 (GPU work negligible), "
                "us: " + ", ".join(f"{k} {v['host_wall_us']:.0f}" for k, v in tiny.items())]
    if "launch_overhead_us" in r:
        out.append("Host time of one cast call (3 allocations + 1 launch), us: " + ", ".join(
            f"{k} {v:.1f}" for k, v in r["launch_overhead_us"].items()))
    for shape, prof in r.get("profile", {}).items():
        for name, rep in prof.items():
            cats = ", ".join(f"{c} {ms:.3f}" for c, ms in sorted(rep["by_category_ms"].items(),
                                                                 key=lambda kv: -kv[1]))
            out.append(f"GPU time per step, {shape} {name}: {rep['total_ms']:.3f} ms ({cats})")
    return "\n".join(out)


def checkpoint_table(r: dict) -> str:
    c = r["config"]
    out = [f"{c['layers']} x te.TransformerLayer (hidden {c['hidden']}, FFN {c['ffn_hidden']}, "
           f"{c['heads']} heads), seq {c['seq']}, batch {c['batch']} ({_run(r['env'])})", ""]
    rows = []
    for key, x in r["results"].items():
        book = x.get("bookkeeping_overhead")
        iqr = x.get("bookkeeping_overhead_iqr")
        none = r["results"][key.split("/")[0] + "/none"]
        host = (f"{x['host_fwd_ms']:.1f}/{x['host_bwd_ms']:.1f}" if "host_fwd_ms" in x else "")
        bound = x.get("bookkeeping_bound")
        rows.append([key, f"{x['ms']:.1f}", host, f"{x['ms'] / none['ms']:.3f}",
                     "" if x.get("extra_over_forward") is None else f"{x['extra_over_forward']:.2f}",
                     f"{x['peak_bytes'] / 2 ** 30:.2f}", f"{x['memory_ratio']:.3f}",
                     "" if book is None else
                     f"{100 * book:+.1f}% [{100 * iqr[0]:+.1f}, {100 * iqr[1]:+.1f}]",
                     "" if bound is None else f"{100 * bound:.2f}%"])
    out.append(rst_table(["precision/mode", "step ms", "host f/b ms", "vs none", "extra/fwd",
                          "peak act GiB", "act. ratio", "bookkeeping [IQR]", "bound"], rows))
    profiles = r.get("profile", {})
    if profiles:
        out.append("")
        out.append("GPU busy per step (ms, union of kernel intervals, torch.profiler): " + ", ".join(
            f"{k} {p['gpu_busy_ms']:.1f}" for k, p in profiles.items()))
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--card", default="NVIDIA_H200")
    args = p.parse_args(argv)
    for name, fn in (("bench_linear", linear_tables), ("bench_checkpoint", checkpoint_table),
                     ("bench_checkpoint_batch4", checkpoint_table)):
        path = os.path.join(_RESULTS, f"{name}_{args.card}.json")
        if os.path.exists(path):
            with open(path) as f:
                print(fn(json.load(f)), end="\n\n")
        else:
            print(f"({path} not found)\n")


if __name__ == "__main__":
    main()
