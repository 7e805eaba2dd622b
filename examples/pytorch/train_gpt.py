"""The main job: train a small character-level GPT built from ``te.TransformerLayer``
in FP8 with delayed scaling and per-layer activation checkpointing, choosing each
layer's precision *inside* its checkpointed function (the first and last layers in
high precision, the others in FP8).

With no configuration flags it compares three runs from the same seed and data:
FP8 + checkpointing, FP8 without checkpointing (its losses and FP8 scales must equal
the first run's, bit for bit) and a high-precision baseline with checkpointing (FP32
on CPU, BF16 on CUDA; ``--hp-dtype``). ``--precision`` / ``--no-checkpoint`` train one
configuration instead. At the end it prints validation loss, tokens/s and peak memory
and writes ``train_gpt_summary.json`` and ``train_gpt_loss.png`` into ``--out``.

    python examples/pytorch/train_gpt.py                        # CPU, about 3 minutes
    python examples/pytorch/train_gpt.py --device cuda --layers 8 --hidden 512
    python examples/pytorch/train_gpt.py --precision fp8 --use-reentrant --steps 100
    torchrun --nproc-per-node 2 examples/pytorch/train_gpt.py --precision fp8

Under ``torchrun`` it trains data-parallel (DDP; gloo on CPU, NCCL on CUDA), each
rank on its own batches, and the FP8 amaxes are all-reduced (MAX) over the
data-parallel group, so every rank ends with the same FP8 scales.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List

import torch
import torch.distributed as dist
import torch.nn.functional as F

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Format

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)        # the helper modules beside this file (train_gpt_*.py)
from train_gpt_data import CharData, load_text  # noqa: E402
from train_gpt_report import Progress, SavedActivations, peak_memory_mb, report  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "out"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
__all__ = ["main", "parse_args", "build_parser", "resolve", "GPT", "RunConfig", "Outcome",
           "train", "fp8_modules", "fp8_scales", "deterministic_kernels", "load_text", "CharData"]


# ---- model --------------------------------------------------------------------------

@dataclass(frozen=True)
class RunConfig:
    """One training configuration."""

    name: str
    fp8: bool                 # middle layers in FP8
    checkpoint: bool          # every layer checkpointed
    hp_dtype: torch.dtype     # dtype of everything not in FP8

    @property
    def label(self) -> str:
        hp = "BF16" if self.hp_dtype == torch.bfloat16 else "FP32"
        what = f"FP8 (+{hp})" if self.fp8 else hp
        return f"{what} {'+ checkpointing' if self.checkpoint else 'no checkpointing'}"


def fp8_layer_mask(num_layers: int, fp8: bool) -> List[bool]:
    """Which layers run in FP8: all but the first and the last."""
    return [fp8 and 0 < i < num_layers - 1 for i in range(num_layers)]


class GPT(torch.nn.Module):
    """Token + learned position embedding, ``layers`` x ``te.TransformerLayer``,
    ``te.LayerNorm`` and a ``te.Linear`` head; layers take ``[seq, batch, hidden]``."""

    def __init__(self, args, device: torch.device):
        super().__init__()
        h = args.hidden
        self.tok_emb = torch.nn.Embedding(CharData.vocab_size, h, device=device)
        self.pos_emb = torch.nn.Embedding(args.seq_len, h, device=device)
        self.layers = torch.nn.ModuleList(
            te.TransformerLayer(h, 4 * h, args.heads, hidden_dropout=args.dropout,
                                attention_dropout=args.dropout, self_attn_mask_type="causal",
                                layer_number=i + 1, params_dtype=torch.float32, device=device)
            for i in range(args.layers))
        self.ln_f = te.LayerNorm(h, params_dtype=torch.float32, device=device)
        self.head = te.Linear(h, CharData.vocab_size, bias=False, params_dtype=torch.float32,
                              device=device)
        for emb in (self.tok_emb, self.pos_emb):
            torch.nn.init.normal_(emb.weight, std=0.02)
        # How forward runs; set by `configure` (kept out of forward's arguments for DDP).
        self.layer_fp8 = [False] * args.layers
        self.checkpoint, self.use_reentrant = False, False
        self.recipe, self.amax_group = None, None

    def configure(self, config: RunConfig, recipe, amax_group, use_reentrant: bool) -> None:
        self.layer_fp8 = fp8_layer_mask(len(self.layers), config.fp8)
        self.checkpoint, self.use_reentrant = config.checkpoint, use_reentrant
        self.recipe, self.amax_group = recipe, amax_group

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = (self.tok_emb(tokens) + self.pos_emb(pos)).transpose(0, 1).contiguous()
        for layer, layer_fp8 in zip(self.layers, self.layer_fp8):

            def layer_fn(hidden, layer=layer, layer_fp8=layer_fp8):
                # The precision of this layer is chosen inside the checkpointed function.
                with te.autocast(enabled=layer_fp8, recipe=self.recipe,
                                 amax_reduction_group=self.amax_group):
                    return layer(hidden)

            if self.checkpoint and torch.is_grad_enabled():
                x = te.checkpoint(layer_fn, x, use_reentrant=self.use_reentrant)
            else:
                x = layer_fn(x)
        return self.head(self.ln_f(x)).transpose(0, 1).float()     # [batch, seq, vocab]


def fp8_modules(model: torch.nn.Module) -> list:
    """The TE modules that hold delayed-scaling state (those that ran in FP8)."""
    return [m for m in model.modules() if isinstance(m, te.TransformerEngineBaseModule)
            and m.fp8_meta.get("scaling_fwd") is not None]


def fp8_scales(model: torch.nn.Module) -> torch.Tensor:
    """Every FP8 module's forward and backward scales, concatenated (on the CPU)."""
    parts = [m.fp8_meta[k].scale for m in fp8_modules(model) for k in ("scaling_fwd", "scaling_bwd")]
    return torch.cat(parts).cpu() if parts else torch.empty(0)

# ---- training -----------------------------------------------------------------------

@dataclass
class Outcome:
    """What one run produced: the JSON-able result, the trained model, and the FP8
    scales after every step (for the bit-identity check)."""

    result: dict
    model: GPT
    scale_trace: List[torch.Tensor] = field(default_factory=list)


def learning_rate(args, step: int) -> float:
    """Linear warm-up over the first 5% of steps, then cosine decay to 10%."""
    warmup = max(1, args.steps // 20)
    if step <= warmup:
        return args.lr * step / warmup
    progress = (step - warmup) / max(1, args.steps - warmup)
    return args.lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * progress)))


def mixed_precision(config: RunConfig, device: torch.device):
    """torch.autocast to BF16 when the high-precision dtype is BF16; else nothing."""
    if config.hp_dtype == torch.bfloat16:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def evaluate(model: GPT, args, data: CharData, config: RunConfig, device, batches: int) -> float:
    """Mean validation loss over fixed batches (the same on every rank and in every run)."""
    was_training = model.training
    model.eval()
    gen = torch.Generator().manual_seed(args.seed + 12345)
    total = 0.0
    for _ in range(batches):
        x, y = data.batch("val", args.batch, gen)
        with mixed_precision(config, device):
            logits = model(x)
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).item()
    model.train(was_training)
    return total / batches


def train(config: RunConfig, args, data: CharData, device: torch.device, rank: int,
          world: int, amax_group) -> Outcome:
    """One training run from ``args.seed``; returns its `Outcome`."""
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.cuda.manual_seed_all(args.seed)
        torch.cuda.reset_peak_memory_stats(device)
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16,
                            amax_compute_algo="max", reduce_amax=not args.no_amax_reduce)
    model = GPT(args, device)
    model.configure(config, recipe, amax_group, args.use_reentrant)
    ddp = model
    if world > 1:
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(args.seed * 7919 + rank)     # each rank its own batches
    outcome = Outcome({}, model)
    losses, val_curve, saved = [], [], SavedActivations()
    tokens_per_step = args.batch * args.seq_len * world
    progress = Progress(args.steps, config.label, rank == 0 and not args.quiet)
    train_seconds = 0.0
    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = learning_rate(args, step)
        x, y = data.batch("train", args.batch, gen)
        with saved.context() if step == 1 else contextlib.nullcontext():
            with mixed_precision(config, device):
                logits = ddp(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        del logits        # drop the graph now (with it the checkpoint calls' FP8 stashes)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = loss.detach()
        if world > 1:
            dist.all_reduce(loss)
            loss /= world
        loss_value = loss.item()                 # also waits for the device
        train_seconds += time.perf_counter() - start
        if not math.isfinite(loss_value):
            raise RuntimeError(f"train_gpt.py: {config.label}: the loss is {loss_value} "
                               f"at step {step}; try a lower --lr")
        losses.append(loss_value)
        if config.fp8:
            outcome.scale_trace.append(fp8_scales(model))
        if args.eval_interval and step % args.eval_interval == 0 and step < args.steps:
            val_curve.append([step, evaluate(model, args, data, config, device, 4)])
        progress.update(step, loss_value, tokens_per_step * step / train_seconds)
    progress.close()
    val_loss = evaluate(model, args, data, config, device, args.eval_batches)
    val_curve.append([args.steps, val_loss])
    outcome.result = {
        "run": config.name, "label": config.label, "fp8": config.fp8,
        "checkpoint": config.checkpoint, "hp_dtype": str(config.hp_dtype).replace("torch.", ""),
        "fp8_layers": [i for i, f in enumerate(model.layer_fp8) if f],
        "train_loss": losses, "val_curve": val_curve, "final_train_loss": losses[-1],
        "val_loss": val_loss, "tokens_per_s": tokens_per_step * args.steps / train_seconds,
        "train_seconds": train_seconds, "peak_memory_mb": peak_memory_mb(device),
        "saved_activations_mb": saved.megabytes,
        "recompute_stash_tensors_left": te.distributed.recompute_stash_count(),
    }
    if world > 1 and config.fp8:
        outcome.result["fp8_scales_identical_across_ranks"] = identical_across_ranks(
            fp8_scales(model).to(device))
    return outcome


def identical_across_ranks(t: torch.Tensor) -> bool:
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t)
    return all(torch.equal(gathered[0], g) for g in gathered[1:])

# ---- command line -------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Train a character-level GPT from te.TransformerLayer in FP8 with "
                    "per-layer checkpointing (see the module docstring).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--compare", action="store_true",
                   help="train FP8 + checkpointing, FP8 without checkpointing and the "
                        "high-precision baseline (the default without --precision/--no-checkpoint)")
    p.add_argument("--precision", choices=["fp8", "bf16", "fp32"], default=None,
                   help="train one configuration: FP8 middle layers (the rest in --hp-dtype), "
                        "or everything in BF16 / FP32")
    p.add_argument("--no-checkpoint", action="store_true",
                   help="train one configuration without activation checkpointing")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--use-reentrant", dest="use_reentrant", action="store_true",
                      help="reentrant checkpointing")
    mode.add_argument("--non-reentrant", dest="use_reentrant", action="store_false",
                      help="non-reentrant checkpointing (the default)")
    p.set_defaults(use_reentrant=False)
    p.add_argument("--hp-dtype", choices=sorted(DTYPES), default=None,
                   help="dtype of the baseline and of everything outside FP8 "
                        "(default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=16, help="sequences per step per process")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--dropout", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--data", default=None,
                   help="a text file or folder (default: this Python's standard library source)")
    p.add_argument("--max-bytes", type=int, default=4_000_000, help="cap on the text read")
    p.add_argument("--eval-interval", type=int, default=None,
                   help="steps between validation points (default: a tenth of --steps; 0: only at the end)")
    p.add_argument("--eval-batches", type=int, default=16, help="batches of the final validation")
    det = p.add_mutually_exclusive_group()
    det.add_argument("--deterministic", dest="deterministic", action="store_true", default=None,
                     help="deterministic CUDA kernels (math attention, torch deterministic "
                          "algorithms): slower, but runs repeat bit for bit (default: on for "
                          "--compare on CUDA, where the checkpointing comparison needs it)")
    det.add_argument("--nondeterministic", dest="deterministic", action="store_false",
                     help="the fastest CUDA kernels (FlashAttention's backward adds in any order)")
    p.add_argument("--no-amax-reduce", action="store_true",
                   help="do not all-reduce FP8 amaxes over the data-parallel ranks "
                        "(their scales then drift apart; for comparison)")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="folder for the JSON summary and the plot")
    p.add_argument("--no-plot", action="store_true", help="write no PNG (headless CI)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def parse_args(argv=None):
    """The arguments, checked and resolved (`resolve`); a bad one exits with usage."""
    p = build_parser()
    args = p.parse_args(argv)
    try:
        resolve(args)
    except ValueError as err:
        p.error(str(err))
    return args


def resolve(args) -> None:
    """Check the arguments and fill in ``args.configs`` (the runs) and the defaults
    that depend on others; raises ValueError saying which flag to change."""
    single = args.precision is not None or args.no_checkpoint
    if args.compare and single:
        raise ValueError("--compare trains its three fixed configurations; drop --precision / "
                         "--no-checkpoint, or drop --compare to train one configuration")
    for name in ("steps", "layers", "hidden", "heads", "seq_len", "batch", "eval_batches"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.hidden % 16 or args.hidden % args.heads:
        raise ValueError(f"--hidden must be a multiple of 16 (FP8 GEMMs) and of --heads; "
                         f"got --hidden {args.hidden} --heads {args.heads}")
    if (args.batch * args.seq_len) % 16:
        raise ValueError(f"--batch x --seq-len must be a multiple of 16 (FP8 GEMMs); got "
                         f"{args.batch} x {args.seq_len}")
    if not 0.0 <= args.dropout < 1.0:
        raise ValueError(f"--dropout must be in [0, 1), got {args.dropout}")
    if args.eval_interval is None:
        args.eval_interval = max(1, args.steps // 10)
    if args.eval_interval < 0:
        raise ValueError(f"--eval-interval must be >= 0, got {args.eval_interval}")
    if args.deterministic is None:
        args.deterministic = args.device == "cuda" and not single
    if args.hp_dtype is None:
        args.hp_dtype = "bf16" if args.device == "cuda" else "fp32"
    hp = DTYPES[args.hp_dtype]
    if single:
        precision = args.precision or "fp8"
        dtype = hp if precision == "fp8" else DTYPES[precision]
        name = precision + ("" if args.no_checkpoint else "-ckpt")
        args.configs = [RunConfig(name, precision == "fp8", not args.no_checkpoint, dtype)]
    else:
        args.compare = True
        args.configs = [RunConfig("fp8-ckpt", True, True, hp), RunConfig("fp8", True, False, hp),
                        RunConfig(f"{args.hp_dtype}-ckpt", False, True, hp)]


@contextlib.contextmanager
def deterministic_kernels(enabled: bool):
    """Deterministic kernels while inside (math attention, torch's deterministic
    algorithms, a fixed cuBLAS workspace); puts back what it found."""
    if not enabled:
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel
    saved_env = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    saved = (torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled())
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = saved_env or ":4096:8"
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with sdpa_kernel([SDPBackend.MATH]):
            yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        if saved_env is None:
            del os.environ["CUBLAS_WORKSPACE_CONFIG"]


def main(argv=None) -> List[Outcome]:
    """Train the configured runs; returns their outcomes (on every rank)."""
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("train_gpt.py: --device cuda, but CUDA is not available")
    with deterministic_kernels(args.deterministic):
        return _main(args)


def _main(args) -> List[Outcome]:
    own_group = False
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        backend = "nccl" if args.device == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=5))
        own_group = True
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    try:
        if any(c.fp8 for c in args.configs):
            ok, reason = te.is_fp8_available(return_reason=True, device=device)
            if not ok:
                raise SystemExit(f"train_gpt.py: FP8 is not available on {device}: {reason}; "
                                 "train with --precision bf16 or fp32")
            if args.layers < 3 and rank == 0:
                print("train_gpt.py: with fewer than 3 layers no layer runs in FP8 "
                      "(the first and the last stay in high precision)")
        # The amax reduction group: the data-parallel group (here, all ranks).
        amax_group = dist.new_group(list(range(world))) if world > 1 else None
        try:
            text, source = load_text(args.data, args.max_bytes)
            data = CharData(text, args.seq_len, device)
        except ValueError as err:
            raise SystemExit(str(err)) from None
        if rank == 0:
            print(f"data: {len(text):,} bytes of {source}: {len(data.train):,} training and "
                  f"{len(data.val):,} validation tokens; {world} process(es) on {device}")
        outcomes = [train(c, args, data, device, rank, world, amax_group) for c in args.configs]
        if rank == 0:
            report(args, outcomes, device, world, source)
        return outcomes
    finally:
        if own_group:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
