"""The command line's commands: what plan, show, compare and replan do and print.

Each takes the parsed flags (planners/cli_flags.py) and returns the exit code; a bad input raises
PlanError and a plan that cannot fit raises NoPlanError, which planners/__main__.py turns into
exit codes 2 and 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Callable, Sequence

from planners.api import plan_with_stats
from planners.calibration import Calibration
from planners.cli_settings import (
    Priced, module_for, price, settings_record, topology_for, workload_for,
)  # fmt: skip
from planners.cost import COMPONENTS
from planners.files import load_constraints, load_plan, load_tables, recorded_constraints, save_plan
from planners.inputs import ColumnWiseStatistic, DataType, Optimizer, format_bytes
from planners.replan import replan
from planners.report import (
    describe_counts, format_tables, moved_tables, pick_tables, setting_differences, table_moves,
    tables_csv, why_lines,
)  # fmt: skip
from planners.stats import PlanStats, TableStats
from planners.types import PlanError
from planners.units import format_seconds, plural, time_unit


def _cmd_plan(args: argparse.Namespace) -> int:
    tables = load_tables(args.tables)
    topology = topology_for(args.world_size, args.ranks_per_host, args, {})
    constraints = (load_constraints(args.constraints, tables, topology.world_size)
                   if args.constraints else {})  # fmt: skip
    optimizer = args.optimizer or Optimizer.ROWWISE_ADAGRAD.value
    statistic = args.column_wise_statistic or ColumnWiseStatistic.EXACT.value
    module = args.module or ""
    comm = args.comm_dtype or DataType.FP32.value
    result = plan_with_stats(tables, topology, batch_size=args.batch_size,
                             constraints=constraints or None, optimizer=optimizer,
                             module_fqn=module, column_wise_statistic=statistic,
                             comm_dtype=comm,
                             torchrec_compatible=args.torchrec_compatible,
                             replicas=args.replicas or 1,
                             replica_sync=args.replica_sync or "exact",
                             prefetch=bool(args.prefetch), auto_tier=args.auto_tier)  # fmt: skip
    settings = settings_record(tables, args.tables, constraints, topology, args.batch_size,
                               optimizer, statistic, module, comm, args.torchrec_compatible,
                               args.replicas or 1, args.replica_sync or "exact",
                               bool(args.prefetch))  # fmt: skip
    priced = Priced(args.output or "", result.plan, result.stats, settings, [], tables,
                     constraints)  # fmt: skip
    # Files first: neither a misspelt --table nor a reader that stops early (| head) loses them.
    if args.output:
        save_plan(args.output, result.plan, settings)
    _plot(priced.stats, args)
    _print_one(priced, args)
    for path in (args.output, args.plot):
        if path:
            _say(args, f"wrote {path}")
    return 0


def _plot(stats: PlanStats, args: argparse.Namespace) -> None:
    if args.plot:
        from planners.plot import plot_stats

        plot_stats(stats, args.plot, colour_by=args.plot_by)


def _say(args: argparse.Namespace, line: str) -> None:
    """A progress line: on stdout for people, on stderr when stdout is JSON or CSV."""
    print(line, file=sys.stdout if args.format == "table" else sys.stderr)


def _print_one(p: Priced, args: argparse.Namespace) -> None:
    stats = p.stats
    picked = pick_tables(stats, args.table, args.sort)
    if args.top is not None:
        picked = picked[: max(args.top, 0)]
    if args.format == "json":
        data = {"plan": p.path, "overrides": p.overrides, "stats": stats.to_dict(),
                "settings": {k: v for k, v in p.settings.items() if k != "tables"}}  # fmt: skip
        data["stats"]["tables"] = [t.to_dict() for t in picked]
        data["constants"] = stats.topology.constants  # which constants priced it
        print(json.dumps(data, indent=2))
        return
    if args.format == "csv":
        for line in p.overrides:
            print(f"override: {line}", file=sys.stderr)
        sys.stdout.write(tables_csv(stats, picked))
        return
    for line in p.overrides:
        print(f"override: {line}")
    if args.table:
        print(_shard_detail(p, picked))
    else:
        print(stats.format_ranks(args.rows))
        print()
        shown = format_tables(stats, picked)
        if len(picked) < len(stats.tables):
            shown += f"\n  ... {plural(len(stats.tables) - len(picked), 'more table')} (--top)"
        print(shown)
    print()
    print(stats.summary())


def _shard_detail(p: Priced, tables: Sequence[TableStats]) -> str:
    """Each table's line of the per-table view, one line per shard, and why it is placed so."""
    stats, out = p.stats, []
    unit, scale = time_unit(max(t.max_cost for t in tables))
    host = stats.topology.ranks_per_host or 1
    for t in tables:
        out.append(format_tables(stats, [t]))
        out.append(f"  {t.num_embeddings:_} rows x {t.embedding_dim} columns in "
                   f"{plural(len(t.shards), 'shard')}")  # fmt: skip
        for s in t.shards:
            parts = ", ".join(f"{h} {scale * getattr(s, a):.3f}" for a, h, _ in COMPONENTS
                              if getattr(s, a))  # fmt: skip
            out.append(f"  rank {s.rank:>4} (host {s.rank // host}): rows {s.row_offset:_}.."
                       f"{s.row_offset + s.num_rows:_}, cols {s.col_offset}..{s.col_offset + s.num_cols}"
                       f"; {format_bytes(s.memory)}; {scale * s.cost:.3f} {unit} ({parts})")  # fmt: skip
        out.extend(why_lines(stats, p.tables, t.name, p.constraints or None))
        out.append("")
    return "\n".join(out).rstrip()


def _cmd_show(args: argparse.Namespace) -> int:
    priced = price(args.plan, args)
    _plot(priced.stats, args)
    _print_one(priced, args)
    if args.plot:
        _say(args, f"wrote {args.plot}")
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    one, two = (price(path, args) for path in args.plans)
    a, b = one.stats, two.stats
    rows = [
        ("ranks x batch", lambda s: f"{len(s.ranks)} x {s.batch_size}"),
        ("slowest rank", lambda s: format_seconds(s.max_cost)),
        ("mean rank", lambda s: format_seconds(s.mean_cost)),
        ("imbalance max/mean", lambda s: f"{s.imbalance:.3f}"),
        ("lower bound", lambda s: format_seconds(s.lower_bound)),
        ("slowest / bound", lambda s: f"{s.bound_ratio:.3f}"),
        ("max memory", lambda s: format_bytes(max(r.memory for r in s.ranks))),
        ("ranks over capacity", lambda s: str(len(s.over_capacity))),
    ]
    names = [p[-40:] for p in args.plans]
    if args.plot:
        from planners.plot import plot_compare

        plot_compare((a, b), (names[0], names[1]), args.plot, colour_by=args.plot_by)
    if args.format == "json":
        moves = table_moves(a, b)
        print(json.dumps({
            "plans": list(args.plans),
            "overrides": [one.overrides, two.overrides],
            "differences": setting_differences((a, b), (one.settings, two.settings)),
            "stats": [a.to_dict(), b.to_dict()],
            "moved": [{"table": m.table, "what": list(m.what),
                       "before": {"sharding_type": m.before.sharding_type.value,
                                  "ranks": list(m.before.ranks), "sizes": list(m.before.sizes)},
                       "after": {"sharding_type": m.after.sharding_type.value,
                                 "ranks": list(m.after.ranks), "sizes": list(m.after.sizes)}}
                      for m in moves],
            "slowest_rank_ratio": b.max_cost / a.max_cost if a.max_cost > 0 else 1.0,
        }, indent=2))  # fmt: skip
        if args.plot:
            _say(args, f"wrote {args.plot}")
        return 0
    width = max(22, *(len(n) for n in names))
    for p in (one, two):
        for line in p.overrides:
            print(f"override ({p.path}): {line}")
    for line in setting_differences((a, b), (one.settings, two.settings)):
        print(line)
    for line in dict.fromkeys(s.topology.constants for s in (a, b)):  # which constants priced them
        print(line)
    print(f"{'':<22} {names[0]:>{width}} {names[1]:>{width}}")
    for label, fn in rows:
        print(f"{label:<22} {fn(a):>{width}} {fn(b):>{width}}")
    for label, s in zip(names, (a, b)):
        print(f"{label}: {describe_counts(s)}")
    if args.plot:
        print(f"wrote {args.plot}")
    for line in moved_tables((names[0], names[1]), (a, b)):  # the ratio last, for scripts
        print(line)
    return 0

def _cmd_replan(args: argparse.Namespace) -> int:
    plan, recorded = load_plan(args.plan)
    tables = load_tables(args.tables)
    constraints = (load_constraints(args.constraints, tables, plan.world_size) if args.constraints
                   else recorded_constraints(recorded, args.plan))  # fmt: skip
    topology = topology_for(plan.world_size, plan.ranks_per_host, args, recorded)
    work = workload_for(args, recorded, args.plan)
    torchrec = recorded.get("torchrec_compatible", False) is True
    module = module_for(plan, work.module)
    result = replan(plan, tables, topology, batch_size=work.batch_size,
                    max_moved_bytes=args.max_moved, constraints=constraints or None,
                    optimizer=work.optimizer, module_fqn=module,
                    column_wise_statistic=work.column_wise_statistic, comm_dtype=work.comm_dtype,
                    torchrec_compatible=torchrec)  # fmt: skip
    if args.output:
        save_plan(args.output, result.plan, settings_record(
            tables, args.tables, constraints, topology, work.batch_size,
            Optimizer.parse(work.optimizer).value, work.column_wise_statistic, module,
            DataType.parse(work.comm_dtype).value, torchrec))  # fmt: skip
    print(result.format())
    if args.output:
        print(f"wrote {args.output}")
    return 0



# what `python -m planners COMMAND` runs, in the order the help lists them
def _cmd_calibrate(args: argparse.Namespace) -> int:
    """Runs modular's measurement in its own process (the planner never imports modular)."""
    import subprocess

    least = 1 if args.device == "cuda" else 2  # one GPU over NCCL: its kernels (no peer)
    if args.world_size < least or args.threads_per_rank < 1:
        raise PlanError(f"calibrate needs --world-size >= {least} and --threads-per-rank >= 1, got "
                        f"{args.world_size} and {args.threads_per_rank}")  # fmt: skip
    if args.device == "cpu" and args.backend == "nccl":
        raise PlanError("calibrate --backend nccl needs --device cuda (CPU ranks run gloo)")
    command = [sys.executable, "-m", "modular.measure", "--out", args.out,
               "--world-size", str(args.world_size), "--threads-per-rank", str(args.threads_per_rank)]  # fmt: skip
    if args.device != "cpu":  # the CPU command as it was
        command += ["--device", args.device] + (["--backend", args.backend] if args.backend else [])
    # modular beside this planners package (a checkout), or installed with it
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    run = subprocess.run(command + (["--quick"] if args.quick else []), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env=env)  # fmt: skip
    lines = [line for line in run.stdout.splitlines() if "is_fx_tracing" not in line]
    print("\n".join(lines))
    if run.returncode:
        last = next((line for line in reversed(lines) if line.strip()), "")
        raise PlanError(f"calibrate failed (exit {run.returncode}): {last.strip()} (its output is above)")
    print(Calibration.load(args.out).describe())  # what it wrote reads back
    print(f"wrote {args.out}: use it with --topology {args.out}, or "
          f"planners.Topology.from_file({args.out!r})")  # fmt: skip
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "plan": _cmd_plan, "show": _cmd_show, "compare": _cmd_compare, "replan": _cmd_replan,
    "calibrate": _cmd_calibrate,
}  # fmt: skip
