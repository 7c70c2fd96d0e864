"""Our planner against TorchRec's on the same synthetic tables, priced under one cost model;
and against an earlier revision of itself.

    python benchmarks/planner_bench.py                       # the table in docs/benchmarks.md
    python benchmarks/planner_bench.py --tables 10 100 --world-sizes 8 64 --torchrec-timeout 60
    python benchmarks/planner_bench.py --no-torchrec --sizes 1000x4096 10000x4096 10000x256 \
        --compare-ref 9d08d14 --torchrec-compatible         # issue 38's frontier, before/after

For each (tables, ranks): the tables are drawn with a fixed seed (rows log-uniform in
[1e3, 1e8], dim in {32, 64, 128, 256}, one feature with a pooling factor log-uniform in
[1, 50], fp32); the cluster is 8 ranks per host, 80 GiB per rank, batch 512 per rank. Every
plan is priced here with planners.plan_stats (docs/planner.md), which also gives the lower bound.

Our planner runs --runs times (default 3), each in a fresh process, and the table gives the
median wall time of `plan_with_stats` (statistics included), its CPU time, and the process's
peak RSS (VmHWM: Python, numpy, the tables and the planning). With --compare-ref REV the planner
of that git revision (`git archive REV planners`, into a temporary directory) runs the same way,
alternating with ours, so that load from other jobs falls on both; a second table sets the two
side by side. With --torchrec-compatible a third table gives what `torchrec_compatible=True`
plans cost against the unrestricted bound. `--sizes 1000x4096 ...` replaces the grid of
--tables x --world-sizes.

TorchRec's EmbeddingShardingPlanner runs in a subprocess on a `meta` EmbeddingBagCollection with
a "cuda" Topology (planning needs no GPU), restricted to the five sharding types we have and to
device-resident kernels (fused, dense), given the same pooling factors, bandwidths (in its
bytes/ms) and a 10% storage reservation; it is killed after --torchrec-timeout seconds, and
skipped (reported as such) where the same world size with 10x fewer tables already took more
than a tenth of that.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import planners  # noqa: E402
from benchmarks import _plan_run  # noqa: E402
from benchmarks._plan_run import BATCH  # noqa: E402
from planners import Table, Topology  # noqa: E402


def synthetic_tables(n: int) -> list[Table]:
    """`n` tables drawn with a fixed seed (see the module docstring)."""
    return _plan_run.synthetic_tables(n, Table)


def topology(world: int) -> Topology:
    return _plan_run.topology(world, Topology)


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


def run_plan(root: str, n: int, world: int, *flags: str) -> dict[str, Any]:
    """One `_plan_run.py` process: planners from `root` (see its docstring)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "run.json")
        cmd = [sys.executable, _plan_run.__file__, root, str(n), str(world), out, *flags]
        subprocess.run(cmd, check=True, cwd=ROOT)
        with open(out) as f:
            return json.load(f)


def reference_checkout(rev: str, into: str) -> str:
    """`planners/` of git revision `rev`, written under `into` (no worktree, no index touched)."""
    archive = subprocess.run(["git", "-C", ROOT, "archive", rev, "planners"], check=True,
                             capture_output=True).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    return into


class Runs:
    """Several runs of one planner on one size: the median time, and the plan, priced here."""

    def __init__(self, runs: list[dict[str, Any]], tables: list[Table], topo: Topology,
                 compatible: bool = False) -> None:  # fmt: skip
        self.runs = runs
        plans = {json.dumps(r.get("plan"), sort_keys=True) for r in runs}
        if len(plans) != 1:
            raise SystemExit("the planner gave different plans in two runs of the same input")
        last = runs[-1]
        self.no_plan = last.get("no_plan")
        self.plan = planners.ShardingPlan.from_dict(last["plan"]) if "plan" in last else None
        self.stats = (planners.plan_stats(self.plan, tables, topo, batch_size=BATCH,
                                          torchrec_compatible=compatible)
                      if self.plan is not None else None)  # fmt: skip

    def time(self) -> str:
        t = [r["seconds"] for r in self.runs]
        spread = f" ({min(t):.2f}-{max(t):.2f})" if len(t) > 1 else ""
        return f"{statistics.median(t):.2f} s{spread}"

    def cpu(self) -> str:
        return f"{statistics.median(r['cpu_seconds'] for r in self.runs):.2f}"

    def rss(self) -> str:
        return f"{max(r['peak_rss'] for r in self.runs) / 2**30:.2f} GiB"

    def cells(self, bound: float | None) -> list[str]:
        """max ms, / bound; or the reason there is no plan."""
        if self.stats is None:
            return [f"no plan fits ({(self.no_plan or '').removeprefix('no plan fits: ')[:60]}...)", "-"]
        return [_ms(self.stats.max_cost), f"{self.stats.max_cost / (bound or self.stats.lower_bound):.3f}"]


def _ms(x: float) -> str:
    return f"{1e3 * x:.3f}"


def _sizes(args: argparse.Namespace) -> list[tuple[int, int]]:
    if args.sizes:
        try:
            return [(int(a), int(b)) for a, b in (s.lower().split("x") for s in args.sizes)]
        except ValueError:
            raise SystemExit(f"--sizes takes TABLESxRANKS, e.g. 1000x4096; got {args.sizes}") from None
    return [(n, w) for n in sorted(args.tables) for w in args.world_sizes]


def _table(header: list[str], rows: list[list[str]]) -> None:
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join(["---"] * len(header)) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |", flush=True)
    print()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tables", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--sizes", nargs="+", metavar="NxW",
                        help="(tables, ranks) pairs instead of --tables x --world-sizes, e.g. 10000x4096")
    parser.add_argument("--runs", type=int, default=3,
                        help="runs of each planner per size, each a fresh process (default 3)")
    parser.add_argument("--compare-ref", metavar="REV",
                        help="also run the planner of this git revision, alternating with ours")
    parser.add_argument("--torchrec-compatible", action="store_true",
                        help="also plan with torchrec_compatible=True and report what it costs")
    parser.add_argument("--torchrec-timeout", type=float, default=150.0,
                        help="seconds before TorchRec's planner is stopped (default 150)")
    parser.add_argument("--no-torchrec", action="store_true", help="do not run TorchRec's planner")
    parser.add_argument("--torchrec-worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.torchrec_worker:
        n, world, out = args.torchrec_worker
        torchrec_worker(int(n), int(world), out)
        return 0

    print(f"load average at the start: {' '.join(f'{x:.1f}' for x in os.getloadavg())} "
          f"({os.cpu_count()} cores); median of {args.runs} runs\n")
    with tempfile.TemporaryDirectory() as tmp:
        ref_root = reference_checkout(args.compare_ref, tmp) if args.compare_ref else None
        results = []
        for n, world in _sizes(args):
            tables, topo = synthetic_tables(n), topology(world)
            runs: dict[str, list] = {"ours": [], "ref": [], "compatible": []}
            for _ in range(args.runs):  # alternating, so that load falls on all of them alike
                if ref_root:
                    runs["ref"].append(run_plan(ref_root, n, world))
                runs["ours"].append(run_plan(ROOT, n, world))
                if args.torchrec_compatible:
                    runs["compatible"].append(run_plan(ROOT, n, world, "--torchrec-compatible"))
            ours = Runs(runs["ours"], tables, topo)
            ref = Runs(runs["ref"], tables, topo) if ref_root else None
            compatible = Runs(runs["compatible"], tables, topo, True) if args.torchrec_compatible else None
            results.append((n, world, tables, topo, ours, ref, compatible))

    rows, tr_seconds = [], {}
    for n, world, tables, topo, ours, ref, compatible in results:
        bound = ours.stats.lower_bound if ours.stats else None
        cells = [str(n), str(world), ours.time(), ours.cpu(), ours.rss(), *ours.cells(bound)]
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
                            f"{stats.max_cost / ours.stats.max_cost:.2f}" if ours.stats else "-"]  # fmt: skip
            else:
                tr_cells[0] = tr.get("skipped") or f"failed: {tr.get('error', '?')[:80]}"
        rows.append(cells + tr_cells + [_ms(bound) if bound else "-"])
    _table(["tables", "ranks", "ours: time", "ours: CPU s", "ours: peak RSS", "ours: max ms",
            "ours / bound", "TorchRec: time", "TorchRec: max ms", "TorchRec / bound",
            "TorchRec / ours", "bound ms"], rows)  # fmt: skip

    if args.compare_ref:
        rev = args.compare_ref
        rows = []
        for n, world, _, _, ours, ref, _ in results:
            bound = ours.stats.lower_bound if ours.stats else None
            ratio = (f"{ours.stats.max_cost / ref.stats.max_cost:.4f}"
                     if ours.stats and ref.stats else "-")  # fmt: skip
            same = "yes" if ours.plan == ref.plan else "no"
            rows.append([str(n), str(world), ref.time(), ref.cpu(), ref.rss(), *ref.cells(bound),
                         ours.time(), ours.cpu(), ours.rss(), *ours.cells(bound), ratio, same])  # fmt: skip
        _table(["tables", "ranks", f"{rev}: time", f"{rev}: CPU s", f"{rev}: peak RSS",
                f"{rev}: max ms", f"{rev} / bound", "ours: time", "ours: CPU s", "ours: peak RSS",
                "ours: max ms", "ours / bound", f"ours / {rev} (max)", "same plan"], rows)  # fmt: skip

    if args.torchrec_compatible:
        rows = []
        for n, world, _, _, ours, _, compatible in results:
            bound = ours.stats.lower_bound if ours.stats else None
            own = (f"{compatible.stats.bound_ratio:.3f}" if compatible.stats else "-")
            ratio = (f"{compatible.stats.max_cost / ours.stats.max_cost:.3f}"
                     if ours.stats and compatible.stats else "-")  # fmt: skip
            rows.append([str(n), str(world), *ours.cells(bound), compatible.time(),
                         *compatible.cells(bound), ratio, own])  # fmt: skip
        _table(["tables", "ranks", "ours: max ms", "ours / bound", "compatible: time",
                "compatible: max ms", "compatible / bound", "compatible / ours",
                "compatible / its own bound"], rows)  # fmt: skip
    print(f"load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
