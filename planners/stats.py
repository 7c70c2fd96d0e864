"""Plan statistics: what each rank holds, what it costs, and how far the plan is from the bound,
as records a report, the CLI and a test read; planners/evaluate.py prices a plan into them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from planners.cost import COMPONENTS
from planners.inputs import (
    ColumnWiseStatistic, DataType, ManagedCollision, Optimizer, Topology, format_bytes,
)  # fmt: skip
from planners.options import lower_bound
from planners.replicas import Replicas
from planners.types import PlanError, ShardingType
from planners.units import format_seconds, plural, time_unit

__all__ = ["PlanStats", "RankStats", "ShardStats", "TableStats", "format_seconds", "plural"]

_COMPONENTS = tuple(attr for attr, _, _ in COMPONENTS)
# The parts of a rank's memory that the model keeps across steps (Note [what a rank holds] in
# planners/cost.py): (RankStats attribute, ShardCost attribute, short column header).
MEMORY_PARTS = (("weights", "weights", "weights"), ("optimizer_state", "state", "state"),
                ("gradients", "gradients", "grads"), ("buffers", "buffers", "buffers"),
                ("cache", "cache", "cache"))  # fmt: skip


@dataclass(frozen=True)
class RankStats:
    """One rank: bytes used of its capacity, and seconds per step by part of the pipeline
    (`COMPONENTS` in planners/cost.py names them)."""

    rank: int
    memory: float
    capacity: float
    lookup: float
    input_dist: float
    output_dist: float
    grad_sync: float  # data-parallel gradient all-reduce
    tables: tuple[tuple[str, float], ...]  # (table, seconds) of each shard here, slowest first
    stat_exchange: float = 0.0  # column pieces' row statistics (cost.column_stat_floats)
    replica_sync: float = 0.0  # 2D, exact: the other replica groups' batches (planners/replicas.py)
    # `memory` by part (Note [what a rank holds] in planners/cost.py); the rest is `batch`.
    weights: float = 0.0  # its shards' (and data-parallel copies') weights
    optimizer_state: float = 0.0  # fused state, or the torch optimizer's (unfused)
    gradients: float = 0.0  # unfused: the dense kernels' gradient buffers
    buffers: float = 0.0  # kept by kernels: emulated copies' gather buffers, scratch statistics
    # Calibrated only (Note [calibrated prices] in planners/calibration.py): the step's fixed
    # cost on this rank (Python, checks, collectives' latencies, kernel calls); 0 by default.
    fixed: float = 0.0
    # Managed-collision tables (Note [pricing managed collisions] in planners/mc_cost.py): this
    # rank's share of their collision state and its ids' history, kept across steps; and the
    # seconds of the remap's collectives and work, the same on every rank.
    collision_state: float = 0.0
    remap: float = 0.0
    # Tiered tables (Note [pricing tiered tables] in planners/tier_cost.py): seconds in the step
    # (`tier`, a part of `cost`), the caches' bytes with their bookkeeping (a part of `memory`),
    # the stores' bytes on the tier (not in `memory`) of its `tier_capacity`, and the seconds of
    # tier traffic, hidden by prefetch or not (`tier_io`).
    tier: float = 0.0
    cache: float = 0.0
    tier_bytes: float = 0.0
    tier_capacity: float = 0.0
    tier_io: float = 0.0
    # Bytes `modular.shard` holds for a moment beyond `memory` when the model is on meta: the
    # largest table whose init_fn runs whole on this rank (Note [pricing meta init] in
    # planners/init_transient.py); not in `memory`, not reserved by the search.
    meta_init: float = 0.0
    # Bytes an unfused torch optimizer's step holds for a moment (its temporaries for the rank's
    # largest piece, Note [pricing step transients] in planners/init_transient.py); not in
    # `memory` (the step runs once the batch's buffers are freed: `peak`), not reserved.
    step_transient: float = 0.0
    # Bytes a rank's first step allocates beside its tables and batch and keeps: the runtime's
    # workspaces (Note [pricing a step's runtime] in planners/init_transient.py); in `peak`,
    # not in `memory`.
    runtime: float = 0.0
    # Bytes a rank holds as `shard` of a meta model ends: its weights and fused state (a torch
    # optimizer's state and the unfused gradient buffers come later), collision state and
    # caches, and the table it initialises whole (`meta_init`); such a rank peaks at the larger
    # of this and `peak` (Note [pricing a step's runtime] in planners/init_transient.py).
    shard_peak: float = 0.0

    @property
    def peak(self) -> float:
        """The rank's peak bytes over a step: what it holds, the runtime's, and the larger of
        the batch's buffers (forward and backward) and the optimizer step's temporaries (after
        them)."""
        return self.held + self.runtime + max(self.batch, self.step_transient)

    @property
    def held(self) -> float:
        """Bytes the model keeps across steps: weights + optimizer state + gradients + buffers
        (what tests/modular/test_memory_prices.py measures) + collision state + tiered caches."""
        return (self.weights + self.optimizer_state + self.gradients + self.buffers
                + self.collision_state + self.cache)  # fmt: skip

    @property
    def batch(self) -> float:
        """Bytes of the step's batch: ids, pooled outputs and their gradients, wire copies."""
        return self.memory - self.held

    @property
    def cost(self) -> float:
        return (self.lookup + self.input_dist + self.output_dist + self.grad_sync
                + self.stat_exchange + self.replica_sync + self.fixed + self.remap
                + self.tier)  # fmt: skip

    def __repr__(self) -> str:
        return (f"RankStats(rank={self.rank}, cost={format_seconds(self.cost)}, memory="
                f"{format_bytes(self.memory)} of {format_bytes(self.capacity)}, "
                f"{plural(len(self.tables), 'shard')})")  # fmt: skip


@dataclass(frozen=True)
class ShardStats:
    """One shard of a table: where it is, its block of rows x columns, its bytes and seconds."""

    rank: int
    row_offset: int
    num_rows: int
    col_offset: int
    num_cols: int
    memory: float
    lookup: float
    input_dist: float
    output_dist: float
    grad_sync: float
    stat_exchange: float
    replica_sync: float = 0.0
    tier: float = 0.0
    # a tiered shard's cache rows, estimated (or given) hit rate and bytes on the tier
    cache_rows: int = field(default=0, kw_only=True)
    hit_rate: float = field(default=0.0, kw_only=True)
    tier_bytes: float = field(default=0.0, kw_only=True)

    @property
    def cost(self) -> float:
        return (self.lookup + self.input_dist + self.output_dist + self.grad_sync
                + self.stat_exchange + self.replica_sync + self.tier)  # fmt: skip


@dataclass(frozen=True)
class TableStats:
    """One table: how it is placed and what each of its shards holds and costs.

    A data-parallel table has one shard (a copy) per rank."""

    name: str  # 'fqn.table', or the bare name for the model's own EBC
    num_embeddings: int
    embedding_dim: int
    sharding_type: ShardingType
    shards: tuple[ShardStats, ...]
    # raw ids remapped into `zch_size` slots by torchrec's MCH module; None for a plain table
    managed_collision: ManagedCollision | None = field(default=None, kw_only=True)
    # tiered (Note [pricing tiered tables]): the placement's cache load factor and policy
    cache_load_factor: float | None = field(default=None, kw_only=True)
    cache_policy: str = field(default="lru", kw_only=True)

    @property
    def cache_rows(self) -> int:
        """Cache rows over all shards (0 for a resident table)."""
        return sum(s.cache_rows for s in self.shards)

    @property
    def hit_rate(self) -> float:
        """The shards' hit rates weighted by their rows (0 for a resident table)."""
        rows = sum(s.num_rows for s in self.shards)
        return sum(s.hit_rate * s.num_rows for s in self.shards) / rows if rows else 0.0

    @property
    def zch_size(self) -> int | None:
        return None if self.managed_collision is None else self.managed_collision.zch_size

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(s.rank for s in self.shards)

    @property
    def sizes(self) -> tuple[int, ...]:
        """Rows per shard (row-wise kinds) or columns per shard (column-wise); () otherwise."""
        if self.sharding_type is ShardingType.COLUMN_WISE:
            return tuple(s.num_cols for s in self.shards)
        if self.sharding_type in (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE):
            return tuple(s.num_rows for s in self.shards)
        return ()

    @property
    def max_cost(self) -> float:
        """Seconds of the slowest shard: what this table adds to the rank it slows most."""
        return max(s.cost for s in self.shards)

    @property
    def total_cost(self) -> float:
        return sum(s.cost for s in self.shards)

    @property
    def max_memory(self) -> float:
        return max(s.memory for s in self.shards)

    @property
    def memory(self) -> float:
        return sum(s.memory for s in self.shards)

    def __repr__(self) -> str:
        return (f"TableStats({self.name!r}, {self.sharding_type.value} on ranks {list(self.ranks)}, "
                f"largest shard {format_seconds(self.max_cost)} and "
                f"{format_bytes(self.max_memory)})")  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return {
            "table": self.name, "num_embeddings": self.num_embeddings,
            "embedding_dim": self.embedding_dim, "sharding_type": self.sharding_type.value,
            "ranks": list(self.ranks), "sizes": list(self.sizes), "max_cost_s": self.max_cost,
            "total_cost_s": self.total_cost, "memory": self.memory, "zch_size": self.zch_size,
            "cache_load_factor": self.cache_load_factor,
            **({"cache_policy": self.cache_policy, "cache_rows": self.cache_rows,
                "hit_rate": self.hit_rate} if self.cache_load_factor is not None else {}),
            "shards": [
                {"rank": s.rank, "row_offset": s.row_offset, "num_rows": s.num_rows,
                 "col_offset": s.col_offset, "num_cols": s.num_cols, "memory": s.memory,
                 "cost_s": s.cost, **{c: getattr(s, c) for c in _COMPONENTS}}
                for s in self.shards
            ],
        }  # fmt: skip


@dataclass(frozen=True)
class PlanStats:
    """Per-rank and per-table cost and memory of a plan, its imbalance and its gap to the bound.

        stats = plan_stats(plan, tables, topology, batch_size=512)
        print(stats.format())
        stats.tables[0].sharding_type, stats.tables[0].ranks, stats.tables[0].sizes
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
    tables: tuple[TableStats, ...] = field(default=(), kw_only=True)  # in input order
    num_sequence_tables: int = field(default=0, kw_only=True)  # an EmbeddingCollection's
    # the dtype pooled embeddings travel in (CostModel.comm_dtype); shown when it is not FP32
    comm_dtype: DataType = field(default=DataType.FP32, kw_only=True)
    # the bound is that of plans TorchRec runs unchanged (Note [plans TorchRec runs unchanged])
    torchrec_compatible: bool = field(default=False, kw_only=True)
    # 2D: these ranks are one shard group of `replicas` (planners/replicas.py); None is 1D
    replicas: Replicas | None = field(default=None, kw_only=True)
    # bytes each rank receives per step to remap managed-collision tables' raw ids
    remap_bytes: float = field(default=0.0, kw_only=True)
    # priced for a loop that prefetches (tiered tables' traffic beside the step)
    prefetch: bool = field(default=False, kw_only=True)
    # the tables `plan` tiered by itself (planners.tier_choice.AutoTiers); None: it tiered none
    auto_tiers: Any = field(default=None, kw_only=True)

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

    def table(self, name: str) -> TableStats:
        """The statistics of one table, by 'fqn.table' or its bare name."""
        for t in self.tables:
            if name in (t.name, t.name.rsplit(".", 1)[-1]):
                return t
        raise PlanError(f"no table named {name!r} in this plan")

    def __repr__(self) -> str:
        return (f"PlanStats({plural(self.num_tables, 'table')} on {plural(len(self.ranks), 'rank')}"
                f", slowest rank {self.slowest_rank.rank} {format_seconds(self.max_cost)}, "
                f"bound {format_seconds(self.lower_bound)}, ratio {self.bound_ratio:.3f})")  # fmt: skip

    def __str__(self) -> str:
        return self.format()

    def summary(self) -> str:
        """A few lines: the numbers to look at first."""
        slow = self.slowest_rank
        top = ", ".join(f"{name} ({format_seconds(sec)})" for name, sec in slow.tables[:5])
        more = f" and {len(slow.tables) - 5} more" if len(slow.tables) > 5 else ""
        mem = max(r.memory for r in self.ranks)
        statistic = ""
        if (self.optimizer is Optimizer.ROWWISE_ADAGRAD
                and self.column_wise_statistic is not ColumnWiseStatistic.EXACT):  # fmt: skip
            statistic = f" (column_wise_statistic {self.column_wise_statistic.value})"
        comm = "" if self.comm_dtype is DataType.FP32 else f", comm_dtype {self.comm_dtype.value}"
        lines = [
            f"{plural(self.num_tables, 'table')}"
            + (f" ({self.num_sequence_tables} sequence)" if self.num_sequence_tables else "")
            + f" on {plural(len(self.ranks), 'rank')} "
            f"({self.topology.ranks_per_host} per host), batch {self.batch_size} per rank, "
            f"optimizer {self.optimizer.value}{statistic}{comm}",
            f"slowest rank {slow.rank}: {format_seconds(slow.cost)} per step; mean "
            f"{format_seconds(self.mean_cost)}; imbalance (max/mean) {self.imbalance:.3f}",
            f"lower bound {format_seconds(self.lower_bound)}"
            + (" (of torchrec-compatible plans)" if self.torchrec_compatible else "")
            + "; slowest rank / bound = "
            f"{self.bound_ratio:.3f} (gap {100 * (self.bound_ratio - 1):.1f}%)",
            f"tables on the slowest rank: {top or 'none (data-parallel only)'}{more}",
            f"memory: max {format_bytes(mem)} of {format_bytes(self.ranks[0].capacity)} per rank "
            f"({format_bytes(self.topology.device_memory)} device, "
            f"{100 * self.topology.reserved_fraction:.0f}% reserved)",
        ]
        if self.topology.calibration is not None:  # Note [calibrated prices]
            lines.append(self.topology.calibration.describe())
        defaults = _defaults_used(self.topology)
        if defaults:
            lines.append(f"H100 defaults in effect (give your own for other hardware, e.g. a CPU "
                         f"gloo job): {', '.join(defaults)}")  # fmt: skip
        if self.replicas is not None and self.replicas.count > 1:
            rep, g = self.replicas, len(self.ranks)
            sync = (f"exact: {format_seconds(slow.replica_sync)} per step on the slowest rank "
                    "for the other groups' ids and pooled gradients" if rep.per_step
                    else "periodic: none per step (sync_replicas every N steps is not priced)")
            lines.insert(1, f"2D: {rep.count} replica groups of {g} ranks ({rep.count * g} in all, "
                            f"{rep.ranks_per_host} per host), global batch "
                            f"{rep.count * g * self.batch_size}; replica sync {sync}")
        mc = [t for t in self.tables if t.managed_collision is not None]
        if mc:  # Note [pricing managed collisions]
            rank = max(self.ranks, key=lambda r: r.collision_state)
            lines.append(f"managed collisions: {plural(len(mc), 'table')} (zch_size "
                         f"{', '.join(f'{t.zch_size:_}' for t in mc[:4])}{', ...' if len(mc) > 4 else ''}); "
                         f"collision state up to {format_bytes(rank.collision_state)} per rank; remap "
                         f"{format_seconds(rank.remap)} per step, {format_bytes(self.remap_bytes)} "
                         "received per rank")  # fmt: skip
        if self.auto_tiers is not None:  # Note [choosing tiers] in planners/tier_choice.py
            lines.append(self.auto_tiers.describe())
        tiered = [t for t in self.tables if t.cache_load_factor is not None]
        if tiered:  # Note [pricing tiered tables]
            rank = max(self.ranks, key=lambda r: r.tier_bytes)
            lines.append(f"tiered: {plural(len(tiered), 'table')} ("
                         + ", ".join(f"{t.name} {t.cache_load_factor:g} {t.cache_policy}, hit "
                                     f"{t.hit_rate:.2f}" for t in tiered[:4])
                         + f"{', ...' if len(tiered) > 4 else ''}); up to "
                         f"{format_bytes(rank.tier_bytes)} on the tier per rank of "
                         f"{format_bytes(rank.tier_capacity)}; tier traffic "
                         f"{format_seconds(max(r.tier_io for r in self.ranks))} per step on the "
                         f"busiest rank{' (prefetched: beside the step)' if self.prefetch else ''}")
        if self.over_capacity:
            lines.append(f"OVER CAPACITY on ranks {list(self.over_capacity)}")
        over = [r.rank for r in self.ranks if r.tier_bytes > r.tier_capacity]
        if over:
            lines.append(f"OVER TIER CAPACITY on ranks {over}")
        if self.plan_seconds is not None:
            lines.append(f"planned in {self.plan_seconds:.2f} s")
        return "\n".join(lines)

    def format_ranks(self, max_rows: int | None = None) -> str:
        """The per-rank table: memory, cost and its parts (all ranks unless `max_rows`), and a
        line saying what the parts' short names mean."""
        unit, scale = time_unit(self.max_cost)
        shown_parts = [(a, h, d) for a, h, d in COMPONENTS
                       if a in ("lookup", "input_dist", "output_dist")
                       or any(getattr(r, a) for r in self.ranks)]  # fmt: skip
        if any(r.fixed for r in self.ranks):  # calibrated (Note [calibrated prices])
            shown_parts.append(("fixed", "fixed", "measured fixed cost and the rank's own batch"))
        if any(r.remap for r in self.ranks):  # Note [pricing managed collisions]
            shown_parts.append(("remap", "mc-remap", "managed-collision remap: raw ids to slots"))
        tiered = any(r.cache or r.tier_bytes for r in self.ranks)
        mc = any(r.collision_state for r in self.ranks)
        stepped = any(r.step_transient for r in self.ranks)  # an unfused optimizer's temporaries
        memory_parts = (MEMORY_PARTS[:4] + ((("cache", "", "cache"),) if tiered else ())
                        + ((("collision_state", "", "mc-state"),) if mc else ()))  # fmt: skip
        head = (f"{'rank':>5} {'memory':>10} {'use%':>5} {'cost ' + unit:>9} "
                + " ".join(f"{h:>8}" for _, h, _ in shown_parts) + f" {'shards':>6}")  # fmt: skip
        rows = [head]
        shown = self.ranks if max_rows is None else self.ranks[:max_rows]
        mem_rows = [f"{'rank':>5} " + " ".join(f"{h:>10}" for _, _, h in memory_parts)
                    + f" {'batch':>10}" + (f" {'tier':>10} {'tier-io':>8}" if tiered else "")
                    + (f" {'step-temp':>10}" if stepped else "") + f" {'meta-init':>10}"
                    + f" {'peak':>10} {'shard-peak':>10}"]  # fmt: skip
        for r in shown:
            rows.append(
                f"{r.rank:>5} {format_bytes(r.memory):>10} {100 * r.memory / r.capacity:>5.1f} "
                f"{scale * r.cost:>9.3f} "
                + " ".join(f"{scale * getattr(r, a):>8.3f}" for a, _, _ in shown_parts)
                + f" {len(r.tables):>6}"
            )
            mem_rows.append(f"{r.rank:>5} " + " ".join(
                f"{format_bytes(getattr(r, a)):>10}" for a, _, _ in memory_parts)
                + f" {format_bytes(r.batch):>10}"
                + (f" {format_bytes(r.tier_bytes):>10} {scale * r.tier_io:>8.3f}" if tiered
                   else "") + (f" {format_bytes(r.step_transient):>10}" if stepped else "")
                + f" {format_bytes(r.meta_init):>10}"
                + f" {format_bytes(r.peak):>10} {format_bytes(r.shard_peak):>10}")  # fmt: skip
        if len(shown) < len(self.ranks):
            more = f"  ... {plural(len(self.ranks) - len(shown), 'more rank')}"
            rows.append(more)
            mem_rows.append(more)
        rows.extend(f"  {h}: {d}" for _, h, d in shown_parts[1:])
        rows.extend(mem_rows)  # no blank line: views split the output at blank lines
        rows.append("  memory by part: weights, optimizer state, gradients (unfused), buffers "
                    "kept by kernels" + (", tiered tables' caches and their bookkeeping" if tiered else "")
                    + (", managed-collision state" if mc else "")
                    + "; batch: ids, pooled outputs, wire copies"
                    + ("; tier: tiered tables' stores on the tier (not in memory; "
                       f"{format_bytes(self.ranks[0].tier_capacity)} a rank), tier-io: {unit} of "
                       "their traffic, in the step unless prefetched" if tiered else "")
                    + ("; step-temp: what the torch optimizer's step holds for a moment once the "
                       "batch is freed (peak: held + runtime + the larger of batch and step-temp)" if stepped else "")
                    + "; meta-init: what `shard` holds for a moment beyond memory when the model is "
                    "on meta (the largest table it initialises whole here); peak: a step's, held + "
                    f"the runtime's {format_bytes(self.ranks[0].runtime)} + the larger of batch and "
                    "step-temp; shard-peak: what `shard` of a meta model holds as it ends (weights, "
                    "fused state, meta-init, its runtime): a meta model's rank peaks at the larger")  # fmt: skip
        return "\n".join(rows)

    def format(self, max_rows: int | None = None) -> str:
        """The per-rank table followed by the summary (all ranks unless `max_rows` is given)."""
        return self.format_ranks(max_rows) + "\n\n" + self.summary()

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_cost_s": self.max_cost,
            "mean_cost_s": self.mean_cost,
            "imbalance": self.imbalance,
            "lower_bound_s": self.lower_bound,
            "bound_ratio": self.bound_ratio,
            "slowest_rank": self.slowest_rank.rank,
            "world_size": len(self.ranks),
            "ranks_per_host": self.topology.ranks_per_host,
            "batch_size": self.batch_size,
            "optimizer": self.optimizer.value,
            "column_wise_statistic": self.column_wise_statistic.value,
            "comm_dtype": self.comm_dtype.value,
            "torchrec_compatible": self.torchrec_compatible,
            "replicas": 1 if self.replicas is None else self.replicas.count,
            "replica_sync": None if self.replicas is None else self.replicas.sync.value,
            "ranks": [
                {"rank": r.rank, "memory": r.memory, "capacity": r.capacity, "cost_s": r.cost,
                 "fixed_s": r.fixed, "remap_s": r.remap, "collision_state": r.collision_state,
                 "tier_bytes": r.tier_bytes, "tier_io_s": r.tier_io,
                 **{c: getattr(r, c) for c in _COMPONENTS},
                 **{a: getattr(r, a) for a, _, _ in MEMORY_PARTS}, "batch": r.batch,
                 "meta_init": r.meta_init, "step_transient": r.step_transient, "runtime": r.runtime,
                 "shard_peak": r.shard_peak,
                 "peak": r.peak,
                 "tables": [n for n, _ in r.tables]}
                for r in self.ranks
            ],
            "tables": [t.to_dict() for t in self.tables],
        }  # fmt: skip


# Topology's defaults describe an H100 SXM node; a report says which of them a plan was priced
# with, since a CPU gloo job or another GPU would have other numbers.
_DEFAULTS = (
    ("device_memory", "device memory 80 GiB (--device-memory)", 80 * 1024**3),
    ("device_memory_bandwidth", "memory 3.35e12 B/s (--memory-bandwidth)", 3.35e12),
    ("intra_host_bandwidth", "NVLink 450e9 B/s (--intra-host-bandwidth)", 450e9),
    ("cross_host_bandwidth", "NIC 50e9 B/s (--cross-host-bandwidth)", 50e9),
)


def _defaults_used(topology: Topology) -> list[str]:
    """The H100 defaults a plan was priced with; calibrated, only the memory's size can be."""
    names = ("device_memory",) if topology.calibration is not None else None
    return [text for name, text, value in _DEFAULTS
            if getattr(topology, name) == value and (names is None or name in names)]  # fmt: skip
