#!/usr/bin/env bash
# The main job: make (or reuse) the venv, install the package (with matplotlib for
# the loss plot), and train the example GPT. Extra arguments go to train_gpt.py.
set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# shellcheck source=../../qa/make_venv.sh
source "$ROOT/qa/make_venv.sh" plot || exit 1
cd "$ROOT" || exit 1
exec "$VENV_PY" examples/pytorch/train_gpt.py "$@"
