"""An MLP block (LayerNorm -> fc1 -> GELU -> fc2, bf16 parameters, forward + backward) in
BF16 and FP8, eager and under ``torch.compile``, side by side.

One command (on a Hopper GPU, from the repository root)::

    python3 benchmarks/bench_mlp_block.py

For each hidden size (``--hidden``, default 1024 2048 4096; ffn = 4 x hidden) and
``--tokens`` (8192) rows it times, as medians of CUDA-event-timed repeats after warm-up
(L2 flushed between repeats; ``common.median_ms``), one forward and backward with the
gradients dropped before each:

- ``torch_bf16``: ``torch.nn`` LayerNorm, Linear, GELU (tanh), Linear, eager;
- ``torch_bf16_compiled``: the same under ``torch.compile`` (Inductor, default mode);
- ``torchao_fp8``: the same with ``torchao.float8``'s tensorwise recipe, compiled
  (skipped, with a note, when torchao does not import);
- ``te_fp8``: ``te.LayerNormMLP`` in ``te.autocast(recipe=DelayedScaling())``, eager
  (the fused kernels, as the package runs by default);
- ``te_fp8_compiled``: the same function, ``te.autocast`` opened inside it, under
  ``torch.compile(..., fullgraph=True)`` (NOTE [torch.compile] in
  transformer_engine/pytorch/torch_compile.py).

``--recipe current`` uses ``Float8CurrentScaling()`` for the te variants; ``--mode``
passes a ``torch.compile`` mode to every compiled variant (e.g.
``max-autotune-no-cudagraphs``). Reported per size: each median in ms, TFLOP/s (12 x
tokens x hidden x ffn per forward + backward, the GEMMs only), and the ratios of
``te_fp8_compiled`` to the faster BF16 variant and to ``torchao_fp8``. The table is
printed last; the JSON (card, versions, shapes, medians, command) goes to ``--out``
(default ``benchmarks/out``). ``--device cpu`` runs the variants once each on tiny
shapes with wall-clock medians (a check that the script runs, not a measurement).
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

VARIANTS = ("torch_bf16", "torch_bf16_compiled", "torchao_fp8", "te_fp8", "te_fp8_compiled")
RECIPES = {"delayed": DelayedScaling, "current": Float8CurrentScaling}


def torch_block(hidden: int, device) -> torch.nn.Module:
    ffn = 4 * hidden
    return torch.nn.Sequential(
        torch.nn.LayerNorm(hidden), torch.nn.Linear(hidden, ffn),
        torch.nn.GELU(approximate="tanh"), torch.nn.Linear(ffn, hidden),
    ).to(device=device, dtype=torch.bfloat16)


def make_step(variant: str, hidden: int, tokens: int, args, device):
    """``(step, note)``: a function running one forward + backward of ``variant``, or
    None and why it is skipped."""
    torch.manual_seed(0)
    torch._dynamo.reset()           # each compiled variant compiles for its own shape
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    compile_kw = {} if args.mode is None else {"mode": args.mode}
    if variant.startswith("torch_bf16"):
        model = torch_block(hidden, device)
        run = torch.compile(model, **compile_kw) if variant.endswith("compiled") else model
    elif variant == "torchao_fp8":
        try:
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        except ImportError as err:
            return None, f"torchao does not import ({err})"
        model = torch_block(hidden, device)
        convert_to_float8_training(model,
                                   config=Float8LinearConfig.from_recipe_name("tensorwise"))
        run = torch.compile(model, **compile_kw)
    else:
        model = te.LayerNormMLP(hidden, 4 * hidden, params_dtype=torch.bfloat16, device=device)
        recipe = RECIPES[args.recipe]()

        def fn(inp):
            with te.autocast(recipe=recipe):
                return model(inp)

        run = (torch.compile(fn, fullgraph=True, **compile_kw) if variant.endswith("compiled")
               else fn)
    params = [x] + list(model.parameters())

    def step():
        for p in params:
            p.grad = None
        run(x).backward(dy)
    return step, None


def cpu_median_ms(step, repeats: int = 5) -> float:
    step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--recipe", choices=sorted(RECIPES), default="delayed")
    p.add_argument("--mode", default=None, help="torch.compile mode of the compiled variants")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    add_out_argument(p)
    p.add_argument("--name", default="bench_mlp_block")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_mlp_block.py: needs a CUDA GPU (or --device cpu for a check)")
    timer = median_ms if device.type == "cuda" else cpu_median_ms
    results, notes = [], {}
    for hidden in args.hidden:
        row = {"hidden": hidden, "ffn": 4 * hidden, "tokens": args.tokens, "ms": {}}
        for variant in args.variants:
            step, note = make_step(variant, hidden, args.tokens, args, device)
            if step is None:
                notes[variant] = note
                continue
            step()                                  # compile / warm up outside the timing
            if device.type == "cuda":
                torch.cuda.synchronize()
            row["ms"][variant] = timer(step)
            print(f"hidden {hidden} {variant}: {row['ms'][variant]:.3f} ms", flush=True)
        results.append(row)
    report(results, notes, args)


def report(results, notes, args) -> None:
    header = ["hidden"] + [v for v in VARIANTS if v in args.variants] + \
             ["te_c / best bf16", "te_c / torchao"]
    rows = []
    for r in results:
        ms = r["ms"]
        flops = 12.0 * r["tokens"] * r["hidden"] * r["ffn"]
        r["tflops"] = {v: flops / (t * 1e-3) / 1e12 for v, t in ms.items()}
        bf16 = [ms[v] for v in ("torch_bf16", "torch_bf16_compiled") if v in ms]
        te_c = ms.get("te_fp8_compiled")
        r["speedup_vs_best_bf16"] = min(bf16) / te_c if bf16 and te_c else None
        r["speedup_vs_torchao"] = ms["torchao_fp8"] / te_c if te_c and "torchao_fp8" in ms \
            else None
        cells = [f"{ms[v]:.3f}" if v in ms else "-" for v in header[1:-2]]
        rows.append([r["hidden"]] + cells
                    + [f"{x:.2f}x" if x else "-" for x in (r["speedup_vs_best_bf16"],
                                                           r["speedup_vs_torchao"])])
    env = environment()
    try:
        import torchao
        env["torchao"] = torchao.__version__
    except ImportError:
        env["torchao"] = None
    result = {"env": env, "recipe": args.recipe, "mode": args.mode, "tokens": args.tokens,
              "results": results, "notes": notes}
    path = write_json(result, args.name, args.out)
    for variant, note in notes.items():
        print(f"note: {variant} skipped: {note}")
    print(f"\nMLP block forward + backward, {args.tokens} tokens, ms (median), "
          f"{env['card']}, torch {env['torch']}, recipe {args.recipe}, "
          f"compile mode {args.mode or 'default'}; JSON: {path}")
    print(table(rows, header))


if __name__ == "__main__":
    main()
