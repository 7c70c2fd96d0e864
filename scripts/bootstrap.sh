#!/usr/bin/env bash
# Creates (or reuses) the project virtualenv at .venv and installs the pinned stack into it.
# Idempotent: a stamp records what was installed, so a second run costs a fraction of a second.
# Usage: source scripts/bootstrap.sh   (exports VENV_PY, the venv's python)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MODULAR_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
want="$(cat "$ROOT/requirements.txt" "$ROOT/pyproject.toml" "$ROOT/scripts/bootstrap.sh" | sha256sum | cut -c1-16)"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[bootstrap] creating virtualenv $VENV with $($PY --version)" >&2
  "$PY" -m venv "$VENV"
fi
if [ "$(cat "$VENV/.modular-stamp" 2>/dev/null)" != "$want" ]; then
  echo "[bootstrap] installing the pinned stack (torch 2.13.0 CPU, fbgemm-gpu-cpu 1.8.0, torchrec 1.8.0)" >&2
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r "$ROOT/requirements.txt"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps torchrec==1.8.0
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e "$ROOT"
  echo "$want" > "$VENV/.modular-stamp"
fi
export VENV_PY="$VENV/bin/python"
