#!/usr/bin/env bash
# The GPU job: the L0 test files with their CUDA cases (Triton kernels, CUDA FP8 GEMMs,
# CUDA RNG), on a machine with a CUDA GPU. It uses the python3 found there with its
# own torch (the GPU machine has no network: nothing is installed; pytest must be
# importable). CI has no GPU and does not run it.
# Usage: bash qa/L1_pytorch_gpu/test.sh [pytest args...]
set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${PYTHON:-python3}"
cd "$ROOT" || exit 1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1     # the image's pytest plugins are not ours
# shellcheck source=../pytorch_test_files.sh
source "$ROOT/qa/pytorch_test_files.sh"

"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU'; \
print(torch.cuda.get_device_name(), 'torch', torch.__version__)" || exit 1
FAILED=()
for t in "${TESTS[@]}"; do
    echo "=== $t"
    "$PY" -m pytest -q -p no:cacheprovider -rfEs "$@" "$t"
    rc=$?
    # 5: nothing collected (a file that skips itself whole, with its reason printed)
    [ $rc -eq 0 ] || [ $rc -eq 5 ] || FAILED+=("$t")
done
if [ ${#FAILED[@]} -gt 0 ]; then
    echo "FAILED test files: ${FAILED[*]}"
    exit 1
fi
echo "All ${#TESTS[@]} test files passed on the GPU."
