#!/usr/bin/env bash
# Run NVIDIA's TE tests/pytorch files against this package on the GPU machine and
# write per-file counts (results.json) and a failure summary (summary.md) to <out dir>.
#   qa/te_yardstick/run.sh <path to TE tests/pytorch> <out dir> [test_file.py ...]
# Environment: YARDSTICK_WORKERS (12), YARDSTICK_MEMORY_GB (90% of free), YARDSTICK_BUDGET_S (400),
# YARDSTICK_ALONE_BUDGET_S (80),
# YARDSTICK_TEST_TIMEOUT_S (120), PYTHON (python3). See README.md.
set -u
if [ $# -lt 2 ]; then
    sed -n '2,7p' "$0"
    exit 2
fi
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY="${PYTHON:-python3}"
exec "$PY" "$HERE/run.py" "$@"
