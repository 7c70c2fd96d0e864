"""What a command prices a plan with: the settings a plan file records, and flags overriding them.

`price` reads a plan file and prices it as it was planned (tables, constraints, cluster and
workload from its record), naming every setting a flag changed; `settings_record` is the record
that `plan -o` and `replan -o` write beside the plan so that `show` and `compare` need no flags.
"""

from __future__ import annotations

import argparse
from typing import Any, NamedTuple

from planners.files import (
    constraint_record, load_constraints, load_plan, load_tables, recorded_constraints,
    recorded_tables, tables_digest,
)  # fmt: skip
from planners.inputs import (
    ColumnWiseStatistic, DataType, Optimizer, Table, TableConstraint, Topology, format_bytes,
)  # fmt: skip
from planners.evaluate import plan_stats
from planners.stats import PlanStats
from planners.types import PlanError, ShardingPlan

_SETTINGS = ("device_memory", "reserved_fraction", "device_memory_bandwidth",
             "intra_host_bandwidth", "cross_host_bandwidth", "tier_memory", "tier_bandwidth")  # fmt: skip


def topology_for(world: int, per_host: int | None, args: argparse.Namespace,
                 recorded: dict) -> Topology:  # fmt: skip
    kwargs: dict[str, Any] = {}
    for name in _SETTINGS:
        value = getattr(args, name, None)
        value = recorded.get(name) if value is None else value
        if value is not None:
            kwargs[name] = value
    # Note [calibrated prices] in planners/calibration.py: a measured file, given or recorded
    path = getattr(args, "topology", None) or recorded.get("topology_file")
    if path:
        return Topology.from_file(path, world, ranks_per_host=per_host, **kwargs)
    return Topology(world, ranks_per_host=per_host, **kwargs)


class Workload(NamedTuple):
    batch_size: int
    optimizer: str
    column_wise_statistic: str
    module: str | None
    comm_dtype: str


def workload_for(args: argparse.Namespace, recorded: dict, plan_path: str) -> Workload:
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
    return Workload(batch, optimizer, statistic, module, comm)


def module_for(plan: ShardingPlan, module: str | None) -> str:
    if module is not None:
        return module
    return next(iter(plan.modules)) if len(plan.modules) == 1 else ""


class Priced(NamedTuple):
    """One plan priced under its settings: what it was planned from, and what a flag changed."""

    path: str
    plan: ShardingPlan
    stats: PlanStats
    settings: dict[str, Any]  # the effective settings, as a plan file records them
    overrides: list[str]  # 'batch_size 256 (the plan records 512)'
    tables: tuple[Table, ...]
    constraints: dict[str, TableConstraint]


def settings_record(tables: tuple[Table, ...], tables_path: str,
                    constraints: dict[str, TableConstraint], topology: Topology, batch: int,
                    optimizer: str, statistic: str, module: str, comm: str, torchrec: bool,
                    replicas: int = 1, replica_sync: str = "exact",
                    prefetch: bool = False) -> dict[str, Any]:  # fmt: skip
    return {
        "replicas": replicas, "replica_sync": replica_sync, "prefetch": prefetch,
        "batch_size": batch, "optimizer": optimizer, "column_wise_statistic": statistic,
        "comm_dtype": comm, "module": module, "torchrec_compatible": torchrec,
        **{name: getattr(topology, name) for name in _SETTINGS},
        "world_size": topology.world_size, "ranks_per_host": topology.ranks_per_host,
        **({"topology_file": topology.calibration.path} if topology.calibration else {}),
        "tables_path": tables_path, "tables_digest": tables_digest(tables),
        "tables": [t.to_dict() for t in tables],
        "constraints": {name: constraint_record(c) for name, c in constraints.items()},
    }  # fmt: skip

def price(path: str, args: argparse.Namespace) -> Priced:
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
        topology = topology_for(plan.world_size, plan.ranks_per_host, args, recorded)
    else:
        topology = topology_for(plan.world_size * replicas,
                                recorded.get("ranks_per_host", plan.ranks_per_host), args,
                                recorded)  # fmt: skip
    work = workload_for(args, recorded, path)
    # planned for TorchRec's layouts: the bound is theirs (a file without the record was not)
    torchrec = recorded.get("torchrec_compatible", False)
    if not isinstance(torchrec, bool):
        raise PlanError(f"{path}: the recorded torchrec_compatible must be true or false, got "
                        f"{torchrec!r}")  # fmt: skip
    module = module_for(plan, work.module)
    prefetch = bool(args.prefetch) if args.prefetch is not None else recorded.get("prefetch", False)
    if not isinstance(prefetch, bool):
        raise PlanError(f"{path}: the recorded prefetch must be true or false, got {prefetch!r}")
    for name, value in (("batch_size", args.batch_size), ("optimizer", args.optimizer),
                        ("column_wise_statistic", args.column_wise_statistic),
                        ("comm_dtype", args.comm_dtype), ("module", args.module),
                        ("replicas", args.replicas), ("replica_sync", args.replica_sync),
                        ("prefetch", args.prefetch),
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
                           replica_sync=replica_sync, prefetch=prefetch)  # fmt: skip
    except PlanError as e:
        raise PlanError(f"{path}: {e}") from None
    settings = settings_record(tables, tables_path, constraints, topology, work.batch_size,
                               Optimizer.parse(work.optimizer).value, work.column_wise_statistic,
                               module, DataType.parse(work.comm_dtype).value, torchrec, replicas,
                               replica_sync, prefetch)  # fmt: skip
    return Priced(path, plan, stats, settings, overrides, tables, constraints)


def _setting_text(name: str) -> Any:
    """How a setting reads in an override line: bytes with a unit, bandwidths in B/s."""
    if name in ("device_memory", "tier_memory"):
        return format_bytes
    if name.endswith("bandwidth"):
        return lambda v: f"{v:.3g} B/s" if isinstance(v, (int, float)) else repr(v)
    return lambda v: v

