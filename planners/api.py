"""`plan`: tables and a cluster in, a `ShardingPlan` out -- and `plan_with_stats` to see why."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Mapping

from planners.cost import CostModel, TableArrays
from planners.explain import before_candidates, before_search, explain_no_plan
from planners.inputs import ColumnWiseStatistic, DataType, Optimizer, TableConstraint, Topology
from planners.model_tables import TablesLike, as_table_set, match_constraints
from planners.options import enumerate_candidates, lower_bound
from planners.replicas import ReplicaSync, group_topology
from planners.search import search
from planners.stats import PlanStats, stats_for
from planners.types import ShardingPlan, ShardingType, TablePlacement, even_split

__all__ = ["PlanResult", "plan", "plan_with_stats"]


@dataclass(frozen=True)
class PlanResult:
    """A plan, its statistics (per-rank cost and memory, bound, imbalance) and the search time."""

    plan: ShardingPlan
    stats: PlanStats
    seconds: float


def plan(
    tables: TablesLike,
    topology: Topology,
    *,
    batch_size: int,
    constraints: Mapping[str, TableConstraint] | None = None,
    optimizer: Optimizer | str = Optimizer.ROWWISE_ADAGRAD,
    module_fqn: str = "",
    column_wise_statistic: ColumnWiseStatistic | str = ColumnWiseStatistic.EXACT,
    pooling_factors: Mapping[str, float] | None = None,
    comm_dtype: DataType | str = DataType.FP32,
    torchrec_compatible: bool = False,
    replicas: int = 1,
    replica_sync: ReplicaSync | str = ReplicaSync.EXACT,
) -> ShardingPlan:
    """Places every table so that the slowest rank is as fast as possible and every rank fits.

        tables = [planners.Table("t_user", 10_000_000, 128, features=("user_id",)),
                  planners.Table("t_item", 1_000_000, 64, pooling_factor=20.0)]
        plan = planners.plan(tables, planners.Topology(16, ranks_per_host=8),
                             batch_size=512)

    `tables` is a list of `Table` or of torchrec `EmbeddingBagConfig` (planned as the tables of
    the EBC at `module_fqn`, default the model itself), a {EBC FQN: [Table, ...]} mapping, or a
    model (an EBC itself included) whose EBCs may live on `meta`. Configs and models carry no
    pooling factors: `pooling_factors` maps a feature to its mean ids per sample (default 1.0):

        plan = planners.plan(ebc.embedding_bag_configs(), topology, batch_size=512,
                             pooling_factors={"item_hist": 40.0})

    `batch_size` is per rank. `constraints` maps a table name (or 'fqn.table') to its
    `TableConstraint`. `optimizer` is the fused embedding optimizer; with row-wise Adagrad (the
    default), pass the `column_wise_statistic` you give `modular.fuse_optimizer`:

        plan = planners.plan(tables, topology, batch_size=512, column_wise_statistic="per_shard")
        opt = modular.fuse_optimizer(model, "exact_rowwise_adagrad", lr=0.1,
                                     column_wise_statistic="per_shard")

    "exact" (the default) prices a table cut into column pieces with its exact row statistic (a
    second backward pass, a scratch statistic per row and one fp32 per id exchanged between the
    pieces); "per_shard" prices each piece as a plain fused table, so cutting costs less and
    the plan may cut where "exact" would not. Under the other optimizers it changes nothing (any
    valid value is accepted). `comm_dtype` ("fp32", "fp16" or "bf16") is the dtype pooled
    embeddings travel in, as given to `modular.shard(comm_dtype=...)`; tables are priced in their
    own dtype (`Table.dtype`, FP16/BF16 at 2 bytes an element, optimizer state in FP32). The
    same input always gives the same plan.

    `torchrec_compatible=True` plans only what TorchRec's DistributedModelParallel runs as
    planned: `to_torchrec` then converts the plan with no `TorchRecLayoutWarning` and no moved
    row (row-wise over every rank, table-row-wise over a whole host, both in TorchRec's block
    split; a table whose width is no multiple of 4 only data-parallel):

        plan = planners.plan(tables, topology, batch_size=512, torchrec_compatible=True)
        tr_plan = planners.to_torchrec(plan, tables)

    `replicas=R` plans 2D sparse parallelism (`modular.shard(model, plan, mesh=mesh)` over a
    ("replicate", "shard") mesh): one shard group of `topology.world_size / R` ranks, the plan's
    world size, for the global batch of every rank, with each shard's cross-replica sync priced
    under `replica_sync` ("exact", the default: every replica group's ids and pooled gradients
    gathered each step; "periodic": nothing per step), Note [pricing replica groups]:

        plan = planners.plan(tables, planners.Topology(64, ranks_per_host=8), batch_size=512,
                             replicas=4)   # a plan for 16 ranks, replicated 4 times

    Raises `NoPlanError` (a PlanError) naming the tables that do not fit, with the numbers and
    the ways out; PlanError for invalid input.
    """
    return plan_with_stats(
        tables, topology, batch_size=batch_size, constraints=constraints,
        optimizer=optimizer, module_fqn=module_fqn, column_wise_statistic=column_wise_statistic,
        pooling_factors=pooling_factors, comm_dtype=comm_dtype,
        torchrec_compatible=torchrec_compatible, replicas=replicas, replica_sync=replica_sync,
    ).plan  # fmt: skip


def plan_with_stats(
    tables: TablesLike,
    topology: Topology,
    *,
    batch_size: int,
    constraints: Mapping[str, TableConstraint] | None = None,
    optimizer: Optimizer | str = Optimizer.ROWWISE_ADAGRAD,
    module_fqn: str = "",
    column_wise_statistic: ColumnWiseStatistic | str = ColumnWiseStatistic.EXACT,
    pooling_factors: Mapping[str, float] | None = None,
    comm_dtype: DataType | str = DataType.FP32,
    torchrec_compatible: bool = False,
    replicas: int = 1,
    replica_sync: ReplicaSync | str = ReplicaSync.EXACT,
) -> PlanResult:
    """Like `plan` (the same arguments), and also returns the plan's statistics, priced under
    the same optimizer and `column_wise_statistic`, and how long the search took.

        result = planners.plan_with_stats(tables, topology, batch_size=512)
        print(result.stats.format())
    """
    start = time.perf_counter()
    table_set = as_table_set(tables, module_fqn, pooling_factors=pooling_factors)
    layout = None
    if replicas != 1:  # one shard group is planned (Note [pricing replica groups])
        topology, layout = group_topology(topology, replicas, replica_sync)
    model = CostModel(topology, batch_size, Optimizer.parse(optimizer),
                      column_wise_statistic=column_wise_statistic,
                      comm_dtype=comm_dtype, replicas=layout)  # parsed by CostModel
    cons = match_constraints(table_set, constraints, topology.world_size)
    plain = [t for _, t in table_set]
    base = model.batch_buffer_bytes(TableArrays.of(plain))
    # What no search can overcome fails here, before it (docs/planner.md, "When no plan fits").
    early = before_candidates(table_set, cons, model, base)
    if early is not None:
        raise early
    candidates = enumerate_candidates(plain, model, cons, topology.capacity - base,
                                      torchrec=torchrec_compatible)  # fmt: skip
    early = before_search(table_set, candidates, cons, model, base)
    if early is not None:
        raise early
    bound = lower_bound(candidates, topology.world_size)
    outcome = search(plain, model, candidates, cons, float(topology.capacity), bound)
    if outcome.placements is None:
        raise explain_no_plan(table_set, candidates, cons, model, base, outcome.unplaced)
    modules: dict[str, dict[str, TablePlacement]] = {}
    for (fqn, table), p in zip(table_set, outcome.placements):
        sizes = None
        if p.kind in (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE, ShardingType.COLUMN_WISE):
            total = table.embedding_dim if p.kind is ShardingType.COLUMN_WISE else table.num_embeddings
            # explicit sizes only where they differ from the default even split, so that a plan
            # reads short and survives a round trip through TorchRec unchanged
            sizes = None if p.sizes == even_split(total, len(p.sizes)) else p.sizes
        modules.setdefault(fqn, {})[table.name] = TablePlacement(p.kind, p.ranks, sizes)
    result = ShardingPlan(topology.world_size, modules, ranks_per_host=topology.ranks_per_host)
    seconds = time.perf_counter() - start
    stats = stats_for(result, table_set, model, bound, plan_seconds=seconds,
                      torchrec_compatible=torchrec_compatible)
    return PlanResult(result, stats, seconds)
