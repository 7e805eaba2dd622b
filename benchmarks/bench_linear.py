"""te.Linear forward+backward in FP8 (delayed scaling) against torch.nn.Linear in
bf16 and torchao.float8's tensorwise recipe (compiled), with the bare-GEMM ceiling.

One command (on a Hopper GPU, from the repository root)::

    python3 benchmarks/bench_linear.py

For each shape (M tokens, K in, N out) it times, as medians of CUDA-event-timed
repeats after warm-up (L2 flushed between repeats):

- ``bf16_gemms`` / ``fp8_gemms``: the three bare GEMMs of a linear's forward and
  backward (forward, dgrad, wgrad; NOTE [GEMM vocabulary] in quantize.py) through
  ``torch.matmul`` in bf16 and ``torch._scaled_mm`` in FP8 on pre-cast operands:
  their ratio is the ceiling of any FP8 speed-up.
- ``nn_bf16``: ``torch.nn.Linear`` in bf16, forward + backward.
- ``te_fp8``: ``te.Linear`` (bf16 parameters and activations) inside
  ``te.autocast(recipe=DelayedScaling())``, forward + backward, with the delayed
  scaling updates, in the default configuration (the fused kernels of NOTE [Fused
  casts], launched as NOTE [Launch overhead] in kernels/launch.py says);
  ``te_fp8_jit``: the same with every Triton launch through Triton's JIT;
  ``te_fp8_unfused``: the same with the torch reference casts and update;
  ``te_fp8_block`` / ``te_fp8_block_emulated`` (only when named in ``--variants``):
  ``Float8BlockScaling()`` with Hopper's block-scaled GEMM / with the emulated GEMMs.
- ``torchao_fp8``: ``torchao.float8`` tensorwise, ``torch.compile``-d.
- ``te_fp8_graphed``: ``te.Linear`` captured by ``te.make_graphed_callables`` under the
  same recipe (the delayed-scaling updates inside the graphs); ``nn_bf16_graphed``:
  ``torch.nn.Linear`` captured by ``torch.cuda.make_graphed_callables``. Their ratio,
  next to the ceiling and as a fraction of it, is the second table; with it the host
  time to enqueue one eager step of ``te_fp8`` and of ``nn_bf16`` (``--no-graphs``
  leaves these out). ``--shapes graphs`` is the set of that comparison (1024^3,
  2048^3, 4096^3, 4096x4096x8192).

Before the shapes it measures the host side (nothing profiled yet, since a profiler
can slow every later launch): one step at 256x256x256, where the GPU work is
negligible, timed as above and as host wall time per step over many steps; and the
host cost of one launch of the cast kernel, through the JIT and direct.
After the shapes: a cProfile of te's tiny step (Python functions by own time) and,
with ``--profile``, a torch.profiler breakdown of the steps by kernel.

TFLOP/s = 6 M K N / time. The table is printed last; the JSON (card, versions,
shapes, medians, command) goes to ``--out`` (default ``benchmarks/results``).
``--tune`` times tile settings of the fused cast kernel.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "benchmarks")]

import torch  # noqa: E402

from common import environment, median_ms, table, write_json  # noqa: E402
from transformer_engine.pytorch import quantize  # noqa: E402
from transformer_engine.pytorch.kernel_config import get_kernel_config, kernel_config  # noqa: E402
from linear_steps import (BF16, DEFAULT_SHAPES, E4M3, GRAPH_HEADER, bare_gemms,  # noqa: E402
                          graph_columns, graph_row, host_wall_us, nn_step, parse_shapes,
                          prepare, te_step, timed, torchao_step)


def profile_steps(runs: dict, iters: int = 5) -> dict:
    """Device time per step by kernel (torch.profiler), for each named step."""
    from torch.profiler import ProfilerActivity, profile
    report = {}
    for name, run in runs.items():
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                run()
            torch.cuda.synchronize()
        kernels = []
        for e in prof.key_averages():
            t = getattr(e, "self_device_time_total", None)
            if t is None:
                t = e.self_cuda_time_total
            if t > 0 and e.device_type == torch.autograd.DeviceType.CUDA:
                kernels.append((e.key, t / iters / 1e3, e.count // iters))
        kernels.sort(key=lambda r: -r[1])
        groups = {}
        for key, ms, _ in kernels:
            groups[_category(key)] = groups.get(_category(key), 0.0) + ms
        report[name] = {"total_ms": sum(r[1] for r in kernels), "by_category_ms": groups,
                        "kernels": [{"name": k[:160], "ms_per_step": ms, "calls_per_step": c}
                                    for k, ms, c in kernels[:25]]}
    return report


def host_profile(run, iters: int = 20) -> dict:
    """Host (CPU) side of one step: torch ops per step and their self CPU time."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(5):
        run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(iters):
            run()
        torch.cuda.synchronize()
    ops = [(e.key, e.count / iters, e.self_cpu_time_total / iters) for e in prof.key_averages()]
    ops.sort(key=lambda r: -r[2])
    aten = [o for o in ops if o[0].startswith("aten::")]
    return {"aten_calls_per_step": sum(o[1] for o in aten),
            "launches_per_step": sum(o[1] for o in ops if o[0] in ("cudaLaunchKernel",
                                                                   "cuLaunchKernel",
                                                                   "cuLaunchKernelEx")),
            "top_self_cpu_us": [{"op": k[:100], "calls": c, "self_us": t} for k, c, t in ops[:25]]}


def python_profile(run, steps: int = 300, top: int = 30) -> list:
    """cProfile of ``steps`` steps: Python functions by own time, per step (us)."""
    import cProfile
    import pstats
    for _ in range(20):
        run()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        run()
    torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof).stats
    rows = [{"function": f"{os.path.basename(f)}:{line}({name})", "calls_per_step": cc / steps,
             "own_us_per_step": tt / steps * 1e6, "cum_us_per_step": ct / steps * 1e6}
            for (f, line, name), (cc, _, tt, ct, _) in stats.items()]
    rows.sort(key=lambda r: -r["own_us_per_step"])
    return rows[:top]


def launch_overhead_us(launches: int = 2000) -> dict:
    """Host cost of one launch of the cast kernel on a tiny tensor (us), through
    Triton's JIT and through the cached compiled kernel (NOTE [Launch overhead]);
    of small torch ops, for scale; and of a tiny GEMM, bf16 and FP8."""
    from transformer_engine.pytorch.kernels import casts as tk
    x = torch.randn(64, 64, device="cuda", dtype=BF16)
    scale, hist = torch.ones(1, device="cuda"), torch.zeros(4, 1, device="cuda")
    out = {}
    for name, direct in (("triton_jit", False), ("triton_direct", True)):
        with kernel_config(direct_launch=direct):
            out[name] = host_wall_us(lambda: tk.cast_transpose(
                x, scale, E4M3, amax_history=hist, transpose=True), launches)
    out["torch_add"] = host_wall_us(lambda: x.add(1), launches)
    out["torch_empty"] = host_wall_us(lambda: torch.empty(64, 64, device="cuda"), launches)
    # the GEMMs of a step: bf16 torch.mm against torch._scaled_mm (tensorwise scales)
    x8, w8 = x.to(E4M3), x.to(E4M3).t().contiguous()
    out["torch_mm"] = host_wall_us(lambda: torch.mm(x, x), launches)
    out["torch_scaled_mm"] = host_wall_us(lambda: torch._scaled_mm(
        x8, w8.t(), scale_a=scale[0], scale_b=scale[0], out_dtype=BF16), launches)
    return out


def _category(name: str) -> str:
    low = name.lower()
    if "cast_transpose_kernel" in low:
        return "fused cast+amax+transpose (ours)"
    if "_amax_kernel" in low:
        return "amax (ours)"
    if "_delayed_update_kernel" in low:
        return "delayed-scaling update (ours)"
    if any(s in low for s in ("gemm", "nvjet", "xmma", "cutlass", "sm90_", "scaled_mm")):
        return "GEMM"
    if "triton" in low:
        return "other triton (torch.compile)"
    if "elementwise" in low or "reduce" in low or "copy" in low or "fill" in low:
        return "torch elementwise/reduce/copy"
    return "other"


def tune_cast(timer) -> list:
    """GB/s of the fused cast (bf16 8192x8192 -> FP8 + FP8^T + amax) per tile setting,
    and of a plain device copy (the bandwidth ceiling)."""
    from transformer_engine.pytorch.kernels import casts as tk
    x = torch.randn(8192, 8192, device="cuda", dtype=BF16)
    scale, slot = torch.ones(1, device="cuda"), torch.zeros(1, device="cuda")
    moved = x.numel() * (2 + 1 + 1)
    rows = [{"config": "torch copy (read+write bf16)",
             "GB/s": 2 * x.numel() * 2 / timer(lambda: x.clone()) / 1e6}]
    for cfg in [(32, 128, 4), (64, 64, 4), (64, 128, 4), (64, 128, 8), (32, 256, 8),
                (128, 64, 8)]:
        old = tk._set_tiles(*cfg)
        try:
            ms = timer(lambda: tk.cast_transpose(x, scale, E4M3, amax_history=slot,
                                                 transpose=True))
        finally:
            tk._set_tiles(*old)
        rows.append({"config": f"tile {cfg[0]}x{cfg[1]} warps {cfg[2]}", "ms": ms,
                     "GB/s": moved / ms / 1e6})
    with kernel_config(fused=False):
        ms = timer(lambda: quantize.cast_transpose_to_fp8(x, scale, E4M3, amax_history=slot,
                                                          transpose=True))
    rows.append({"config": "torch reference ops", "ms": ms, "GB/s": moved / ms / 1e6})
    return rows


TE_VARIANTS = {"te_fp8": "default", "te_fp8_jit": "jit", "te_fp8_unfused": "unfused",
               "te_fp8_block": "block", "te_fp8_block_emulated": "block_emulated"}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", type=parse_shapes, default=DEFAULT_SHAPES,
                   help="comma-separated MxKxN, or 'default' (12 shapes from 4096^3 to "
                        "16384x8192x8192) or 'graphs' (1024^3 to 4096x4096x8192)")
    p.add_argument("--no-torchao", action="store_true")
    p.add_argument("--no-graphs", action="store_true", help="leave out the CUDA-graph columns")
    p.add_argument("--variants", default="te_fp8,te_fp8_jit,te_fp8_unfused",
                   help=f"te variants to time, of {sorted(TE_VARIANTS)}")
    p.add_argument("--profile", type=parse_shapes, default=[], help="MxKxN to profile by kernel")
    p.add_argument("--tune", action="store_true")
    p.add_argument("--rep-ms", type=float, default=300)
    p.add_argument("--out", default=os.path.join(_ROOT, "benchmarks", "results"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_linear.py: needs a CUDA GPU")
    variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in variants if v not in TE_VARIANTS]
    if bad or "te_fp8" not in variants:
        raise SystemExit(f"bench_linear.py: --variants must include te_fp8 and name only "
                         f"{sorted(TE_VARIANTS)}, got {args.variants!r}")
    timer = lambda fn: median_ms(fn, rep_ms=args.rep_ms)  # noqa: E731
    env = environment()
    torchao_error = None
    if not args.no_torchao:
        try:
            import torchao
            env["torchao"] = torchao.__version__
        except Exception as err:  # report exactly why it cannot run
            torchao_error = f"{type(err).__name__}: {err}"
            env["torchao"] = None
    use_torchao = not args.no_torchao and torchao_error is None
    from transformer_engine.pytorch.kernels import casts as triton_kernels
    result = {"env": env, "shapes": [list(s) for s in args.shapes], "results": [],
              "torchao_error": torchao_error,
              "kernel_config": dataclasses.asdict(get_kernel_config()),
              "direct_launch_supported": triton_kernels.direct_launch_supported(
                  env.get("triton"))}

    # ---- host side first: no profiler has run yet --------------------------------
    tiny = {}
    makers = {"nn_bf16": (nn_step, {})}
    makers.update({v: (te_step, {"variant": TE_VARIANTS[v]}) for v in variants})
    if use_torchao:
        makers["torchao_fp8"] = (torchao_step, {})
    for name, (make, kw) in makers.items():
        run = prepare(make, 256, 256, 256, **kw)
        tiny[name] = {"event_ms": timer(run), "host_wall_us": host_wall_us(run)}
    result["tiny_256"] = tiny
    result["launch_overhead_us"] = launch_overhead_us()
    print("host side at 256x256x256 (GPU work negligible): " + ", ".join(
        f"{k} {v['host_wall_us']:.0f} us/step" for k, v in tiny.items()), flush=True)
    print("one launch (host us): " + ", ".join(
        f"{k} {v:.1f}" for k, v in result["launch_overhead_us"].items()), flush=True)

    if args.tune:
        result["tune_cast"] = tune_cast(timer)

    rows, graph_rows = [], []
    for (m, k, n) in args.shapes:
        t0 = time.time()
        r = {"M": m, "K": k, "N": n}
        r.update(bare_gemms(m, k, n, timer))
        r["nn_bf16"], _ = timed(nn_step, timer, m, k, n)
        for v in variants:
            r[v], _ = timed(te_step, timer, m, k, n, variant=TE_VARIANTS[v])
        if use_torchao:
            try:
                r["torchao_fp8"], _ = timed(torchao_step, timer, m, k, n)
            except Exception as err:
                torchao_error = result["torchao_error"] = f"{type(err).__name__}: {err}"[:2000]
                use_torchao = False
        r["ceiling_fp8_over_bf16"] = r["bf16_gemms"] / r["fp8_gemms"]
        if not args.no_graphs:
            r.update(graph_columns(m, k, n, timer, r["ceiling_fp8_over_bf16"]))
        flops = 6.0 * m * k * n
        r["tflops"] = {key: flops / (r[key] * 1e9) for key in
                       ["bf16_gemms", "fp8_gemms", "nn_bf16", "torchao_fp8", "te_fp8_graphed",
                        "nn_bf16_graphed"] + variants if key in r}
        r["te_over_nn"] = r["nn_bf16"] / r["te_fp8"]
        if "torchao_fp8" in r:
            r["te_over_torchao"] = r["torchao_fp8"] / r["te_fp8"]
        r["seconds"] = time.time() - t0
        result["results"].append(r)
        print(f"{m}x{k}x{n}: " + ", ".join(f"{key} {r[key]:.3f} ms" for key in
              ["fp8_gemms", "bf16_gemms", "nn_bf16", "torchao_fp8"] + variants if key in r),
              flush=True)
        tf = r["tflops"]
        rows.append([f"{m}x{k}x{n}", f"{tf['bf16_gemms']:.0f}", f"{tf['fp8_gemms']:.0f}",
                     f"{tf['nn_bf16']:.0f}", f"{tf['te_fp8']:.0f}",
                     f"{tf.get('te_fp8_jit', float('nan')):.0f}",
                     f"{tf.get('te_fp8_unfused', float('nan')):.0f}",
                     f"{tf.get('torchao_fp8', float('nan')):.0f}",
                     f"{r['ceiling_fp8_over_bf16']:.2f}", f"{r['te_over_nn']:.2f}",
                     f"{r.get('te_over_torchao', float('nan')):.2f}"])
        if "te_fp8_graphed" in r:
            graph_rows.append(graph_row(r))
        write_json(result, "bench_linear", args.out)   # keep partial results

    # ---- profilers last ------------------------------------------------------------
    result["python_profile_te_256"] = python_profile(prepare(te_step, 256, 256, 256))
    result["host_profile_te_256"] = host_profile(prepare(te_step, 256, 256, 256))
    if args.profile:
        result["profile"] = {}
        for (m, k, n) in args.profile:
            runs = {"te_fp8": prepare(te_step, m, k, n), "nn_bf16": prepare(nn_step, m, k, n)}
            if use_torchao:
                runs["torchao_fp8"] = prepare(torchao_step, m, k, n)
            result["profile"][f"{m}x{k}x{n}"] = profile_steps(runs)

    path = write_json(result, "bench_linear", args.out)
    print(f"\nwrote {path}")
    if torchao_error:
        print(f"torchao could not run: {torchao_error}")
    if "tune_cast" in result:
        print(table([[c["config"], f"{c.get('ms', float('nan')):.4f}", f"{c['GB/s']:.0f}"]
                     for c in result["tune_cast"]], ["cast 8192x8192 bf16", "ms", "GB/s"]))
    for shape, prof in result.get("profile", {}).items():
        for name, rep in prof.items():
            cats = ", ".join(f"{c} {ms:.3f}" for c, ms in sorted(rep["by_category_ms"].items(),
                                                                 key=lambda kv: -kv[1]))
            print(f"profile {shape} {name}: {rep['total_ms']:.3f} ms/step on the GPU: {cats}")
    hp = result["host_profile_te_256"]
    print(f"te step at 256^3: {hp['aten_calls_per_step']:.0f} aten calls, "
          f"{hp['launches_per_step']:.0f} launches; Python own time per step: " + ", ".join(
              f"{r['function']} {r['own_us_per_step']:.0f}us"
              for r in result["python_profile_te_256"][:10]))
    print(f"\nte.Linear fwd+bwd, TFLOP/s (6MKN/t), {env['card']}, torch {env['torch']}, "
          f"triton {env['triton']}, torchao {env.get('torchao')}")
    print(table(rows, ["MxKxN", "bf16 GEMMs", "fp8 GEMMs", "nn bf16", "te fp8", "te jit",
                       "te unfused", "torchao", "ceiling", "te/nn", "te/ao"]))
    if graph_rows:
        print("\nCUDA graphs: ms per step (graphed te FP8 via te.make_graphed_callables, graphed "
              "nn bf16 via torch.cuda.make_graphed_callables); host us to enqueue an eager step")
        print(table(graph_rows, GRAPH_HEADER))


if __name__ == "__main__":
    main()
