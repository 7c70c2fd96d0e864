"""Issue 47, the planner's part: which tables go on a tier (Note [choosing tiers] in
planners/tier_choice.py). `plan` tiers only when no resident plan fits, the fewest largest
tables at the largest cache that fits, says so, and says what is missing when even the smallest
cache does not fit; tiers given by a user are checked. Pure and single-process."""

from __future__ import annotations

import logging
import math

import pytest

import planners
from planners import NoPlanError, PlanError, ShardingType, Table, TableConstraint, Topology
from planners.cost import CostModel, TableArrays
from planners.inputs import format_bytes
from planners.tier_choice import AutoTiers
from planners.tier_cost import CACHE_LADDER

# weights + row-wise Adagrad state: 1,040 MB, 260 MB and 0.26 MB
TABLES = [Table("t_big", 4_000_000, 64, pooling_factor=4.0), Table("t_mid", 1_000_000, 64),
          Table("t_small", 1_000, 64)]  # fmt: skip
BATCH = 64
ROW = 64 * 4 + 4


def _topo(mb: float) -> Topology:
    return Topology(2, device_memory=int(mb * 2**20), reserved_fraction=0.0)


def _plan(topo, **kw):
    return planners.plan_with_stats(TABLES, topo, batch_size=BATCH, **kw)


def _tiers(plan):
    return {n: p.cache_load_factor for n, p in plan.modules[""].items() if p.cache_load_factor}


def test_a_plan_that_fits_resident_tiers_nothing():
    result = _plan(_topo(1200))
    assert _tiers(result.plan) == {} and result.stats.auto_tiers is None
    assert "tier" not in result.stats.format()


def test_the_fewest_largest_tables_at_the_largest_cache_that_fits(caplog):
    topo = _topo(350)  # 1,300 MB resident on 2 x 367 MB: tiering t_big alone is enough
    with caplog.at_level(logging.WARNING, logger="planners.tier_choice"):
        result = _plan(topo)
    tiers = _tiers(result.plan)
    assert list(tiers) == ["t_big"] and result.stats.auto_tiers.tables == ("t_big",)
    factor = tiers["t_big"]
    assert factor in CACHE_LADDER and result.stats.auto_tiers.cache_load_factor == factor
    assert "planner tiered 1 table at cache_load_factor" in caplog.text
    assert "planner tiered 1 table" in result.stats.summary()
    many = AutoTiers(tuple(f"t{i}" for i in range(20)), 0.01)
    assert "t0, t1, t2, t3, t4, t5, t6, t7 and 12 more (modular.shard" in many.describe()
    assert max(r.memory for r in result.stats.ranks) <= topo.capacity
    # the same plan as asking for that tier; a larger cache on the ladder does not fit
    given = planners.plan(TABLES, topo, batch_size=BATCH, auto_tier=False,
                          constraints={"t_big": TableConstraint(cache_load_factor=factor)})
    assert given.modules == result.plan.modules
    larger = [f for f in CACHE_LADDER if f > factor]
    assert larger, "the test wants a memory where the largest cache does not fit"
    with pytest.raises(NoPlanError):
        planners.plan(TABLES, topo, batch_size=BATCH, auto_tier=False,
                      constraints={"t_big": TableConstraint(cache_load_factor=larger[-1])})
    # and nothing is tiered with auto_tier=False
    with pytest.raises(NoPlanError, match="no plan fits"):
        planners.plan(TABLES, topo, batch_size=BATCH, auto_tier=False)


def test_a_table_tiered_by_the_planner_takes_its_constraints_policy_and_hit_rate():
    hints = {"t_big": TableConstraint(cache_policy="lfu", hit_rate=0.99)}
    result = _plan(_topo(350), constraints=hints)
    assert result.plan.placement("", "t_big").cache_policy == "lfu"
    assert result.stats.table("t_big").hit_rate == pytest.approx(0.99)
    zipf = _plan(_topo(350), constraints={"t_big": TableConstraint(zipf_alpha=1.5)})
    assert zipf.stats.table("t_big").hit_rate > _plan(_topo(350)).stats.table("t_big").hit_rate


def test_two_tables_when_one_is_not_enough():
    topo = _topo(100)
    result = _plan(topo)
    assert set(_tiers(result.plan)) == {"t_big", "t_mid"}
    with pytest.raises(NoPlanError):  # t_big alone, even at the smallest cache, does not fit
        planners.plan(TABLES, topo, batch_size=BATCH, auto_tier=False,
                      constraints={"t_big": TableConstraint(cache_load_factor=CACHE_LADDER[-1])})


def test_allow_tier_false_keeps_a_table_resident():
    topo = _topo(600)
    assert list(_tiers(_plan(topo).plan)) == ["t_big"]
    keep = {"t_big": TableConstraint(allow_tier=False)}
    result = _plan(topo, constraints=keep)
    assert result.plan.placement("", "t_big").cache_load_factor is None
    assert "t_mid" in _tiers(result.plan)
    with pytest.raises(NoPlanError, match="with every table resident, no plan fits"):
        _plan(_topo(420), constraints=keep)  # t_big: 520 MB a rank, over 440 MB


def test_what_is_missing_at_the_smallest_cache():
    topo = _topo(6)
    with pytest.raises(NoPlanError) as e:
        _plan(topo)
    base = CostModel(topo, BATCH).batch_buffer_bytes(TableArrays.of(TABLES))
    need = sum(math.ceil(t.num_embeddings * 0.01) * (ROW + 27) + 4 * t.num_embeddings for t in TABLES)
    missing = need - 2 * (topo.capacity - base)
    assert missing > 0
    text = str(e.value)
    assert text.startswith("no plan fits even with the 3 largest tierable tables on a tier at the "
                           "smallest cache (cache_load_factor 0.01)")
    assert f"{format_bytes(missing)} missing in all, {format_bytes(missing / 2)} per rank" in text
    assert "with every table resident, no plan fits" in text and "use at least" in text


def test_tiers_given_by_a_user_are_checked():
    tier = {"t_small": TableConstraint(cache_load_factor=0.1)}
    with pytest.raises(PlanError, match=r"tiered table 't_small': .* fused optimizer, not unfused_sgd"):
        planners.plan(TABLES, Topology(2), batch_size=BATCH, constraints=tier, optimizer="unfused_sgd")
    half = [Table("t_small", 1_000, 64, dtype="fp16")]
    with pytest.raises(PlanError, match="FP32 tables so far, not fp16"):
        planners.plan(half, Topology(2), batch_size=BATCH, constraints=tier)
    odd = [Table("t_small", 1_000, 6)]
    with pytest.raises(PlanError, match="width of 6"):
        planners.plan(odd, Topology(2), batch_size=BATCH, constraints=tier)
    planners.plan(odd, Topology(2), batch_size=BATCH, constraints=tier, optimizer="adam")  # wrapped
    with pytest.raises(PlanError, match="2D layouts"):
        planners.plan(TABLES, Topology(4), batch_size=BATCH, constraints=tier, replicas=2)
    only_dp = {"t_small": TableConstraint(cache_load_factor=0.1, sharding_types=("data_parallel",))}
    with pytest.raises(PlanError, match="may only be data_parallel"):
        planners.plan(TABLES, Topology(2), batch_size=BATCH, constraints=only_dp)


def test_a_tiered_table_is_never_a_copy_nor_pieces_sharing_row_statistics():
    hot = [Table("t_hot", 2_000, 64, pooling_factor=200.0)]  # cheapest as copies when resident
    topo = Topology(4)
    assert planners.plan(hot, topo, batch_size=4096).placement("", "t_hot").sharding_type is (
        ShardingType.DATA_PARALLEL)
    tier = {"t_hot": TableConstraint(cache_load_factor=0.5)}
    for optimizer in ("rowwise_adagrad", "lamb", "partial_rowwise_adam"):
        p = planners.plan(hot, topo, batch_size=4096, constraints=tier, optimizer=optimizer)
        kind = p.placement("", "t_hot").sharding_type
        assert kind not in (ShardingType.DATA_PARALLEL, ShardingType.COLUMN_WISE), optimizer
        assert p.placement("", "t_hot").cache_load_factor == 0.5
