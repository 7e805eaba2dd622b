#!/usr/bin/env bash
# The curated L0 unit-test job: makes (or reuses) a venv, installs the package with
# its test extras against torch==2.13.0 (the CPU build), then runs each listed test
# file in its own pytest process, collects the failures and exits non-zero if any
# failed. At the end it prints one line counting the skipped tests by reason (on a
# CPU: the CUDA-only cases).
#
# The files run in lanes, one per CPU core (at most 4; TE_TEST_LANES=N sets the count,
# 1 runs them one after another), each process with the cores divided among the lanes
# (OMP_NUM_THREADS, unless set). A free lane takes the longest file left, by the
# seconds measured in file_seconds.txt beside this script (a file not listed there
# goes first). Each file's output is held in a log and printed in one piece, under its
# name, when the file ends.
set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# shellcheck source=../make_venv.sh
source "$ROOT/qa/make_venv.sh" test || exit 1

cd "$ROOT" || exit 1
# shellcheck source=../pytorch_test_files.sh
source "$ROOT/qa/pytorch_test_files.sh"

CORES="$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)"
LANES="${TE_TEST_LANES:-$((CORES < 4 ? CORES : 4))}"
if ! [[ "$LANES" =~ ^[1-9][0-9]*$ ]]; then
    echo "TE_TEST_LANES must be a positive integer, got '$LANES'" >&2
    exit 1
fi
if (( BASH_VERSINFO[0] * 100 + BASH_VERSINFO[1] < 501 )); then
    LANES=1                              # waiting for any of several jobs needs bash 5.1
fi
THREADS="${OMP_NUM_THREADS:-$((CORES / LANES > 1 ? CORES / LANES : 1))}"

# The order: longest measured file first, files without a measurement before all.
declare -A MEASURED=()
while read -r seconds path; do
    [[ -z "$seconds" || "$seconds" == \#* ]] || MEASURED[$path]=$seconds
done < "$ROOT/qa/L0_pytorch_unittest/file_seconds.txt"
mapfile -t ORDER < <(for i in "${!TESTS[@]}"; do
    echo "${MEASURED[${TESTS[$i]}]:-999999} $i"
done | LC_ALL=C sort -k1,1gr -k2,2n | cut -d' ' -f2)

REPORTS="$(mktemp -d)"                   # per test file: JUnit report, log, pytest's tmp
declare -A RUNNING=()                    # pid -> index of the file it runs
declare -A BEGAN=()                      # index -> start time
trap 'exit 130' INT
trap 'exit 143' TERM
trap '[ ${#RUNNING[@]} -eq 0 ] || kill "${!RUNNING[@]}" 2>/dev/null; rm -rf "$REPORTS"' EXIT

start_file() {  # run TESTS[$1] in the background, its output to its log
    local i="$1"
    # SIGINT at its default, as in a foreground process (a background job gets it ignored)
    ( trap - INT; OMP_NUM_THREADS="$THREADS" exec "$VENV_PY" -m pytest -q -p no:cacheprovider \
        --basetemp="$REPORTS/tmp$i" --junitxml="$REPORTS/$i.xml" "${TESTS[$i]}" \
        >"$REPORTS/$i.log" 2>&1 ) &
    RUNNING[$!]=$i
    BEGAN[$i]="$(now)"
}

now() { local t="${EPOCHREALTIME:-$SECONDS}"; echo "${t/,/.}"; }

START=$SECONDS
FAILED=()
declare -A FAILED_AT=()                  # index -> 1 where the file failed
echo "=== ruff check"
"$VENV_PY" -m ruff check . || FAILED+=("ruff")
echo "Running ${#TESTS[@]} test files in $LANES lane(s), $THREADS thread(s) each."
next=0
while [ "$next" -lt ${#ORDER[@]} ] || [ ${#RUNNING[@]} -gt 0 ]; do
    while [ "$next" -lt ${#ORDER[@]} ] && [ ${#RUNNING[@]} -lt "$LANES" ]; do
        start_file "${ORDER[$next]}"
        next=$((next + 1))
    done
    done_pid=""
    if [ "$LANES" -eq 1 ]; then
        done_pid="${!RUNNING[*]}"
        wait "$done_pid"
    else
        wait -n -p done_pid "${!RUNNING[@]}"
    fi
    status=$?
    [ -n "$done_pid" ] || continue
    i="${RUNNING[$done_pid]}"
    unset "RUNNING[$done_pid]"
    t="${TESTS[$i]}"
    took="$(awk -v a="${BEGAN[$i]}" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }')"
    echo "=== $t ($took s)"
    cat "$REPORTS/$i.log"
    echo "$took $t" >>"$REPORTS/seconds"
    [ "$status" -eq 0 ] || FAILED_AT[$i]=1
done
for i in "${!TESTS[@]}"; do                 # the failed files in the list's order
    [ -z "${FAILED_AT[$i]:-}" ] || FAILED+=("${TESTS[$i]}")
done
if [ -n "${TE_TEST_SECONDS_OUT:-}" ]; then   # this run's seconds, in file_seconds.txt's form
    { sed -n '/^#/p' "$ROOT/qa/L0_pytorch_unittest/file_seconds.txt"
      LC_ALL=C sort -k1,1gr "$REPORTS/seconds"; } >"$REPORTS/seconds.txt" \
        && cp "$REPORTS/seconds.txt" "$TE_TEST_SECONDS_OUT"
fi

"$VENV_PY" "$ROOT/qa/skip_summary.py" "$REPORTS"/*.xml
echo "Ran ${#TESTS[@]} test files in $((SECONDS - START)) s."
if [ ${#FAILED[@]} -gt 0 ]; then
    echo "FAILED test files: ${FAILED[*]}"
    exit 1
fi
echo "All ${#TESTS[@]} test files passed."
