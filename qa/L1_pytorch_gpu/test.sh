#!/usr/bin/env bash
# The GPU job: every file of qa/pytorch_test_files.sh with its CUDA cases, sharded over
# parallel pytest processes on one GPU (qa/L1_pytorch_gpu/run_job.py), then a
# one-screen summary (per file passed / failed / errors / skipped / seconds, the skip
# reasons tallied) and qa/L1_pytorch_gpu/out/l1_job.json. It uses the python3 found
# there with its own torch and Triton (the GPU machine has no network: nothing is
# installed; pytest must be importable). Exits non-zero on any failure or error.
# CI has no GPU and does not run it. About 6 minutes on one H100 (README.md here).
# Usage: bash qa/L1_pytorch_gpu/test.sh [--workers N] [--out DIR] [test files...]
set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
exec "${PYTHON:-python3}" "$ROOT/qa/L1_pytorch_gpu/run_job.py" "$@"
