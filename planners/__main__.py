"""Command line: plan tables, show a plan, compare two plans (python -m planners --help)."""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from typing import Any, NamedTuple, Sequence

from planners.api import plan_with_stats
from planners.explain import NoPlanError
from planners.files import load_constraints, load_plan, load_tables, save_plan
from planners.inputs import ColumnWiseStatistic, Optimizer, Topology, format_bytes, parse_bytes
from planners.stats import PlanStats, plan_stats
from planners.types import PlanError, ShardingPlan

EXIT_NO_PLAN = 1  # the input is valid but no plan fits; the message says why
EXIT_BAD_INPUT = 2  # a bad file or flag; one line says which and where

_EPILOG = """\
examples:
  python -m planners plan examples/tables_criteo_1tb.yaml --world-size 64 --ranks-per-host 8 \\
      --device-memory 80GiB --batch-size 512 -o plan.json
  python -m planners show plan.json --tables examples/tables_criteo_1tb.yaml --plot ranks.png
  python -m planners compare plan.json other.json --tables examples/tables_criteo_1tb.yaml

TABLES is a YAML or JSON list of records, or a CSV file with a header, with the fields
name, num_embeddings, embedding_dim, features, pooling_factor, dtype, weighted
(only the first three are required). The cost model is described in docs/planner.md.
Exit codes: 0 ok, 1 no plan fits (the message names the tables and the ways out),
2 bad input (a one-line error naming the file, line or field).
"""


def _bandwidth(text: str) -> float:
    try:
        return float(parse_bytes(text, "bandwidth"))
    except PlanError as e:  # argparse shows an ArgumentTypeError's own text, not the type's name
        raise argparse.ArgumentTypeError(str(e)) from None


def _bytes(text: str) -> int:
    try:
        return parse_bytes(text, "memory size")
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
    g.add_argument("--device-memory", type=_bytes, help="memory per rank, e.g. 80GiB (default 80GiB)")
    g.add_argument("--reserved", type=float, dest="reserved_fraction",
                   help="fraction of device memory kept free (default 0.1)")  # fmt: skip
    g.add_argument("--memory-bandwidth", type=_bandwidth, dest="device_memory_bandwidth",
                   help="device memory bytes/s, e.g. 3.35e12 (default H100 HBM3)")  # fmt: skip
    g.add_argument("--intra-host-bandwidth", type=_bandwidth,
                   help="bytes/s per rank inside a host (default 450e9, NVLink)")
    g.add_argument("--cross-host-bandwidth", type=_bandwidth,
                   help="bytes/s per rank across hosts (default 50e9, 400 Gb/s NIC)")
    g.add_argument("--optimizer", choices=[o.value for o in Optimizer],
                   help="embedding optimizer (default rowwise_adagrad)")
    g.add_argument("--column-wise-statistic", choices=[s.value for s in ColumnWiseStatistic],
                   help="row-wise Adagrad's row statistic on a table cut into column pieces, as "
                        "given to modular.fuse_optimizer: exact (default; each piece pays a second "
                        "backward pass and an exchange of statistics) or per_shard (TorchRec's "
                        "approximation: plain pieces, so cutting costs less); no effect under the "
                        "other optimizers")  # fmt: skip
    g.add_argument("--module", help="FQN of the EBC the tables belong to (default: '')")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m planners",
        description="Plan where embedding tables go on a GPU cluster, and explain the plan.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{plan,show,compare}")
    p = sub.add_parser("plan", help="plan TABLES and print the per-rank table and summary",
                       epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("tables", metavar="TABLES", help="table file (.yaml, .json or .csv)")
    p.add_argument("--constraints", metavar="C", help="per-table constraints (.yaml or .json)")
    p.add_argument("-o", "--output", metavar="PLAN", help="write the plan JSON here")
    p.add_argument("--rows", type=int, default=None, help="show at most this many ranks")
    _add_cluster_flags(p, required=True)
    s = sub.add_parser("show", help="print a plan's per-rank table again, and --plot it",
                       epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    s.add_argument("plan", metavar="PLAN", help="plan JSON written by 'plan'")
    s.add_argument("--tables", metavar="TABLES", required=True, help="the table file planned")
    s.add_argument("--plot", metavar="PNG", help="draw per-rank cost and memory bars here")
    s.add_argument("--rows", type=int, default=None, help="show at most this many ranks")
    _add_cluster_flags(s, required=False)
    c = sub.add_parser("compare", help="compare two plans of the same tables",
                       epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    c.add_argument("plans", metavar="PLAN", nargs=2, help="two plan JSON files")
    c.add_argument("--tables", metavar="TABLES", required=True, help="the table file planned")
    _add_cluster_flags(c, required=False)
    return parser


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
    return _Workload(batch, optimizer, statistic, module)


def _module_for(plan: ShardingPlan, module: str | None) -> str:
    if module is not None:
        return module
    return next(iter(plan.modules)) if len(plan.modules) == 1 else ""


def _cmd_plan(args: argparse.Namespace) -> int:
    tables = load_tables(args.tables)
    constraints = load_constraints(args.constraints) if args.constraints else None
    topology = _topology(args.world_size, args.ranks_per_host, args, {})
    optimizer = args.optimizer or Optimizer.ROWWISE_ADAGRAD.value
    statistic = args.column_wise_statistic or ColumnWiseStatistic.EXACT.value
    module = args.module or ""
    result = plan_with_stats(tables, topology, batch_size=args.batch_size, constraints=constraints,
                             optimizer=optimizer, module_fqn=module,
                             column_wise_statistic=statistic)  # fmt: skip
    print(result.stats.format(args.rows))
    if args.output:
        settings = {"batch_size": args.batch_size, "optimizer": optimizer,
                    "column_wise_statistic": statistic, "module": module,
                    **{name: getattr(topology, name) for name in _SETTINGS}}  # fmt: skip
        save_plan(args.output, result.plan, settings)
        print(f"wrote {args.output}")
    return 0


def _stats_of(path: str, tables, args: argparse.Namespace) -> tuple[ShardingPlan, PlanStats]:
    plan, recorded = load_plan(path)
    topology = _topology(plan.world_size, plan.ranks_per_host, args, recorded)
    work = _workload(args, recorded, path)
    module = _module_for(plan, work.module)
    try:
        stats = plan_stats(plan, tables, topology, batch_size=work.batch_size,
                           optimizer=work.optimizer, module_fqn=module,
                           column_wise_statistic=work.column_wise_statistic)  # fmt: skip
    except PlanError as e:
        raise PlanError(f"{path}: {e}") from None
    return plan, stats


def _cmd_show(args: argparse.Namespace) -> int:
    tables = load_tables(args.tables)
    _, stats = _stats_of(args.plan, tables, args)
    print(stats.format(args.rows))
    if args.plot:
        from planners.plot import plot_stats

        plot_stats(stats, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    tables = load_tables(args.tables)
    (plan_a, a), (plan_b, b) = (_stats_of(path, tables, args) for path in args.plans)
    rows = [
        ("slowest rank (ms)", lambda s: f"{1e3 * s.max_cost:.3f}"),
        ("mean rank (ms)", lambda s: f"{1e3 * s.mean_cost:.3f}"),
        ("imbalance max/mean", lambda s: f"{s.imbalance:.3f}"),
        ("lower bound (ms)", lambda s: f"{1e3 * s.lower_bound:.3f}"),
        ("slowest / bound", lambda s: f"{s.bound_ratio:.3f}"),
        ("max memory", lambda s: format_bytes(max(r.memory for r in s.ranks))),
        ("ranks over capacity", lambda s: str(len(s.over_capacity))),
    ]
    names = [p[-40:] for p in args.plans]
    width = max(22, *(len(n) for n in names))
    print(f"{'':<22} {names[0]:>{width}} {names[1]:>{width}}")
    for label, fn in rows:
        print(f"{label:<22} {fn(a):>{width}} {fn(b):>{width}}")
    for label, plan in zip(names, (plan_a, plan_b)):
        kinds = Counter(p.sharding_type.value for t in plan.modules.values() for p in t.values())
        print(f"{label}: " + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())))
    flat_a = {(f, n): p for f, t in plan_a.modules.items() for n, p in t.items()}
    flat_b = {(f, n): p for f, t in plan_b.modules.items() for n, p in t.items()}
    differ = sum(1 for key, p in flat_a.items() if flat_b.get(key) != p)
    print(f"tables placed differently: {differ} of {len(flat_a)}")
    ratio = b.max_cost / a.max_cost if a.max_cost > 0 else 1.0
    print(f"slowest rank of {names[1]} / {names[0]}: {ratio:.3f}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the CLI; returns the exit code (0 ok, 1 no plan fits, 2 bad input)."""
    args = _parser().parse_args(argv)
    command = {"plan": _cmd_plan, "show": _cmd_show, "compare": _cmd_compare}[args.command]
    try:
        return command(args)
    except NoPlanError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_NO_PLAN
    except PlanError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as e:
        print(f"error: {e.filename or ''}: {e.strerror or e}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
