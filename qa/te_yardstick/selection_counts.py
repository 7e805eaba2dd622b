"""Count the selection: per test function, how many cases each selected file collects,
how many selection.py deselects and how many run. Writes SELECTION.md.

    python3 selection_counts.py <TE tests/pytorch> [out.md]

Collection runs here (no GPU needed) with ``--yardstick-cpu-collect``: the compute
capability reads as an H100's, so that the parameter lists TE builds from it are the
H100's; availability checks (FP8, block scaling, MXFP8, NVFP4, bf16) answer as this
package answers on the CPU, which is what it answers on an H100. The GPU run's
results.json has the counts that machine collected, for comparison.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from run import REPO, _env  # noqa: E402
from selection import EXCLUDED_FILES, FILES, REVIEWED_KEPT, test_key  # noqa: E402


def collect(tests_dir: str, name: str):
    """``(selected node ids, {deselected node id: reason})`` of one file."""
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "log.jsonl")
        cmd = [sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
               "-p", "te_standins", "-c", os.path.join(HERE, "pytest.ini"),
               f"--rootdir={tests_dir}", "--yardstick-cpu-collect", f"--yardstick-log={log}",
               os.path.join(tests_dir, name)]
        proc = subprocess.run(cmd, cwd=tmp, env=_env(), capture_output=True, text=True)
        if proc.returncode not in (0, 5):
            raise RuntimeError(f"collection of {name} failed:\n{proc.stdout[-3000:]}")
        selected, deselected = [], {}
        with open(log) as f:
            for line in f:
                rec = json.loads(line)
                if rec["event"] == "selected":
                    selected.append(rec["nodeid"])
                elif rec["event"] == "deselect":
                    deselected[rec["nodeid"]] = rec["reason"]
    return selected, deselected


def main(argv):
    tests_dir = os.path.abspath(argv[0])
    out = argv[1] if len(argv) > 1 else os.path.join(HERE, "SELECTION.md")
    rows, totals = [], Counter()
    reasons = {}
    broken = {}
    for name in FILES:
        try:
            selected, deselected = collect(tests_dir, name)
        except RuntimeError as err:
            errors = [ln[1:].strip() for ln in str(err).splitlines() if ln.startswith("E ")]
            broken[name] = errors[-1] if errors else str(err).splitlines()[0]
            continue
        per = defaultdict(Counter)
        for nodeid in selected:
            per[test_key(nodeid)]["run"] += 1
        for nodeid, reason in deselected.items():
            per[test_key(nodeid)]["deselected"] += 1
            reasons[test_key(nodeid)] = reason
        for key in sorted(per):
            c = per[key]
            rows.append((key, c["run"], c["deselected"]))
            totals.update(c)
    commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    runs = [r for r in rows if r[1]]
    lines = [
        "# The yardstick's selection of TE's tests/pytorch",
        "",
        f"Made by `python3 qa/te_yardstick/selection_counts.py <TE tests/pytorch>` at commit "
        f"{commit} (CPU collection as on an H100: README.md). "
        f"**{len(runs)} test functions, {totals['run']} cases run; "
        f"{totals['deselected']} cases deselected.**",
        "",
        "| test function | cases run | cases deselected | reason |",
        "|---|---|---|---|",
    ]
    for key, run, des in rows:
        note = reasons.get(key, "") if des else REVIEWED_KEPT.get(key, "")
        if not des and note:
            note = "kept (scan.py flags it): " + note
        lines.append(f"| `{key}` | {run} | {des} | {note} |")
    if broken:
        lines += ["", "## Selected files that fail to collect (no case of them counted)", ""]
        lines += [f"- `{name}`: {why}" for name, why in broken.items()]
    lines += ["", "## Files left out", ""]
    lines += [f"- `{name}`: {why}" for name, why in EXCLUDED_FILES.items()]
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"{len(runs)} functions, {totals['run']} cases run, {totals['deselected']} "
          f"deselected; wrote {out}")
    for name, why in broken.items():
        print(f"collection of {name} failed: {why}", file=sys.stderr)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
