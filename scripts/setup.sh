#!/usr/bin/env bash
# Create (or reuse) .venv and install harmony-opt with its test extras.
#
# torch comes first and explicitly, so that pip never resolves the bare "torch"
# requirement to a multi-GB CUDA build on a CPU machine. Override with
#   HARMONY_OPT_TORCH="torch==2.5.1 --index-url https://download.pytorch.org/whl/cu124" scripts/setup.sh
# (or install your CUDA torch into .venv yourself first: an importable torch is kept).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    # shellcheck disable=SC2086
    $PIP install ${HARMONY_OPT_TORCH:-torch==2.13.0}
fi
$PIP install -e ".[test]"
