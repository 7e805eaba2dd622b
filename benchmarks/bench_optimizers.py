"""One optimizer step over the parameters of a 1B-parameter GPT shape: this package's
``te.optimizers.FusedAdam`` (AdamW mode) against ``torch.optim.AdamW(fused=True)``, and
``FusedSGD`` against ``torch.optim.SGD(fused=True)``: median step time, kernel launches
per step, and the largest difference from the torch optimizer after the timed steps.

One command (on a CUDA GPU, from the repository root; about a minute on an H100)::

    python3 benchmarks/bench_optimizers.py

The parameter set: ``--layers`` (20) GPT blocks of hidden ``--hidden`` (2048) with a
4x MLP (QKV, projection, FC1, FC2 weights and biases, two LayerNorms) and a
``--vocab`` (50304) x hidden embedding: 1.1 billion float32 parameters in 243 tensors,
as a data-parallel rank without a distributed optimizer holds them. Gradients are
fixed random tensors. Each variant gets the same parameters and gradients, runs
``--warmup`` steps, then ``--steps`` steps timed one by one with CUDA events (the
median is reported), then one step under torch.profiler to count kernel launches.
``--scale`` shrinks every dimension (for a smoke run on the CPU: ``--device cpu
--scale 0.02``, where the times are those of the CPU paths). The JSON (card, versions,
command, shapes, every step time) goes to ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "benchmarks")]

import torch  # noqa: E402

from common import add_out_argument, environment, table, write_json  # noqa: E402
from transformer_engine.pytorch.optimizers import FusedAdam, FusedSGD  # noqa: E402

LR, BETAS, EPS, WD = 1e-4, (0.9, 0.95), 1e-8, 0.1


def gpt_shapes(layers: int, hidden: int, vocab: int, scale: float) -> list:
    """The parameter shapes of a GPT of that size, each dimension times ``scale``."""
    h, v = max(8, int(hidden * scale)), max(8, int(vocab * scale))
    block = [(3 * h, h), (3 * h,), (h, h), (h,), (4 * h, h), (4 * h,), (h, 4 * h), (h,),
             (h,), (h,), (h,), (h,)]
    return [(v, h)] + block * layers + [(h,), (h,)]


def make_optimizer(name: str, params):
    if name == "torch_adamw_fused":
        return torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                                 fused=params[0].is_cuda)
    if name == "te_fused_adam":
        return FusedAdam(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adam_w_mode=True)
    if name == "te_fused_adam_capturable":
        return FusedAdam(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adam_w_mode=True,
                         capturable=True)
    if name == "torch_sgd_fused":
        return torch.optim.SGD(params, lr=LR, momentum=0.9, fused=params[0].is_cuda)
    if name == "te_fused_sgd":
        return FusedSGD(params, lr=LR, momentum=0.9)
    raise ValueError(f"unknown variant {name!r}")


REFERENCE = {"te_fused_adam": "torch_adamw_fused", "te_fused_adam_capturable": "torch_adamw_fused",
             "te_fused_sgd": "torch_sgd_fused"}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run(name: str, shapes: list, args) -> tuple:
    """Step times (ms) of variant ``name``, its kernels per step, and its parameters."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    params, grads = [], []
    for shape in shapes:
        params.append(torch.nn.Parameter(
            (torch.randn(shape, generator=gen) * 0.02).to(args.device)))
        grads.append((torch.randn(shape, generator=gen) * 1e-3).to(args.device))
    for p, g in zip(params, grads):
        p.grad = g
    opt = make_optimizer(name, params)
    for _ in range(args.warmup):
        opt.step()
    _sync(args.device)
    times = []
    for _ in range(args.steps):
        if args.device == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            opt.step()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            opt.step()
            times.append(1e3 * (time.perf_counter() - t0))
    kernels = None
    if args.device == "cuda":
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            opt.step()
            torch.cuda.synchronize()
        kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    finals = [p.detach().clone() for p in params]
    del opt, params, grads
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return times, kernels, finals


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=20)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--variants", default="torch_adamw_fused,te_fused_adam,"
                   "te_fused_adam_capturable,torch_sgd_fused,te_fused_sgd")
    p.add_argument("--name", default="bench_optimizers")
    add_out_argument(p)
    args = p.parse_args(argv)
    shapes = gpt_shapes(args.layers, args.hidden, args.vocab, args.scale)
    numel = sum(torch.Size(s).numel() for s in shapes)
    result = {"env": environment(), "config": {k: v for k, v in vars(args).items()
                                               if k not in ("out", "name")},
              "parameters": numel, "tensors": len(shapes), "rows": []}
    finals, rows = {}, []
    for name in (v for v in args.variants.split(",") if v):
        times, kernels, finals[name] = run(name, shapes, args)
        row = {"variant": name, "median_ms": statistics.median(times), "step_ms": times,
               "kernels_per_step": kernels}
        ref = REFERENCE.get(name)
        if ref in finals:
            row["max_abs_diff_vs_" + ref] = max(
                float((a - b).abs().max()) for a, b in zip(finals[name], finals[ref]))
            row["vs_reference"] = result["rows"][[r["variant"] for r in result["rows"]]
                                                 .index(ref)]["median_ms"] / row["median_ms"]
        result["rows"].append(row)
        rows.append([name, f"{row['median_ms']:.3f}", "" if kernels is None else kernels,
                     f"{row['vs_reference']:.2f}" if "vs_reference" in row else "",
                     f"{row['max_abs_diff_vs_' + ref]:.1e}" if ref in finals else ""])
        print(f"  {name}: {row['median_ms']:.3f} ms", flush=True)
    path = write_json(result, args.name, args.out)
    print(f"one optimizer step, {numel / 1e9:.2f}B float32 parameters in {len(shapes)} "
          f"tensors; {result['env']['card']}")
    print(table(rows, ["variant", "median ms", "kernels/step", "torch/this", "max |diff|"]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
