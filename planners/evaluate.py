"""Pricing a plan: each rank's seconds and bytes under the cost model (`evaluate`), and the
statistics a report shows (`plan_stats`, `stats_for`), as the records of planners/stats.py.

`plan_stats` prices any `ShardingPlan` -- ours or one converted from TorchRec -- under the cost
model of planners/cost.py, so two plans of the same tables can be compared number for number.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np

from planners.cost import (
    COMPONENTS, STAT_BYTES, CostModel, ShardCost, TableArrays, column_scratch_bytes,
)  # fmt: skip
from planners.inputs import (
    ColumnWiseStatistic, DataType, Optimizer, Table, TableConstraint, Topology,
)  # fmt: skip
from planners.model_tables import (
    TableSet, TablesLike, as_table_set, display_name, match_constraints,
)  # fmt: skip
from planners.init_transient import SHARD_RUNTIME_BYTES, STEP_RUNTIME_BYTES, meta_init_bytes, step_transient_bytes
from planners.mc_cost import collision_price
from planners.options import enumerate_candidates, lower_bound
from planners.replicas import ReplicaSync, group_topology
from planners.tier_cost import DEFAULT_ZIPF_ALPHA, TierSpec
from planners.types import ShardingPlan, ShardingType
from planners.stats import MEMORY_PARTS, PlanStats, RankStats, ShardStats, TableStats
from planners.validate import check_placements, validate_plan

__all__ = ["evaluate", "plan_stats", "stats_for", "validate_plan"]


def plan_tiers(
    plan: ShardingPlan, table_set: TableSet,
    constraints: Sequence[TableConstraint | None] | None = None,
) -> list[TierSpec | None]:
    """Each table's tier under `plan` (its placement's cache load factor and policy) with the
    hit rate or Zipf exponent its constraint gives; None for a resident table."""
    out: list[TierSpec | None] = []
    for i, (fqn, table) in enumerate(table_set):
        p = plan.placement(fqn, table.name)
        con = None if constraints is None else constraints[i]
        out.append(None if p.cache_load_factor is None else TierSpec(
            p.cache_load_factor, p.cache_policy, None if con is None else con.hit_rate,
            DEFAULT_ZIPF_ALPHA if con is None else con.zipf_alpha))  # fmt: skip
    return out


def evaluate(
    plan: ShardingPlan, table_set: TableSet, model: CostModel,
    constraints: Sequence[TableConstraint | None] | None = None,
) -> tuple[np.ndarray, np.ndarray, list[list[tuple[str, float]]], list[list[ShardStats]],
           np.ndarray]:  # fmt: skip
    """Per-rank component seconds (W x 7, in `COMPONENTS` order), per-rank bytes (W, and W x 5 by
    `MEMORY_PARTS`), per-rank (table, seconds) lists, per-table shard statistics (in shard
    order), and per rank the tiered stores' bytes and their traffic's seconds (W x 2)."""
    topo = model.topology
    world = topo.world_size
    tables = [t for _, t in table_set]
    arrays = TableArrays.of(tables, plan_tiers(plan, table_set, constraints))
    comp = np.zeros((world, len(COMPONENTS)))
    tier = np.zeros((world, 2))  # bytes on the tier, seconds of tier traffic
    # Each rank's own batch, with the low-precision copies of what every shard sends it
    # (Note [wire copies] in planners/cost.py), summed over the plan's shards below.
    mem = np.full(world, model.batch_buffer_bytes(arrays, wire=False))
    held: list[list[tuple[str, float]]] = [[] for _ in range(world)]
    per_table: list[list[ShardStats | None]] = []
    parts_mem = np.zeros((world, len(MEMORY_PARTS)))
    pieces: list[list[tuple[int, int, str, bool]]] = [[] for _ in range(world)]  # column pieces
    groups: dict[ShardingType, list[tuple[int, int, int, int, int, int, int, int]]] = {}
    for i, (fqn, table) in enumerate(table_set):
        placement = plan.placement(fqn, table.name)
        shards = placement.shards(num_embeddings=table.num_embeddings,
                                  embedding_dim=table.embedding_dim, world_size=world)  # fmt: skip
        kind = placement.sharding_type
        k = 1 if kind is ShardingType.DATA_PARALLEL else len(shards)
        per_table.append([None] * len(shards))
        for j, s in enumerate(shards):
            if kind is ShardingType.COLUMN_WISE and k > 1:
                pieces[s.rank].append((s.num_rows, s.num_cols, table.dtype.value, table.sequence))
            groups.setdefault(kind, []).append(
                (i, s.rank, s.num_rows, s.num_cols, k, j, s.row_offset, s.col_offset)
            )
    for kind, entries in groups.items():
        idx, ranks, rows, cols, ks, js, row_offs, col_offs = (np.array(c) for c in zip(*entries))
        cost: ShardCost = model.shard(kind, arrays.take(idx), rows.astype(float),
                                      cols.astype(float), ks.astype(float))  # fmt: skip
        parts = np.stack([getattr(cost, attr) for attr, _, _ in COMPONENTS], axis=1)
        np.add.at(comp, ranks, parts)
        np.add.at(mem, ranks, cost.memory)
        np.add.at(tier, ranks, np.stack(np.broadcast_arrays(cost.tier_bytes, cost.tier_io), axis=1))
        for p, (_, attr, _) in enumerate(MEMORY_PARTS):
            np.add.at(parts_mem[:, p], ranks, np.broadcast_to(getattr(cost, attr), ranks.shape))
        mem += float(np.sum(model.arrival_wire_bytes(kind, arrays.take(idx), cols.astype(float))))
        total = cost.total
        for e, (n, r, sec) in enumerate(zip(idx.tolist(), ranks.tolist(), total.tolist())):
            held[r].append((display_name(*_name(table_set[n])), sec))
            per_table[n][int(js[e])] = ShardStats(
                r, int(row_offs[e]), int(rows[e]), int(col_offs[e]), int(cols[e]),
                float(cost.memory[e]), *(float(x) for x in parts[e]),
                cache_rows=int(np.broadcast_to(cost.cache_rows, ranks.shape)[e]),
                hit_rate=float(np.broadcast_to(cost.hit_rate, ranks.shape)[e]),
                tier_bytes=float(np.broadcast_to(cost.tier_bytes, ranks.shape)[e]),
            )  # fmt: skip
    # Note [what a rank holds]: `shard` reserved a scratch statistic for each column piece under
    # exact row-wise Adagrad; a rank keeps one only for kernel groups that mix widths.
    for r in range(world):
        scratch = column_scratch_bytes(model.optimizer, model.column_wise_statistic, pieces[r])
        if model.exact_column_statistic:
            scratch -= STAT_BYTES * sum(rows for rows, _, _, _ in pieces[r])
        mem[r] += scratch
        parts_mem[r, 3] += scratch
    return comp, mem, held, per_table, parts_mem, tier  # type: ignore[return-value]


def fixed_seconds(plan: ShardingPlan, table_set: TableSet, topology: Topology,
                  batch_size: int) -> list[float]:  # fmt: skip
    """Each rank's fixed cost of a step under calibrated prices (Note [calibrated prices] in
    planners/calibration.py): the measured fixed part, `kernel_fixed` for each kind of shard
    beyond the first that the rank holds, one all-reduce's latency where any table is
    data-parallel, and its own batch's routing (the same on every rank: each sends its batch's
    ids to every piece that looks them up). All 0 uncalibrated."""
    cal, world = topology.calibration, topology.world_size
    if cal is None:
        return [0.0] * world
    kinds: list[set[ShardingType]] = [set() for _ in range(world)]
    sent = 0.0
    for fqn, table in table_set:
        placement = plan.placement(fqn, table.name)
        kind = placement.sharding_type
        if kind is ShardingType.DATA_PARALLEL:
            for r in range(world):
                kinds[r].add(kind)
            continue
        shards = placement.shards(num_embeddings=table.num_embeddings,
                                  embedding_dim=table.embedding_dim, world_size=world)  # fmt: skip
        for s in shards:
            kinds[s.rank].add(kind)
        ids = sum(p * f for p, f in zip(table.pooling_factors, table.batch_fractions))
        copies = len(shards) if kind is ShardingType.COLUMN_WISE else 1
        sent += batch_size * ids * copies
    data_parallel = any(ShardingType.DATA_PARALLEL in k for k in kinds)
    own_batch = cal.sent_id * sent
    return [
        cal.step_fixed + cal.kernel_fixed * max(len(k) - 1, 0) + own_batch
        + (cal.all_reduce_latency if data_parallel else 0.0)
        for k in kinds
    ]


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
    comm_dtype: DataType | str = DataType.FP32,
    torchrec_compatible: bool = False,
    replicas: int = 1,
    replica_sync: ReplicaSync | str = ReplicaSync.EXACT,
    prefetch: bool = False,
) -> PlanStats:
    """Prices `plan` for `tables` on `topology` and compares it with the lower bound.

        stats = plan_stats(plan, tables, topology, batch_size=512)
        stats.max_cost, stats.imbalance, stats.bound_ratio, stats.slowest_rank.tables

    `optimizer` and `column_wise_statistic` as for `planners.plan`: price a plan under the
    settings it will be trained with ("per_shard" makes column pieces under row-wise Adagrad
    cheaper; under the other optimizers it changes nothing). `torchrec_compatible` as for
    `planners.plan`: the bound is then that of plans TorchRec runs unchanged. `replicas` and
    `replica_sync` as for `planners.plan`: `topology` is the whole world and `plan` one shard
    group of `world_size / replicas` ranks, priced with its cross-replica sync. `prefetch` as
    for `planners.plan`: tiered tables' traffic runs beside the step. A table is tiered as its
    placement says; `constraints` give its `hit_rate` or `zipf_alpha`.

    Raises PlanError if the plan does not place exactly these tables (see `validate_plan`).
    A plan over memory capacity is reported (`over_capacity`), not rejected.
    """
    table_set = as_table_set(tables, module_fqn)
    layout = None
    if replicas != 1:
        topology, layout = group_topology(topology, replicas, replica_sync)
    model = CostModel(topology, batch_size, Optimizer.parse(optimizer),
                      column_wise_statistic=column_wise_statistic,
                      comm_dtype=comm_dtype, replicas=layout, prefetch=prefetch)  # parsed by CostModel
    cons = match_constraints(table_set, constraints, topology.world_size)
    # the bound prices each table on the tier the plan puts it on
    cons = [c if s is None else dataclasses.replace(c or TableConstraint(), cache_load_factor=s[0],
                                                    cache_policy=s[1], allow_tier=True)
            for c, s in zip(cons, plan_tiers(plan, table_set, cons))]  # fmt: skip
    plain = [t for _, t in table_set]
    capacity = (topology.capacity - model.batch_buffer_bytes(TableArrays.of(plain))
                - collision_price(plain, model).reserve)
    candidates = enumerate_candidates(plain, model, cons, capacity, torchrec=torchrec_compatible)
    bound = lower_bound(candidates, topology.world_size)
    return stats_for(plan, table_set, model, bound, plan_seconds,
                     torchrec_compatible=torchrec_compatible, constraints=cons)


def stats_for(
    plan: ShardingPlan,
    table_set: TableSet,
    model: CostModel,
    bound: float,
    plan_seconds: float | None = None,
    *,
    torchrec_compatible: bool = False,
    constraints: Sequence[TableConstraint | None] | None = None,
) -> PlanStats:
    """`plan_stats` for callers that already hold the flattened tables and the bound
    (`constraints`, matched to them, give tiered tables' hit rates)."""
    topology = model.topology
    check_placements(plan, table_set, topology)
    comp, mem, held, per_table, parts_mem, tier = evaluate(plan, table_set, model, constraints)
    fixed = fixed_seconds(plan, table_set, topology, model.batch_size)
    # managed-collision tables: the same on every rank, whatever the plan (Note [pricing
    # managed collisions] in planners/mc_cost.py)
    collision = collision_price([t for _, t in table_set], model)
    meta_init = meta_init_bytes(plan, table_set, topology.world_size)
    step_transient = step_transient_bytes(plan, table_set, topology.world_size, model.optimizer)
    mem = mem + collision.state + collision.batch
    # what `shard` of a meta model holds at its end (Note [pricing a step's runtime]): weights,
    # fused state (a torch optimizer makes its own later) and caches
    part = {a: p for p, (a, _, _) in enumerate(MEMORY_PARTS)}
    at_shard = parts_mem[:, part["weights"]] + parts_mem[:, part["cache"]]
    if model.optimizer.fused_name is not None:
        at_shard = at_shard + parts_mem[:, part["optimizer_state"]]
    state = collision.state  # a property that adds per-rank arrays: once, not once a rank
    ranks = tuple(
        RankStats(
            rank=r, memory=float(mem[r]), capacity=float(topology.capacity),
            lookup=float(comp[r, 0]), input_dist=float(comp[r, 1]),
            output_dist=float(comp[r, 2]), grad_sync=float(comp[r, 3]),
            tables=tuple(sorted(held[r], key=lambda x: (-x[1], x[0]))),
            stat_exchange=float(comp[r, 4]), replica_sync=float(comp[r, 5]),
            **{a: float(parts_mem[r, p]) for p, (a, _, _) in enumerate(MEMORY_PARTS)},
            fixed=fixed[r], collision_state=float(state[r]), remap=collision.remap,
            tier=float(comp[r, 6]), tier_bytes=float(tier[r, 0]), tier_io=float(tier[r, 1]),
            tier_capacity=float(topology.tier_memory), meta_init=meta_init[r],
            step_transient=step_transient[r], runtime=float(STEP_RUNTIME_BYTES),
            shard_peak=float(at_shard[r] + state[r] + meta_init[r] + SHARD_RUNTIME_BYTES),
        )
        for r in range(topology.world_size)
    )  # fmt: skip
    if model.prefetch:  # Note [pricing tiered tables]: what the step cannot hide, it waits for
        ranks = tuple(dataclasses.replace(r, tier=r.tier + max(0.0, r.tier_io - r.cost))
                      for r in ranks)  # fmt: skip
    tables = tuple(
        TableStats(display_name(fqn, t.name), t.num_embeddings, t.embedding_dim,
                   plan.placement(fqn, t.name).sharding_type, tuple(shards),
                   managed_collision=t.managed_collision,
                   cache_load_factor=plan.placement(fqn, t.name).cache_load_factor,
                   cache_policy=plan.placement(fqn, t.name).cache_policy)
        for (fqn, t), shards in zip(table_set, per_table)
    )  # fmt: skip
    # every rank pays at least the smallest fixed cost, so the bound does too
    bound = bound + min(fixed) if topology.calibration is not None else bound
    bound += collision.remap  # every rank remaps
    return PlanStats(ranks, bound, topology, model.batch_size, model.optimizer, len(table_set),
                     plan_seconds, column_wise_statistic=model.column_wise_statistic,
                     tables=tables,
                     num_sequence_tables=sum(t.sequence for _, t in table_set),
                     comm_dtype=model.comm_dtype,
                     torchrec_compatible=torchrec_compatible,
                     replicas=model.replicas, remap_bytes=collision.received,
                     prefetch=model.prefetch)  # fmt: skip

