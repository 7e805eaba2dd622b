"""Train a small character-level GPT built from te.TransformerLayer, in FP8 with
activation checkpointing, choosing each layer's precision *inside* its checkpointed
function (first and last layer in high precision, the rest in FP8).

By default it trains three configurations from the same seed and data:
FP8 + checkpointing, FP8 without checkpointing (whose losses must coincide with the
first, bit for bit), and a high-precision baseline (FP32 on CPU, BF16 on CUDA); then
prints a summary, writes a JSON summary and a PNG of the loss curves.

    python examples/pytorch/train_gpt.py                    # CPU, a few minutes
    python examples/pytorch/train_gpt.py --device cuda --layers 8 --hidden 512
    torchrun --nproc-per-node 2 examples/pytorch/train_gpt.py --runs fp8-ckpt
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Format

RUNS = {   # name -> (fp8, checkpoint)
    "fp8-ckpt": (True, True),
    "fp8": (True, False),
    "hp": (False, False),
}
LABELS = {"fp8-ckpt": "FP8 + checkpointing", "fp8": "FP8, no checkpointing", "hp": "high precision"}


# ---- data -------------------------------------------------------------------------

def load_text(path: str | None, max_bytes: int) -> tuple[bytes, str]:
    """The training text: a file, every text file under a folder, or (default) the
    source of the Python standard library on this machine, in sorted path order."""
    if path is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        files, what = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts), \
            f"Python {sys.version.split()[0]} standard library source ({root})"
    else:
        root = Path(path)
        if root.is_file():
            files, what = [root], str(root)
        elif root.is_dir():
            files, what = sorted(p for p in root.rglob("*") if p.is_file()), f"files under {root}"
        else:
            raise SystemExit(f"train_gpt.py: --data {path!r} is neither a file nor a folder")
    chunks, total = [], 0
    for f in files:
        try:
            data = f.read_bytes()
        except OSError:
            continue
        if b"\0" in data[:1024]:        # skip binary files
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    text = b"\n".join(chunks)[:max_bytes]
    if len(text) < 10_000:
        raise SystemExit(f"train_gpt.py: only {len(text)} bytes of text found in {what}")
    return text, what


class CharData:
    """Byte-level tokens, split deterministically in blocks of 64 KiB: every tenth
    block validates, the rest trains (so both sample the same mix of files)."""

    vocab_size = 256
    block = 1 << 16

    def __init__(self, text: bytes, seq_len: int, device):
        tokens = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        blocks = tokens.split(self.block)
        self.train = torch.cat([b for i, b in enumerate(blocks) if i % 10 != 9])
        self.val = torch.cat([b for i, b in enumerate(blocks) if i % 10 == 9])
        self.seq_len, self.device = seq_len, device

    def batch(self, split: str, batch_size: int, generator: torch.Generator):
        data = self.train if split == "train" else self.val
        starts = torch.randint(0, len(data) - self.seq_len - 1, (batch_size,), generator=generator)
        idx = starts[:, None] + torch.arange(self.seq_len + 1)
        chunk = data[idx]
        return chunk[:, :-1].to(self.device), chunk[:, 1:].to(self.device)


# ---- model ------------------------------------------------------------------------

class GPT(torch.nn.Module):
    def __init__(self, args, device):
        super().__init__()
        h = args.hidden
        self.tok_emb = torch.nn.Embedding(CharData.vocab_size, h, device=device)
        self.pos_emb = torch.nn.Embedding(args.seq_len, h, device=device)
        self.layers = torch.nn.ModuleList(
            te.TransformerLayer(h, 4 * h, args.heads, hidden_dropout=args.dropout,
                                attention_dropout=args.dropout, layer_number=i + 1, device=device)
            for i in range(args.layers))
        self.ln_f = te.LayerNorm(h, device=device)
        self.head = te.Linear(h, CharData.vocab_size, bias=False, device=device)
        for emb in (self.tok_emb, self.pos_emb):
            torch.nn.init.normal_(emb.weight, std=0.02)

    def forward(self, tokens, fp8: bool, checkpoint: bool, recipe, amax_group, use_reentrant):
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = (self.tok_emb(tokens) + self.pos_emb(pos)).transpose(0, 1).contiguous()  # [s, b, h]
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            layer_fp8 = fp8 and 0 < i < last

            def run_layer(hidden, layer=layer, layer_fp8=layer_fp8):
                # The per-layer precision is chosen inside the checkpointed function.
                with te.autocast(enabled=layer_fp8, recipe=recipe,
                                 amax_reduction_group=amax_group if layer_fp8 else None):
                    return layer(hidden)

            if checkpoint and torch.is_grad_enabled():
                x = te.checkpoint(run_layer, x, use_reentrant=use_reentrant)
            else:
                x = run_layer(x)
        x = self.ln_f(x).transpose(0, 1)
        return self.head(x).float()


def fp8_modules(model):
    return [m for m in model.modules() if isinstance(m, te.TransformerEngineBaseModule)
            and m.fp8_meta.get("scaling_fwd") is not None]


# ---- one training run ---------------------------------------------------------------

class Progress:
    """tqdm when installed and on a terminal, else a line every tenth of the run."""

    def __init__(self, total: int, desc: str, enabled: bool):
        self.total, self.desc, self.enabled, self.bar = total, desc, enabled, None
        if enabled and sys.stderr.isatty():
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, desc=desc, leave=True)
            except ImportError:
                pass

    def update(self, step: int, loss: float):
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.3f}")
            return
        every = max(1, self.total // 10)
        if step % every == 0 or step == self.total:
            width = 30
            done = int(width * step / self.total)
            print(f"{self.desc:>22} [{'#' * done}{'.' * (width - done)}] {step}/{self.total} "
                  f"loss {loss:.4f}", flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def train(name: str, args, data: CharData, device, rank: int, world: int, amax_group):
    fp8, checkpoint = RUNS[name]
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.cuda.manual_seed_all(args.seed)
        torch.cuda.reset_peak_memory_stats(device)
    te.FP8GlobalStateManager.reset()
    model = GPT(args, device)
    ddp = model
    if world > 1:
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16, amax_compute_algo="max")
    use_bf16 = device.type == "cuda"
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    losses, scale_trace = [], []
    progress = Progress(args.steps, LABELS[name], rank == 0 and not args.quiet)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        lr = args.lr * min(1.0, step / max(1, args.steps // 10))
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = data.batch("train", args.batch, gen)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
            logits = ddp(x, fp8, checkpoint, recipe, amax_group, args.use_reentrant)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_value = loss.item()
        if not math.isfinite(loss_value):
            raise SystemExit(f"train_gpt.py: {name}: loss is {loss_value} at step {step}")
        losses.append(loss_value)
        if fp8:
            scale_trace.append(torch.cat([m.fp8_meta["scaling_fwd"].scale
                                          for m in fp8_modules(model)]).cpu())
        progress.update(step, loss_value)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    progress.close()
    val = evaluate(model, args, data, fp8, recipe, device)
    result = {
        "run": name, "label": LABELS[name], "fp8": fp8, "checkpoint": checkpoint,
        "train_loss": losses, "final_train_loss": losses[-1], "val_loss": val,
        "tokens_per_s": args.steps * args.batch * args.seq_len * world / elapsed,
        "seconds": elapsed,
        "peak_memory_mb": (torch.cuda.max_memory_allocated(device) / 2 ** 20 if device.type == "cuda"
                           else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "recompute_stash_tensors_after": te.distributed.recompute_stash_count(),
    }
    if fp8 and world > 1:
        result["fp8_scales_identical_across_ranks"] = scales_identical(model, device)
    return result, scale_trace


@torch.no_grad()
def evaluate(model, args, data, fp8, recipe, device, batches: int = 8) -> float:
    model.eval()
    gen = torch.Generator().manual_seed(12345)
    total = 0.0
    for _ in range(batches):
        x, y = data.batch("val", args.batch, gen)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(x, fp8, False, recipe, None, args.use_reentrant)
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).item()
    model.train()
    return total / batches


def scales_identical(model, device) -> bool:
    scales = torch.cat([torch.cat([m.fp8_meta[k].scale for k in ("scaling_fwd", "scaling_bwd")])
                        for m in fp8_modules(model)]).to(device)
    gathered = [torch.empty_like(scales) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, scales)
    return all(torch.equal(gathered[0], g) for g in gathered[1:])


# ---- reporting ----------------------------------------------------------------------

def plot(results, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("train_gpt.py: matplotlib is not installed, no plot written "
              "(pip install matplotlib, or pass --no-plot)")
        return False
    fig, ax = plt.subplots(figsize=(8, 4.5))
    styles = {"fp8-ckpt": dict(lw=2.5, color="tab:blue"),
              "fp8": dict(lw=1.2, ls="--", color="tab:orange"),
              "hp": dict(lw=1.2, color="tab:green")}
    for r in results:
        ax.plot(range(1, len(r["train_loss"]) + 1), r["train_loss"],
                label=f"{r['label']} (val {r['val_loss']:.3f})", **styles[r["run"]])
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (cross-entropy, nats/char)")
    ax.set_title("Character-level GPT from te.TransformerLayer")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--runs", default="fp8-ckpt,fp8,hp",
                   help=f"comma-separated configurations to train, from {list(RUNS)}")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--dropout", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--data", default=None,
                   help="a text file or folder (default: this Python's standard library source)")
    p.add_argument("--max-bytes", type=int, default=4_000_000)
    p.add_argument("--use-reentrant", action="store_true",
                   help="reentrant checkpointing (default: non-reentrant)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "out"))
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    unknown = [n for n in names if n not in RUNS]
    if unknown or not names:
        p.error(f"--runs: unknown configuration(s) {unknown}; choose from {list(RUNS)}")
    args.run_names = names
    if (args.batch * args.seq_len) % 16 or args.hidden % 16 or args.hidden % args.heads:
        p.error("--batch * --seq-len and --hidden must be multiples of 16 (FP8 GEMMs), "
                "and --hidden a multiple of --heads")
    if args.layers < 3 and any(RUNS[n][0] for n in names):
        print("train_gpt.py: with fewer than 3 layers no layer runs in FP8 "
              "(the first and last stay in high precision)")
    return args


def main(argv=None):
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    amax_group = None
    if world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        amax_group = dist.new_group(list(range(world)))   # FP8 amax reduction over the DP group
    text, source = load_text(args.data, args.max_bytes)
    data = CharData(text, args.seq_len, device)
    if rank == 0:
        print(f"data: {len(text):,} bytes of {source}; {len(data.train):,} train / "
              f"{len(data.val):,} validation tokens; {world} process(es) on {device}")
    results, traces = [], {}
    for name in args.run_names:
        result, traces[name] = train(name, args, data, device, rank, world, amax_group)
        results.append(result)
    if rank == 0:
        report(args, results, traces, device, world)
    if world > 1:
        dist.destroy_process_group()
    return results


def report(args, results, traces, device, world):
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"\n{'run':<24}{'val loss':>10}{'train loss':>12}{'tokens/s':>11}{'peak MB':>10}")
    for r in results:
        print(f"{r['label']:<24}{r['val_loss']:>10.4f}{r['final_train_loss']:>12.4f}"
              f"{r['tokens_per_s']:>11.0f}{r['peak_memory_mb']:>10.0f}")
    by = {r["run"]: r for r in results}
    summary = {"args": {k: v for k, v in vars(args).items() if k != "run_names"},
               "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "world_size": world, "torch": torch.__version__, "runs": results}
    if "fp8-ckpt" in by and "fp8" in by:
        same = by["fp8-ckpt"]["train_loss"] == by["fp8"]["train_loss"]
        same_scales = all(torch.equal(a, b) for a, b in zip(traces["fp8-ckpt"], traces["fp8"]))
        summary["checkpointing_bit_identical"] = same and same_scales
        print(f"FP8 with and without checkpointing: losses identical {same}, "
              f"FP8 scales identical after every step {same_scales}")
    for r in results:
        if "fp8_scales_identical_across_ranks" in r:
            print(f"{r['label']}: FP8 scales identical across {world} ranks: "
                  f"{r['fp8_scales_identical_across_ranks']}")
    if device.type == "cpu":
        print("(peak MB on CPU is the process's maximum resident set so far, not per run)")
    (out / "train_gpt_summary.json").write_text(json.dumps(summary, indent=1))
    if not args.no_plot and plot(results, out / "train_gpt_loss.png"):
        print(f"plot: {out / 'train_gpt_loss.png'}")
    print(f"summary: {out / 'train_gpt_summary.json'}")


if __name__ == "__main__":
    main()
