"""Benchmarks write their JSON to the git-ignored benchmarks/out/ unless told otherwise
with --out: running one never overwrites a committed result in benchmarks/results/."""

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"


def _calls(tree, name):
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call)
            and getattr(node.func, "id", getattr(node.func, "attr", None)) == name]


def test_every_benchmark_takes_the_shared_out_option():
    writers = []
    for path in sorted(BENCHMARKS.glob("*.py")):
        if path.name == "common.py":
            continue
        tree = ast.parse(path.read_text())
        own_out = [c for c in _calls(tree, "add_argument")
                   if c.args and isinstance(c.args[0], ast.Constant) and c.args[0].value == "--out"]
        assert not own_out, f"{path.name} defines its own --out; use common.add_out_argument"
        if _calls(tree, "write_json"):
            writers.append(path.name)
            assert _calls(tree, "add_out_argument"), f"{path.name} writes JSON without --out"
    assert len(writers) >= 10, writers                     # the scan saw the benchmarks


def test_the_default_folder_is_ignored_and_not_the_results():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import common
    finally:
        sys.path.remove(str(BENCHMARKS))
    default = pathlib.Path(common.DEFAULT_OUT)
    assert default.parent == BENCHMARKS and default.name != "results"
    probe = default / "bench_x_cpu.json"
    inside = subprocess.run(["git", "rev-parse", "--is-inside-work-tree"], cwd=ROOT,
                            capture_output=True, text=True)
    if inside.stdout.strip() != "true":
        pytest.skip("not a git checkout: git check-ignore cannot answer")
    ignored = subprocess.run(["git", "check-ignore", "-q", str(probe)], cwd=ROOT)
    assert ignored.returncode == 0, f"{probe} is not git-ignored"
    kept = subprocess.run(["git", "check-ignore", "-q", str(BENCHMARKS / "results" / "x.json")],
                          cwd=ROOT)
    assert kept.returncode == 1, "benchmarks/results/ must stay tracked"
