"""Host cost of the eager FP8 path: a model of many small te.Linear modules under one
``te.autocast`` per step, against the same model of torch.nn.Linear.

One command, from the repository root (``--device cpu`` on a machine without a GPU)::

    python3 benchmarks/bench_host.py --device cuda

The model is ``--modules`` (24) linear layers of ``--features`` x ``--features`` (64)
applied in sequence to ``--tokens`` (16) tokens: the compute is negligible, so a
step's time is host time (Python and the torch dispatcher). Parameters and input
are bfloat16 on CUDA, float32 on the CPU; torch runs one CPU thread (``--threads``),
so that no op waits for a second core. A step is: enter ``te.autocast`` (the FP8
variants), forward through all layers, ``loss = y.sum()``, backward, exit the
autocast (with its delayed-scaling update). Gradients are set to None between
steps, outside the timed region; on CUDA the device is synchronized there too, so
each timed step starts with an empty launch queue and is not synchronized itself.

Variants: ``nn`` (torch.nn.Linear), ``te_hp`` (te.Linear outside any autocast),
``te_delayed`` (``DelayedScaling()``), ``te_current`` (``Float8CurrentScaling()``).
Reported per variant: the median host wall time per step over all timed steps
(variants interleaved in rounds, so drift hits all alike), that time per module,
its ratio to ``nn``, and the aten ops dispatched per step (counted with a
``TorchDispatchMode``: below autograd, composite ops decomposed; independent of the
machine, the best CPU proxy of host cost) and per module.

``--baseline PATH`` times another checkout of the package (e.g. a worktree of main)
side by side: each round runs this script once for PATH and once for this tree in
fresh processes, alternating, and the table shows both. ``--te-root PATH`` imports
the package from PATH (what ``--baseline`` uses). ``--profile`` prints a cProfile of
the delayed-scaling steps (Python functions by own time) and the ops by count.
``--parts`` also times, per call, the pieces of one FP8 ``te.Linear`` forward of the same
size (the prologue, the input and weight cast, the FP8 GEMM, an empty autograd Function,
one allocation) next to the whole forward and ``torch.nn.Linear``'s; with ``--baseline``
it calls the baseline's private cast and GEMM functions, so both trees need them.

The table is printed last; the JSON (card or CPU model, versions, shapes, medians,
op counts, command) goes to ``--out`` (default ``benchmarks/out``).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_BENCH = os.path.join(_ROOT, "benchmarks")


def _te_root(argv) -> str:
    """``--te-root`` must take effect before the package is imported."""
    for i, a in enumerate(argv):
        if a == "--te-root" and i + 1 < len(argv):
            return os.path.abspath(argv[i + 1])
        if a.startswith("--te-root="):
            return os.path.abspath(a.split("=", 1)[1])
    return _ROOT


sys.path[:0] = [_te_root(sys.argv), _BENCH]

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import transformer_engine.pytorch as te  # noqa: E402
from bench_cpu_gemm import cpu_model  # noqa: E402
from common import add_out_argument, environment, table, write_json  # noqa: E402
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling  # noqa: E402

VARIANTS = ("nn", "te_hp", "te_delayed", "te_current")
RECIPES = {"te_delayed": DelayedScaling, "te_current": Float8CurrentScaling}


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched inside it, by name (autograd's backward ops
    included: the mode travels to the autograd threads)."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def build_model(variant: str, modules: int, features: int, device, dtype) -> torch.nn.Module:
    if variant == "nn":
        layers = [torch.nn.Linear(features, features, device=device, dtype=dtype)
                  for _ in range(modules)]
    else:
        layers = [te.Linear(features, features, params_dtype=dtype, device=device)
                  for _ in range(modules)]
    return torch.nn.Sequential(*layers)


class Step:
    """One training step of a variant, and what is done between timed steps."""

    def __init__(self, variant: str, modules: int, tokens: int, features: int, device, dtype):
        self.model = build_model(variant, modules, features, device, dtype)
        self.x = torch.randn(tokens, features, device=device, dtype=dtype, requires_grad=True)
        self.leaves = [self.x] + list(self.model.parameters())
        self.recipe = RECIPES[variant]() if variant in RECIPES else None
        self.device = torch.device(device)

    def __call__(self) -> None:
        ctx = (te.autocast(recipe=self.recipe) if self.recipe is not None
               else contextlib.nullcontext())
        with ctx:
            loss = self.model(self.x).sum()
            loss.backward()

    def reset(self) -> None:
        for t in self.leaves:
            t.grad = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def time_steps(step: Step, steps: int) -> list:
    """Host wall time (us) of each of ``steps`` steps."""
    out = []
    for _ in range(steps):
        step.reset()
        t0 = time.perf_counter()
        step()
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def count_ops(step: Step) -> collections.Counter:
    step.reset()
    with OpCounter() as counter:
        step()
    step.reset()
    return counter.counts


def python_profile(step: Step, steps: int, top: int) -> list:
    """cProfile of ``steps`` steps: Python functions by own time, per step (us)."""
    import cProfile
    import pstats
    prof = cProfile.Profile()
    for _ in range(steps):
        step.reset()
        prof.enable()
        step()
        prof.disable()
    rows = [(tt / steps * 1e6, ct / steps * 1e6, cc / steps,
             f"{os.path.basename(f)}:{line}({name})")
            for (f, line, name), (cc, _, tt, ct, _) in pstats.Stats(prof).stats.items()]
    rows.sort(reverse=True)
    return [{"function": r[3], "calls_per_step": r[2], "own_us_per_step": round(r[0], 2),
             "cum_us_per_step": round(r[1], 2)} for r in rows[:top]]


class _Identity(torch.autograd.Function):
    """An autograd Function that does nothing: the floor of a Python Function's call."""

    @staticmethod
    def forward(ctx, x, weight, bias, settings):
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None


def _per_call_us(fn, calls: int, device) -> float:
    """Median over 5 rounds of the host time per call (us); the queue drained between."""
    for _ in range(max(calls // 10, 10)):
        fn()
    rounds = []
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(rounds)


def forward_parts(args, device, dtype) -> dict:
    """Host time per call of the pieces of one small FP8 te.Linear forward (delayed
    scaling, in an open autocast, input requiring grad) next to the whole forward and
    torch.nn.Linear's: where a forward's host time goes."""
    from transformer_engine.pytorch import quantize
    from transformer_engine.pytorch.module import fp8_linear as te_linear
    torch.manual_seed(0)
    n, tokens = args.features, args.tokens
    layer = te.Linear(n, n, params_dtype=dtype, device=device)
    reference = torch.nn.Linear(n, n, device=device, dtype=dtype)
    x = torch.randn(tokens, n, device=device, dtype=dtype, requires_grad=True)
    x_data, w, b = x.detach(), layer.weight.detach(), layer.bias.detach()
    fp8 = torch.float8_e4m3fn
    with te.autocast(recipe=DelayedScaling()):
        layer(x)
        state = layer.fp8_meta["scaling_fwd"]
        pair = lambda transpose: quantize.cast_pair_unchecked(  # noqa: E731
            x_data, w, state.scale, fp8, 0, state.amax_history, transpose, transpose)
        (x8, _), (w8, _) = pair(False)

        def prologue():
            with layer.prepare_forward(x, None):
                pass
        parts = {
            "torch.nn.Linear forward": lambda: reference(x),
            "te.Linear forward": lambda: layer(x),
            "prepare_forward (enter + exit)": prologue,
            "input + weight cast, with transposes": lambda: pair(True),
            "input + weight cast, no transposes": lambda: pair(False),
            "FP8 GEMM with bias": lambda: te_linear._gemm(x8, w8, dtype, b, True),
            "empty autograd Function apply": lambda: _Identity.apply(x, w, b, None),
            "one torch.empty": lambda: torch.empty((tokens, n), dtype=fp8, device=device),
        }
        return {name: _per_call_us(fn, args.steps * 10, device) for name, fn in parts.items()}


def measure(args) -> dict:
    """Time and count every variant in this process; returns the raw result."""
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    steps = {v: Step(v, args.modules, args.tokens, args.features, device, dtype)
             for v in args.variants}
    for step in steps.values():
        for _ in range(args.warmup):
            step.reset()
            step()
    ops = {v: count_ops(s) for v, s in steps.items()}
    times = {v: [] for v in steps}
    for _ in range(args.rounds):
        for v, step in steps.items():
            times[v] += time_steps(step, args.steps)
    result = {"times_us": times,
              "ops": {v: dict(sorted(c.items(), key=lambda kv: -kv[1])) for v, c in ops.items()}}
    if args.profile and "te_delayed" in steps:
        result["profile_te_delayed"] = python_profile(steps["te_delayed"], args.steps, args.top)
    if args.parts:
        result["forward_parts_us"] = forward_parts(args, device, dtype)
    return result


def summarize(raw: dict, modules: int) -> dict:
    times, ops = raw["times_us"], raw["ops"]
    out = {}
    for v in times:
        med = statistics.median(times[v])
        total = sum(ops[v].values())
        out[v] = {"host_us_per_step": med, "host_us_per_module": med / modules,
                  "aten_ops_per_step": total, "aten_ops_per_module": total / modules,
                  "steps_timed": len(times[v])}
    if "nn" in out:
        for v in out:
            out[v]["ratio_to_nn"] = out[v]["host_us_per_step"] / out["nn"]["host_us_per_step"]
    return out


def _child_argv(args, root: str, rounds: int, path: str) -> list:
    options = {"--te-root": root, "--raw-json": path, "--device": args.device,
               "--threads": args.threads, "--modules": args.modules, "--tokens": args.tokens,
               "--features": args.features, "--steps": args.steps, "--warmup": args.warmup,
               "--rounds": rounds}
    argv = [sys.executable, os.path.abspath(__file__)]
    for name, value in options.items():
        argv += [name, str(value)]
    return argv + (["--parts"] if args.parts else []) + ["--variants", *args.variants]


def compare(args) -> dict:
    """Alternate fresh processes for the baseline checkout and this one."""
    roots = {"baseline": os.path.abspath(args.baseline), "this": _ROOT}
    raws = {k: {"times_us": collections.defaultdict(list), "ops": None,
                "parts": collections.defaultdict(list)} for k in roots}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "raw.json")
        for r in range(args.rounds):
            for key, root in roots.items():
                subprocess.run(_child_argv(args, root, 1, path), check=True)
                with open(path) as f:
                    raw = json.load(f)
                for v, t in raw["times_us"].items():
                    raws[key]["times_us"][v] += t
                raws[key]["ops"] = raw["ops"]
                if "forward_parts_us" in raw:
                    for name, us in raw["forward_parts_us"].items():
                        raws[key]["parts"][name].append(us)
            print(f"round {r + 1}/{args.rounds} done", flush=True)
    out = {k: {"times_us": dict(v["times_us"]), "ops": v["ops"]} for k, v in raws.items()}
    for k, v in raws.items():
        if v["parts"]:          # the median over rounds of each piece
            out[k]["forward_parts_us"] = {n: statistics.median(us) for n, us in v["parts"].items()}
    return out


def print_table(summaries: dict) -> None:
    rows = []
    for label, summary in summaries.items():
        for v, s in summary.items():
            rows.append([label, v, f"{s['host_us_per_step']:.0f}",
                         f"{s['host_us_per_module']:.1f}", f"{s.get('ratio_to_nn', 0):.2f}",
                         s["aten_ops_per_step"], f"{s['aten_ops_per_module']:.1f}"])
    print(table(rows, ["code", "variant", "host us/step", "us/module", "/ nn",
                       "aten ops/step", "ops/module"]))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--modules", type=int, default=24)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--features", type=int, default=64)
    p.add_argument("--steps", type=int, default=100, help="timed steps per variant and round")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (1: no intra-op parallelism in the host time)")
    p.add_argument("--baseline", help="another checkout of the package to time side by side")
    p.add_argument("--te-root", help="import the package from this checkout")
    p.add_argument("--raw-json", help=argparse.SUPPRESS)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--parts", action="store_true",
                   help="also time the pieces of one te.Linear forward (host us per call)")
    p.add_argument("--name", default="bench_host")
    add_out_argument(p)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    if args.raw_json:                       # a child of --baseline
        with open(args.raw_json, "w") as f:
            json.dump(measure(args), f)
        return
    if args.baseline:
        raws = compare(args)
    else:
        raws = {"this": measure(args)}
    summaries = {k: summarize(raw, args.modules) for k, raw in raws.items()}

    env = environment()
    device = torch.device(args.device)
    if device.type == "cpu":
        env["card"] = "CPU"
    env.update(cpu=cpu_model(), threads=torch.get_num_threads(), device=args.device,
               te_root=args.te_root or _ROOT)
    shape = {"modules": args.modules, "tokens": args.tokens, "features": args.features,
             "dtype": "bfloat16" if device.type == "cuda" else "float32",
             "steps": args.steps, "rounds": args.rounds, "warmup": args.warmup}
    result = {"env": env, "shape": shape, "summary": summaries,
              "ops": {k: raw["ops"] for k, raw in raws.items()}}
    if args.baseline:
        result["baseline_root"] = os.path.abspath(args.baseline)
    for k, raw in raws.items():
        if "forward_parts_us" in raw:
            result[f"forward_parts_us_{k}"] = raw["forward_parts_us"]
            print(f"\nhost us per call, pieces of one te.Linear forward ({k}):")
            for name, us in raw["forward_parts_us"].items():
                print(f"  {us:8.1f}  {name}")
        if "profile_te_delayed" in raw:
            result[f"profile_te_delayed_{k}"] = raw["profile_te_delayed"]
            print(f"\ncProfile of te_delayed ({k}), per step, by own time:")
            for r in raw["profile_te_delayed"]:
                print(f"  {r['own_us_per_step']:8.1f} us own {r['cum_us_per_step']:8.1f} cum "
                      f"{r['calls_per_step']:6.1f} calls  {r['function']}")
            for v in ("te_delayed", "te_current"):
                if v in raw["ops"]:
                    print(f"ops of {v} ({k}): {raw['ops'][v]}")
    path = write_json(result, args.name, args.out)
    print(f"\n{env['card']} ({env['cpu']}), torch {env['torch']}, {args.modules} linears "
          f"{args.features}x{args.features}, {args.tokens} tokens, {shape['dtype']}; "
          "median host time per step")
    print_table(summaries)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
