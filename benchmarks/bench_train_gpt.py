"""Training throughput of the example GPT (examples/pytorch/train_gpt.py) in FP8 and
in BF16, eager and with ``--cuda-graphs`` (or ``--compiled``: with ``--compile``), at
two model widths.

One command (on a Hopper GPU, from the repository root)::

    python3 benchmarks/bench_train_gpt.py

For each hidden size of ``--hiddens`` (``--layers`` layers, ``--heads`` heads, every
layer checkpointed, dropout as train_gpt.py's default) it trains ``--steps`` steps
with ``train_gpt.train`` four ways: FP8 (the middle layers; the rest in BF16) and BF16,
each eager and graphed (with ``--compiled``: eager and compiled, the layer function
under ``torch.compile(fullgraph=True)``). A step is timed from the batch to ``loss.item()`` (the optimizer
step included, validation not); tokens/s is taken from the median step time over the
steps after the first ``--skip`` (compilation and autotuning), and the time to capture
the graphs is reported apart. Other train_gpt.py flags (``--batch``, ``--seq-len``,
``--lr``...) pass through. The table is printed last; the JSON goes to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "benchmarks"), os.path.join(_ROOT, "examples", "pytorch")]

import torch  # noqa: E402

from common import add_out_argument, environment, table, write_json  # noqa: E402
from train_gpt import build_parser, describe, train  # noqa: E402

CONFIGS = {"fp8": dict(fp8=True, bf16=True), "bf16": dict(fp8=False, bf16=True)}


def run(args, hidden: int, precision: str, graphs: bool, skip: int,
        compiled: bool = False) -> dict:
    """``graphs``: the second way of the comparison, CUDA graphs or (``compiled``)
    torch.compile."""
    config = argparse.Namespace(**{**vars(args), **CONFIGS[precision], "hidden": hidden,
                                   "cuda_graphs": graphs and not compiled,
                                   "compile": graphs and compiled})
    torch.cuda.empty_cache()
    torch._dynamo.reset()
    _, log = train(config)
    steady = log["step_seconds"][skip:] or log["step_seconds"]
    step_s = statistics.median(steady)
    return {"hidden": hidden, "precision": precision, "cuda_graphs": graphs,
            "label": describe(config), "median_step_ms": step_s * 1e3,
            "tokens_per_s": config.batch * config.seq_len / step_s,
            "tokens_per_s_all_steps": log["tokens_per_s"],
            "capture_seconds": log.get("capture_seconds"),
            "final_train_loss": log["train_loss"][-1], "final_val_loss": log["val_loss"][-1][1],
            "step_seconds": log["step_seconds"]}


def main(argv=None):
    parser = build_parser()
    parser.description = __doc__.split("\n\n")[0]
    parser.set_defaults(device="cuda", steps=40, layers=8, heads=8, quiet=True)
    parser.add_argument("--hiddens", default="512,1024", help="comma-separated hidden sizes")
    parser.add_argument("--skip", type=int, default=5, help="steps left out of the median")
    add_out_argument(parser)
    parser.add_argument("--compiled", action="store_true",
                        help="compare eager with --compile instead of --cuda-graphs")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_train_gpt.py: needs a CUDA GPU")
    hiddens = [int(h) for h in args.hiddens.split(",") if h]
    out, skip, compiled = args.out, args.skip, args.compiled
    for name in ("hiddens", "skip", "out", "compiled"):
        delattr(args, name)
    name = "bench_train_gpt_compiled" if compiled else "bench_train_gpt"
    second = "compiled" if compiled else "graphed"
    result = {"env": environment(), "args": vars(args), "hiddens": hiddens, "runs": []}
    for hidden in hiddens:
        for precision in CONFIGS:
            for graphs in (False, True):
                r = run(args, hidden, precision, graphs, skip, compiled)
                result["runs"].append(r)
                print(f"  hidden {hidden} {r['label']}: {r['tokens_per_s']:,.0f} tokens/s, "
                      f"{r['median_step_ms']:.2f} ms/step", flush=True)
                write_json(result, name, out)        # keep partial results
    path = write_json(result, name, out)
    rows = []
    for hidden in hiddens:
        runs = {(r["precision"], r["cuda_graphs"]): r for r in result["runs"] if r["hidden"] == hidden}
        for precision in CONFIGS:
            eager, graphed = runs[(precision, False)], runs[(precision, True)]
            rows.append([hidden, precision, f"{eager['tokens_per_s']:,.0f}",
                         f"{graphed['tokens_per_s']:,.0f}",
                         f"{graphed['tokens_per_s'] / eager['tokens_per_s']:.2f}",
                         f"{graphed['tokens_per_s'] / runs[('bf16', True)]['tokens_per_s']:.2f}",
                         f"{graphed['capture_seconds'] or 0:.1f}",
                         f"{eager['final_val_loss']:.4f} / {graphed['final_val_loss']:.4f}"])
    print(f"\nexample GPT, {args.layers} layers, {args.heads} heads, batch {args.batch} x seq "
          f"{args.seq_len}, {args.steps} steps, {result['env']['card']}, torch "
          f"{result['env']['torch']}: tokens/s from the median step")
    print(table(rows, ["hidden", "precision", "eager tok/s", f"{second} tok/s",
                       f"{second}/eager", f"{second} / bf16 {second}", "capture s",
                       f"val loss eager / {second}"]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
