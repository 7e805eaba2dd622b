"""The main job: train the example GPT of train_gpt.py three times, from the same
seed and data, and compare the runs.

1. FP8 + checkpointing (train_gpt.py's default),
2. FP8 without checkpointing: its loss and its FP8 scales after every step must
   equal those of run 1 bit for bit, which is what te.checkpoint promises,
3. the high-precision baseline (FP32, or BF16 with --bf16), checkpointed.

It prints a table, writes train_gpt_summary.json and train_gpt_loss.png into
--out, and exits with 1 if runs 1 and 2 differ.

    python examples/pytorch/compare_runs.py [train_gpt.py's flags] [--no-plot]
"""

import argparse
import contextlib
import json
import os
import sys
import weakref
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import transformer_engine.pytorch as te
from train_gpt import GPT, build_parser, describe, get_batch, load_tokens, train

RUNS = {"fp8-ckpt": dict(fp8=True, checkpoint=True),
        "fp8": dict(fp8=True, checkpoint=False),
        "baseline-ckpt": dict(fp8=False, checkpoint=True)}


def fp8_scales(model) -> torch.Tensor:
    """The forward and backward FP8 scales of every module that ran in FP8."""
    scales = [m.fp8_meta[key].scale.cpu() for m in model.modules()
              if isinstance(m, te.TransformerEngineBaseModule)
              for key in ("scaling_fwd", "scaling_bwd") if m.fp8_meta.get(key) is not None]
    return torch.cat(scales) if scales else torch.empty(0)


def saved_activations_mb(args) -> float:
    """MB of the tensors autograd keeps for backward in one training forward (not the
    parameters): what checkpointing saves. Counted once the forward has returned: a
    tensor saved for a graph that is already gone (a reentrant checkpoint's first
    forward keeps none of its graph) is not kept."""
    saved = []

    def pack(t):
        if isinstance(t, torch.nn.Parameter):
            return t
        # an alias without autograd history: a saved output would otherwise hold its
        # own graph in a cycle and outlive it
        held = t.detach()
        saved.append(weakref.ref(held))
        return held

    x, _ = get_batch(load_tokens(args.data), args, torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = GPT(args, torch.device(args.device))(x.to(args.device))
    storages = {}
    for ref in saved:
        t = ref()
        if t is not None:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    del out
    return sum(storages.values()) / 2**20


def run(args, after_step=None, **config) -> dict:
    """Train one configuration; returns its log with the FP8 scales after every step."""
    args = argparse.Namespace(**{**vars(args), **config})
    scales = []

    def record(step, model, loss):
        scales.append(fp8_scales(model))
        if after_step is not None:
            after_step(step, model, loss)

    _, log = train(args, after_step=record)
    return {"label": describe(args), **log, "fp8_scales": scales,
            "saved_activations_mb": saved_activations_mb(args)}


def bit_identical(a: dict, b: dict) -> bool:
    """The same loss and the same FP8 scales after every step, bit for bit."""
    return (a["train_loss"] == b["train_loss"] and len(a["fp8_scales"]) == len(b["fp8_scales"])
            and all(torch.equal(x, y) for x, y in zip(a["fp8_scales"], b["fp8_scales"])))


@contextlib.contextmanager
def deterministic_kernels(enabled: bool):
    """Math attention and deterministic kernels while inside, when ``enabled``: on CUDA
    FlashAttention's backward adds in any order, so two runs would differ in the last
    bits. Puts back what it found."""
    if not enabled:
        yield
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def smooth(values, beta=0.9):
    """Bias-corrected exponential moving average, for a readable loss curve."""
    out, avg = [], 0.0
    for i, v in enumerate(values, 1):
        avg = beta * avg + (1 - beta) * v
        out.append(avg / (1 - beta**i))
    return out


def plot(runs: dict, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 5))
    # Runs 1 and 2 should coincide: a wide pale line and hollow markers under thin ones.
    styles = [(dict(lw=3.0, alpha=0.55), dict(ms=8, fillstyle="none")),
              (dict(lw=1.3, ls="--"), dict(ms=4)), (dict(lw=1.3), dict(ms=4))]
    for r, color, (line, marker) in zip(runs.values(), ["tab:blue", "tab:orange", "tab:green"],
                                        styles):
        ax.plot(range(1, len(r["train_loss"]) + 1), smooth(r["train_loss"]), color=color,
                label=f"{r['label']}: train (smoothed)", **line)
        steps, losses = zip(*r["val_loss"])
        ax.plot(steps, losses, marker="o", ls=":", color=color,
                label=f"{r['label']}: validation (final {losses[-1]:.3f})", **marker)
    ax.set(xlabel="step", ylabel="cross-entropy (nats per byte)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    parser = build_parser()
    parser.description = __doc__.split("\n\n")[0]
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    parser.add_argument("--no-plot", action="store_true", help="write no PNG")
    args = parser.parse_args(argv)
    if not (args.fp8 and args.checkpoint):
        parser.error("compare_runs.py sets --no-fp8 and --no-checkpoint itself, for each run")
    with deterministic_kernels(args.device == "cuda"):
        runs = {name: run(args, **config) for name, config in RUNS.items()}
    identical = bit_identical(runs["fp8-ckpt"], runs["fp8"])

    print(f"\n{'run':<30}{'val loss':>9}{'train loss':>11}{'tokens/s':>10}{'saved MB':>10}")
    for r in runs.values():
        print(f"{r['label']:<30}{r['val_loss'][-1][1]:>9.4f}{r['train_loss'][-1]:>11.4f}"
              f"{r['tokens_per_s']:>10.0f}{r['saved_activations_mb']:>10.1f}")
    print(f"FP8 with and without checkpointing: losses and FP8 scales after every step "
          f"bit-identical: {identical}")
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {"args": vars(args), "torch": torch.__version__,
               "checkpointing_bit_identical": identical,
               "runs": {name: {k: v for k, v in r.items() if k != "fp8_scales"}
                        for name, r in runs.items()}}
    (args.out / "train_gpt_summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print(f"summary: {args.out / 'train_gpt_summary.json'}")
    if not args.no_plot:
        plot(runs, args.out / "train_gpt_loss.png",
             f"char-level GPT, {args.layers} x te.TransformerLayer (hidden {args.hidden}), "
             f"{args.device}\nFP8 with and without checkpointing bit-identical: {identical}")
        print(f"plot: {args.out / 'train_gpt_loss.png'}")
    if not identical:
        sys.exit("compare_runs.py: FP8 with and without checkpointing differ")
    return runs


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt as interrupt:          # Ctrl-C: one line, the shell's code 130
        print(interrupt or "interrupted", file=sys.stderr)
        sys.exit(130)
