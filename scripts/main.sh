#!/usr/bin/env bash
# The main job: train the sharded DLRM example on 2 CPU ranks, then plan Criteo 1TB for 64 GPUs.
# Works from a fresh clone: the first run creates .venv and installs the pinned stack.
# Usage: bash scripts/main.sh [extra train_dlrm.py flags, e.g. --steps 600]
# Outputs (gitignored) go to $OUT_DIR, default out/.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
OUT_DIR="${OUT_DIR:-$ROOT/out}"
mkdir -p "$OUT_DIR"

echo "== 1/2 train: DLRM, 26 tables planned and sharded over 2 gloo ranks =="
"$VENV_PY" examples/train_dlrm.py --world-size 2 --steps "${STEPS:-300}" \
  --checkpoint-dir "$OUT_DIR/checkpoints" --export "$OUT_DIR/dlrm_unsharded.pt" "$@"

echo "== 2/2 plan: Criteo 1TB tables on 64 GPUs (8 per host, 80 GiB each) =="
"$VENV_PY" -m planners plan examples/tables_criteo_1tb.yaml --world-size 64 --ranks-per-host 8 \
  --device-memory 80GiB --batch-size 512 --rows 16 --sort cost --top 10 \
  -o "$OUT_DIR/plan.json" --plot "$OUT_DIR/ranks.png"
# the plan file records its tables and settings: one table, shard by shard, needs no more flags
"$VENV_PY" -m planners show "$OUT_DIR/plan.json" --table t_cat_0
echo "outputs: $OUT_DIR/{checkpoints,dlrm_unsharded.pt,plan.json,ranks.png}"
