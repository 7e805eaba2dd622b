"""Tests of the main job: examples/pytorch/train_gpt.py (a few steps of a tiny model:
the loss falls, only the middle layers run in FP8, Ctrl-C ends in one line with exit
code 130, two gloo processes keep the same FP8 scales) and compare_runs.py (FP8 with
and without checkpointing bit-identical, and a slightly nudged run caught); both
refuse bad arguments up front with one line."""

import datetime
import importlib.util
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import transformer_engine.pytorch as te

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "pytorch"


def load_example(name):
    """An example script as a module (examples/ is not a package); loading train_gpt
    first under its own name lets compare_runs' ``from train_gpt import`` find it."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


tg = load_example("train_gpt")
cr = load_example("compare_runs")

TINY = ["--steps", "8", "--layers", "3", "--hidden", "32", "--heads", "2", "--seq-len", "16",
        "--batch", "4", "--lr", "1e-2", "--quiet"]


def tiny_args(*extra):
    return tg.build_parser().parse_args([*TINY, *extra])


def has_fp8_state(module):
    return any(isinstance(m, te.TransformerEngineBaseModule) and m.fp8_meta.get("scaling_fwd")
               is not None for m in module.modules())


def test_loss_falls_and_only_the_middle_layers_run_in_fp8():
    model, log = tg.train(tiny_args("--layers", "4", "--steps", "12"))
    losses = log["train_loss"]
    assert len(losses) == 12 and all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5, losses
    assert [step for step, _ in log["val_loss"]] == list(range(1, 13))
    assert log["val_loss"][-1][1] < log["val_loss"][0][1] - 0.3
    assert [has_fp8_state(layer) for layer in model.layers] == [False, True, True, False]
    assert not has_fp8_state(model.head)
    scales = cr.fp8_scales(model)
    assert not torch.equal(scales, torch.ones_like(scales)), "the FP8 scales never moved"


def test_the_baseline_runs_nothing_in_fp8():
    model, _ = tg.train(tiny_args("--no-fp8", "--steps", "2"))
    assert not has_fp8_state(model) and cr.fp8_scales(model).numel() == 0


@pytest.fixture
def layer_forwards(monkeypatch):
    """Counts te.TransformerLayer forward calls (a recompute is a second call)."""
    calls = []
    original = te.TransformerLayer.forward

    def counted(self, *args, **kwargs):
        calls.append(self.layer_number)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(te.TransformerLayer, "forward", counted)
    return calls


@pytest.mark.parametrize("mode", [[], ["--use-reentrant"]], ids=["non-reentrant", "reentrant"])
def test_fp8_with_and_without_checkpointing_are_bit_identical(layer_forwards, mode):
    args = tiny_args(*mode)
    ckpt = cr.run(args, **cr.RUNS["fp8-ckpt"])
    ckpt_calls = len(layer_forwards)
    plain = cr.run(args, **cr.RUNS["fp8"])
    # Per step: 3 layers twice with checkpointing (first forward + recompute), once
    # without; then 8 validation batches (no checkpointing) and 1 saved-MB forward.
    assert ckpt_calls == 8 * (2 * 3 + 8 * 3) + 3
    assert len(layer_forwards) - ckpt_calls == 8 * (3 + 8 * 3) + 3
    assert cr.bit_identical(ckpt, plain)
    assert len(ckpt["fp8_scales"]) == 8 and ckpt["fp8_scales"][0].numel() > 0
    assert te.distributed.recompute_stash_count() == 0
    assert ckpt["saved_activations_mb"] < plain["saved_activations_mb"] / 3


def test_fp8_weights_train_and_checkpointing_stays_bit_identical():
    """--fp8-weights: the FP8 layers' GEMM weights are FP8 primary weights (AdamW
    writes them by quantizing); the loss falls, and checkpointing changes nothing."""
    from transformer_engine.pytorch.tensor import Float8Tensor
    args = tiny_args("--fp8-weights", "--layers", "4", "--steps", "12")
    models = []
    ckpt = cr.run(args, after_step=lambda step, model, loss: models.append(model),
                  **cr.RUNS["fp8-ckpt"])
    plain = cr.run(args, **cr.RUNS["fp8"])
    assert ckpt["label"] == "FP8 + FP32, FP8 weights, checkpointed"
    assert cr.bit_identical(ckpt, plain)
    losses = ckpt["train_loss"]
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5, losses
    # Q, K, V, projection, FC1, FC2 of the middle layers only
    assert [sum(isinstance(p, Float8Tensor) for p in layer.parameters())
            for layer in models[-1].layers] == [0, 6, 6, 0]
    with pytest.raises(ValueError, match="--fp8-weights keeps the FP8 layers' weights in FP8"):
        tg.train(tiny_args("--fp8-weights", "--no-fp8"))


def test_cuda_graphs_on_the_cpu_fail_with_a_clear_message(capsys):
    with pytest.raises(SystemExit) as stop:
        tg.main([*TINY, "--cuda-graphs"])
    assert stop.value.code == 2
    assert ("--cuda-graphs needs --device cuda (CUDA graphs capture GPU work), got --device cpu"
            in capsys.readouterr().err)
    with pytest.raises(ValueError, match="--cuda-graphs needs --device cuda"):
        tg.train(tiny_args("--cuda-graphs"))


@pytest.mark.parametrize("flags, message", [
    (["--hidden", "100"], "--hidden must be a multiple of 16 (FP8 GEMMs need it), got 100"),
    (["--hidden", "48", "--heads", "5"], "--hidden must be a multiple of --heads (5), got 48"),
    (["--batch", "3", "--seq-len", "5"],
     "--batch x --seq-len must be a multiple of 8 (FP8 GEMMs need it), got 3 x 5 = 15"),
    (["--steps", "0"], "--steps must be at least 1, got 0"),
    (["--seq-len", "-4"], "--seq-len must be at least 1, got -4"),
    (["--lr", "0"], "--lr must be positive, got 0.0"),
    (["--dropout", "1"], "--dropout must be in [0, 1), got 1.0"),
    (["--data", "/nonexistent/text.txt"], "--data: no such file: /nonexistent/text.txt"),
    (["--data", __file__, "--seq-len", "100000"],
     "training needs at least 20 x (--seq-len + 1) = 2000020"),
], ids=["hidden16", "heads", "tokens8", "steps", "seq-len", "lr", "dropout", "data", "short-data"])
def test_bad_arguments_are_refused_before_anything_is_built(flags, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        tg.check_args(tg.build_parser().parse_args(flags))


def test_fp8_shape_rules_hold_only_when_a_layer_runs_in_fp8():
    for flags in (["--no-fp8"], ["--layers", "2"]):        # no layer in FP8
        tg.check_args(tg.build_parser().parse_args([*flags, "--hidden", "100", "--heads", "4",
                                                    "--batch", "3", "--seq-len", "5"]))
    with pytest.raises(ValueError, match="multiple of 16"):
        tg.check_args(tg.build_parser().parse_args(["--layers", "3", "--hidden", "100",
                                                    "--heads", "4"]))


@pytest.mark.parametrize("script, flags, line", [
    ("train_gpt", ["--hidden", "100"],
     "train_gpt.py: error: --hidden must be a multiple of 16 (FP8 GEMMs need it), got 100"),
    ("compare_runs", ["--hidden", "100"],
     "compare_runs.py: error: --hidden must be a multiple of 16 (FP8 GEMMs need it), got 100"),
    ("train_gpt", ["--device", "cuda"], "train_gpt.py: error: --device cuda: no CUDA device"),
    ("compare_runs", ["--device", "cuda"], "compare_runs.py: error: --device cuda: no CUDA device"),
    ("train_gpt", ["--hidden", "abc"],
     "train_gpt.py: error: argument --hidden: invalid int value: 'abc'"),
], ids=["train-hidden", "compare-hidden", "train-cuda", "compare-cuda", "train-not-int"])
def test_bad_arguments_end_the_scripts_with_one_line(script, flags, line):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")        # no CUDA device, on any machine
    done = subprocess.run([sys.executable, str(EXAMPLES / f"{script}.py"), *flags], env=env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 2 and done.stdout == "", (done.returncode, done.stdout)
    assert done.stderr.count("\n") == 1 and done.stderr.startswith(line), done.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_cuda_graphs_with_reentrant_checkpointing_fail_with_a_clear_message():
    with pytest.raises(ValueError, match="needs the non-reentrant checkpoint"):
        tg.train(tiny_args("--device", "cuda", "--cuda-graphs", "--use-reentrant"))


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)),
                    reason="needs a CUDA GPU with FP8 (compute capability 8.9+)")
@pytest.mark.parametrize("precision", [[], ["--bf16"], ["--no-fp8", "--bf16"]],
                         ids=["fp8-fp32", "fp8-bf16", "bf16"])
def test_cuda_graphs_train_as_the_eager_steps_do(precision):
    """--cuda-graphs replays the forward and backward (dropout 0.05 in checkpointed
    layers): the loss after every step and every FP8 scale equal the eager run's bit
    for bit (deterministic kernels in both, as compare_runs.py uses)."""
    args = tiny_args("--device", "cuda", "--steps", "5", *precision)
    with cr.deterministic_kernels(True):
        eager = cr.run(args)
        graphed = cr.run(args, cuda_graphs=True)
    assert graphed["label"].endswith(", CUDA graphs") and graphed["capture_seconds"] > 0
    assert cr.bit_identical(eager, graphed)
    assert len(graphed["train_loss"]) == 5


def test_bit_identical_compares_every_step_and_every_scale():
    scales = [torch.ones(6), torch.full((6,), 2.0)]
    a = {"train_loss": [5.0, 4.0], "fp8_scales": scales}
    nudged = [scales[0], scales[1].clone()]
    nudged[1][5] = torch.nextafter(nudged[1][5], torch.tensor(3.0))
    assert cr.bit_identical(a, {"train_loss": [5.0, 4.0], "fp8_scales": list(scales)})
    assert not cr.bit_identical(a, {"train_loss": [5.0, 4.0], "fp8_scales": nudged})
    assert not cr.bit_identical(a, {"train_loss": [5.0, 4.0], "fp8_scales": scales[:1]})
    assert not cr.bit_identical(a, {"train_loss": [5.0, 4.000001], "fp8_scales": scales})


def test_main_job_writes_summary_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    runs = cr.main([*TINY, "--steps", "4", "--out", str(tmp_path)])
    assert list(runs) == ["fp8-ckpt", "fp8", "baseline-ckpt"]
    summary = json.loads((tmp_path / "train_gpt_summary.json").read_text())
    assert summary["checkpointing_bit_identical"] is True
    assert [r["label"] for r in summary["runs"].values()] == [
        "FP8 + FP32, checkpointed", "FP8 + FP32, no checkpointing", "FP32, checkpointed"]
    assert (tmp_path / "train_gpt_loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "after every step bit-identical: True" in capsys.readouterr().out


def test_main_job_catches_a_slightly_nudged_run(tmp_path, monkeypatch, capsys):
    """Nudge one weight of the un-checkpointed FP8 run by 0.1% after its third step:
    the comparison must say so and exit non-zero."""

    def nudged_train(args, after_step):
        def nudge(step, model, loss):
            if step == 3 and args.fp8 and not args.checkpoint:
                model.ln_f.weight.data[0] *= 1.001
            after_step(step, model, loss)
        return tg.train(args, after_step=nudge)

    monkeypatch.setattr(cr, "train", nudged_train)
    with pytest.raises(SystemExit, match="FP8 with and without checkpointing differ"):
        cr.main([*TINY, "--steps", "5", "--no-plot", "--out", str(tmp_path)])
    summary = json.loads((tmp_path / "train_gpt_summary.json").read_text())
    assert summary["checkpointing_bit_identical"] is False
    ckpt, plain = summary["runs"]["fp8-ckpt"]["train_loss"], summary["runs"]["fp8"]["train_loss"]
    assert ckpt[:3] == plain[:3] and ckpt[3:] != plain[3:]
    assert "bit-identical: False" in capsys.readouterr().out


@pytest.mark.parametrize("script", ["train_gpt", "compare_runs"])
def test_ctrl_c_prints_one_line_and_exits_130(script, tmp_path):
    cmd = [sys.executable, str(EXAMPLES / f"{script}.py"), *TINY[:-1], "--steps", "100000"]
    if script == "compare_runs":
        cmd += ["--no-plot", "--out", str(tmp_path)]
    # SIGINT at its default (a shell's background job would inherit it ignored).
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        seen, deadline = b"", time.monotonic() + 120
        while not re.search(rb"\| [1-9]\d*/100000 ", seen):  # the bar shows a step done
            assert time.monotonic() < deadline and proc.poll() is None, seen.decode()
            if select.select([proc.stderr], [], [], 1.0)[0]:
                seen += os.read(proc.stderr.fileno(), 1 << 16)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    err = (seen + err).decode()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and out == b""
    last_lines = [line for line in err.splitlines() if line.strip()]
    assert last_lines[-1].startswith("interrupted at step ") and err.count("interrupted") == 1
    assert int(last_lines[-1].split()[-1]) >= 1


# ---- two data-parallel processes over gloo -------------------------------------------

def _dp_worker(rank: int, world: int, store: str, out: str):
    """One rank: join the gloo group through a file store, train FP8 + checkpointing
    with and without the amax reduction, save the final FP8 state."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        saved = {}
        for extra in ([], ["--no-amax-reduce"]):
            model, log = tg.train(tiny_args("--steps", "4", *extra))
            saved["local" if extra else "reduced"] = {
                "scales": cr.fp8_scales(model),
                "loss": log["train_loss"],
                "params": [p.detach().clone() for p in model.parameters()]}
        torch.save(saved, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_gloo_processes_keep_the_same_fp8_scales(tmp_path):
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
    assert r0["reduced"]["scales"].numel() > 0
    assert torch.equal(r0["reduced"]["scales"], r1["reduced"]["scales"])
    assert r0["reduced"]["loss"] == r1["reduced"]["loss"]     # the mean over the ranks
    for a, b in zip(r0["reduced"]["params"], r1["reduced"]["params"]):
        assert torch.equal(a, b)                              # DDP kept the replicas in step
    # The control: each rank trains on its own batches, so without the reduction the
    # amaxes, and hence the scales, differ between the ranks.
    assert not torch.equal(r0["local"]["scales"], r1["local"]["scales"])


def test_compiled_layer_function_trains_as_the_eager_one():
    """--compile (the checkpointed layer function under torch.compile(fullgraph=True),
    its te.autocast inside), with the aot_eager backend, which runs the eager ops traced
    whole: the loss after every step and the FP8 layers' scales equal the uncompiled
    run's bit for bit, checkpointing included. (The first compiled FP8 forward gives
    every TE module without FP8 state a fresh one, the high-precision layers' too:
    NOTE [torch.compile].)"""
    import torch._dynamo

    def fp8_layer_scales(scales):
        return lambda step, model, loss: scales.append(cr.fp8_scales(model.layers[1]))

    args = tiny_args("--steps", "4")
    eager_scales, compiled_scales = [], []
    eager = cr.run(args, after_step=fp8_layer_scales(eager_scales))
    torch._dynamo.reset()
    compiled = cr.run(args, after_step=fp8_layer_scales(compiled_scales), compile=True,
                      compile_backend="aot_eager")
    torch._dynamo.reset()
    assert compiled["label"] == "FP8 + FP32, checkpointed, compiled"
    assert compiled["train_loss"] == eager["train_loss"]
    assert len(compiled_scales) == 4 and compiled_scales[0].numel() > 0
    assert all(torch.equal(a, b) for a, b in zip(eager_scales, compiled_scales))
    with pytest.raises(ValueError, match="--compile and --cuda-graphs"):
        tg.train(tiny_args("--compile", "--cuda-graphs"))
