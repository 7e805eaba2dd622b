"""The main job's measuring and reporting: saved-activation bytes, peak memory, the
progress bar, the summary table, the JSON summary and the loss plot (see train_gpt.py)."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path
from typing import List

import torch


class SavedActivations:
    """Bytes of the non-parameter tensors autograd saves for backward during one
    forward (distinct storages): what checkpointing saves, on any device."""

    def __init__(self):
        self.storages = {}

    def _pack(self, t: torch.Tensor):
        if not isinstance(t, torch.nn.Parameter):
            s = t.untyped_storage()
            self.storages[(t.device, s.data_ptr())] = s.nbytes()
        return t

    def context(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    @property
    def megabytes(self) -> float:
        return sum(self.storages.values()) / 2 ** 20


def peak_memory_mb(device: torch.device) -> float:
    """CUDA: peak allocated by this run. CPU: the process's maximum resident set so far."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024     # KiB on Linux


class Progress:
    """A tqdm bar when tqdm is installed and stderr is a terminal; else a text line
    every tenth of the run."""

    def __init__(self, total: int, desc: str, enabled: bool):
        self.total, self.desc, self.enabled, self.bar = total, desc, enabled, None
        if enabled and sys.stderr.isatty():
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, desc=desc, leave=True)
            except ImportError:
                pass

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:.0f}")
            return
        if step == 1 or step % max(1, self.total // 10) == 0 or step == self.total:
            done = int(30 * step / self.total)
            print(f"{self.desc:>30} [{'#' * done}{'.' * (30 - done)}] {step:>5}/{self.total} "
                  f"loss {loss:.4f}  {tokens_per_s:,.0f} tok/s", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def smooth(values: List[float], beta: float = 0.9) -> List[float]:
    """Bias-corrected exponential moving average, for a readable loss curve."""
    out, avg = [], 0.0
    for i, v in enumerate(values, 1):
        avg = beta * avg + (1 - beta) * v
        out.append(avg / (1 - beta ** i))
    return out


def plot(outcomes: list, path: Path, title: str) -> bool:
    """The loss curves into a PNG; False (with a message) when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("train_gpt.py: matplotlib is not installed, so no plot was written "
              "(pip install matplotlib, or pass --no-plot)")
        return False
    styles = [dict(color="tab:blue", lw=3.0, alpha=0.55), dict(color="tab:orange", lw=1.3, ls="--"),
              dict(color="tab:green", lw=1.3)]
    fig, ax = plt.subplots(figsize=(9, 5))
    for i, o in enumerate(outcomes):
        r, style = o.result, styles[i % len(styles)]
        steps = range(1, len(r["train_loss"]) + 1)
        ax.plot(steps, smooth(r["train_loss"]), label=f"{r['label']}: train (smoothed)", **style)
        vs, vl = zip(*r["val_curve"])
        ax.plot(vs, vl, marker="o", ms=8 if i == 0 else 4, ls=":", color=style["color"],
                fillstyle="none" if i == 0 else "full",
                label=f"{r['label']}: validation (final {r['val_loss']:.3f})")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per byte)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def report(args, outcomes: list, device: torch.device, world: int, source: str) -> dict:
    """Print the table, write the JSON summary and the plot; returns the summary."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"\n{'run':<32}{'val loss':>9}{'train loss':>11}{'tokens/s':>10}"
          f"{'peak MB':>9}{'saved MB':>10}")
    for o in outcomes:
        r = o.result
        print(f"{r['label']:<32}{r['val_loss']:>9.4f}{r['final_train_loss']:>11.4f}"
              f"{r['tokens_per_s']:>10.0f}{r['peak_memory_mb']:>9.0f}"
              f"{r['saved_activations_mb']:>10.1f}")
    summary = {"args": {k: v for k, v in vars(args).items() if k != "configs"}, "data": source,
               "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "world_size": world, "torch": torch.__version__,
               "runs": [o.result for o in outcomes]}
    by_name = {o.result["run"]: o for o in outcomes}
    if "fp8-ckpt" in by_name and "fp8" in by_name:
        a, b = by_name["fp8-ckpt"], by_name["fp8"]
        same_loss = a.result["train_loss"] == b.result["train_loss"]
        same_scales = len(a.scale_trace) == len(b.scale_trace) and all(
            torch.equal(u, v) for u, v in zip(a.scale_trace, b.scale_trace))
        summary["checkpointing_bit_identical"] = same_loss and same_scales
        print(f"FP8 with vs without checkpointing: losses bit-identical: {same_loss}; "
              f"FP8 scales bit-identical after every step: {same_scales}")
    for o in outcomes:
        if "fp8_scales_identical_across_ranks" in o.result:
            print(f"{o.result['label']}: FP8 scales identical on all {world} ranks: "
                  f"{o.result['fp8_scales_identical_across_ranks']}")
    if device.type == "cpu":
        print("(peak MB on the CPU is the process's maximum resident set so far; saved MB is "
              "what autograd keeps for backward in one step)")
    (out / "train_gpt_summary.json").write_text(json.dumps(summary, indent=1))
    title = (f"char-level GPT, {args.layers} x te.TransformerLayer (hidden {args.hidden}), "
             f"{world} x {summary['device']}")
    if "checkpointing_bit_identical" in summary:
        title += f"\nFP8 with and without checkpointing bit-identical: " \
                 f"{summary['checkpointing_bit_identical']}"
    if args.no_plot:
        print("plot: skipped (--no-plot)")
    elif plot(outcomes, out / "train_gpt_loss.png", title):
        print(f"plot: {out / 'train_gpt_loss.png'}")
    print(f"summary: {out / 'train_gpt_summary.json'}")
    return summary
