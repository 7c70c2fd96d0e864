"""Command line: plan tables, show a plan, compare two plans (python -m planners --help)."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any, NamedTuple, Sequence

from planners.api import plan_with_stats
from planners.cost import COMPONENTS
from planners.explain import NoPlanError
from planners.files import (
    constraint_record, load_constraints, load_plan, load_tables, recorded_constraints,
    recorded_tables, save_plan, tables_digest,
)  # fmt: skip
from planners.inputs import (
    ColumnWiseStatistic, DataType, Optimizer, Table, TableConstraint, Topology, format_bytes,
    parse_bytes,
)  # fmt: skip
from planners.replicas import ReplicaSync
from planners.report import (
    SORT_KEYS, describe_counts, format_tables, moved_tables, pick_tables, setting_differences,
    table_moves, tables_csv, why_lines,
)  # fmt: skip
from planners.stats import PlanStats, TableStats, format_seconds, plan_stats, plural, time_unit
from planners.types import PlanError, ShardingPlan

EXIT_NO_PLAN = 1  # the input is valid but no plan fits; the message says why
EXIT_BAD_INPUT = 2  # a bad file or flag; one line says which and where

_EPILOG = """\
examples:
  python -m planners plan examples/tables_criteo_1tb.yaml --world-size 64 --ranks-per-host 8 \\
      --device-memory 80GiB --batch-size 512 -o plan.json
  python -m planners show plan.json --table t_cat_9 --plot ranks.png
  python -m planners show plan.json --sort cost --top 10
  python -m planners show plan.json --format csv > shards.csv
  python -m planners compare plan.json other.json --plot both.png

TABLES is a YAML or JSON list of records, or a CSV file with a header, with the fields
name, num_embeddings, embedding_dim, features, pooling_factor, dtype, weighted, sequence,
batch_fraction (only the first three are required; sequence: true for an EmbeddingCollection's
table, whose pooling_factor is then the average sequence length; batch_fraction, in (0, 1], a
deduplicated feature's bags per sample, e.g. 0.125 for a request-level feature of 8 candidates:
its lookups and comms are priced at that batch, and 'show --table' says so). A plan file written by 'plan -o' records
the tables, constraints, cluster and workload it was planned from, so 'show' and 'compare' need
no more flags; a flag given again overrides the record, and the output says so. Sizes need a
unit (80GiB, 512MiB, 80GB). The cost model is described in docs/planner.md.
Exit codes: 0 ok, 1 no plan fits (the message names the tables and the ways out),
2 bad input (a one-line error naming the file, line or field).
"""


def _bandwidth(text: str) -> float:
    try:
        return float(parse_bytes(text, "bandwidth"))
    except PlanError as e:  # argparse shows an ArgumentTypeError's own text, not the type's name
        raise argparse.ArgumentTypeError(str(e)) from None


def _bytes(text: str) -> int:
    # A bare number would be bytes: '--device-memory 80' meant 80 GiB, not 80 bytes.
    if re.fullmatch(r"\s*[0-9.eE+-]+\s*", text):
        try:
            number = float(text)
        except ValueError:
            number = None
        if number is not None and number > 0:
            raise argparse.ArgumentTypeError(
                f"memory size needs a unit: {text!r} would be {text.strip()} bytes; write e.g. "
                f"'{text.strip()}GiB' or '{text.strip()}MiB'"
            )
    try:
        return parse_bytes(text, "memory size")
    except PlanError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _optimizer(text: str) -> str:
    try:
        return Optimizer.parse(text).value
    except PlanError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_cluster_flags(p: argparse.ArgumentParser, required: bool) -> None:
    g = p.add_argument_group("cluster and workload" + ("" if required else
                                                       " (default: as recorded in the plan)"))  # fmt: skip
    if required:
        g.add_argument("--world-size", type=int, required=True, help="number of ranks (GPUs)")
        g.add_argument("--ranks-per-host", type=int, help="ranks per host (default: min(8, world size))")
        g.add_argument("--batch-size", type=int, required=True, help="samples per rank per step")
    else:
        g.add_argument("--batch-size", type=int, help="samples per rank per step")
    g.add_argument("--device-memory", type=_bytes,
                   help="memory per rank with its unit, e.g. 80GiB (default 80GiB, an H100)")  # fmt: skip
    g.add_argument("--reserved", type=float, dest="reserved_fraction",
                   help="fraction of device memory kept free (default 0.1)")  # fmt: skip
    g.add_argument("--memory-bandwidth", type=_bandwidth, dest="device_memory_bandwidth",
                   help="device memory bytes/s, e.g. 3.35e12 (default H100 HBM3)")  # fmt: skip
    g.add_argument("--intra-host-bandwidth", type=_bandwidth,
                   help="bytes/s per rank inside a host (default 450e9, NVLink)")
    g.add_argument("--cross-host-bandwidth", type=_bandwidth,
                   help="bytes/s per rank across hosts (default 50e9, 400 Gb/s NIC)")
    g.add_argument("--optimizer", type=_optimizer, metavar="OPT",
                   help="embedding optimizer: sgd, rowwise_adagrad (default), adagrad, adam, "
                        "partial_rowwise_adam, lamb, partial_rowwise_lamb, or "
                        "modular.fuse_optimizer's names exact_sgd, exact_rowwise_adagrad, "
                        "exact_adagrad")  # fmt: skip
    g.add_argument("--column-wise-statistic", choices=[s.value for s in ColumnWiseStatistic],
                   help="row-wise Adagrad's row statistic on a table cut into column pieces, as "
                        "given to modular.fuse_optimizer: exact (default; each piece pays a second "
                        "backward pass and an exchange of statistics) or per_shard (TorchRec's "
                        "approximation: plain pieces, so cutting costs less); no effect under the "
                        "other optimizers")  # fmt: skip
    g.add_argument("--comm-dtype", choices=[d.value for d in DataType],
                   help="dtype the pooled embeddings and their gradients travel in, as given to "
                        "modular.shard(comm_dtype=...): fp32 (default), fp16 or bf16 (half the "
                        "output-dist bytes, plus the low-precision copies in memory)")  # fmt: skip
    g.add_argument("--module", help="FQN of the EBC the tables belong to (default: '')")
    g.add_argument("--replicas", type=int, metavar="R",
                   help="2D sparse parallelism: plan one shard group of world-size / R ranks, "
                        "replicated R times (modular.shard with a ('replicate', 'shard') mesh); "
                        "default 1")  # fmt: skip
    g.add_argument("--replica-sync", choices=[m.value for m in ReplicaSync],
                   help="how the R replica groups stay in step, as given to modular.shard: exact "
                        "(default; every group's ids and pooled gradients gathered each step, "
                        "priced) or periodic (nothing per step)")  # fmt: skip


def _add_view_flags(p: argparse.ArgumentParser, plot_help: str) -> None:
    g = p.add_argument_group("what to print")
    g.add_argument("--table", action="append", metavar="NAME", default=[],
                   help="show only this table, shard by shard (repeatable)")
    g.add_argument("--sort", choices=list(SORT_KEYS), default="order",
                   help="order of the per-table view: as planned (default), by name, by the "
                        "cost or memory of the largest shard, total cost, type or shard count")  # fmt: skip
    g.add_argument("--top", type=int, metavar="N", help="show at most N tables")
    g.add_argument("--rows", type=int, default=None, help="show at most this many ranks")
    g.add_argument("--format", choices=("table", "json", "csv"), default="table",
                   help="table (default, for people), json (everything), or csv (one row per shard)")
    g.add_argument("--plot", metavar="PNG", help=plot_help)
    g.add_argument("--plot-by", choices=("type", "table"), default="type",
                   help="colour the plot's table blocks by sharding type (default) or by table")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m planners",
        description="Plan where embedding tables go on a GPU cluster, and explain the plan.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{plan,show,compare,replan}")
    p = sub.add_parser("plan", help="plan TABLES and print where each table went and what it costs",
                       epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("tables", metavar="TABLES", help="table file (.yaml, .json or .csv)")
    p.add_argument("--constraints", metavar="C", help="per-table constraints (.yaml or .json)")
    p.add_argument("--torchrec-compatible", action="store_true",
                   help="plan only what TorchRec's DistributedModelParallel runs as planned: "
                        "to_torchrec converts it with no warning and no moved row (row-wise "
                        "tables over every rank, table-row-wise over a whole host, in TorchRec's "
                        "block split); recorded in the plan file")  # fmt: skip
    p.add_argument("-o", "--output", metavar="PLAN", help="write the plan JSON here")
    _add_view_flags(p, "draw per-rank cost, memory and tables here (PNG)")
    _add_cluster_flags(p, required=True)
    s = sub.add_parser("show", help="print a plan again (per rank and per table), and --plot it",
                       epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    s.add_argument("plan", metavar="PLAN", help="plan JSON written by 'plan'")
    s.add_argument("--tables", metavar="TABLES", help="the table file (default: as recorded)")
    s.add_argument("--constraints", metavar="C", help="constraints (default: as recorded)")
    _add_view_flags(s, "draw per-rank cost, memory and tables here (PNG)")
    _add_cluster_flags(s, required=False)
    c = sub.add_parser("compare", help="compare two plans: settings, figures, tables that moved",
                       epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    c.add_argument("plans", metavar="PLAN", nargs=2, help="two plan JSON files")
    c.add_argument("--tables", metavar="TABLES", help="the table file (default: as recorded)")
    c.add_argument("--constraints", metavar="C", help="constraints (default: as recorded)")
    c.add_argument("--plot", metavar="PNG", help="draw the two plans side by side here (PNG)")
    c.add_argument("--plot-by", choices=("type", "table"), default="type",
                   help="colour the plot's table blocks by sharding type (default) or by table")
    c.add_argument("--format", choices=("table", "json"), default="table",
                   help="table (default) or json: both plans' statistics, the settings that "
                        "differ and every table that moved")  # fmt: skip
    _add_cluster_flags(c, required=False)
    r = sub.add_parser("replan", help="a plan for updated tables within a budget of moved bytes "
                                      "(modular.reshard moves them), and what moves and why")
    r.add_argument("plan", metavar="PLAN", help="the current plan JSON written by 'plan'")
    r.add_argument("--tables", metavar="TABLES", required=True,
                   help="the updated tables (new pooling factors, new rows)")
    r.add_argument("--max-moved", type=_budget, metavar="BYTES",
                   help="most bytes of weights and optimizer state that may change rank, e.g. "
                        "20GiB (default: no limit; 0B keeps the old plan)")  # fmt: skip
    r.add_argument("--constraints", metavar="C", help="constraints (default: as recorded)")
    r.add_argument("-o", "--output", metavar="PLAN", help="write the new plan JSON here")
    _add_cluster_flags(r, required=False)
    return parser


def _budget(text: str) -> int:
    """A byte count with its unit, or 0 (keep the old plan)."""
    if re.fullmatch(r"\s*0+\s*[A-Za-z]*\s*", text):
        return 0
    return _bytes(text)


def _cmd_replan(args: argparse.Namespace) -> int:
    from planners.replan import replan  # the one command that needs it

    plan, recorded = load_plan(args.plan)
    tables = load_tables(args.tables)
    constraints = (load_constraints(args.constraints, tables, plan.world_size) if args.constraints
                   else recorded_constraints(recorded, args.plan))  # fmt: skip
    topology = _topology(plan.world_size, plan.ranks_per_host, args, recorded)
    work = _workload(args, recorded, args.plan)
    torchrec = recorded.get("torchrec_compatible", False) is True
    module = _module_for(plan, work.module)
    result = replan(plan, tables, topology, batch_size=work.batch_size,
                    max_moved_bytes=args.max_moved, constraints=constraints or None,
                    optimizer=work.optimizer, module_fqn=module,
                    column_wise_statistic=work.column_wise_statistic, comm_dtype=work.comm_dtype,
                    torchrec_compatible=torchrec)  # fmt: skip
    if args.output:
        save_plan(args.output, result.plan, _settings(
            tables, args.tables, constraints, topology, work.batch_size,
            Optimizer.parse(work.optimizer).value, work.column_wise_statistic, module,
            DataType.parse(work.comm_dtype).value, torchrec))  # fmt: skip
    print(result.format())
    if args.output:
        print(f"wrote {args.output}")
    return 0


_SETTINGS = ("device_memory", "reserved_fraction", "device_memory_bandwidth",
             "intra_host_bandwidth", "cross_host_bandwidth")  # fmt: skip


def _topology(world: int, per_host: int | None, args: argparse.Namespace, recorded: dict) -> Topology:
    kwargs: dict[str, Any] = {}
    for name in _SETTINGS:
        value = getattr(args, name, None)
        value = recorded.get(name) if value is None else value
        if value is not None:
            kwargs[name] = value
    return Topology(world, ranks_per_host=per_host, **kwargs)


class _Workload(NamedTuple):
    batch_size: int
    optimizer: str
    column_wise_statistic: str
    module: str | None
    comm_dtype: str


def _workload(args: argparse.Namespace, recorded: dict, plan_path: str) -> _Workload:
    batch = args.batch_size if args.batch_size is not None else recorded.get("batch_size")
    if batch is None:
        raise PlanError(f"{plan_path} does not record the batch size; pass --batch-size")
    optimizer = args.optimizer or recorded.get("optimizer", Optimizer.ROWWISE_ADAGRAD.value)
    # a plan file written before the setting existed was planned with the exact statistic
    statistic = args.column_wise_statistic or recorded.get(
        "column_wise_statistic", ColumnWiseStatistic.EXACT.value
    )
    module = args.module if args.module is not None else recorded.get("module")
    if module is not None and not isinstance(module, str):
        raise PlanError(f"{plan_path}: the recorded module must be an FQN string, got {module!r}")
    # a plan file written before the setting existed was planned with FP32 comms
    comm = args.comm_dtype or recorded.get("comm_dtype", DataType.FP32.value)
    return _Workload(batch, optimizer, statistic, module, comm)


def _module_for(plan: ShardingPlan, module: str | None) -> str:
    if module is not None:
        return module
    return next(iter(plan.modules)) if len(plan.modules) == 1 else ""


class _Priced(NamedTuple):
    """One plan priced under its settings: what it was planned from, and what a flag changed."""

    path: str
    plan: ShardingPlan
    stats: PlanStats
    settings: dict[str, Any]  # the effective settings, as a plan file records them
    overrides: list[str]  # 'batch_size 256 (the plan records 512)'
    tables: tuple[Table, ...]
    constraints: dict[str, TableConstraint]


def _settings(tables: tuple[Table, ...], tables_path: str, constraints: dict[str, TableConstraint],
              topology: Topology, batch: int, optimizer: str, statistic: str, module: str,
              comm: str, torchrec: bool, replicas: int = 1,
              replica_sync: str = "exact") -> dict[str, Any]:  # fmt: skip
    return {
        "replicas": replicas, "replica_sync": replica_sync,
        "batch_size": batch, "optimizer": optimizer, "column_wise_statistic": statistic,
        "comm_dtype": comm, "module": module, "torchrec_compatible": torchrec,
        **{name: getattr(topology, name) for name in _SETTINGS},
        "world_size": topology.world_size, "ranks_per_host": topology.ranks_per_host,
        "tables_path": tables_path, "tables_digest": tables_digest(tables),
        "tables": [t.to_dict() for t in tables],
        "constraints": {name: constraint_record(c) for name, c in constraints.items()},
    }  # fmt: skip


def _cmd_plan(args: argparse.Namespace) -> int:
    tables = load_tables(args.tables)
    topology = _topology(args.world_size, args.ranks_per_host, args, {})
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
                             replica_sync=args.replica_sync or "exact")  # fmt: skip
    settings = _settings(tables, args.tables, constraints, topology, args.batch_size, optimizer,
                         statistic, module, comm, args.torchrec_compatible,
                         args.replicas or 1, args.replica_sync or "exact")  # fmt: skip
    priced = _Priced(args.output or "", result.plan, result.stats, settings, [], tables,
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


def _price(path: str, args: argparse.Namespace) -> _Priced:
    """A plan file priced as it was planned, with the flags given overriding its record."""
    plan, recorded = load_plan(path)
    overrides = []
    if args.tables:
        tables = load_tables(args.tables)
        tables_path = args.tables
        digest = recorded.get("tables_digest")
        if digest is not None and digest != tables_digest(tables):
            overrides.append(f"tables {args.tables} (the plan records "
                             f"{recorded.get('tables_path', 'other tables')})")  # fmt: skip
    else:
        tables = recorded_tables(recorded, path)
        if tables is None:
            raise PlanError(f"{path} does not record the tables it was planned from (it was "
                            "written before plans recorded them); pass --tables FILE")  # fmt: skip
        tables_path = str(recorded.get("tables_path", path))
    if args.constraints:
        constraints = load_constraints(args.constraints, tables, plan.world_size)
        if recorded.get("constraints") != {n: constraint_record(c) for n, c in constraints.items()}:
            overrides.append(f"constraints {args.constraints}")
    else:
        constraints = recorded_constraints(recorded, path)
    # a 2D plan is one shard group: its world is the group's times the replicas
    replicas = args.replicas or recorded.get("replicas", 1)
    replica_sync = args.replica_sync or recorded.get("replica_sync", "exact")
    if replicas == 1:
        topology = _topology(plan.world_size, plan.ranks_per_host, args, recorded)
    else:
        topology = _topology(plan.world_size * replicas,
                             recorded.get("ranks_per_host", plan.ranks_per_host), args, recorded)
    work = _workload(args, recorded, path)
    # planned for TorchRec's layouts: the bound is theirs (a file without the record was not)
    torchrec = recorded.get("torchrec_compatible", False)
    if not isinstance(torchrec, bool):
        raise PlanError(f"{path}: the recorded torchrec_compatible must be true or false, got "
                        f"{torchrec!r}")  # fmt: skip
    module = _module_for(plan, work.module)
    for name, value in (("batch_size", args.batch_size), ("optimizer", args.optimizer),
                        ("column_wise_statistic", args.column_wise_statistic),
                        ("comm_dtype", args.comm_dtype), ("module", args.module),
                        ("replicas", args.replicas), ("replica_sync", args.replica_sync),
                        *((n, getattr(args, n, None)) for n in _SETTINGS)):  # fmt: skip
        was = recorded.get(name)
        if value is not None and was is not None and value != was:
            show = _setting_text(name)
            overrides.append(f"{name} {show(value)} (the plan records {show(was)})")
        elif value is not None and was is None:
            overrides.append(f"{name} {value} (the plan records none)")
    try:
        stats = plan_stats(plan, tables, topology, batch_size=work.batch_size,
                           optimizer=work.optimizer, module_fqn=module,
                           constraints=constraints or None,
                           column_wise_statistic=work.column_wise_statistic,
                           comm_dtype=work.comm_dtype,
                           torchrec_compatible=torchrec, replicas=replicas,
                           replica_sync=replica_sync)  # fmt: skip
    except PlanError as e:
        raise PlanError(f"{path}: {e}") from None
    settings = _settings(tables, tables_path, constraints, topology, work.batch_size,
                         Optimizer.parse(work.optimizer).value, work.column_wise_statistic, module,
                         DataType.parse(work.comm_dtype).value, torchrec, replicas,
                         replica_sync)  # fmt: skip
    return _Priced(path, plan, stats, settings, overrides, tables, constraints)


def _setting_text(name: str) -> Any:
    """How a setting reads in an override line: bytes with a unit, bandwidths in B/s."""
    if name == "device_memory":
        return format_bytes
    if name.endswith("bandwidth"):
        return lambda v: f"{v:.3g} B/s" if isinstance(v, (int, float)) else repr(v)
    return lambda v: v


def _print_one(p: _Priced, args: argparse.Namespace) -> None:
    stats = p.stats
    picked = pick_tables(stats, args.table, args.sort)
    if args.top is not None:
        picked = picked[: max(args.top, 0)]
    if args.format == "json":
        data = {"plan": p.path, "overrides": p.overrides, "stats": stats.to_dict(),
                "settings": {k: v for k, v in p.settings.items() if k != "tables"}}  # fmt: skip
        data["stats"]["tables"] = [t.to_dict() for t in picked]
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


def _shard_detail(p: _Priced, tables: Sequence[TableStats]) -> str:
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
    priced = _price(args.plan, args)
    _plot(priced.stats, args)
    _print_one(priced, args)
    if args.plot:
        _say(args, f"wrote {args.plot}")
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    one, two = (_price(path, args) for path in args.plans)
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


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the CLI; returns the exit code (0 ok, 1 no plan fits, 2 bad input)."""
    args = _parser().parse_args(argv)
    command = {"plan": _cmd_plan, "show": _cmd_show, "compare": _cmd_compare,
               "replan": _cmd_replan}[args.command]
    try:
        return command(args)
    except NoPlanError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_NO_PLAN
    except PlanError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:  # `... | head`: the reader stopped reading; not an error of ours
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so that the flush at exit does not fail again
        return 0
    except OSError as e:
        print(f"error: {e.filename or ''}: {e.strerror or e}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
