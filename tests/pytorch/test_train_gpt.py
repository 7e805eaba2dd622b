"""Smoke tests of the main job, examples/pytorch/train_gpt.py: a few steps of a tiny
model (the loss falls, FP8 + checkpointing equals FP8 without it bit for bit, the
per-layer precision is what it says), its outputs, its argument checks, and two
data-parallel processes over gloo ending with identical FP8 scales."""

import datetime
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import transformer_engine.pytorch as te

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "pytorch" / "train_gpt.py"


def load_script():
    """The script as a module (examples/ is not a package)."""
    if "train_gpt" in sys.modules:
        return sys.modules["train_gpt"]
    spec = importlib.util.spec_from_file_location("train_gpt", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_gpt"] = module       # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


tg = load_script()


def tiny_args(out, *extra):
    return ["--steps", "8", "--layers", "3", "--hidden", "32", "--heads", "2", "--seq-len", "16",
            "--batch", "4", "--lr", "1e-2", "--max-bytes", "200000", "--eval-batches", "2",
            "--eval-interval", "0", "--quiet", "--no-plot", "--out", str(out), *extra]


@pytest.fixture
def count_layer_forwards(monkeypatch):
    """Counts te.TransformerLayer forward calls (a recompute is a second call)."""
    calls = []
    original = te.TransformerLayer.forward

    def counted(self, *args, **kwargs):
        calls.append(self.layer_number)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(te.TransformerLayer, "forward", counted)
    return calls


@pytest.mark.parametrize("mode", ["--non-reentrant", "--use-reentrant"])
def test_fp8_checkpointing_matches_no_checkpointing(tmp_path, count_layer_forwards, mode):
    (ckpt,) = tg.main(tiny_args(tmp_path, "--precision", "fp8", mode))
    ckpt_calls = len(count_layer_forwards)
    (plain,) = tg.main(tiny_args(tmp_path, "--precision", "fp8", "--no-checkpoint", mode))
    plain_calls = len(count_layer_forwards) - ckpt_calls
    steps, layers, eval_batches = 8, 3, 2
    # Every layer ran twice per step with checkpointing (phase 1 + recompute), once without.
    assert ckpt_calls == 2 * steps * layers + eval_batches * layers
    assert plain_calls == steps * layers + eval_batches * layers
    losses = ckpt.result["train_loss"]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-2:]) / 2 < losses[0] - 0.3, losses
    assert losses == plain.result["train_loss"]
    assert ckpt.result["val_loss"] == plain.result["val_loss"]
    assert len(ckpt.scale_trace) == steps
    for step, (a, b) in enumerate(zip(ckpt.scale_trace, plain.scale_trace), 1):
        assert torch.equal(a, b), f"FP8 scales differ after step {step}"
    assert not torch.equal(ckpt.scale_trace[-1], torch.ones_like(ckpt.scale_trace[-1])), \
        "the FP8 scales never moved from 1: the layer did not run in FP8"
    assert ckpt.result["recompute_stash_tensors_left"] == 0
    assert ckpt.result["saved_activations_mb"] < plain.result["saved_activations_mb"]


def test_only_the_middle_layers_run_in_fp8(tmp_path):
    (fp8,) = tg.main(tiny_args(tmp_path, "--precision", "fp8", "--layers", "4"))
    (fp32,) = tg.main(tiny_args(tmp_path, "--precision", "fp32", "--layers", "4"))
    assert fp8.result["fp8_layers"] == [1, 2]
    has_state = [bool(tg.fp8_modules(layer)) for layer in fp8.model.layers]
    assert has_state == [False, True, True, False]
    assert not tg.fp8_modules(fp8.model.head) and not tg.fp8_modules(fp32.model)
    # Same seed and data: the baseline differs only through the FP8 layers.
    assert fp8.result["train_loss"][0] != fp32.result["train_loss"][0]
    assert abs(fp8.result["train_loss"][-1] - fp32.result["train_loss"][-1]) < 0.25


def test_compare_writes_summary_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    args = [a for a in tiny_args(tmp_path, "--steps", "4") if a != "--no-plot"]
    outcomes = tg.main(args)
    assert [o.result["run"] for o in outcomes] == ["fp8-ckpt", "fp8", "fp32-ckpt"]
    summary = json.loads((tmp_path / "train_gpt_summary.json").read_text())
    assert summary["checkpointing_bit_identical"] is True
    assert [r["label"] for r in summary["runs"]] == [
        "FP8 (+FP32) + checkpointing", "FP8 (+FP32) no checkpointing", "FP32 + checkpointing"]
    png = (tmp_path / "train_gpt_loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "losses bit-identical: True" in printed and "tokens/s" in printed


def test_no_plot_writes_no_png(tmp_path):
    tg.main(tiny_args(tmp_path, "--precision", "fp32", "--steps", "2"))
    assert (tmp_path / "train_gpt_summary.json").exists()
    assert not (tmp_path / "train_gpt_loss.png").exists()


def test_data_split_is_deterministic_and_disjoint(tmp_path):
    text = bytes(range(1, 256)) * 200     # no NUL: a NUL marks a binary file
    (tmp_path / "a.txt").write_bytes(text)
    loaded, what = tg.load_text(str(tmp_path), 10 ** 6)
    assert loaded == text and str(tmp_path) in what
    a, b = tg.CharData(loaded, 16, torch.device("cpu")), tg.CharData(loaded, 16, torch.device("cpu"))
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    assert len(a.train) + len(a.val) == len(text) and len(a.val) * 8 < len(a.train)
    x, y = a.batch("val", 3, torch.Generator().manual_seed(0))
    assert torch.equal(x[:, 1:], y[:, :-1])


@pytest.mark.parametrize("argv, message", [
    (["--compare", "--precision", "bf16"], "--compare trains its three fixed configurations"),
    (["--compare", "--no-checkpoint"], "drop --compare to train one configuration"),
    (["--hidden", "40"], r"--hidden must be a multiple of 16 \(FP8 GEMMs\) and of --heads; "
                         r"got --hidden 40 --heads 4"),
    (["--hidden", "48", "--heads", "5"], "got --hidden 48 --heads 5"),
    (["--batch", "3", "--seq-len", "15"], "--batch x --seq-len must be a multiple of 16 .*3 x 15"),
    (["--steps", "0"], "--steps must be positive, got 0"),
    (["--dropout", "1.0"], r"--dropout must be in \[0, 1\), got 1.0"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(ValueError, match=message):
        tg.resolve(tg.build_parser().parse_args(argv))
    with pytest.raises(SystemExit):
        tg.parse_args(argv)
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize("argv, runs", [
    ([], ["fp8-ckpt", "fp8", "fp32-ckpt"]),
    (["--hp-dtype", "bf16"], ["fp8-ckpt", "fp8", "bf16-ckpt"]),
    (["--precision", "bf16"], ["bf16-ckpt"]),
    (["--no-checkpoint"], ["fp8"]),
    (["--precision", "fp32", "--no-checkpoint"], ["fp32"]),
])
def test_runs_chosen_by_the_flags(argv, runs):
    args = tg.parse_args(argv)
    assert [c.name for c in args.configs] == runs
    assert args.compare == (len(runs) == 3)


@pytest.mark.parametrize("argv, deterministic", [
    ([], False),                                    # CPU kernels are deterministic anyway
    (["--device", "cuda"], True),                   # the CUDA comparison needs it
    (["--device", "cuda", "--precision", "fp8"], False),
    (["--device", "cuda", "--nondeterministic"], False),
    (["--precision", "fp8", "--deterministic"], True),
])
def test_deterministic_kernels_default(argv, deterministic):
    assert tg.parse_args(argv).deterministic is deterministic


def test_deterministic_kernels_put_back_what_they_found(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = torch.are_deterministic_algorithms_enabled()
    with tg.deterministic_kernels(True):
        assert torch.are_deterministic_algorithms_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert not torch.backends.cuda.flash_sdp_enabled()
    assert torch.are_deterministic_algorithms_enabled() == before
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    assert torch.backends.cuda.flash_sdp_enabled()


def test_a_missing_data_path_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--data .*nowhere.* is neither a file nor a folder"):
        tg.load_text(str(tmp_path / "nowhere"), 1000)
    (tmp_path / "short.txt").write_text("too short")
    with pytest.raises(ValueError, match="only 9 bytes of text"):
        tg.load_text(str(tmp_path / "short.txt"), 1000)


# ---- two data-parallel processes over gloo -------------------------------------------

def _dp_worker(rank: int, world: int, store: str, out: str):
    """One rank: join the gloo group through a file store, train FP8 + checkpointing
    with and without the amax reduction, save the final FP8 state."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        module = tg
        saved = {}
        for extra in ([], ["--no-amax-reduce"]):
            (outcome,) = module.main(tiny_args(Path(out) / "run", "--steps", "4",
                                               "--precision", "fp8", *extra))
            metas = [m.fp8_meta for m in module.fp8_modules(outcome.model)]
            saved["reduced" if not extra else "local"] = {
                "scales": module.fp8_scales(outcome.model),
                "histories": [m[k].amax_history.clone() for m in metas
                              for k in ("scaling_fwd", "scaling_bwd")],
                "loss": outcome.result["train_loss"],
                "params": [p.detach().clone() for p in outcome.model.parameters()],
                "says_identical": outcome.result["fp8_scales_identical_across_ranks"]}
        torch.save(saved, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_gloo_processes_end_with_identical_fp8_scales(tmp_path):
    world, deadline = 2, time.monotonic() + 240
    context = mp.start_processes(_dp_worker, args=(world, str(tmp_path / "store"), str(tmp_path)),
                                 nprocs=world, join=False, start_method="spawn")
    try:
        while not context.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                pytest.fail("the two gloo processes did not finish within 240 s")
    finally:
        for p in context.processes:
            if p.is_alive():
                p.kill()
                p.join()
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(world))
    reduced0, reduced1 = r0["reduced"], r1["reduced"]
    assert torch.equal(reduced0["scales"], reduced1["scales"])
    for a, b in zip(reduced0["histories"], reduced1["histories"]):
        assert torch.equal(a, b)
    assert reduced0["says_identical"] and reduced1["says_identical"]
    assert reduced0["loss"] == reduced1["loss"]         # the loss is averaged over the ranks
    for a, b in zip(reduced0["params"], reduced1["params"]):
        assert torch.equal(a, b)                        # DDP kept the replicas in step
    # The control: each rank sees its own batches, so without the reduction the
    # amaxes, and hence the scales, differ between the ranks.
    assert not torch.equal(r0["local"]["scales"], r1["local"]["scales"])
    assert not (r0["local"]["says_identical"] or r1["local"]["says_identical"])
