"""Run NVIDIA's TE ``tests/pytorch`` files (selection.py) against this package, in
parallel pytest processes on one GPU, within a time budget; write the per-file counts
and the failures grouped by message. ``run.sh`` is the entry point (README.md).

    python3 run.py <TE tests/pytorch> <out dir> [file.py ...]

Environment: YARDSTICK_WORKERS (processes at once, default 12), YARDSTICK_MEMORY_GB
(GPU memory the chunks may take together, default 90% of the card's free memory at
the start), YARDSTICK_BUDGET_S (seconds for the parallel pass, default 400),
YARDSTICK_ALONE_BUDGET_S (seconds for the serial pass, default 80),
YARDSTICK_TEST_TIMEOUT_S (one test, default 120), YARDSTICK_COMMIT (the commit to
report), YARDSTICK_K (a pytest -k expression: run only the matching tests; the counts
then cover that subset), PYTHON (default: this interpreter).

Each selected file runs as ``FILES[file]`` chunks (every n-th test), each chunk a
pytest process of its own (so one test file's process state never leaks into
another's, as in TE's own CI, which runs each file alone). Chunks are queued largest
file first onto the workers; a chunk starts only while the memory weights
(selection.MEMORY_GB) of the chunks running and its own fit in YARDSTICK_MEMORY_GB. A
chunk whose process dies (crash, or a test over the per-test limit) is restarted
after the test it died in, which is recorded as crashed; whatever the budget leaves
unstarted (or stops) is recorded as not run.

NOTE [Environment failures]
    A test that fails with a message of the shared card (`ENV_FAILURE`: out of
    memory, device busy or unavailable, unknown error) or whose process died (not by
    the per-test limit) in the parallel pass is run again alone, one pytest process
    at a time per file, after it. Its outcome alone is the one that counts. One that
    still fails with such a message alone is ``env_failed``, reported apart from the
    package's failures (``failed`` / ``error`` / ``crashed``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from selection import (DEFAULT_MEMORY_GB, EXCLUDED_FILES, FILES, MEMORY_GB,  # noqa: E402
                       test_key)

OUTCOMES = ("passed", "failed", "error", "skipped", "crashed", "env_failed", "not_run")
FAILED = ("failed", "error", "crashed")
ENV_FAILURE = re.compile(r"out of memory|OutOfMemoryError|busy or unavailable|device busy|"
                         r"unknown error|CUBLAS_STATUS_ALLOC_FAILED", re.IGNORECASE)
_TIMEOUT_DEATH = "longer than the per-test limit"


def memory_gb(name: str) -> float:
    """The GPU memory one chunk of file ``name`` may take (selection.MEMORY_GB)."""
    return MEMORY_GB.get(name, DEFAULT_MEMORY_GB)


def is_env_failure(message: str) -> bool:
    """A failure message that the shared card, not the package, may cause."""
    return bool(ENV_FAILURE.search(message or ""))


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [REPO, HERE] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["PYTHONDONTWRITEBYTECODE"] = "1"          # the TE tests folder stays untouched
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"   # only the plugins named below
    env.setdefault("OMP_NUM_THREADS", "2")
    return env


class Unit:
    """One chunk of one file: a pytest process (restarted after a crash)."""

    def __init__(self, tests_dir, out, name, k, n, only=None):
        self.tests_dir, self.name, self.k, self.n, self.only = tests_dir, name, k, n, only
        stem = f"{name[:-3]}.{k}of{n}" if only is None else f"{name[:-3]}.alone"
        self.log = os.path.join(out, "logs", stem + ".jsonl")
        self.output = os.path.join(out, "logs", stem + ".out")
        self.work = os.path.join(out, "work", stem)
        self.runs, self.ended = 0, ""

    def command(self, python, test_timeout):
        cmd = [python, "-m", "pytest", "-q", "-rN", "-p", "no:cacheprovider", "-p",
               "te_standins", "-c", os.path.join(HERE, "pytest.ini"),
               f"--rootdir={self.tests_dir}", os.path.join(self.tests_dir, self.name),
               f"--yardstick-chunk={self.k}/{self.n}", f"--yardstick-log={self.log}",
               f"--yardstick-test-timeout={test_timeout}"]
        if os.environ.get("YARDSTICK_K"):          # a subset: counts cover only it
            cmd += ["-k", os.environ["YARDSTICK_K"]]
        if self.only:
            cmd += [f"--yardstick-only={self.only}"]
        return cmd + (["--yardstick-resume"] if self.runs else [])

    def run(self, python, deadline, test_timeout, env):
        os.makedirs(self.work, exist_ok=True)
        while True:
            left = deadline - time.time()
            if left < 5:
                self.ended = self.ended or "budget spent before the chunk finished"
                return
            with open(self.output, "a") as out:
                out.write(f"\n=== run {self.runs + 1}: {' '.join(self.command(python, 0))}\n")
                out.flush()
                try:
                    proc = subprocess.run(self.command(python, test_timeout), cwd=self.work,
                                          env=env, stdout=out, stderr=subprocess.STDOUT,
                                          timeout=left)
                    code = proc.returncode
                except subprocess.TimeoutExpired:
                    code = None
            self.runs += 1
            died_in = _unfinished(self.log)
            if code is None:                      # the test it was in counts as not run
                self.ended = "budget spent: the process was stopped"
                return
            if died_in is None:
                self.ended = f"pytest exit code {code}"
                return
            why = _death_reason(self.output, code, test_timeout)
            _append(self.log, event="crash", nodeid=died_in, message=why)


def _collect_only(unit, python, env):
    os.makedirs(unit.work, exist_ok=True)
    with open(unit.output, "a") as out:
        subprocess.run(unit.command(python, 0) + ["--collect-only"], cwd=unit.work, env=env,
                       stdout=out, stderr=subprocess.STDOUT, timeout=300)
    unit.ended = "not started: the budget was spent first"


Unit.collect_only = _collect_only


def _records(path):
    if not os.path.exists(path):
        return
    with open(path) as f:
        for line in f:
            try:
                yield json.loads(line)
            except ValueError:
                continue                          # a line cut by a kill


def _unfinished(path):
    """The test the log started last and never finished, or None."""
    open_test = None
    for rec in _records(path):
        if rec.get("event") == "start":
            open_test = rec["nodeid"]
        elif rec.get("event") in ("finish", "crash") and rec["nodeid"] == open_test:
            open_test = None
    return open_test


def _append(path, **record):
    record["time"] = time.time()
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def _death_reason(output, code, test_timeout):
    with open(output, errors="replace") as f:
        tail = f.read()[-20000:]
    if "Timeout (" in tail.rpartition("=== run")[2]:
        return f"ran longer than the per-test limit of {test_timeout:g} s (process ended)"
    signal = f" (signal {-code})" if code is not None and code < 0 else ""
    return f"the process died during this test: exit code {code}{signal}"


# ---- summary -------------------------------------------------------------------------------

_NUMBER = re.compile(r"(?<![A-Za-z_])[-+]?\d+(\.\d+)?(e[-+]?\d+)?")
_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")


def _group_key(message: str) -> str:
    """A failure message with its numbers and addresses blanked, first line only, so
    that one cause gives one group."""
    first = (message or "").strip().splitlines()[0] if message else "(no message)"
    first = _ADDRESS.sub("0x_", first)
    return _NUMBER.sub("N", first)[:300]


def read_results(units):
    """``(results, deselected, memory)`` from the units' logs, in order: a later
    unit's outcome of a test (the serial pass) replaces an earlier one and is marked
    ``alone``; ``memory`` is the largest logged peak (GiB) per file."""
    results, deselected, memory = {}, {}, {}
    for u in units:
        alone = u.only is not None
        for rec in _records(u.log):
            event, nodeid = rec.get("event"), rec.get("nodeid")
            if event == "deselect":
                deselected[nodeid] = rec["reason"]
            elif event == "selected":
                results.setdefault(nodeid, {"outcome": "not_run"})
            elif event == "finish":
                results[nodeid] = {"outcome": rec["outcome"], "message": rec.get("message"),
                                   "skip": rec.get("skip"), "duration": rec.get("duration")}
            elif event == "crash":
                results[nodeid] = {"outcome": "crashed",
                                   "message": {"message": rec["message"], "where": ""}}
            elif event == "memory":
                memory[u.name] = max(memory.get(u.name, 0.0), rec["peak_gb"])
            if alone and event in ("finish", "crash"):
                results[nodeid]["alone"] = True
    return results, deselected, memory


def needs_alone(results) -> dict:
    """``{file: [node id, ...]}`` of the failures to run again alone (NOTE [Environment
    failures]): an environment message, or a process death not by the time limit."""
    out = defaultdict(list)
    for nodeid, r in results.items():
        message = (r.get("message") or {}).get("message", "")
        if r["outcome"] in FAILED and (is_env_failure(message) or (
                r["outcome"] == "crashed" and _TIMEOUT_DEATH not in message)):
            out[test_key(nodeid).split("::")[0]].append(nodeid)
    return dict(out)


def classify(results) -> None:
    """Failures that keep an environment message after the serial pass become
    ``env_failed`` (in place)."""
    for r in results.values():
        if r["outcome"] in FAILED and is_env_failure((r.get("message") or {}).get("message")):
            r["outcome"] = "env_failed"


def summarize(units, out, meta):
    results, deselected, memory = read_results(units)
    classify(results)
    files = {}
    functions = defaultdict(Counter)
    for nodeid, r in results.items():
        name = test_key(nodeid).split("::")[0]
        files.setdefault(name, Counter())[r["outcome"]] += 1
        functions[test_key(nodeid)][r["outcome"]] += 1
    for nodeid in deselected:
        name = test_key(nodeid).split("::")[0]
        files.setdefault(name, Counter())["deselected"] += 1
        functions[test_key(nodeid)]["deselected"] += 1
    totals = Counter()
    for c in files.values():
        totals.update(c)
    groups = defaultdict(lambda: {"count": 0, "files": Counter(), "examples": [],
                                  "where": Counter()})
    for nodeid, r in sorted(results.items()):
        if r["outcome"] not in FAILED + ("env_failed",):
            continue
        msg = r.get("message") or {}
        g = groups[(r["outcome"], _group_key(msg.get("message", "")))]
        g["count"] += 1
        g["files"][test_key(nodeid).split("::")[0]] += 1
        if msg.get("where"):
            g["where"][msg["where"]] += 1
        if len(g["examples"]) < 3:
            g["examples"].append({"nodeid": nodeid, "message": msg.get("message", "")[:1500]})
    failure_groups = sorted(({"outcome": k[0], "message": k[1], "count": g["count"],
                              "files": dict(g["files"]), "where": dict(g["where"].most_common(5)),
                              "examples": g["examples"]} for k, g in groups.items()),
                            key=lambda g: -g["count"])
    skip_reasons = Counter(_group_key(r.get("skip") or "") for r in results.values()
                           if r["outcome"] == "skipped")
    report = {
        "meta": meta,
        "files": {name: {o: c.get(o, 0) for o in OUTCOMES + ("deselected",)}
                  for name, c in sorted(files.items())},
        "totals": {o: totals.get(o, 0) for o in OUTCOMES + ("deselected",)},
        "functions": {k: dict(c) for k, c in sorted(functions.items())},
        "chunks": {os.path.basename(u.log): {"runs": u.runs, "ended": u.ended} for u in units},
        "run_alone": {o: sum(1 for r in results.values() if r.get("alone") and r["outcome"] == o)
                      for o in OUTCOMES if o != "not_run"},
        "env_failures": sorted(n for n, r in results.items() if r["outcome"] == "env_failed"),
        "package_failures": sum(totals.get(o, 0) for o in FAILED),
        "memory_peak_gb": {name: {"peak": round(gb, 2), "weight": memory_gb(name)}
                           for name, gb in sorted(memory.items())},
        "failure_groups": failure_groups,
        "skip_reasons": dict(skip_reasons.most_common(30)),
        "deselection_reasons": dict(Counter(deselected.values()).most_common()),
        "excluded_files": EXCLUDED_FILES,
    }
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(_markdown(report))
    return report


def _markdown(report):
    meta, lines = report["meta"], []
    lines.append(f"# TE tests/pytorch against this package ({meta.get('device', '?')})\n")
    lines.append(f"{meta.get('package_commit', '?')}; torch {meta.get('torch', '?')}; "
                 f"{meta.get('workers')} workers in {meta.get('memory_gb', 0):.0f} GiB; "
                 f"{meta.get('wall_s', 0):.0f} s in all, of a {meta.get('budget_s')} s "
                 f"budget and {meta.get('alone_budget_s')} s for the serial pass.\n")
    alone = report["run_alone"]
    lines.append(f"**{report['package_failures']}** failures of the package (failed, error, "
                 f"crashed); **{len(report['env_failures'])}** of the environment "
                 f"(env_failed: still out of memory / device busy / unknown error alone). "
                 f"Run again alone: {sum(alone.values())} ("
                 + ", ".join(f"{o} {c}" for o, c in alone.items() if c) + ").\n")
    head = ("file",) + OUTCOMES + ("deselected",)
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    for name, c in report["files"].items():
        lines.append(f"| {name} | " + " | ".join(str(c[o]) for o in head[1:]) + " |")
    t = report["totals"]
    lines.append("| **total** | " + " | ".join(str(t[o]) for o in head[1:]) + " |\n")
    lines.append("## Failures, grouped by message\n")
    for g in report["failure_groups"]:
        files = ", ".join(f"{k}: {v}" for k, v in g["files"].items())
        lines.append(f"- **{g['count']}** {g['outcome']}: `{g['message']}` ({files})")
        for ex in g["examples"][:1]:
            lines.append(f"  - e.g. `{ex['nodeid']}`")
    return "\n".join(lines) + "\n"


# ---- main ----------------------------------------------------------------------------------

def _device_and_versions(python, env):
    probe = ("import json, torch; c = torch.cuda.is_available(); "
             "free, total = torch.cuda.mem_get_info() if c else (0, 0); "
             "print(json.dumps({'torch': torch.__version__, 'device': "
             "torch.cuda.get_device_name() if c else 'no CUDA', "
             "'free_gb': free / 2**30, 'total_gb': total / 2**30}))")
    try:
        out = subprocess.run([python, "-c", probe], env=env, capture_output=True, text=True,
                             timeout=120).stdout.strip().splitlines()[-1]
        return json.loads(out)
    except (subprocess.SubprocessError, IndexError, ValueError):
        return {}


def _package_commit():
    """The package's commit: YARDSTICK_COMMIT when set (a copied working tree may carry
    a stale .git), else git's HEAD."""
    if os.environ.get("YARDSTICK_COMMIT"):
        return "commit " + os.environ["YARDSTICK_COMMIT"]
    try:
        return "commit " + subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                                          capture_output=True, text=True).stdout.strip()
    except OSError:
        return "commit ?"


def admit(queue, running_gb: float, running: int, memory: float):
    """Index of the first queued chunk that fits beside the running ones (a chunk
    heavier than ``memory`` runs when nothing else does), or None."""
    for i, u in enumerate(queue):
        if running == 0 or running_gb + memory_gb(u.name) <= memory:
            return i
    return None


def run_parallel(units, workers: int, memory: float, run_one) -> None:
    """``run_one(unit)`` for every unit, on ``workers`` threads, the queue in order,
    each start admitted by `admit`."""
    queue, lock, used = list(units), threading.Condition(), {"gb": 0.0, "n": 0}

    def next_unit():
        with lock:
            while queue:
                i = admit(queue, used["gb"], used["n"], memory)
                if i is not None:
                    used["gb"] += memory_gb(queue[i].name)
                    used["n"] += 1
                    return queue.pop(i)
                lock.wait()
            return None

    def worker():
        while True:
            unit = next_unit()
            if unit is None:
                return
            try:
                run_one(unit)
            finally:
                with lock:
                    used["gb"] -= memory_gb(unit.name)
                    used["n"] -= 1
                    lock.notify_all()

    threads = [threading.Thread(target=worker) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def main(argv):
    if len(argv) < 2:
        print(__doc__)
        return 2
    tests_dir, out = os.path.abspath(argv[0]), os.path.abspath(argv[1])
    names = argv[2:] or list(FILES)
    unknown = [n for n in names if n not in FILES]
    if unknown:
        print(f"run.py: not in selection.FILES: {unknown}")
        return 2
    missing = [n for n in names if not os.path.exists(os.path.join(tests_dir, n))]
    if missing:
        print(f"run.py: {tests_dir} lacks {missing}")
        return 2
    os.makedirs(os.path.join(out, "logs"), exist_ok=True)
    for stale in os.listdir(os.path.join(out, "logs")):
        os.remove(os.path.join(out, "logs", stale))
    python = os.environ.get("PYTHON", sys.executable)
    workers = int(os.environ.get("YARDSTICK_WORKERS", "12"))
    budget = float(os.environ.get("YARDSTICK_BUDGET_S", "400"))
    alone_budget = float(os.environ.get("YARDSTICK_ALONE_BUDGET_S", "80"))
    test_timeout = float(os.environ.get("YARDSTICK_TEST_TIMEOUT_S", "120"))
    env = _env()
    meta = dict(_device_and_versions(python, env), tests_dir=tests_dir, workers=workers,
                budget_s=budget, alone_budget_s=alone_budget, test_timeout_s=test_timeout,
                package_commit=_package_commit(), k_expression=os.environ.get("YARDSTICK_K"),
                files=names)
    meta["memory_gb"] = float(os.environ.get("YARDSTICK_MEMORY_GB") or
                              0.9 * meta.get("free_gb", 0.0) or 80.0)
    start = time.time()
    deadline = start + budget
    units = [Unit(tests_dir, out, name, k, FILES[name]) for name in names
             for k in range(FILES[name])]
    run_parallel(units, workers, meta["memory_gb"],
                 lambda unit: unit.run(python, deadline, test_timeout, env))
    # the failures the shared card may have caused, again, one process at a time
    alone_deadline = max(deadline, time.time()) + alone_budget
    retry = needs_alone(read_results(units)[0])
    for name, nodeids in sorted(retry.items()):
        listing = os.path.join(out, "logs", f"{name[:-3]}.alone.txt")
        with open(listing, "w") as f:
            f.write("\n".join(nodeids) + "\n")
        unit = Unit(tests_dir, out, name, 0, 1, only=listing)
        units.append(unit)
        unit.run(python, alone_deadline, test_timeout, env)
    meta["wall_s"] = time.time() - start
    # chunks the budget never reached: collect them, so that their tests count as not run
    idle = [u for u in units if u.runs == 0]
    collectors = [threading.Thread(target=u.collect_only, args=(python, env)) for u in idle]
    for t in collectors:
        t.start()
    for t in collectors:
        t.join()
    report = summarize(units, out, meta)
    t = report["totals"]
    print(" ".join(f"{o}={t[o]}" for o in t) + f"  ({meta['wall_s']:.0f} s)")
    print(f"wrote {os.path.join(out, 'results.json')} and summary.md")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
