"""Every plan `planners.plan` returns fits every rank's memory as `plan_stats` prices it.

The search charges memory as it places shards; `plan_stats` prices the finished plan. Where the
search reserved less than the plan holds, a plan would come back that does not fit, and `shard`
would run out of memory on the device. Two such gaps were real: data-parallel copies were
added to every rank without a check, and under FP16/BF16 comms the search reserved one table's
worth of low-precision copies per table where k row-wise pieces make k (Note [wire copies] in
planners/cost.py). The tests below plan at the tightest memory that plans at all (bisection),
where a reserve that is too small shows.
"""

from __future__ import annotations

import pytest

import planners
from planners import NoPlanError, ShardingType, Table, TableConstraint, Topology
from tests.planners.helpers import check_valid, synthetic

T = ShardingType
GiB = 2**30


def _tightest(tables, world, batch, **kw):
    """The plan at the smallest device memory (within 0.1%) that `plan` accepts, and its topology."""
    low, high, found = 1e-4, 1024.0, None
    while high / low > 1.001:
        mid = (low * high) ** 0.5
        topo = Topology(world, device_memory=int(mid * GiB))
        try:
            found = (planners.plan_with_stats(tables, topo, batch_size=batch, auto_tier=False, **kw), topo)
            high = mid
        except planners.PlanError:
            low = mid
    assert found is not None
    return found


def _only(kind, tables):
    return {t.name: TableConstraint(sharding_types=(kind,)) for t in tables}


FP16_TABLES = [Table(f"t{i}", 1_000_000, 128, pooling_factor=20.0, dtype="fp16") for i in range(8)]


@pytest.mark.parametrize("comm", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("world", [2, 8])
@pytest.mark.parametrize("kind", [T.ROW_WISE, T.DATA_PARALLEL, None])
def test_the_tightest_plan_fits_every_rank(comm, world, kind):
    cons = _only(kind, FP16_TABLES) if kind is not None else None
    result, topo = _tightest(FP16_TABLES, world, 16_384, comm_dtype=comm, constraints=cons)
    stats = planners.plan_stats(result.plan, FP16_TABLES, topo, batch_size=16_384,
                                comm_dtype=comm)  # fmt: skip
    assert stats.over_capacity == (), [(r.rank, r.memory - r.capacity) for r in stats.ranks]
    # tight: the plan fills the fullest rank (a loose reserve would plan only with room to spare)
    assert max(r.memory for r in stats.ranks) > 0.97 * topo.capacity, comm


@pytest.mark.parametrize("seed", range(4))
def test_the_tightest_plan_fits_on_mixed_tables_and_constraints(seed):
    tables = synthetic(12, seed=seed, max_rows=2e6)
    kinds = [T.ROW_WISE, T.DATA_PARALLEL, T.TABLE_WISE, T.COLUMN_WISE]
    cons = {t.name: TableConstraint(sharding_types=(kinds[i % 4],))
            for i, t in enumerate(tables) if i % 3}  # fmt: skip
    for comm in ("fp32", "fp16"):
        result, topo = _tightest(tables, 4, 8192, comm_dtype=comm, constraints=cons)
        stats = planners.plan_stats(result.plan, tables, topo, batch_size=8192, comm_dtype=comm,
                                    constraints=cons)  # fmt: skip
        assert stats.over_capacity == (), (seed, comm)


def test_row_wise_pieces_reserve_their_copies_on_every_rank():
    # 8 row-wise tables in 8 pieces on 8 ranks, FP16 comms: each piece's partial sums arrive on
    # every rank as fp16 copies, 2 * batch * 128 * 2 bytes a piece (forward and gradient), 64
    # pieces: the least memory that plans grows by exactly that over FP32 comms (no copies).
    cons = {t.name: TableConstraint(sharding_types=(T.ROW_WISE,), min_shards=8)
            for t in FP16_TABLES}  # fmt: skip
    copies = 64 * 2 * 16_384 * 128 * 2
    low, low_topo = _tightest(FP16_TABLES, 8, 16_384, comm_dtype="fp16", constraints=cons)
    plain, plain_topo = _tightest(FP16_TABLES, 8, 16_384, comm_dtype="fp32", constraints=cons)
    assert {len(p.ranks) for p in low.plan.modules[""].values()} == {8}
    # and, on the rank holding a piece, its partial sums for all 8 ranks' batches leaving and
    # their gradients arriving (`shard`'s memory): as much again
    extra = low.stats.ranks[0].memory - plain.stats.ranks[0].memory
    assert extra == 2 * copies
    grown = low_topo.capacity - plain_topo.capacity
    assert grown == pytest.approx(2 * copies, rel=0.01)
    assert low.stats.over_capacity == ()


def test_data_parallel_copies_that_do_not_fit_together_are_refused():
    # Each copy (~0.6 GiB with its state) fits a rank, ten of them do not: the search used to
    # add data-parallel tables to every rank without looking and returned a plan at 5x capacity.
    tables = [Table(f"t{i}", 1_000_000, 128) for i in range(10)]
    topo = Topology(4, device_memory=2 * GiB)
    with pytest.raises(NoPlanError, match="10 tables may only be data_parallel") as err:
        planners.plan(tables, topo, batch_size=1024, constraints=_only(T.DATA_PARALLEL, tables))
    assert "more ranks do not help" in str(err.value) and "'t0': " in str(err.value)
    assert sorted(err.value.tables) == sorted(t.name for t in tables)
    # with room for every copy the same tables plan, all data-parallel
    plan = planners.plan(tables, Topology(4, device_memory=12 * GiB), batch_size=1024,
                         constraints=_only(T.DATA_PARALLEL, tables))  # fmt: skip
    assert {p.sharding_type for p in plan.modules[""].values()} == {T.DATA_PARALLEL}


def test_tables_the_search_would_make_data_parallel_are_sharded_when_copies_do_not_fit():
    # Small tables with many ids per sample are cheapest data-parallel; with room for only some
    # copies the rest are sharded instead of pushing every rank over its memory.
    tables = [Table(f"t{i}", 200_000, 64, pooling_factor=500.0) for i in range(12)]
    roomy = planners.plan(tables, Topology(4), batch_size=65_536)
    assert {p.sharding_type for p in roomy.modules[""].values()} == {T.DATA_PARALLEL}
    result, topo = _tightest(tables, 4, 65_536)
    kinds = [p.sharding_type for p in result.plan.modules[""].values()]
    assert T.DATA_PARALLEL in kinds and set(kinds) != {T.DATA_PARALLEL}
    check_valid(result.plan, tables, topo, 65_536)
