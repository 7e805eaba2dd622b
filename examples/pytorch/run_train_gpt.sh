#!/usr/bin/env bash
# The main job: make (or reuse) the venv, install the package (with tqdm for the
# progress bar and matplotlib for the loss plot), and train the example GPT three
# ways (compare_runs.py). Extra arguments go to compare_runs.py.
set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# shellcheck source=../../qa/make_venv.sh
source "$ROOT/qa/make_venv.sh" plot || exit 1
cd "$ROOT" || exit 1
echo "[main job] training the example GPT three ways (FP8 + checkpointing, FP8, baseline)" \
     "with examples/pytorch/compare_runs.py; each run shows a progress bar"
exec "$VENV_PY" examples/pytorch/compare_runs.py "$@"
