"""Reading `benchmarks/step_time.py`'s printed table back, for the scripts that run it several
times (step_targets.py, feature_scaling.py).

Each separate run is a fresh `python benchmarks/step_time.py ...` process, as a user would run it,
so that one run's allocator, caches and page cache cannot flatter the next; this module only
parses what it prints. Cells are read by their column names, not positions.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# step_time.py's column -> the short name used here (ms cells become floats, "n/a" None).
COLUMNS = {
    "plan": "plan",
    "optimizer": "optimizer",
    "ours ms": "ours",
    "ours + prefetch ms": "prefetch",
    "TorchRec ms": "torchrec",
    "TorchRec pipeline ms": "pipeline",
    "floor ms": "floor",
    "unsharded ms": "unsharded",
    "dense part ms": "dense",
    "comm ms": "comm",
}
SHORT_PLANS = {"table_wise": "tw", "row_wise": "rw", "column_wise": "cw", "data_parallel": "dp",
               "table_row_wise": "twrw", "mixed": "mix"}  # fmt: skip


def parse_step_table(text: str) -> dict[tuple[str, str], dict[str, Optional[float]]]:
    """(plan, optimizer) -> {"ours": ms, "torchrec": ms, ...} from step_time.py's output."""
    rows: dict[tuple[str, str], dict[str, Optional[float]]] = {}
    header: Optional[list[str]] = None
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("|"):
            header = None if not line else header
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[:2] == ["plan", "optimizer"]:
            header = cells
            continue
        if header is None or set(cells[0]) <= set("-: "):
            continue
        row: dict[str, Optional[float]] = {}
        for name, cell in zip(header, cells):
            key = COLUMNS.get(name)
            if key is None or key in ("plan", "optimizer"):
                continue
            row[key] = None if cell in ("n/a", "") else float(cell)
        rows[(SHORT_PLANS.get(cells[0], cells[0]), cells[1])] = row
    return rows


def run_step_time(args: list[str], *, log: Optional[str] = None) -> str:
    """One fresh run of step_time.py with `args`; returns its stdout (raises with its tail if it
    fails). `log`: also write the whole output there."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, os.path.join(HERE, "step_time.py"), *args]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if log is not None:
        with open(log, "w") as f:
            f.write(" ".join(cmd) + "\n\n" + done.stdout + "\n--- stderr ---\n" + done.stderr)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-30:])
        raise RuntimeError(f"{' '.join(cmd)} exited with {done.returncode}:\n{tail}")
    return done.stdout


def overhead_ratio(row: dict[str, Optional[float]], ours: str = "ours", theirs: str = "torchrec") -> Optional[float]:
    """(ours - base) / (theirs - base), base = floor + dense part: the framework's own cost per
    step against TorchRec's (issue 29). Negative when ours is below the floor (the dense
    optimizer's floor updates the whole table; ours and TorchRec's do not)."""
    a, b, floor, dense = row.get(ours), row.get(theirs), row.get("floor"), row.get("dense")
    if None in (a, b, floor, dense):
        return None
    base = floor + dense
    if b - base <= 0:
        return None
    return (a - base) / (b - base)
