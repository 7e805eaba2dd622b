"""The GPU job in one run: every test file of qa/pytorch_test_files.sh, with its CUDA
cases, sharded over parallel pytest processes that share one GPU, then a one-screen
summary and a JSON record of the run.

    python3 qa/L1_pytorch_gpu/run_job.py [--workers N] [--out DIR] [--timeout S]

Each file runs as one or more pytest processes (``--shard I/K`` of tests/pytorch's
conftest: the long files are cut into K shards that run at once), longest first, at
most ``--workers`` at a time. Each process writes a JUnit report; the summary gives per
file passed / failed / errors / skipped and its seconds (the longest of its shards),
then every skip reason with its count, so no CUDA case skips unseen. A process that
dies or passes its timeout counts as an error of its file. The exit status is 1 on any
failure, error or lost shard, else 0. The record (card, torch, Triton, commit, wall
time, per-file counts) goes to DIR/l1_job.json.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import platform
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Shards of the files that would otherwise set the job's length on their own (seconds
# measured alone on an H100 are in qa/L1_pytorch_gpu/README.md). A file's shards also
# start first: the runner orders jobs by this weight, longest first.
SHARDS = {
    "tests/pytorch/test_block_scaling.py": 8,
    "tests/pytorch/test_torch_compile.py": 8,
    "tests/pytorch/test_train_gpt.py": 6,
    "tests/pytorch/test_block_gemm_routing.py": 6,
    "tests/pytorch/test_triton_kernels.py": 4,
    "tests/pytorch/test_block_scaling_modules.py": 4,
    "tests/pytorch/test_transformer_layer.py": 4,
    "tests/pytorch/test_kernel_ptx.py": 4,
    "tests/pytorch/test_fused_producers.py": 3,
    "tests/pytorch/test_modules.py": 3,
    "tests/pytorch/test_graph.py": 2,
    "tests/pytorch/test_graph_api.py": 2,
    "tests/pytorch/test_recompute_invariance.py": 2,
    "tests/pytorch/test_megatron_gpt.py": 2,
}


def test_files() -> list:
    """The TESTS array of qa/pytorch_test_files.sh."""
    text = (ROOT / "qa" / "pytorch_test_files.sh").read_text()
    body = re.search(r"TESTS=\((.*?)\n\)", text, re.S).group(1)
    return [line.strip() for line in body.splitlines()
            if line.strip() and not line.strip().startswith("#")]


def run_shard(path: str, index: int, count: int, reports: Path, timeout: float, deadline: float,
              env) -> dict:
    """One pytest process; returns its wall time, exit code and report path."""
    report = reports / f"{Path(path).stem}.{index}of{count}.xml"
    log = report.with_suffix(".log")
    timeout = min(timeout, deadline - time.monotonic())
    if timeout <= 0:
        return {"file": path, "shard": f"{index}/{count}", "seconds": 0.0,
                "code": "not run (budget spent)", "report": report, "log": log}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", "--durations=8",
           f"--junitxml={report}", path]
    if count > 1:
        cmd.append(f"--shard={index}/{count}")
    start = time.monotonic()
    with open(log, "w") as out:
        try:
            code = subprocess.run(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                  timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    return {"file": path, "shard": f"{index}/{count}", "seconds": time.monotonic() - start,
            "code": code, "report": report, "log": log}


def read_report(report: Path) -> dict:
    """Counts and skip reasons of one JUnit report."""
    counts = collections.Counter()
    reasons = collections.Counter()
    failures = []
    root = ET.parse(report).getroot()
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        kinds = {child.tag for child in case}
        if "failure" in kinds:
            counts["failed"] += 1
            failures.append(name)
        elif "error" in kinds:
            counts["errors"] += 1
            failures.append(name)
        elif "skipped" in kinds:
            counts["skipped"] += 1
            skipped = case.find("skipped")
            reasons[(skipped.get("message") or "no reason given").strip()] += 1
        else:
            counts["passed"] += 1
    return {"counts": counts, "reasons": reasons, "failures": failures}


def environment() -> dict:
    import torch
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip() or None
    return {"card": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "torch": torch.__version__, "triton": triton_version,
            "python": platform.python_version(), "commit": commit,
            "cpus": os.cpu_count()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=12)
    parser.add_argument("--out", default=str(ROOT / "qa" / "L1_pytorch_gpu" / "out"))
    parser.add_argument("--timeout", type=float, default=420.0,
                        help="seconds one pytest process may run")
    parser.add_argument("--budget", type=float, default=540.0,
                        help="seconds the whole job may run: a process still running then "
                             "is stopped, one not started is not run (both count as lost)")
    parser.add_argument("--commit", default=None,
                        help="the commit the record names (default: git's HEAD here; a "
                             "copied tree's .git may be stale)")
    parser.add_argument("--no-gpu", action="store_true",
                        help="run without a GPU (to check the runner itself on a CPU)")
    parser.add_argument("files", nargs="*", help="test files (default: the whole list)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    reports = out / "reports"
    reports.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        PYTEST_DISABLE_PLUGIN_AUTOLOAD="1",     # the image's pytest plugins are not ours
        OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    info = environment()
    if args.commit:
        info["commit"] = args.commit
    if not info["card"] and not args.no_gpu:
        print("run_job.py: no CUDA GPU: the GPU job needs one", file=sys.stderr)
        return 1
    files = args.files or test_files()
    jobs = [(f, i, SHARDS.get(f, 1)) for f in files for i in range(SHARDS.get(f, 1))]
    jobs.sort(key=lambda job: -SHARDS.get(job[0], 1))
    print(f"{info['card']}, torch {info['torch']}, Triton {info['triton']}, commit "
          f"{info['commit']}: {len(files)} files in {len(jobs)} processes, "
          f"{args.workers} at a time", flush=True)
    start = time.monotonic()
    results = []
    with concurrent.futures.ThreadPoolExecutor(args.workers) as pool:
        futures = [pool.submit(run_shard, f, i, k, reports, args.timeout,
                               start + args.budget, env)
                   for f, i, k in jobs]
        for future in concurrent.futures.as_completed(futures):
            results.append(future.result())
    wall = time.monotonic() - start
    return summarize(files, results, wall, info, out)


def summarize(files, results, wall: float, info: dict, out: Path) -> int:
    per_file = {f: {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "seconds": 0.0,
                    "lost_shards": []} for f in files}
    reasons = collections.Counter()
    failures = []
    for r in results:
        entry = per_file[r["file"]]
        entry["seconds"] = max(entry["seconds"], r["seconds"])
        found = None
        if r["report"].exists():
            try:
                found = read_report(r["report"])
            except ET.ParseError:
                found = None
        # pytest's 5: nothing collected (a file that skips itself whole, reason in its log)
        if found is None or r["code"] not in (0, 1, 5):
            entry["lost_shards"].append(f"{r['shard']} ({r['code']}; {r['log'].name})")
            entry["errors"] += 1
            failures.append(f"{r['file']} shard {r['shard']}: exit {r['code']}, see "
                            f"{r['log']}")
        if found is not None:
            for key, n in found["counts"].items():
                entry[key] += n
            reasons.update(found["reasons"])
            failures.extend(found["failures"])
    totals = collections.Counter()
    for entry in per_file.values():
        totals.update({k: entry[k] for k in ("passed", "failed", "errors", "skipped")})
    print(f"\n{'file':<52} {'pass':>5} {'fail':>4} {'err':>3} {'skip':>5} {'s':>5}")
    for f in sorted(per_file, key=lambda f: -per_file[f]["seconds"]):
        e = per_file[f]
        mark = "  <-- " if e["failed"] or e["errors"] else ""
        print(f"{f.replace('tests/pytorch/', ''):<52} {e['passed']:>5} {e['failed']:>4} "
              f"{e['errors']:>3} {e['skipped']:>5} {e['seconds']:>5.0f}{mark}")
    print(f"\nSkip reasons ({totals['skipped']}):")
    for reason, n in reasons.most_common():
        print(f"  [{n}] {reason[:150]}")
    if failures:
        print(f"\nFailed or errored ({len(failures)}):")
        for name in failures[:40]:
            print(f"  {name}")
    print(f"\n{info['card']}: {totals['passed']} passed, {totals['failed']} failed, "
          f"{totals['errors']} errors, {totals['skipped']} skipped in {wall:.0f} s wall")
    durations = sorted(((r["seconds"], r["file"], r["shard"]) for r in results), reverse=True)
    record = {**info, "wall_s": round(wall, 1), "totals": dict(totals),
              "slowest_processes": [{"file": f, "shard": s, "seconds": round(t, 1)}
                                    for t, f, s in durations[:15]],
              "command": "python3 qa/L1_pytorch_gpu/run_job.py",
              "files": {f: {**e, "seconds": round(e["seconds"], 1)} for f, e in per_file.items()},
              "skip_reasons": dict(reasons.most_common()), "failures": failures}
    (out / "l1_job.json").write_text(json.dumps(record, indent=1) + "\n")
    return 1 if (totals["failed"] or totals["errors"]) else 0


if __name__ == "__main__":
    sys.exit(main())
