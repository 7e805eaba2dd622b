"""Step time and peak activation memory of a stack of te.TransformerLayer with and
without activation checkpointing, in FP8 (delayed scaling) and in BF16.

One command (on a Hopper GPU, from the repository root)::

    python3 benchmarks/bench_checkpoint.py

A step is forward + backward of ``--layers`` layers (hidden 4096, FFN 4x, 32
heads, sequence 2048, dropout 0), each layer checkpointed on its own. Modes:

- ``none``: no checkpointing;
- ``te_reentrant`` / ``te_nonreentrant``: ``te.checkpoint(layer, x, use_reentrant=...)``;
- ``..._nobook``: the same with only the FP8 recompute bookkeeping disabled (the
  stash of each module's scale/amax history in phase 1 and its swap-in for the
  recompute replaced by no-ops), to measure what that bookkeeping costs;
- ``torch_checkpoint`` (BF16 model): ``torch.utils.checkpoint.checkpoint``
  (non-reentrant, as PyTorch recommends);
- ``forward``: a training forward alone (graph dropped), the cost a full
  recompute should stay under.

Medians of CUDA-event-timed steps after warm-up, the modes of one precision
timed round-robin (one step of each per round). The bookkeeping overhead is the
median over rounds of the paired difference ``(with - without) / without`` of
steps of the same round, with its interquartile range, so that drift between
rounds cancels. As that difference is noisy at the 1% level, the bookkeeping is also
bounded from above by accounting: the host time spent inside it (timers around exactly
what ``_nobook`` removes) plus, with ``--profile``, the GPU time of the kernels it
adds, over the step time (*bound*). Peak activation memory is the
peak allocated during a step minus what was allocated before it (parameters,
gradients, inputs). The table is printed last; the JSON goes to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import time
import types

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "benchmarks")]

import torch  # noqa: E402
import torch.utils.checkpoint as torch_checkpoint  # noqa: E402

import transformer_engine.pytorch as te  # noqa: E402
from common import (add_out_argument, environment, profile_steps, table,  # noqa: E402
                    write_json)
from transformer_engine.common.recipe import DelayedScaling  # noqa: E402
from transformer_engine.pytorch import amax_update as update_module  # noqa: E402
from transformer_engine.pytorch.fp8 import (RECOMPUTE_STASH_KEY,  # noqa: E402
                                            FP8GlobalStateManager)

_HOOKS = ("copy_forward_fp8_meta_tensors_for_recompute",
          "get_old_fp8_meta_tensors_for_recompute", "restore_fp8_meta_tensors")


@contextlib.contextmanager
def no_fp8_recompute_bookkeeping():
    """Replace the three recompute hooks by no-ops that keep only the autocast
    session (so the backward still updates scales): no stash snapshots (so nothing to
    copy at the update), no frame lookups, no swap. For timing only: the recompute then
    uses the live scales."""
    saved = {name: FP8GlobalStateManager.__dict__[name] for name in _HOOKS}

    def copy(fp8_meta):
        fp8_meta["_bench_session"] = FP8GlobalStateManager.current_session()

    def get_old(fp8_meta):
        # what the module reads after this hook (the hooks return nothing, as TE's)
        fp8_meta[RECOMPUTE_STASH_KEY] = types.SimpleNamespace(
            session=fp8_meta.get("_bench_session"), weights={})

    def restore(fp8_meta):
        fp8_meta.pop(RECOMPUTE_STASH_KEY, None)
    for name, fn in zip(_HOOKS, (copy, get_old, restore)):
        setattr(FP8GlobalStateManager, name, staticmethod(fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(FP8GlobalStateManager, name, fn)


@contextlib.contextmanager
def timed_fp8_recompute_bookkeeping(seconds: list):
    """Time (host, ``time.perf_counter``) everything `no_fp8_recompute_bookkeeping`
    removes: the three recompute hooks and the copy-on-write copy at the update;
    ``seconds[0]`` accumulates. Bounds the bookkeeping's step-time cost from above
    (with its GPU kernels) without depending on step-to-step noise."""
    saved = {name: FP8GlobalStateManager.__dict__[name] for name in _HOOKS}
    saved_copy = update_module.copy_before_write

    def timed(fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[0] += time.perf_counter() - t0
        return wrapper
    for name in saved:
        setattr(FP8GlobalStateManager, name, staticmethod(timed(getattr(FP8GlobalStateManager, name))))
    update_module.copy_before_write = timed(saved_copy)
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(FP8GlobalStateManager, name, method)
        update_module.copy_before_write = saved_copy


def bookkeeping_host_ms(step, steps: int = 10) -> float:
    """Host time per step spent in the FP8 recompute bookkeeping (ms)."""
    seconds = [0.0]
    gc.collect()
    gc.disable()      # as in the timed rounds: no collection inside a timed hook
    try:
        with timed_fp8_recompute_bookkeeping(seconds):
            for _ in range(steps):
                step()
        torch.cuda.synchronize()
    finally:
        gc.enable()
    return 1e3 * seconds[0] / steps


def run_layers(layers, x, mode):
    for layer in layers:
        if mode == "none" or mode == "forward":
            x = layer(x)
        elif mode.startswith("te_"):
            x = te.checkpoint(layer, x, use_reentrant=mode.startswith("te_reentrant"))
        elif mode == "torch_checkpoint":
            x = torch_checkpoint.checkpoint(layer, x, use_reentrant=False)
        else:
            raise ValueError(f"bench_checkpoint: unknown mode {mode!r}")
    return x


def make_step(layers, x, dy, mode, fp8):
    """One training step of ``mode``; each call appends the host time (ms) its forward
    and its backward took to enqueue to ``step.host_ms`` (no sync inside: when the
    host is slower than the GPU, these approach the step time)."""
    recipe = DelayedScaling()
    book = no_fp8_recompute_bookkeeping if mode.endswith("_nobook") else contextlib.nullcontext

    def step():
        t0 = time.perf_counter()
        with book():
            with te.autocast(enabled=fp8, recipe=recipe):
                out = run_layers(layers, x, mode)
            t1 = time.perf_counter()
            if mode != "forward":
                out.backward(dy)
        t2 = time.perf_counter()
        step.host_ms.append((1e3 * (t1 - t0), 1e3 * (t2 - t1)))
    step.host_ms = []
    return step


def measure(steps: dict, warmup: int, iters: int) -> dict:
    """Time the steps round-robin (one step of each mode per round), so that drift
    of clocks or host load hits every mode alike; returns per mode the median step
    time, the largest peak activation memory and all times."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    torch.cuda.synchronize()
    for step in steps.values():
        step.host_ms.clear()
    times = {name: [] for name in steps}
    peaks = {name: 0 for name in steps}
    gc.collect()
    gc.disable()      # a collection inside one timed step would show as noise
    try:
        _rounds(steps, iters, times, peaks)
    finally:
        gc.enable()
    return {name: {"ms": statistics.median(t), "peak_bytes": peaks[name], "times_ms": t,
                   "host_fwd_ms": statistics.median(h[0] for h in steps[name].host_ms),
                   "host_bwd_ms": statistics.median(h[1] for h in steps[name].host_ms)}
            for name, t in times.items()}


def extra_kernel_ms(a: dict, b: dict) -> float:
    """GPU time per step of the kernel launches profile ``a`` has beyond ``b`` (by name:
    the extra launches at the mean duration of that kernel in ``a``)."""
    total = 0.0
    for name, count in a["kernel_counts"].items():
        extra = count - b["kernel_counts"].get(name, 0)
        if extra > 0:
            total += a["kernel_ms"][name] * extra / count
    return total


def kernel_count_diff(a: dict, b: dict, top: int = 12) -> list:
    """Kernels whose per-step count differs most between profiles ``a`` and ``b``."""
    names = set(a["kernel_counts"]) | set(b["kernel_counts"])
    diff = [(n, a["kernel_counts"].get(n, 0) - b["kernel_counts"].get(n, 0)) for n in names]
    return sorted((d for d in diff if d[1]), key=lambda d: -abs(d[1]))[:top]


def _rounds(steps: dict, iters: int, times: dict, peaks: dict) -> None:
    for _ in range(iters):
        for name, step in steps.items():
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end))
            peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated() - before)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--profile", action="store_true",
                   help="after timing, profile one step of each mode on the GPU (busy vs idle)")
    p.add_argument("--name", default="bench_checkpoint", help="JSON file name prefix")
    add_out_argument(p)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_checkpoint.py: needs a CUDA GPU")
    torch.manual_seed(0)
    h = args.hidden
    layers = [te.TransformerLayer(h, 4 * h, args.heads, hidden_dropout=0.0,
                                  attention_dropout=0.0, params_dtype=torch.bfloat16,
                                  device="cuda") for _ in range(args.layers)]
    x = torch.randn(args.seq, args.batch, h, device="cuda", dtype=torch.bfloat16,
                    requires_grad=True)
    dy = torch.randn_like(x)
    env = environment()
    config = {k: getattr(args, k) for k in ("layers", "hidden", "seq", "batch", "heads")}
    config["ffn_hidden"] = 4 * h
    result = {"env": env, "config": config, "results": {}}
    plan = {"fp8": ["forward", "none", "te_reentrant", "te_reentrant_nobook",
                    "te_nonreentrant", "te_nonreentrant_nobook"],
            "bf16": ["forward", "none", "te_reentrant", "te_nonreentrant", "torch_checkpoint"]}
    for precision, modes in plan.items():
        steps = {f"{precision}/{mode}": make_step(layers, x, dy, mode, fp8=precision == "fp8")
                 for mode in modes}
        result["results"].update(measure(steps, args.warmup, args.iters))
        for key in steps:
            if key.startswith("fp8/te_") and not key.endswith("_nobook"):
                result["results"][key]["bookkeeping_host_ms"] = bookkeeping_host_ms(steps[key])
        if args.profile:
            result.setdefault("profile", {}).update(profile_steps(steps))
        for key in steps:
            r = result["results"][key]
            print(f"{key}: {r['ms']:.2f} ms, peak activations {r['peak_bytes'] / 2**30:.2f} GiB",
                  flush=True)
        write_json(result, args.name, args.out)
    rows = []
    res = result["results"]
    for key, r in res.items():
        precision, mode = key.split("/")
        none, fwd = res[f"{precision}/none"], res[f"{precision}/forward"]
        extra = (r["ms"] - none["ms"]) / fwd["ms"] if mode not in ("none", "forward") else None
        book = bound = None
        if mode.endswith("_nobook"):
            with_key = key.replace("_nobook", "")
            bound_ms = res[with_key]["bookkeeping_host_ms"]
            if with_key in result.get("profile", {}):
                r["bookkeeping_gpu_ms"] = extra_kernel_ms(result["profile"][with_key],
                                                          result["profile"][key])
                bound_ms += r["bookkeeping_gpu_ms"]
            bound = r["bookkeeping_bound"] = bound_ms / res[with_key]["ms"]
            with_book = res[key.replace("_nobook", "")]["times_ms"]
            paired = sorted((a - b) / b for a, b in zip(with_book, r["times_ms"]))
            book = statistics.median(paired)
            q = statistics.quantiles(paired, n=4)
            r["bookkeeping_overhead"] = book
            r["bookkeeping_overhead_iqr"] = [q[0], q[2]]
        r["extra_over_forward"] = extra
        r["memory_ratio"] = r["peak_bytes"] / none["peak_bytes"]
        rows.append([key, f"{r['ms']:.2f}", f"{r['host_fwd_ms']:.1f}/{r['host_bwd_ms']:.1f}",
                     f"{r['ms'] / none['ms']:.3f}",
                     "" if extra is None else f"{extra:.2f}",
                     f"{r['peak_bytes'] / 2**30:.2f}", f"{r['memory_ratio']:.3f}",
                     "" if book is None else
                     f"{100 * book:+.2f}% [{100 * q[0]:+.1f}, {100 * q[2]:+.1f}]",
                     "" if bound is None else f"{100 * bound:.2f}%"])
    for key, prof in result.get("profile", {}).items():
        print(f"profile {key}: GPU busy {prof['gpu_busy_ms']:.2f} ms of "
              f"{res[key]['ms']:.2f} ms per step, {prof['kernels_per_step']:.0f} kernels")
    profiles = result.get("profile", {})
    for a, b in (("fp8/te_nonreentrant", "fp8/te_reentrant"), ("fp8/te_reentrant", "fp8/none")):
        if a in profiles and b in profiles:
            print(f"kernels per step, {a} minus {b}:")
            for kname, d in kernel_count_diff(profiles[a], profiles[b]):
                print(f"  {d:+.0f}  {kname}")
    path = write_json(result, args.name, args.out)
    print(f"\nwrote {path}")
    print(f"\n{args.layers} x te.TransformerLayer(hidden {h}, ffn {4 * h}, heads {args.heads}), "
          f"seq {args.seq}, batch {args.batch}, bf16 params; {env['card']}, torch {env['torch']}")
    print(table(rows, ["precision/mode", "step ms", "host f/b ms", "vs none", "extra/fwd",
                       "peak act GiB", "mem ratio", "bookkeeping [IQR]", "bound"]))


if __name__ == "__main__":
    main()
