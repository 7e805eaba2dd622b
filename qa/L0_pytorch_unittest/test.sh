#!/usr/bin/env bash
# The curated L0 unit-test job: makes (or reuses) a venv, installs the package with
# its test extras against torch==2.13.0 (the CPU build), then runs each listed test
# file, collects the failures and exits non-zero if any failed. At the end it prints
# one line counting the skipped tests by reason (on a CPU: the CUDA-only cases).
set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# shellcheck source=../make_venv.sh
source "$ROOT/qa/make_venv.sh" test || exit 1

cd "$ROOT" || exit 1
# shellcheck source=../pytorch_test_files.sh
source "$ROOT/qa/pytorch_test_files.sh"

REPORTS="$(mktemp -d)"                   # one JUnit report per test file, for the skips
trap 'rm -rf "$REPORTS"' EXIT
START=$SECONDS
FAILED=()
echo "=== ruff check"
"$VENV_PY" -m ruff check . || FAILED+=("ruff")
for i in "${!TESTS[@]}"; do
    t="${TESTS[$i]}"
    echo "=== $t"
    "$VENV_PY" -m pytest -q -p no:cacheprovider --junitxml="$REPORTS/$i.xml" "$t" || FAILED+=("$t")
done

"$VENV_PY" "$ROOT/qa/skip_summary.py" "$REPORTS"/*.xml
echo "Ran ${#TESTS[@]} test files in $((SECONDS - START)) s."
if [ ${#FAILED[@]} -gt 0 ]; then
    echo "FAILED test files: ${FAILED[*]}"
    exit 1
fi
echo "All ${#TESTS[@]} test files passed."
