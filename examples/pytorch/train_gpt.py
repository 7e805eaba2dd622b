"""Train a small character-level GPT with Transformer Engine, in FP8, with every
layer checkpointed.

The model is ``--layers`` x ``te.TransformerLayer`` between a byte embedding and a
``te.Linear`` head. Each layer runs under ``te.checkpoint``, and the precision of
each layer is chosen by a ``te.autocast`` opened *inside* the checkpointed function:
the first and the last layer run in high precision, the others in FP8 with delayed
scaling. The text is this Python's standard library source, one byte per token.

    python examples/pytorch/train_gpt.py                       # FP8, checkpointed
    python examples/pytorch/train_gpt.py --no-fp8              # the FP32 baseline
    python examples/pytorch/train_gpt.py --device cuda --bf16 --cuda-graphs
    python examples/pytorch/train_gpt.py --device cuda --bf16 --compile
    torchrun --nproc-per-node 2 examples/pytorch/train_gpt.py  # data-parallel (DDP)

Under torchrun every rank trains on its own batches and the FP8 amaxes are reduced
(MAX) over the data-parallel group, so all ranks keep the same FP8 scales.
With ``--cuda-graphs`` (one CUDA process) the model's forward and backward are
captured once as CUDA graphs by ``te.make_graphed_callables`` and every step replays
them (batch and sequence length are fixed); the loss and the optimizer step stay eager.
With ``--compile`` the layer function (the one each checkpoint calls, with its
``te.autocast`` inside) is compiled once by ``torch.compile(fullgraph=True)`` and shared
by all layers; the embeddings, the head and the loss stay eager.
compare_runs.py trains three configurations with ``train`` below and checks that
FP8 with and without checkpointing give bit-identical results.
"""

import argparse
import os
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR
from tqdm import tqdm

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Format

VOCAB = 256   # bytes


class OneLineParser(argparse.ArgumentParser):
    """argparse, except that a bad argument ends the script with one line on stderr
    (exit code 2) instead of the usage text and the message."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(description=__doc__.split("\n\n")[0],
                      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128, help="a multiple of 16 (FP8 GEMMs)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=16, help="sequences per step and process")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--dropout", type=float, default=0.05, help="after attention and MLP")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", help="a text file to train on instead of the standard library")
    p.add_argument("--no-fp8", dest="fp8", action="store_false", help="no layer in FP8")
    p.add_argument("--no-checkpoint", dest="checkpoint", action="store_false",
                   help="keep every activation instead of recomputing the layers")
    p.add_argument("--use-reentrant", action="store_true", help="reentrant checkpointing")
    p.add_argument("--bf16", action="store_true", help="run what is not FP8 in BF16, not FP32")
    p.add_argument("--fp8-weights", action="store_true",
                   help="keep the FP8 layers' GEMM weights in FP8 only (te.quantized_model_init)")
    p.add_argument("--no-amax-reduce", action="store_true",
                   help="under torchrun, let each rank keep its own FP8 amaxes")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="replay each step's forward and backward as CUDA graphs (one CUDA process)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the layer function (fullgraph)")
    p.add_argument("--compile-backend", default="inductor",
                   help="the torch.compile backend of --compile (aot_eager: the eager ops, traced)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def check_args(args) -> None:
    """Refuse values and flag combinations that cannot run, with the reason in one line
    (ValueError), before anything is built."""
    for name in ("steps", "layers", "hidden", "heads", "seq_len", "batch"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, "
                             f"got {getattr(args, name)}")
    if not args.lr > 0:
        raise ValueError(f"--lr must be positive, got {args.lr}")
    if not 0 <= args.dropout < 1:
        raise ValueError(f"--dropout must be in [0, 1), got {args.dropout}")
    if args.hidden % args.heads:
        raise ValueError(f"--hidden must be a multiple of --heads ({args.heads}), got {args.hidden}")
    if args.fp8 and args.layers >= 3:               # some layer runs in FP8
        if args.hidden % 16:
            raise ValueError(f"--hidden must be a multiple of 16 (FP8 GEMMs need it), "
                             f"got {args.hidden}")
        if args.batch * args.seq_len % 8:
            raise ValueError(f"--batch x --seq-len must be a multiple of 8 (FP8 GEMMs need it), "
                             f"got {args.batch} x {args.seq_len} = {args.batch * args.seq_len}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device cuda: no CUDA device (torch {torch.__version__} sees none)")
    if args.data:
        if not os.path.isfile(args.data):
            raise ValueError(f"--data: no such file: {args.data}")
        size, needed = os.path.getsize(args.data), 20 * (args.seq_len + 1)
        if size < needed:                           # training and validation windows
            raise ValueError(f"--data: {args.data} has {size} bytes; training needs at least "
                             f"20 x (--seq-len + 1) = {needed}")
    if getattr(args, "compile", False) and args.cuda_graphs:
        raise ValueError("--compile and --cuda-graphs are two ways to cut the host time; "
                         "pick one")
    if args.cuda_graphs and args.device != "cuda":
        raise ValueError(f"--cuda-graphs needs --device cuda (CUDA graphs capture GPU work), "
                         f"got --device {args.device}")
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    if args.cuda_graphs and world > 1:
        raise ValueError("--cuda-graphs runs in one process; under torchrun leave it out")
    if getattr(args, "fp8_weights", False) and not args.fp8:
        raise ValueError("--fp8-weights keeps the FP8 layers' weights in FP8; with --no-fp8 "
                         "there are none")
    if getattr(args, "fp8_weights", False) and world > 1:
        raise ValueError("--fp8-weights runs in one process (DistributedDataParallel is not "
                         "tested with FP8 weights); under torchrun leave it out")
    if getattr(args, "compile", False) and world > 1:
        raise ValueError("--compile runs in one process (torch.compile of the FP8 layers "
                         "under DDP is not tested); under torchrun leave it out")
    if args.cuda_graphs and args.checkpoint and args.use_reentrant:
        raise ValueError("--cuda-graphs needs the non-reentrant checkpoint (its recompute is "
                         "captured in the backward graph); leave out --use-reentrant")


def describe(args) -> str:
    precision = ("FP8 + " if args.fp8 else "") + ("BF16" if args.bf16 else "FP32")
    weights = ", FP8 weights" if getattr(args, "fp8_weights", False) else ""
    graphs = ", CUDA graphs" if getattr(args, "cuda_graphs", False) else ""
    graphs += ", compiled" if getattr(args, "compile", False) else ""
    return (f"{precision}{weights}, "
            f"{'checkpointed' if args.checkpoint else 'no checkpointing'}{graphs}")


# ---- data -------------------------------------------------------------------------

def load_tokens(path=None, max_bytes=4_000_000) -> torch.Tensor:
    """The bytes of ``path``, or else of the standard library's ``*.py`` files sorted
    by path (the same text in every run), as token ids."""
    if path:
        text = Path(path).read_bytes()
    else:
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        files, size = [], 0
        for source in sorted(stdlib.rglob("*.py")):
            if "site-packages" not in source.parts and size < max_bytes:
                files.append(source.read_bytes())
                size += len(files[-1]) + 1
        text = b"\n".join(files)
    return torch.frombuffer(bytearray(text[:max_bytes]), dtype=torch.uint8).long()


def get_batch(tokens, args, generator):
    """Random windows of the text: inputs and next-byte targets, each [batch, seq]."""
    starts = torch.randint(len(tokens) - args.seq_len - 1, (args.batch,), generator=generator)
    windows = tokens[starts[:, None] + torch.arange(args.seq_len + 1)]
    return windows[:, :-1], windows[:, 1:]


# ---- model ------------------------------------------------------------------------

class GPT(torch.nn.Module):
    def __init__(self, args, device):
        super().__init__()
        h = args.hidden
        self.tok_emb = torch.nn.Embedding(VOCAB, h, device=device)
        self.pos_emb = torch.nn.Embedding(args.seq_len, h, device=device)
        torch.nn.init.normal_(self.tok_emb.weight, std=0.02)
        torch.nn.init.normal_(self.pos_emb.weight, std=0.02)
        # FP8 in all layers but the first and the last.
        self.layer_fp8 = [args.fp8 and 0 < i < args.layers - 1 for i in range(args.layers)]
        self.recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16,
                                     amax_compute_algo="max", reduce_amax=not args.no_amax_reduce)
        fp8_weights = getattr(args, "fp8_weights", False)
        layers = []
        for i in range(args.layers):
            # No attention dropout: it sends torch's CPU attention down a much slower path.
            with te.quantized_model_init(enabled=fp8_weights and self.layer_fp8[i],
                                         recipe=self.recipe):
                layers.append(te.TransformerLayer(
                    h, 4 * h, args.heads, hidden_dropout=args.dropout, attention_dropout=0.0,
                    self_attn_mask_type="causal", layer_number=i + 1, device=device))
        self.layers = torch.nn.ModuleList(layers)
        self.ln_f = te.LayerNorm(h, device=device)
        self.head = te.Linear(h, VOCAB, bias=False, device=device)
        # The amaxes are reduced over the data-parallel group: here, all ranks.
        self.amax_group = dist.group.WORLD if dist.is_initialized() else None
        self.checkpoint, self.use_reentrant = args.checkpoint, args.use_reentrant
        # one compiled layer function for all layers (a graph per precision and phase)
        self.layer_fn = (torch.compile(self.run_layer, fullgraph=True,
                                       backend=getattr(args, "compile_backend", "inductor"))
                         if getattr(args, "compile", False) else self.run_layer)

    def run_layer(self, layer, fp8, x):
        """One layer in its own precision; this is the function that is checkpointed."""
        with te.autocast(enabled=fp8, recipe=self.recipe, amax_reduction_group=self.amax_group):
            return layer(x)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        # [seq, batch, h], laid out as such (every layer sees one layout: one compiled graph)
        x = (self.tok_emb(tokens) + self.pos_emb(positions)).transpose(0, 1).contiguous()
        for layer, fp8 in zip(self.layers, self.layer_fp8):
            if self.checkpoint and torch.is_grad_enabled():
                x = te.checkpoint(self.layer_fn, layer, fp8, x, use_reentrant=self.use_reentrant)
            else:
                x = self.layer_fn(layer, fp8, x)
        return self.head(self.ln_f(x)).transpose(0, 1)                        # [batch, seq, vocab]


def cross_entropy(model, x, y, bf16: bool) -> torch.Tensor:
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = model(x)
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def capture_cuda_graphs(model, sample_tokens, bf16: bool) -> float:
    """Capture the model's training forward and backward as CUDA graphs; later training
    calls replay them (evaluation runs eagerly). Each layer's FP8 autocast is opened
    inside the model, so the graphs are made with FP8 off at the top; the torch.autocast
    of training is captured with them (without its weight cache, which a graph could
    not keep). Returns the seconds it took."""
    start = time.perf_counter()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16, cache_enabled=False):
        te.make_graphed_callables(model, (sample_tokens,))
    return time.perf_counter() - start


@torch.no_grad()
def evaluate(model, tokens, args, device, batches=8) -> float:
    """Mean loss on fixed validation batches (the same in every run and on every rank)."""
    model.eval()
    generator = torch.Generator().manual_seed(args.seed)
    losses = []
    for _ in range(batches):
        x, y = get_batch(tokens, args, generator)
        losses.append(cross_entropy(model, x.to(device), y.to(device), args.bf16))
    model.train()
    return torch.stack(losses).mean().item()


# ---- training ---------------------------------------------------------------------

def train(args, after_step=None):
    """Train one model as ``args`` say. ``after_step(step, model, loss)`` runs after
    every optimizer step. Returns the model and a log: the training loss of every
    step, the validation loss at a tenth of the run, tokens per second."""
    check_args(args)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    device = torch.device(args.device, torch.cuda.current_device() if args.device == "cuda" else None)
    tokens = load_tokens(args.data)
    blocks = tokens.split(max(args.seq_len + 1, len(tokens) // 100))
    train_tokens = torch.cat([b for i, b in enumerate(blocks) if i % 10 != 9])
    val_tokens = torch.cat(blocks[9::10])           # every tenth block is for validation

    torch.manual_seed(args.seed)                    # the same weights in every run and rank
    model = GPT(args, device)
    ddp_model = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    warmup = max(1, args.steps // 20)               # linear warm-up, then cosine to lr / 10
    scheduler = SequentialLR(optimizer, [
        LinearLR(optimizer, start_factor=1 / warmup, total_iters=warmup),
        CosineAnnealingLR(optimizer, T_max=max(1, args.steps - warmup), eta_min=args.lr / 10),
    ], milestones=[warmup])
    batches = torch.Generator().manual_seed(args.seed + 1 + rank)  # each rank its own batches

    log = {"train_loss": [], "val_loss": [], "seconds": 0.0, "step_seconds": []}
    if args.cuda_graphs:                            # any batch of the fixed shape will do
        sample, _ = get_batch(train_tokens, args, torch.Generator().manual_seed(args.seed))
        log["capture_seconds"] = capture_cuda_graphs(model, sample.to(device), args.bf16)
    step = 0
    with tqdm(total=args.steps, desc=describe(args), unit="step",
              disable=args.quiet or rank != 0) as bar:
        try:
            for step in range(1, args.steps + 1):
                start = time.perf_counter()
                x, y = get_batch(train_tokens, args, batches)
                loss = cross_entropy(ddp_model, x.to(device), y.to(device), args.bf16)
                loss.backward()
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                loss = loss.detach()
                if world > 1:                       # the mean over the ranks
                    dist.all_reduce(loss)
                    loss /= world
                log["train_loss"].append(loss.item())
                log["step_seconds"].append(time.perf_counter() - start)
                log["seconds"] += log["step_seconds"][-1]
                if step % max(1, args.steps // 10) == 0 or step == args.steps:
                    log["val_loss"].append([step, evaluate(model, val_tokens, args, device)])
                if after_step is not None:
                    after_step(step, model, loss)
                bar.set_postfix(loss=f"{log['train_loss'][-1]:.3f}", refresh=False)
                bar.update()
        except KeyboardInterrupt:
            raise KeyboardInterrupt(f"interrupted at step {step}") from None
    log["tokens_per_s"] = args.steps * args.batch * args.seq_len * world / log["seconds"]
    return model, log


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_args(args)
    except ValueError as err:
        parser.error(str(err))
    if "WORLD_SIZE" in os.environ:                  # started by torchrun
        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    try:
        _, log = train(args)
        if not dist.is_initialized() or dist.get_rank() == 0:
            captured = (f" (CUDA graphs captured in {log['capture_seconds']:.1f} s)"
                        if "capture_seconds" in log else "")
            print(f"{describe(args)}: validation loss {log['val_loss'][-1][1]:.4f}, "
                  f"{log['tokens_per_s']:,.0f} tokens/s{captured}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt as interrupt:          # Ctrl-C: one line, the shell's code 130
        print(interrupt or "interrupted", file=sys.stderr)
        sys.exit(130)
