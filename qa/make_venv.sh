#!/usr/bin/env bash
# Make (or reuse) the project venv and install the package into it with the given
# extras, against torch==2.13.0 (the CPU build on this kind of machine).
# Usage: source qa/make_venv.sh [extras]   -> sets VENV_PY
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${TE_VENV:-$ROOT/.venv}"
EXTRAS="${1:-test}"
if [ ! -x "$VENV/bin/python" ]; then
    "${PYTHON:-python3}" -m venv "$VENV" || return 1 2>/dev/null || exit 1
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "torch==2.13.0" \
    || return 1 2>/dev/null || exit 1
# The distribution was once named transformer_engine_pure: drop it (and its build
# metadata) from a reused venv, else two distributions claim the transformer_engine package.
if "$VENV/bin/python" -m pip show -q transformer_engine_pure >/dev/null 2>&1; then
    "$VENV/bin/python" -m pip uninstall -q -y transformer_engine_pure || return 1 2>/dev/null || exit 1
fi
rm -rf "$ROOT/transformer_engine_pure.egg-info"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -c <(echo "torch==2.13.0") \
    -e "$ROOT[$EXTRAS]" || return 1 2>/dev/null || exit 1
# With the test extras, Megatron Core (the client of the Megatron tests) in a step of its
# own: its releases declare Requires-Python >= 3.12 while their code runs on 3.11, which
# pip honours only as a whole-command switch; so this step alone ignores it, for the
# pinned wheels of qa/megatron_requirements.txt only (docs/megatron.md).
if [[ ",$EXTRAS," == *",test,"* ]]; then
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
        --ignore-requires-python -r "$ROOT/qa/megatron_requirements.txt" \
        || return 1 2>/dev/null || exit 1
fi
VENV_PY="$VENV/bin/python"
export VENV_PY
