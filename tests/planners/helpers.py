"""Shared checks for the planner tests: what every valid plan must satisfy."""

from __future__ import annotations

import numpy as np

import planners
from planners import ShardingPlan, ShardingType, Table, Topology
from planners.options import column_unit


def synthetic(n: int, seed: int = 0, max_rows: float = 1e8) -> list[Table]:
    rng = np.random.default_rng(seed)
    rows = np.exp(rng.uniform(np.log(1e3), np.log(max_rows), n)).astype(int)
    dims = rng.choice([32, 64, 128, 256], n)
    pooling = rng.uniform(1, 40, n)
    return [Table(f"t{i}", int(rows[i]), int(dims[i]), pooling_factor=float(pooling[i]))
            for i in range(n)]  # fmt: skip


def check_valid(plan: ShardingPlan, tables: list[Table], topology: Topology, batch_size: int,
                module: str = "") -> planners.PlanStats:  # fmt: skip
    """Every table placed once; shards cover rows/columns exactly; memory within capacity."""
    assert plan.world_size == topology.world_size
    assert plan.ranks_per_host == topology.ranks_per_host
    assert set(plan.modules) == {module}
    assert set(plan.modules[module]) == {t.name for t in tables}
    for t in tables:
        p = plan.modules[module][t.name]
        shards = p.shards(num_embeddings=t.num_embeddings, embedding_dim=t.embedding_dim,
                          world_size=topology.world_size)  # fmt: skip
        if p.sharding_type is ShardingType.DATA_PARALLEL:
            assert len(shards) == topology.world_size
            continue
        ranks = [s.rank for s in shards]
        assert len(set(ranks)) == len(ranks), f"{t.name}: two shards on one rank {ranks}"
        if p.sharding_type in (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE):
            assert sum(s.num_rows for s in shards) == t.num_embeddings
            assert all(s.num_rows >= 1 and s.num_cols == t.embedding_dim for s in shards)
            offsets = [s.row_offset for s in shards]
            assert offsets == sorted(offsets) and ranks == sorted(ranks)
        if p.sharding_type is ShardingType.TABLE_ROW_WISE:
            assert len({r // topology.ranks_per_host for r in ranks}) == 1
        if p.sharding_type is ShardingType.COLUMN_WISE:
            assert sum(s.num_cols for s in shards) == t.embedding_dim
            unit = column_unit(t.embedding_dim)
            assert all(s.num_cols >= unit and s.num_cols % unit == 0 for s in shards)
        if p.sharding_type is ShardingType.TABLE_WISE:
            assert len(shards) == 1 and shards[0].sizes == (t.num_embeddings, t.embedding_dim)
    stats = planners.plan_stats(plan, tables, topology, batch_size=batch_size, module_fqn=module)
    assert stats.over_capacity == (), f"ranks over memory: {stats.over_capacity}"
    assert stats.max_cost >= stats.lower_bound * (1 - 1e-9)
    return stats
