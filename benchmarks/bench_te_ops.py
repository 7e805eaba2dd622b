"""te.ops against te.LayerNormMLP: ``te.ops.Sequential(LayerNorm, Linear, GELU, Linear)``
and ``te.LayerNormMLP`` with the same weights, FP8 forward + backward, side by side.

One command (on a Hopper GPU, from the repository root)::

    python3 benchmarks/bench_te_ops.py

For each recipe (``--recipes``, default delayed and current) and hidden size
(``--hidden``, default 1024 4096; ffn = 4 x hidden) at ``--tokens`` (8192) rows, bf16
parameters, it times, as medians of CUDA-event-timed repeats after warm-up (L2 flushed
between repeats; ``common.median_ms``), one forward and backward in
``te.autocast(recipe=...)`` with the gradients dropped before each:

- ``layernorm_mlp``: ``te.LayerNormMLP(hidden, ffn, activation="gelu")``;
- ``te_ops``: the ``te.ops.Sequential`` above, its weights copied from the module, so
  both compute the same numbers (the script checks the outputs are equal bit for bit
  before timing and reports it).

Reported per row: both medians in ms, the ratio ``te_ops / layernorm_mlp`` (1.00x: as
fast) and whether the outputs matched. The table is printed last; the JSON (card,
versions, shapes, medians, command) goes to ``--out`` (default ``benchmarks/out``).
``--device cpu`` runs each variant a few times on the shapes given with wall-clock
medians (a check that the script runs, not a measurement), e.g.
``--device cpu --hidden 64 --tokens 32``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "benchmarks")]

import torch  # noqa: E402

import transformer_engine.pytorch as te  # noqa: E402
from common import add_out_argument, environment, median_ms, table, write_json  # noqa: E402
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling  # noqa: E402

VARIANTS = ("layernorm_mlp", "te_ops")
RECIPES = {"delayed": DelayedScaling, "current": Float8CurrentScaling}


def make_pair(hidden: int, device):
    """``(te.LayerNormMLP, te.ops.Sequential)`` with the same bf16 weights."""
    torch.manual_seed(0)
    ffn, kw = 4 * hidden, {"device": device}
    mlp = te.LayerNormMLP(hidden, ffn, params_dtype=torch.bfloat16, **kw)
    seq = te.ops.Sequential(te.ops.LayerNorm(hidden, dtype=torch.bfloat16, **kw),
                            te.ops.Linear(hidden, ffn, dtype=torch.bfloat16, **kw),
                            te.ops.GELU(),
                            te.ops.Linear(ffn, hidden, dtype=torch.bfloat16, **kw))
    with torch.no_grad():
        seq[0].weight.copy_(mlp.layer_norm_weight)
        seq[0].bias.copy_(mlp.layer_norm_bias)
        for i, name in ((1, "fc1"), (3, "fc2")):
            seq[i].weight.copy_(getattr(mlp, name + "_weight"))
            seq[i].bias.copy_(getattr(mlp, name + "_bias"))
    return mlp, seq


def make_step(model, recipe, x, dy):
    params = [x] + list(model.parameters())

    def step():
        for p in params:
            p.grad = None
        with te.autocast(recipe=recipe):
            y = model(x)
        y.backward(dy)
    return step


def cpu_median_ms(step, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def outputs_equal(mlp, seq, recipe_cls, x) -> bool:
    """Whether the first FP8 forward of each (fresh FP8 state) gives the same bits."""
    with torch.no_grad():
        with te.autocast(recipe=recipe_cls()):
            a = mlp(x)
        with te.autocast(recipe=recipe_cls()):
            b = seq(x)
    return bool(torch.equal(a, b))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--recipes", nargs="+", choices=sorted(RECIPES), default=["delayed", "current"])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    add_out_argument(p)
    p.add_argument("--name", default="bench_te_ops")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_te_ops.py: needs a CUDA GPU (or --device cpu for a check)")
    timer = median_ms if device.type == "cuda" else cpu_median_ms
    results = []
    for recipe_name in args.recipes:
        recipe_cls = RECIPES[recipe_name]
        for hidden in args.hidden:
            mlp, seq = make_pair(hidden, device)
            g = torch.Generator(device=device).manual_seed(1)
            x = torch.randn(args.tokens, hidden, device=device, dtype=torch.bfloat16,
                            generator=g).requires_grad_()
            dy = torch.randn(args.tokens, hidden, device=device, dtype=torch.bfloat16,
                             generator=g)
            row = {"recipe": recipe_name, "hidden": hidden, "ffn": 4 * hidden,
                   "tokens": args.tokens, "outputs_equal": outputs_equal(mlp, seq, recipe_cls,
                                                                         x),
                   "ms": {}}
            recipe = recipe_cls()
            for variant, model in zip(VARIANTS, (mlp, seq)):
                step = make_step(model, recipe, x, dy)
                step()                                  # warm up outside the timing
                if device.type == "cuda":
                    torch.cuda.synchronize()
                row["ms"][variant] = timer(step)
                print(f"{recipe_name} hidden {hidden} {variant}: {row['ms'][variant]:.3f} ms",
                      flush=True)
            row["te_ops_over_layernorm_mlp"] = row["ms"]["te_ops"] / row["ms"]["layernorm_mlp"]
            results.append(row)
    report(results, args)


def report(results, args) -> None:
    header = ["recipe", "hidden", *VARIANTS, "te_ops / lnmlp", "same output"]
    rows = [[r["recipe"], r["hidden"], *(f"{r['ms'][v]:.3f}" for v in VARIANTS),
             f"{r['te_ops_over_layernorm_mlp']:.2f}x", "yes" if r["outputs_equal"] else "NO"]
            for r in results]
    env = environment()
    result = {"env": env, "tokens": args.tokens, "hidden": args.hidden,
              "recipes": args.recipes, "results": results}
    path = write_json(result, args.name, args.out)
    print(f"\nLayerNorm -> Linear -> GELU -> Linear, bf16 parameters, FP8 forward + backward, "
          f"{args.tokens} tokens, ms (median), {env['card']}, torch {env['torch']}; "
          f"JSON: {path}")
    print(table(rows, header))


if __name__ == "__main__":
    main()
