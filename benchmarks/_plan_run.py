"""One planning run of planner_bench.py's synthetic tables, in a fresh process.

    python benchmarks/_plan_run.py ROOT TABLES RANKS OUT [--torchrec-compatible]

imports `planners` from ROOT (this checkout, or an earlier revision's `git archive` for
planner_bench.py --compare-ref), plans TABLES synthetic tables on RANKS ranks, and writes JSON to
OUT: the wall and CPU seconds of `plan_with_stats` (statistics included), the plan in our JSON
format or the first line of the NoPlanError, and the process's peak RSS (VmHWM, from its start:
Python, numpy, the tables and the planning). A process per run, so
that no run's memory peak or warm caches carry over to the next. Nothing here imports `planners`
until ROOT is on the path.
"""

from __future__ import annotations

import inspect
import json
import math
import resource
import sys
import time
from typing import Any

import numpy as np

GiB = 1024**3
RANKS_PER_HOST = 8
DEVICE_MEMORY = 80 * GiB
BATCH = 512
SEED = 0


def synthetic_tables(n: int, table: Any, seed: int = SEED) -> list:
    """`n` tables drawn with a fixed seed: rows log-uniform in [1e3, 1e8], dim in {32, 64, 128,
    256}, one feature with a pooling factor log-uniform in [1, 50]; built with the `table` class
    (`planners.Table` of the revision being run)."""
    rng = np.random.default_rng([seed, n])
    rows = np.exp(rng.uniform(math.log(1e3), math.log(1e8), n)).astype(np.int64)
    dims = rng.choice([32, 64, 128, 256], n)
    pooling = np.exp(rng.uniform(0.0, math.log(50.0), n))
    return [
        table(f"t{i}", int(rows[i]), int(dims[i]), features=(f"f{i}",),
              pooling_factor=round(float(pooling[i]), 3))
        for i in range(n)
    ]  # fmt: skip


def topology(world: int, topology_class: Any) -> Any:
    return topology_class(world, ranks_per_host=min(RANKS_PER_HOST, world), device_memory=DEVICE_MEMORY)


def _peak_rss() -> int:
    """This process's peak RSS in bytes (VmHWM). getrusage's ru_maxrss would do, but Linux
    keeps it across fork and exec, so a run would report its parent's RSS when larger. (Not
    benchmarks/_common.status_kib: that module imports torch, whose memory would be counted.)"""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def main(argv: list[str]) -> int:
    root, n, world, out = argv[:4]
    try:  # forget the peak inherited across fork and exec (see _peak_rss)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    sys.path.insert(0, root)
    import planners

    tables = synthetic_tables(int(n), planners.Table)
    topo = topology(int(world), planners.Topology)
    kwargs = {"torchrec_compatible": True} if "--torchrec-compatible" in argv[4:] else {}
    if "auto_tier" in inspect.signature(planners.plan_with_stats).parameters:
        # resident plans only, as TorchRec's planner and older revisions make them: a row where
        # none fits keeps meaning "no plan" (tiering 10,000 tables on 256 ranks takes minutes)
        kwargs["auto_tier"] = False
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        result: dict[str, Any] = {
            "plan": planners.plan_with_stats(tables, topo, batch_size=BATCH, **kwargs).plan.to_dict()
        }
    except planners.NoPlanError as e:
        result = {"no_plan": str(e).splitlines()[0]}
    result["seconds"] = time.perf_counter() - wall
    result["cpu_seconds"] = time.process_time() - cpu
    result["peak_rss"] = _peak_rss()
    with open(out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
