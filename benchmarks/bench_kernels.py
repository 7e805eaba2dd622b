"""The fused producer kernels against their unfused equivalents and against the floor:
the bytes a producer must move, at the card's measured copy bandwidth.

One command (on a CUDA GPU, from the repository root)::

    python3 benchmarks/bench_kernels.py

For each hidden size (``--hidden``, default 1024,2048,4096) and ``--tokens`` rows
(4096: seq 2048 x batch 2), in bfloat16, the producers of 4 x te.TransformerLayer:
the normalization in front of QKV and FC1 (LayerNorm, [tokens, hidden]), the
activation in front of FC2 (gelu, [tokens, 4 hidden]; swiglu reads [tokens, 8
hidden]) and its gradient in front of FC1's backward (with the bias gradient), and the
plain current-scaling cast (of [tokens, hidden]); each under delayed and current
scaling. Timed (median of CUDA-event-timed repeats, L2 flushed between them:
``triton.testing.do_bench``):

- ``fused``: the producer's kernel writing the FP8 copy, its transpose and the amax
  (kernels/norm_cast.py, act_cast.py, dact_cast.py, casts.current_cast);
- ``unfused``: today's separate path: torch's op (``normalize``, ``activate``, the
  autograd backward of ``activate`` plus the bias-gradient sum), then the fused cast
  of its output (`quantize.cast_transpose_to_fp8` / ``current_scaling_cast``); for the
  plain current-scaling cast, the Triton amax, ``current_scale`` in torch ops and the
  cast (the path before the two-launch cast);
- ``floor``: the bytes the fused kernel cannot avoid moving (read every input once,
  write the FP8 copy and its transpose, plus a second read of the input for current
  scaling, which needs the amax before it can cast, where the input does not fit in
  L2), divided by the copy bandwidth (``--copy-mib`` of device-to-device copy, read +
  write bytes over time). The byte counts per producer are in docs/fused_kernels.md.

Printed: a table per run (ms, and fused time as a fraction of the floor); the JSON
goes to ``--out`` (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "benchmarks")]

import torch  # noqa: E402

from common import environment, median_ms, table, write_json  # noqa: E402
from transformer_engine.pytorch import quantize  # noqa: E402
from transformer_engine.pytorch.kernel_config import kernel_config  # noqa: E402
from transformer_engine.pytorch.module.layernorm import normalize  # noqa: E402
from transformer_engine.pytorch.module.layernorm_mlp import ACTIVATIONS, activate  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
BF16 = torch.bfloat16


def copy_bandwidth(mib: int, timer) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write bytes over time)."""
    src = torch.empty(mib << 20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms * 1e-3)


def _scaling(recipe: str, slots: int = 3):
    if recipe == "delayed":
        return {"scale": torch.full((slots,), 2.0, device="cuda"), "index": 0,
                "amax_history": torch.zeros(4, slots, device="cuda")}
    return {"power_2_scale": False, "amax_epsilon": 0.0,
            "non_finite": torch.zeros((), dtype=torch.int32, device="cuda")}


def _cast(v, recipe, dtype, scaling):
    """Today's separate cast of a producer's output (fused cast kernel)."""
    if recipe == "delayed":
        return quantize.cast_transpose_to_fp8(v, scaling["scale"], dtype, index=0,
                                              amax_history=scaling["amax_history"],
                                              transpose=True)
    return quantize.current_scaling_cast(v, dtype, False, 0.0, scaling["non_finite"], True, True)


def _floor_bytes(reads: int, writes: int, recipe: str, l2_bytes: int) -> int:
    """Bytes a producer must move: its reads (twice for current scaling, whose cast
    needs the amax first, unless they fit in L2) and writes."""
    again = reads if (recipe == "current" and reads > l2_bytes) else 0
    return reads + again + writes


def norm_case(tokens, hidden, recipe):
    from transformer_engine.pytorch.kernels import norm_cast
    x = torch.randn(tokens, hidden, device="cuda", dtype=BF16)
    w = torch.ones(hidden, device="cuda", dtype=BF16)
    b = torch.zeros(hidden, device="cuda", dtype=BF16)
    s = _scaling(recipe)

    def fused():
        norm_cast.norm_cast(x, w, b, "LayerNorm", 1e-5, False, BF16, E4M3, transpose=True, **s)

    def unfused():
        _cast(normalize(x, w, b, "LayerNorm", 1e-5, False), recipe, E4M3, s)
    n = tokens * hidden
    return fused, unfused, 2 * n + 4 * hidden, 2 * n + 8 * tokens


def act_case(tokens, hidden, recipe, activation):
    from transformer_engine.pytorch.kernels import act_cast
    gated = ACTIVATIONS[activation][1]
    f = 4 * hidden
    x = torch.randn(tokens, 2 * f if gated else f, device="cuda", dtype=BF16)
    s = _scaling(recipe)

    def fused():
        act_cast.act_cast(x, activation, E4M3, transpose=True, **s)

    def unfused():
        _cast(activate(x, activation), recipe, E4M3, s)
    return fused, unfused, 2 * x.numel(), 2 * tokens * f


def dact_case(tokens, hidden, recipe, activation):
    from transformer_engine.pytorch.kernels import dact_cast
    gated = ACTIVATIONS[activation][1]
    f = 4 * hidden
    x = torch.randn(tokens, 2 * f if gated else f, device="cuda", dtype=BF16)
    dy = torch.randn(tokens, f, device="cuda", dtype=BF16)
    x_req = x.clone().requires_grad_()
    y = activate(x_req, activation)
    s = _scaling(recipe)

    def fused():
        dact_cast.dact_cast(x, dy, activation, E5M2, transpose=True, dbias_dtype=BF16, **s)

    def unfused():
        (dx,) = torch.autograd.grad(y, x_req, dy, retain_graph=True)
        _cast(dx, recipe, E5M2, s)
        dx.sum(0)
    width = x.shape[1]
    return fused, unfused, 2 * (x.numel() + dy.numel()), 2 * tokens * width + 4 * width


def current_cast_case(tokens, hidden, recipe):
    from transformer_engine.pytorch.kernels import casts
    x = torch.randn(tokens, hidden, device="cuda", dtype=BF16)
    counter = torch.zeros((), dtype=torch.int32, device="cuda")

    def fused():
        casts.current_cast(x, E4M3, False, 0.0, counter, True, True)

    def unfused():      # the path before the two-launch cast: amax, scale in torch, cast
        scale = quantize.current_scale(casts.amax(x), E4M3, False, 0.0, non_finite=counter)
        casts.cast_transpose(x, scale, E4M3, transpose=True)
    n = tokens * hidden
    return fused, unfused, 2 * n, 2 * n


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", default="1024,2048,4096")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--activations", default="gelu,swiglu")
    p.add_argument("--copy-mib", type=int, default=1024)
    p.add_argument("--rep-ms", type=float, default=100)
    p.add_argument("--name", default="bench_kernels", help="the JSON file's name (before the card)")
    p.add_argument("--out", default=os.path.join(_ROOT, "benchmarks", "results"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels.py: needs a CUDA GPU")
    timer = lambda fn: median_ms(fn, warmup_ms=20, rep_ms=args.rep_ms)  # noqa: E731
    bandwidth = copy_bandwidth(args.copy_mib, timer)
    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    result = {"env": environment(), "copy_GBps": bandwidth / 1e9, "tokens": args.tokens,
              "rows": []}
    rows = []
    activations = [a for a in args.activations.split(",") if a]
    with kernel_config(fused=True, fused_producers=True):
        for hidden in (int(h) for h in args.hidden.split(",")):
            cases = [("layernorm", lambda r, h=hidden: norm_case(args.tokens, h, r)),
                     ("current cast", lambda r, h=hidden: current_cast_case(args.tokens, h, r))]
            for act in activations:
                cases.append((act, lambda r, a=act, h=hidden: act_case(args.tokens, h, r, a)))
                cases.append((f"d{act}", lambda r, a=act, h=hidden: dact_case(args.tokens, h, r, a)))
            for name, make in cases:
                for recipe in ("delayed", "current"):
                    if name == "current cast" and recipe == "delayed":
                        continue
                    fused, unfused, reads, writes = make(recipe)
                    floor_ms = _floor_bytes(reads, writes, recipe, l2_bytes) / bandwidth * 1e3
                    t_fused, t_unfused = timer(fused), timer(unfused)
                    r = {"producer": name, "hidden": hidden, "recipe": recipe,
                         "fused_ms": t_fused, "unfused_ms": t_unfused, "floor_ms": floor_ms,
                         "floor_bytes": _floor_bytes(reads, writes, recipe, l2_bytes)}
                    result["rows"].append(r)
                    rows.append([name, hidden, recipe, f"{t_fused:.3f}", f"{t_unfused:.3f}",
                                 f"{floor_ms:.3f}", f"{floor_ms / t_fused:.0%}",
                                 f"{t_unfused / t_fused:.2f}"])
                    print(f"  {rows[-1]}", flush=True)
                    torch.cuda.empty_cache()
    path = write_json(result, args.name, args.out)
    print(f"{args.tokens} rows, bfloat16 in, FP8 out with its transpose; copy bandwidth "
          f"{bandwidth / 1e9:.0f} GB/s on {result['env']['card']}")
    print(table(rows, ["producer", "hidden", "recipe", "fused ms", "unfused ms", "floor ms",
                       "floor/fused", "speedup"]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
