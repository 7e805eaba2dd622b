"""The host work of the CUDA path of ``bench_host.py``'s model, measured without a GPU:
the same steps on CPU tensors with the fused-kernel path forced on (``KernelConfig
interpret``) and every Triton launch replaced by a no-op, and ``torch._scaled_mm``
replaced by an allocation of its output. What remains is what the CUDA path does on
the host besides launching kernels: its Python, and the aten ops it dispatches (the
allocations and views of each cast's outputs, the GEMM wrapper's ops, the
delayed-scaling update's bookkeeping). Kernels do not run, so the values are garbage:
this counts and times the host path only; it measures neither a Triton launch nor
cuBLASLt's host cost, which come on top on a GPU.

    python3 benchmarks/bench_host_cuda_route.py [--te-root PATH] [--profile te_delayed]

Prints, per variant, the aten ops and Python function calls per step (machine-independent)
and the median host time per step against ``torch.nn.Linear`` (its ``mm`` / ``addmm`` run
for real on the CPU, so the ratio is only indicative).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys

os.environ["TRITON_INTERPRET"] = "1"        # before Triton is imported: CPU tensors allowed

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _te_root(argv) -> str:
    for i, a in enumerate(argv):
        if a == "--te-root" and i + 1 < len(argv):
            return os.path.abspath(argv[i + 1])
    return _ROOT


sys.path[:0] = [_te_root(sys.argv), os.path.join(_ROOT, "benchmarks")]

import torch  # noqa: E402

import bench_host  # noqa: E402
from transformer_engine.pytorch.kernel_config import kernel_config  # noqa: E402
from transformer_engine.pytorch.kernels import launch  # noqa: E402


def _no_launch(self, grid, num_warps, key, *args) -> None:
    """A Triton launch that does nothing (its arguments were built by the caller)."""


def _scaled_mm_output(a, b, scale_a=None, scale_b=None, bias=None, out_dtype=None,
                      use_fast_accum=False, **kwargs):
    return torch.empty(a.shape[0], b.shape[1], dtype=out_dtype, device=a.device)


def python_calls(step) -> int:
    step.reset()
    prof = cProfile.Profile()
    prof.enable()
    step()
    prof.disable()
    return sum(cc for cc, _, _, _, _ in pstats.Stats(prof).stats.values())


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--te-root", help="import the package from this checkout")
    p.add_argument("--modules", type=int, default=24)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--features", type=int, default=64)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--profile", choices=("te_delayed", "te_current"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    launch.Launcher.__call__ = _no_launch
    torch._scaled_mm = _scaled_mm_output
    with kernel_config(interpret=True, cpu_gemm="scaled_mm"):
        torch.manual_seed(0)
        steps = {v: bench_host.Step(v, args.modules, args.tokens, args.features, "cpu",
                                    torch.bfloat16)
                 for v in ("nn", "te_delayed", "te_current")}
        for step in steps.values():
            for _ in range(5):
                step.reset()
                step()
        ops = {v: bench_host.count_ops(s) for v, s in steps.items()}
        calls = {v: python_calls(s) for v, s in steps.items()}
        times = {v: [] for v in steps}
        for _ in range(args.rounds):
            for v, step in steps.items():
                times[v] += bench_host.time_steps(step, args.steps)
        if args.profile:
            for r in bench_host.python_profile(steps[args.profile], args.steps, 30):
                print(f"  {r['own_us_per_step']:8.1f} us own {r['cum_us_per_step']:8.1f} cum "
                      f"{r['calls_per_step']:6.1f} calls  {r['function']}")
    nn = statistics.median(times["nn"])
    print(f"CUDA route on the CPU, launches stubbed; {args.modules} linears "
          f"{args.features}x{args.features}, {args.tokens} tokens, bfloat16")
    for v in steps:
        med = statistics.median(times[v])
        print(f"{v:11s} aten ops/step {sum(ops[v].values()):5d}  python calls/step "
              f"{calls[v]:6d}  host us/step {med:7.0f}  / nn {med / nn:4.2f}")
        print(f"{'':11s} {dict(sorted(ops[v].items(), key=lambda kv: -kv[1]))}")


if __name__ == "__main__":
    main()
