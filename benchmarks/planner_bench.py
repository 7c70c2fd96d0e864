"""Our planner against TorchRec's on the same synthetic tables, priced under one cost model.

    python benchmarks/planner_bench.py                       # the table in docs/benchmarks.md
    python benchmarks/planner_bench.py --tables 10 100 --world-sizes 8 64 --torchrec-timeout 60

For each (tables, ranks): the tables are drawn with a fixed seed (rows log-uniform in
[1e3, 1e8], dim in {32, 64, 128, 256}, one feature with a pooling factor log-uniform in
[1, 50], fp32); the cluster is 8 ranks per host, 80 GiB per rank, batch 512 per rank. Both
planners plan them; both plans are priced with planners.plan_stats (docs/planner.md), which
also gives the lower bound. TorchRec's EmbeddingShardingPlanner runs in a subprocess on a
`meta` EmbeddingBagCollection with a "cuda" Topology (planning needs no GPU), restricted to the
five sharding types we have and to device-resident kernels (fused, dense), given the same
pooling factors, bandwidths (in its bytes/ms) and a 10% storage reservation; it is killed
after --torchrec-timeout seconds, and skipped (reported as such) where the same world size with
10x fewer tables already took more than a tenth of that.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import planners  # noqa: E402
from planners import NoPlanError, Table, Topology  # noqa: E402

GiB = 1024**3
RANKS_PER_HOST = 8
DEVICE_MEMORY = 80 * GiB
BATCH = 512
SEED = 0


def synthetic_tables(n: int, seed: int = SEED) -> list[Table]:
    """`n` tables drawn with a fixed seed (see the module docstring)."""
    rng = np.random.default_rng([seed, n])
    rows = np.exp(rng.uniform(math.log(1e3), math.log(1e8), n)).astype(np.int64)
    dims = rng.choice([32, 64, 128, 256], n)
    pooling = np.exp(rng.uniform(0.0, math.log(50.0), n))
    return [
        Table(f"t{i}", int(rows[i]), int(dims[i]), features=(f"f{i}",),
              pooling_factor=round(float(pooling[i]), 3))
        for i in range(n)
    ]  # fmt: skip


def topology(world: int) -> Topology:
    return Topology(world, ranks_per_host=min(RANKS_PER_HOST, world), device_memory=DEVICE_MEMORY)


def torchrec_worker(n: int, world: int, out: str) -> None:
    """Plans with TorchRec's planner and writes the plan (our JSON format) and its time."""
    import torch
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
    from torchrec.distributed.planner import Topology as TorchRecTopology
    from torchrec.distributed.planner.stats import NoopEmbeddingStats
    from torchrec.distributed.planner.storage_reservations import HeuristicalStorageReservation
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    tables = synthetic_tables(n)
    topo = topology(world)
    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=t.name, embedding_dim=t.embedding_dim,
                                   num_embeddings=t.num_embeddings, feature_names=list(t.features))
                for t in tables],
        device=torch.device("meta"),
    )  # fmt: skip
    types = ["data_parallel", "table_wise", "row_wise", "column_wise", "table_row_wise"]
    constraints = {
        t.name: ParameterConstraints(sharding_types=types, compute_kernels=["fused", "dense"],
                                     pooling_factors=list(t.pooling_factors))
        for t in tables
    }  # fmt: skip
    tr_topology = TorchRecTopology(
        world_size=world, compute_device="cuda", local_world_size=topo.ranks_per_host,
        hbm_cap=topo.device_memory, hbm_mem_bw=topo.device_memory_bandwidth / 1000,
        intra_host_bw=topo.intra_host_bandwidth / 1000, inter_host_bw=topo.cross_host_bandwidth / 1000,
    )  # fmt: skip
    planner = EmbeddingShardingPlanner(
        topology=tr_topology, batch_size=BATCH, constraints=constraints, debug=False,
        stats=[NoopEmbeddingStats()],
        storage_reservation=HeuristicalStorageReservation(percentage=topo.reserved_fraction),
    )  # fmt: skip
    start = time.perf_counter()
    try:
        tr_plan = planner.plan(ebc, [EmbeddingBagCollectionSharder()])
    except Exception as e:  # TorchRec's PlannerError: report it, as the table does
        result: dict[str, Any] = {"error": " ".join(str(e).split())[:300],
                                  "seconds": time.perf_counter() - start}  # fmt: skip
    else:
        seconds = time.perf_counter() - start
        plan = planners.from_torchrec(tr_plan, world_size=world, ranks_per_host=topo.ranks_per_host)
        result = {"plan": plan.to_dict(), "seconds": seconds}
    with open(out, "w") as f:
        json.dump(result, f)


def run_torchrec(n: int, world: int, timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "plan.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--torchrec-worker", str(n), str(world), out]
        start = time.perf_counter()
        try:
            subprocess.run(cmd, timeout=timeout, check=True, capture_output=True)
        except subprocess.TimeoutExpired:
            return {"skipped": f"timed out (>{timeout:.0f} s)"}
        except subprocess.CalledProcessError as e:
            tail = e.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["?"]
            return {"error": tail[0][:200], "seconds": time.perf_counter() - start}
        with open(out) as f:
            return json.load(f)


def _ms(x: float) -> str:
    return f"{1e3 * x:.3f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tables", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--torchrec-timeout", type=float, default=150.0,
                        help="seconds before TorchRec's planner is stopped (default 150)")
    parser.add_argument("--no-torchrec", action="store_true", help="run only our planner")
    parser.add_argument("--torchrec-worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.torchrec_worker:
        n, world, out = args.torchrec_worker
        torchrec_worker(int(n), int(world), out)
        return 0

    header = ("| tables | ranks | ours: time | ours: max ms | ours / bound | TorchRec: time "
              "| TorchRec: max ms | TorchRec / bound | TorchRec / ours | bound ms |")
    print(header)
    print("|" + "|".join(["---"] * 10) + "|")
    tr_seconds: dict[tuple[int, int], float] = {}
    for n in sorted(args.tables):
        tables = synthetic_tables(n)
        for world in args.world_sizes:
            topo = topology(world)
            cells = [str(n), str(world)]
            start = time.perf_counter()
            try:
                result = planners.plan_with_stats(tables, topo, batch_size=BATCH)
            except NoPlanError as e:
                ours = None
                reason = str(e).splitlines()[0].removeprefix("no plan fits: ")
                cells += [f"{time.perf_counter() - start:.2f} s: no plan fits ({reason[:60]}...)", "-", "-"]
            else:
                ours = result.stats
                cells += [f"{result.seconds:.2f} s", _ms(ours.max_cost), f"{ours.bound_ratio:.3f}"]
            tr_cells = ["-", "-", "-", "-"]
            smaller = tr_seconds.get((n // 10, world))
            if args.no_torchrec:
                tr_cells[0] = "not run"
            elif smaller is not None and smaller > args.torchrec_timeout / 10:
                took = "timed out" if math.isinf(smaller) else f"took {smaller:.0f} s"
                tr_cells[0] = f"skipped (est. >{args.torchrec_timeout:.0f} s: {n // 10} tables {took})"
                tr_seconds[(n, world)] = float("inf")
            else:
                tr = run_torchrec(n, world, args.torchrec_timeout)
                tr_seconds[(n, world)] = tr.get("seconds", float("inf"))
                if "plan" in tr:
                    plan = planners.ShardingPlan.from_dict(tr["plan"])
                    stats = planners.plan_stats(plan, tables, topo, batch_size=BATCH)
                    over = f" ({len(stats.over_capacity)} ranks over memory)" if stats.over_capacity else ""
                    tr_cells = [f"{tr['seconds']:.1f} s", _ms(stats.max_cost) + over,
                                f"{stats.bound_ratio:.3f}",
                                f"{stats.max_cost / ours.max_cost:.2f}" if ours else "-"]  # fmt: skip
                else:
                    tr_cells[0] = tr.get("skipped") or f"failed: {tr.get('error', '?')[:80]}"
            bound = _ms(ours.lower_bound) if ours else "-"
            print("| " + " | ".join(cells + tr_cells + [bound]) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
