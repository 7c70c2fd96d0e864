#!/usr/bin/env bash
# Runs the whole test suite in the project virtualenv (created and installed on first use).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
exec "$VENV_PY" -m pytest -q "$@"
