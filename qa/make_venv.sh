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
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -c <(echo "torch==2.13.0") \
    -e "$ROOT[$EXTRAS]" || return 1 2>/dev/null || exit 1
VENV_PY="$VENV/bin/python"
export VENV_PY
