"""The harness that runs NVIDIA's TE tests against this package (qa/te_yardstick):
its stand-ins import, raise when a test uses them, never replace a name the package
has; its selection is consistent. The stand-ins change global import state, so they
are checked in a child process."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HARNESS = ROOT / "qa" / "te_yardstick"
sys.path.insert(0, str(HARNESS))
import run  # noqa: E402
import selection  # noqa: E402


def _run(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(HARNESS)]))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=120)


def test_standins_import_raise_when_used_and_never_shadow_a_real_name():
    proc = _run("""
        import transformer_engine.pytorch as te
        import te_standins
        te.Float8Quantizer = object          # as if the package had grown the name
        try:
            te_standins.install_standins()
        except RuntimeError as err:
            assert "transformer_engine.pytorch.Float8Quantizer exists in this package" in str(err)
        else:
            raise AssertionError("a stand-in replaced a real name")
        del te.Float8Quantizer
        te_standins.install_standins()
        from transformer_engine.pytorch.module.linear import Linear
        import transformer_engine_torch as tex
        from transformer_engine.pytorch.cpp_extensions.fused_attn import FusedAttnBackend
        from transformer_engine.pytorch.attention.dot_product_attention.utils import (
            check_set_window_size)
        from transformer_engine.pytorch._extra_state import UNSAFE_PICKLE_EXTRA_STATE_ENV
        assert te.Linear is Linear                            # real names stay
        from transformer_engine.pytorch.optimizers import multi_tensor_l2norm
        assert tex.multi_tensor_l2norm is multi_tensor_l2norm  # TE re-exports it as this
        assert not isinstance(1.0, te.Float8Quantizer)
        placeholder = te.Float8Quantizer(tex.DType.kFloat8E4M3)   # import time: inert
        try:
            placeholder.scale
            answered = True
        except NotImplementedError:
            answered = False
        assert not answered, "an inert placeholder answered"
        te_standins._COLLECTING[0] = False                    # a test is running
        for use in (lambda: tex.fused_amax_and_scale_update_after_reduction(),
                    lambda: te.MXFP8Quantizer(), lambda: FusedAttnBackend["F16"]()):
            try:
                use()
            except NotImplementedError as err:
                assert "stand-in" in str(err) and "NVIDIA-native" in str(err), err
            else:
                raise AssertionError("a stand-in ran")
        assert not hasattr(tex, "__version__")           # pytest's probes see no attribute
        assert check_set_window_size("causal") == (-1, 0)
        assert check_set_window_size("padding", (3, 3)) == (3, 3)
        assert UNSAFE_PICKLE_EXTRA_STATE_ENV == "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"
        print("OK")
    """)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-3000:]


def test_selection_is_consistent():
    assert not set(selection.FILES) & set(selection.EXCLUDED_FILES)
    assert all(n >= 1 for n in selection.FILES.values())
    for test, _ids, reason in selection.DESELECT:
        assert test.split("::")[0] in selection.FILES, test
        assert reason and len(reason) < 300, test
    key = "test_fusible_ops.py::TestBasicOps::test_bias"
    assert selection.deselection_reason(f"x/y/{key}[mxfp8-cuda-dtype0-5-1]")
    assert selection.deselection_reason(f"x/y/{key}[nvfp4_4over6-cuda-dtype0-5-1]")
    assert selection.deselection_reason(f"{key}[None-cuda-dtype0-5-1]") is None
    key = "test_cuda_graphs.py::test_make_graphed_callables"
    assert selection.deselection_reason(f"{key}[None-Float8BlockScaling-dtype0-linear_op]") is None
    assert selection.deselection_reason("test_jit.py::test_lazy_compile") is not None
    assert selection.deselection_reason("test_qk_norm.py::test_qk_norm_functionality[a]") is None


_OOM = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"


def _unit(tmp_path, name, k=0, n=1, only=None, records=()):
    """A runner unit whose log holds ``records`` (as its pytest process would write)."""
    (tmp_path / "logs").mkdir(exist_ok=True)
    unit = run.Unit(str(tmp_path), str(tmp_path), name, k, n, only=only)
    with open(unit.log, "a") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")
    return unit


def _finish(nodeid, outcome, message=None):
    return {"event": "finish", "nodeid": nodeid, "outcome": outcome,
            "message": None if message is None else {"message": message, "where": "t.py:1"}}


def test_admit_fits_chunks_to_memory():
    heavy, light = "test_fused_rope.py", "test_jit.py"
    assert run.memory_gb(heavy) > run.memory_gb(light) == selection.DEFAULT_MEMORY_GB
    queue = [run.Unit("t", "o", heavy, 0, 2), run.Unit("t", "o", light, 0, 1)]
    assert run.admit(queue, 0.0, 0, 80.0) == 0
    # the heavy chunk does not fit beside 60 GiB of running chunks; the light one does
    assert run.admit(queue, 60.0, 3, 80.0) == 1
    assert run.admit(queue, 78.0, 5, 80.0) is None
    # a chunk heavier than the whole budget still runs, alone
    assert run.admit(queue[:1], 0.0, 0, 10.0) == 0 and run.admit(queue[:1], 1.0, 1, 10.0) is None


def test_run_parallel_never_exceeds_the_memory_budget():
    import threading
    import time
    units = [run.Unit("t", "o", name, k, 4) for name in ("test_fused_rope.py", "test_jit.py")
             for k in range(4)]
    lock, now, peak = threading.Lock(), {"gb": 0.0}, {"gb": 0.0}
    done = []

    def run_one(unit):
        with lock:
            now["gb"] += run.memory_gb(unit.name)
            peak["gb"] = max(peak["gb"], now["gb"])
        time.sleep(0.01)
        with lock:
            now["gb"] -= run.memory_gb(unit.name)
            done.append(unit)
    run.run_parallel(units, 8, 50.0, run_one)
    assert len(done) == 8 and 0 < peak["gb"] <= 50.0


def test_environment_failures_run_again_alone_and_count_apart(tmp_path):
    """Parallel pass: an OOM, a device-busy error, a real failure, a crash and a
    timeout. The OOM passes alone; the busy one stays busy alone (env_failed); the
    real failure and the timeout are not run again; the crash fails alone for real."""
    t = "test_x.py::test_"
    main = _unit(tmp_path, "test_x.py", records=[
        {"event": "selected", "nodeid": t + n} for n in "abcdef"] + [
        _finish(t + "a", "failed", _OOM),
        _finish(t + "b", "error", "RuntimeError: CUDA error: CUDA-capable device(s) is/are "
                                  "busy or unavailable"),
        _finish(t + "c", "failed", "AssertionError: Tensor-likes are not close!"),
        {"event": "crash", "nodeid": t + "d", "message": "the process died during this test: "
                                                         "exit code -11 (signal 11)"},
        {"event": "crash", "nodeid": t + "e", "message": "ran longer than the per-test limit "
                                                         "of 120 s (process ended)"},
        _finish(t + "f", "passed"),
        {"event": "memory", "peak_gb": 3.5}])
    results = run.read_results([main])[0]
    assert run.needs_alone(results) == {"test_x.py": [t + "a", t + "b", t + "d"]}
    alone = _unit(tmp_path, "test_x.py", only=str(tmp_path / "list.txt"), records=[
        _finish(t + "a", "passed"),
        _finish(t + "b", "error", "RuntimeError: CUDA error: unknown error"),
        _finish(t + "d", "failed", "ValueError: a real one")])
    report = run.summarize([main, alone], str(tmp_path), {"workers": 2})
    totals = report["totals"]
    assert (totals["passed"], totals["failed"], totals["error"], totals["crashed"],
            totals["env_failed"]) == (2, 2, 0, 1, 1)
    assert report["env_failures"] == [t + "b"]
    assert report["package_failures"] == 3
    assert report["run_alone"]["passed"] == 1 and report["run_alone"]["env_failed"] == 1
    assert report["memory_peak_gb"]["test_x.py"]["peak"] == 3.5
    summary = (tmp_path / "summary.md").read_text()
    assert "**3** failures of the package" in summary and "**1** of the environment" in summary


def test_only_option_runs_the_listed_tests(tmp_path):
    """``--yardstick-only`` (the serial pass) keeps exactly the listed node ids."""
    (tmp_path / "test_pick.py").write_text(
        "import pytest\n@pytest.mark.parametrize('i', range(4))\ndef test_p(i):\n    pass\n")
    listing = tmp_path / "only.txt"
    listing.write_text("test_pick.py::test_p[1]\ntest_pick.py::test_p[3]\n")
    log = tmp_path / "log.jsonl"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(HARNESS)]))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "te_standins",
         "-c", str(HARNESS / "pytest.ini"), f"--rootdir={tmp_path}", str(tmp_path / "test_pick.py"),
         f"--yardstick-only={listing}", f"--yardstick-log={log}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:]
    done = [json.loads(line)["nodeid"] for line in log.read_text().splitlines()
            if json.loads(line)["event"] == "finish"]
    assert done == ["test_pick.py::test_p[1]", "test_pick.py::test_p[3]"]
