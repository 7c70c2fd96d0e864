"""Plan statistics: what each rank holds, what it costs, and how far the plan is from the bound.

`plan_stats` prices any `ShardingPlan` -- ours or one converted from TorchRec -- under the cost
model of planners/cost.py, so two plans of the same tables can be compared number for number.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from planners.cost import CostModel, ShardCost, TableArrays
from planners.inputs import (
    ColumnWiseStatistic, Optimizer, Table, TableConstraint, Topology, format_bytes,
)  # fmt: skip
from planners.model_tables import (
    TableSet, TablesLike, as_table_set, display_name, match_constraints,
)  # fmt: skip
from planners.options import enumerate_candidates, lower_bound
from planners.types import PlanError, ShardingPlan, ShardingType, check_one_host

__all__ = ["PlanStats", "RankStats", "plan_stats", "stats_for", "validate_plan"]

_COMPONENTS = ("lookup", "input_dist", "output_dist", "grad_sync")


@dataclass(frozen=True)
class RankStats:
    """One rank: bytes used of its capacity, and seconds per step by step of the pipeline."""

    rank: int
    memory: float
    capacity: float
    lookup: float
    input_dist: float
    output_dist: float
    grad_sync: float
    tables: tuple[tuple[str, float], ...]  # (table, seconds) of each shard here, slowest first

    @property
    def cost(self) -> float:
        return self.lookup + self.input_dist + self.output_dist + self.grad_sync


@dataclass(frozen=True)
class PlanStats:
    """Per-rank cost and memory of a plan, its imbalance and its gap to the lower bound.

        stats = plan_stats(plan, tables, topology, batch_size=512)
        print(stats.format())
    """

    ranks: tuple[RankStats, ...]
    lower_bound: float  # seconds; no plan's slowest rank is faster (Note [the lower bound])
    topology: Topology
    batch_size: int
    optimizer: Optimizer
    num_tables: int
    plan_seconds: float | None = None  # wall time of the search, when the planner made the plan
    # what the column pieces were priced with (CostModel); shown when it is not the default
    column_wise_statistic: ColumnWiseStatistic = field(
        default=ColumnWiseStatistic.EXACT, kw_only=True
    )

    @property
    def max_cost(self) -> float:
        return max(r.cost for r in self.ranks)

    @property
    def mean_cost(self) -> float:
        return sum(r.cost for r in self.ranks) / len(self.ranks)

    @property
    def imbalance(self) -> float:
        """Slowest rank over mean rank (1.0 is perfectly even)."""
        mean = self.mean_cost
        return self.max_cost / mean if mean > 0 else 1.0

    @property
    def bound_ratio(self) -> float:
        """Slowest rank over the lower bound (1.0 is provably optimal)."""
        return self.max_cost / self.lower_bound if self.lower_bound > 0 else 1.0

    @property
    def slowest_rank(self) -> RankStats:
        return max(self.ranks, key=lambda r: (r.cost, -r.rank))

    @property
    def over_capacity(self) -> tuple[int, ...]:
        return tuple(r.rank for r in self.ranks if r.memory > r.capacity)

    def summary(self) -> str:
        """A few lines: the numbers to look at first."""
        slow = self.slowest_rank
        top = ", ".join(f"{name} ({_ms(sec)})" for name, sec in slow.tables[:5])
        more = f" and {len(slow.tables) - 5} more" if len(slow.tables) > 5 else ""
        mem = max(r.memory for r in self.ranks)
        statistic = ""
        if (self.optimizer is Optimizer.ROWWISE_ADAGRAD
                and self.column_wise_statistic is not ColumnWiseStatistic.EXACT):  # fmt: skip
            statistic = f" (column_wise_statistic {self.column_wise_statistic.value})"
        lines = [
            f"{self.num_tables} tables on {len(self.ranks)} ranks "
            f"({self.topology.ranks_per_host} per host), batch {self.batch_size} per rank, "
            f"optimizer {self.optimizer.value}{statistic}",
            f"slowest rank {slow.rank}: {_ms(slow.cost)} per step; mean {_ms(self.mean_cost)}; "
            f"imbalance (max/mean) {self.imbalance:.3f}",
            f"lower bound {_ms(self.lower_bound)}; slowest rank / bound = {self.bound_ratio:.3f} "
            f"(gap {100 * (self.bound_ratio - 1):.1f}%)",
            f"tables on the slowest rank: {top or 'none (data-parallel only)'}{more}",
            f"memory: max {format_bytes(mem)} of {format_bytes(self.ranks[0].capacity)} per rank "
            f"({format_bytes(self.topology.device_memory)} device, "
            f"{100 * self.topology.reserved_fraction:.0f}% reserved)",
        ]
        if self.over_capacity:
            lines.append(f"OVER CAPACITY on ranks {list(self.over_capacity)}")
        if self.plan_seconds is not None:
            lines.append(f"planned in {self.plan_seconds:.2f} s")
        return "\n".join(lines)

    def format(self, max_rows: int | None = None) -> str:
        """The per-rank table followed by the summary (all ranks unless `max_rows` is given)."""
        head = (f"{'rank':>5} {'memory':>10} {'use%':>5} {'cost ms':>9} {'lookup':>8} "
                f"{'in-dist':>8} {'out-dist':>8} {'dp-sync':>8} {'shards':>6}")  # fmt: skip
        rows = [head]
        shown = self.ranks if max_rows is None else self.ranks[:max_rows]
        for r in shown:
            rows.append(
                f"{r.rank:>5} {format_bytes(r.memory):>10} {100 * r.memory / r.capacity:>5.1f} "
                f"{1e3 * r.cost:>9.3f} {1e3 * r.lookup:>8.3f} {1e3 * r.input_dist:>8.3f} "
                f"{1e3 * r.output_dist:>8.3f} {1e3 * r.grad_sync:>8.3f} {len(r.tables):>6}"
            )
        if len(shown) < len(self.ranks):
            rows.append(f"  ... {len(self.ranks) - len(shown)} more ranks")
        return "\n".join(rows) + "\n\n" + self.summary()

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_cost_s": self.max_cost,
            "mean_cost_s": self.mean_cost,
            "imbalance": self.imbalance,
            "lower_bound_s": self.lower_bound,
            "bound_ratio": self.bound_ratio,
            "slowest_rank": self.slowest_rank.rank,
            "ranks": [
                {"rank": r.rank, "memory": r.memory, "capacity": r.capacity,
                 **{c: getattr(r, c) for c in _COMPONENTS}, "tables": [n for n, _ in r.tables]}
                for r in self.ranks
            ],
        }  # fmt: skip


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.3f} ms"


def validate_plan(
    plan: ShardingPlan, tables: TablesLike, topology: Topology, *, module_fqn: str = ""
) -> None:
    """Raises PlanError unless `plan` places every table exactly once on this topology.

        validate_plan(plan, tables, Topology(8))   # tables: as `plan` takes them, or a model

    Checks: world sizes agree; every table has a placement and the plan has no others; shards
    cover every row and column exactly (TablePlacement.shards); table-row-wise stays on a host.
    """
    _validate(plan, as_table_set(tables, module_fqn), topology)


def _validate(plan: ShardingPlan, table_set: TableSet, topology: Topology) -> None:
    if plan.world_size != topology.world_size:
        raise PlanError(
            f"the plan is for {plan.world_size} ranks but the topology has "
            f"{topology.world_size}; plan again for this world size"
        )
    expected = {(fqn, t.name) for fqn, t in table_set}
    for fqn, tables in plan.modules.items():
        for name in tables:
            if (fqn, name) not in expected:
                raise PlanError(
                    f"the plan places table {display_name(fqn, name)!r}, which is not among "
                    "the tables given; pass the tables the plan was made for"
                )
    for fqn, table in table_set:
        placement = plan.placement(fqn, table.name)
        where = f"table {display_name(fqn, table.name)!r}"
        placement.shards(num_embeddings=table.num_embeddings, embedding_dim=table.embedding_dim,
                         world_size=topology.world_size, table=where)  # fmt: skip
        if placement.sharding_type is ShardingType.TABLE_ROW_WISE:
            check_one_host(placement.ranks, int(topology.ranks_per_host or 1), where)


def evaluate(
    plan: ShardingPlan, table_set: TableSet, model: CostModel
) -> tuple[np.ndarray, np.ndarray, list[list[tuple[str, float]]]]:
    """Per-rank component seconds (W x 4), per-rank bytes, and per-rank (table, seconds) lists."""
    topo = model.topology
    world = topo.world_size
    tables = [t for _, t in table_set]
    arrays = TableArrays.of(tables)
    comp = np.zeros((world, 4))
    mem = np.full(world, model.batch_buffer_bytes(arrays))
    held: list[list[tuple[str, float]]] = [[] for _ in range(world)]
    groups: dict[ShardingType, list[tuple[int, int, int, int, int]]] = {}
    for i, (fqn, table) in enumerate(table_set):
        placement = plan.placement(fqn, table.name)
        shards = placement.shards(num_embeddings=table.num_embeddings,
                                  embedding_dim=table.embedding_dim, world_size=world)  # fmt: skip
        kind = placement.sharding_type
        k = 1 if kind is ShardingType.DATA_PARALLEL else len(shards)
        for s in shards:
            groups.setdefault(kind, []).append((i, s.rank, s.num_rows, s.num_cols, k))
    for kind, entries in groups.items():
        idx, ranks, rows, cols, ks = (np.array(col) for col in zip(*entries))
        cost: ShardCost = model.shard(kind, arrays.take(idx), rows.astype(float),
                                      cols.astype(float), ks.astype(float))  # fmt: skip
        parts = np.stack([cost.lookup, cost.input_dist, cost.output_dist, cost.grad_sync], axis=1)
        np.add.at(comp, ranks, parts)
        np.add.at(mem, ranks, cost.memory)
        total = cost.total
        for n, r, sec in zip(idx.tolist(), ranks.tolist(), total.tolist()):
            held[r].append((display_name(*_name(table_set[n])), sec))
    return comp, mem, held


def _name(entry: tuple[str, Table]) -> tuple[str, str]:
    return entry[0], entry[1].name


def plan_stats(
    plan: ShardingPlan,
    tables: TablesLike,
    topology: Topology,
    *,
    batch_size: int,
    optimizer: Optimizer | str = Optimizer.ROWWISE_ADAGRAD,
    constraints: Mapping[str, TableConstraint] | None = None,
    module_fqn: str = "",
    plan_seconds: float | None = None,
    column_wise_statistic: ColumnWiseStatistic | str = ColumnWiseStatistic.EXACT,
) -> PlanStats:
    """Prices `plan` for `tables` on `topology` and compares it with the lower bound.

        stats = plan_stats(plan, tables, topology, batch_size=512)
        stats.max_cost, stats.imbalance, stats.bound_ratio, stats.slowest_rank.tables

    `optimizer` and `column_wise_statistic` as for `planners.plan`: price a plan under the
    settings it will be trained with ("per_shard" makes column pieces under row-wise Adagrad
    cheaper; under the other optimizers it changes nothing).

    Raises PlanError if the plan does not place exactly these tables (see `validate_plan`).
    A plan over memory capacity is reported (`over_capacity`), not rejected.
    """
    table_set = as_table_set(tables, module_fqn)
    model = CostModel(topology, batch_size, Optimizer.parse(optimizer),
                      column_wise_statistic=column_wise_statistic)  # parsed by CostModel
    cons = match_constraints(table_set, constraints, topology.world_size)
    plain = [t for _, t in table_set]
    capacity = topology.capacity - model.batch_buffer_bytes(TableArrays.of(plain))
    bound = lower_bound(enumerate_candidates(plain, model, cons, capacity), topology.world_size)
    return stats_for(plan, table_set, model, bound, plan_seconds)


def stats_for(
    plan: ShardingPlan,
    table_set: TableSet,
    model: CostModel,
    bound: float,
    plan_seconds: float | None = None,
) -> PlanStats:
    """`plan_stats` for callers that already hold the flattened tables and the bound."""
    topology = model.topology
    _validate(plan, table_set, topology)
    comp, mem, held = evaluate(plan, table_set, model)
    ranks = tuple(
        RankStats(
            rank=r, memory=float(mem[r]), capacity=float(topology.capacity),
            lookup=float(comp[r, 0]), input_dist=float(comp[r, 1]),
            output_dist=float(comp[r, 2]), grad_sync=float(comp[r, 3]),
            tables=tuple(sorted(held[r], key=lambda x: (-x[1], x[0]))),
        )
        for r in range(topology.world_size)
    )  # fmt: skip
    return PlanStats(ranks, bound, topology, model.batch_size, model.optimizer, len(table_set),
                     plan_seconds, column_wise_statistic=model.column_wise_statistic)  # fmt: skip

