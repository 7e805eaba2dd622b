"""FP8 primary weights (``te.quantized_model_init``) against high-precision weights:
parameter memory, peak memory of a training step, and step time.

One command (on a Hopper GPU, from the repository root)::

    python3 benchmarks/bench_fp8_params.py

The model is ``--layers`` te.TransformerLayer (hidden ``--hidden``, FFN 4x,
``--heads`` heads, sequence ``--seq``, batch 1, dropout 0) with bfloat16 parameters,
built twice from one seed: with bfloat16 weights (``bf16_weights``) and under
``te.quantized_model_init(recipe=DelayedScaling())`` (``fp8_weights``). Both train
in the same FP8 autocast. Reported per variant: the memory the parameters take
(allocated after building minus before), the peak allocated during one training
step (forward, backward, SGD step) minus what was allocated before it, and the
median CUDA-event time of the forward + backward and of the SGD step (an FP8
weight's step dequantizes, adds and quantizes back). Variants are timed in
alternating rounds. The table is printed last; the JSON goes to ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "benchmarks")]

import torch  # noqa: E402

import transformer_engine.pytorch as te  # noqa: E402
from transformer_engine.common.recipe import DelayedScaling  # noqa: E402
from common import add_out_argument, environment, table, write_json  # noqa: E402

RECIPE = DelayedScaling()
MiB = 1 << 20


def _build(args, fp8_weights: bool):
    torch.manual_seed(0)
    before = torch.cuda.memory_allocated()
    with te.quantized_model_init(enabled=fp8_weights, recipe=RECIPE):
        model = torch.nn.ModuleList([
            te.TransformerLayer(args.hidden, 4 * args.hidden, args.heads, hidden_dropout=0.0,
                                attention_dropout=0.0, self_attn_mask_type="causal",
                                params_dtype=torch.bfloat16, device="cuda")
            for _ in range(args.layers)])
    torch.cuda.synchronize()
    return model, torch.cuda.memory_allocated() - before


def _timed(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=20)
    add_out_argument(p)
    args = p.parse_args()
    x = torch.randn(args.seq, 1, args.hidden, device="cuda", dtype=torch.bfloat16)
    variants = {}
    for name, fp8 in (("bf16_weights", False), ("fp8_weights", True)):
        model, param_bytes = _build(args, fp8)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        variants[name] = {"model": model, "opt": opt, "param_MiB": param_bytes / MiB,
                          "fwd_bwd_ms": [], "opt_ms": [], "losses": []}

    def fwd_bwd(v):
        h = x.requires_grad_()
        with te.autocast(recipe=RECIPE):
            for layer in v["model"]:
                h = layer(h)
        loss = h.float().pow(2).mean()
        loss.backward()
        v["losses"].append(loss.item())

    for r in range(args.rounds + 2):                   # two warm-up rounds
        for v in variants.values():
            for q in v["model"].parameters():
                q.grad = None
            gc.collect()
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            t_fb = _timed(lambda v=v: fwd_bwd(v))
            t_opt = _timed(v["opt"].step)
            v["peak_MiB"] = (torch.cuda.max_memory_allocated() - base) / MiB
            if r >= 2:
                v["fwd_bwd_ms"].append(t_fb)
                v["opt_ms"].append(t_opt)
    rows, result = [], {"env": environment(), "shape": vars(args) | {"batch": 1},
                        "recipe": "DelayedScaling()", "variants": {}}
    for name, v in variants.items():
        rec = {"param_MiB": round(v["param_MiB"], 1), "step_peak_MiB": round(v["peak_MiB"], 1),
               "fwd_bwd_ms": round(statistics.median(v["fwd_bwd_ms"]), 3),
               "opt_step_ms": round(statistics.median(v["opt_ms"]), 3),
               "first_losses": [round(v_, 5) for v_ in v["losses"][:4]]}
        result["variants"][name] = rec
        rows.append([name, rec["param_MiB"], rec["step_peak_MiB"], rec["fwd_bwd_ms"],
                     rec["opt_step_ms"]])
    path = write_json(result, "bench_fp8_params", args.out)
    print(f"wrote {path}")
    print(table(rows, ["variant", "params MiB", "step peak MiB", "fwd+bwd ms", "SGD step ms"]))


if __name__ == "__main__":
    main()
