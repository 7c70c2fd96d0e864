"""Issue 47, the planner's part: what a tiered shard costs (Note [pricing tiered tables] in
planners/tier_cost.py): its cache and bookkeeping in memory, its store on the tier, its misses
in the step; the hit rate given or from Zipf. Pure and single-process."""

from __future__ import annotations

import math

import numpy as np
import pytest

import planners
from planners import ShardingPlan, Table, TableConstraint, TablePlacement, Topology
from planners.cost import CostModel, TableArrays
from planners.tier_cost import TierSpec, cache_rows, harmonic, zipf_hit_rate
from planners.types import ShardingType as T

TOPO = Topology(world_size=2, ranks_per_host=2, tier_bandwidth=1e9)
TABLE = Table("t", 10_000, 64, pooling_factor=3.0)
STATE = {"sgd": 0, "rowwise_adagrad": 4, "adagrad": 4 * 64, "adam": 8 * 64}


def _shard(optimizer="rowwise_adagrad", tier=None, kind=T.TABLE_WISE, rows=10_000, k=1, **kw):
    model = CostModel(TOPO, batch_size=100, optimizer=optimizer, **kw)
    c = model.shard(kind, TableArrays.of([TABLE], [tier]), float(rows), 64.0, float(k))
    return {f: float(np.asarray(getattr(c, f)).ravel()[0]) for f in c._fields} | {"total": float(c.total[0])}


@pytest.mark.parametrize("alpha", [0.8, 1.0, 1.05, 1.5])
@pytest.mark.parametrize("n", [1, 7, 100, 101, 5_000, 3_000_000])
def test_harmonic_numbers_match_the_sum(n, alpha):
    exact = float(np.sum(np.arange(1, n + 1, dtype=np.float64) ** -alpha))
    assert float(harmonic(n, alpha)) == pytest.approx(exact, rel=1e-7)


def test_zipf_hit_rate_is_the_hottest_rows_share_of_lookups():
    p = np.arange(1, 2_001, dtype=np.float64) ** -1.05
    assert float(zipf_hit_rate(100, 2_000, 1.05)) == pytest.approx(p[:100].sum() / p.sum(), rel=1e-9)
    assert float(zipf_hit_rate(2_000, 2_000, 1.05)) == 1.0 and float(zipf_hit_rate(5_000, 2_000, 1.05)) == 1.0
    rates = zipf_hit_rate(np.array([1, 10, 100, 1000]), 2_000, 1.05)
    assert np.all(np.diff(rates) > 0)  # a larger cache serves more
    assert float(zipf_hit_rate(100, 2_000, 1.5)) > float(zipf_hit_rate(100, 2_000, 0.8))  # more skew


def test_cache_rows_are_modulars():
    assert cache_rows(150, 0.01) == 2 and cache_rows(50, 0.01) == 1 and cache_rows(1000, 0.05) == 50
    assert cache_rows(3, 1.0) == 3 and cache_rows(1, 0.01) == 1


@pytest.mark.parametrize("optimizer", list(STATE))
@pytest.mark.parametrize("kind,rows,k", [(T.TABLE_WISE, 10_000, 1), (T.ROW_WISE, 5_000, 2)])
def test_a_tiered_shard_holds_its_cache_and_bookkeeping_not_its_rows(optimizer, kind, rows, k):
    resident = _shard(optimizer, None, kind, rows, k)
    tiered = _shard(optimizer, TierSpec(0.05), kind, rows, k)
    row = 64 * 4 + STATE[optimizer]
    slots = math.ceil(rows * 0.05)
    assert tiered["cache_rows"] == slots
    assert tiered["cache"] == slots * (row + 27) + 4 * rows
    assert tiered["weights"] == 0 and tiered["state"] == 0
    assert resident["weights"] + resident["state"] == rows * row and resident["cache"] == 0
    # the same batch parts; the rows themselves go to the tier
    assert tiered["memory"] - tiered["cache"] == pytest.approx(resident["memory"] - rows * row)
    assert tiered["tier_bytes"] == rows * row and resident["tier_bytes"] == 0
    # the lookup reads the cache as a resident shard reads its rows
    assert tiered["lookup"] == resident["lookup"]


def test_misses_are_read_and_written_back_at_the_tier_bandwidth():
    ids = 2 * 100 * 3.0  # table-wise: every rank's batch of 100, 3 ids a sample
    distinct = 10_000 * -math.expm1(-ids / 10_000)
    row = 64 * 4 + 4
    given = _shard(tier=TierSpec(0.05, hit_rate=0.9))
    assert given["hit_rate"] == 0.9
    assert given["tier_io"] == pytest.approx(2 * distinct * 0.1 * row / 1e9)
    work = ids * 8 * math.log2(ids) + distinct * 31
    assert given["tier"] == pytest.approx(given["tier_io"] + work / TOPO.device_memory_bandwidth)
    assert given["total"] == pytest.approx(_shard()["total"] + given["tier"])
    # prefetched, the traffic runs beside the step: only the bookkeeping is in it
    ahead = _shard(tier=TierSpec(0.05, hit_rate=0.9), prefetch=True)
    assert ahead["tier_io"] == given["tier_io"]
    assert ahead["tier"] == pytest.approx(work / TOPO.device_memory_bandwidth)
    assert _shard(tier=TierSpec(0.05, hit_rate=1.0))["tier_io"] == 0.0
    # from Zipf over the shard's rows when no hit rate is given
    zipf = _shard(tier=TierSpec(0.05, zipf_alpha=1.2))
    assert zipf["hit_rate"] == pytest.approx(float(zipf_hit_rate(500, 10_000, 1.2)))
    assert zipf["tier_io"] == pytest.approx(2 * distinct * (1 - zipf["hit_rate"]) * row / 1e9)


def test_plan_stats_show_cache_and_tier_per_rank():
    tables = [TABLE, Table("u", 4_000, 32)]
    tiered = ShardingPlan(2, {"": {"t": TablePlacement(T.ROW_WISE, (0, 1), cache_load_factor=0.01,
                                                      cache_policy="lfu"),
                                   "u": TablePlacement(T.TABLE_WISE, (1,))}})  # fmt: skip
    resident = ShardingPlan(2, {"": {"t": TablePlacement(T.ROW_WISE, (0, 1)),
                                     "u": TablePlacement(T.TABLE_WISE, (1,))}})  # fmt: skip
    cons = {"t": TableConstraint(hit_rate=0.5)}
    a = planners.plan_stats(tiered, tables, TOPO, batch_size=100, constraints=cons)
    b = planners.plan_stats(resident, tables, TOPO, batch_size=100, constraints=cons)
    row = 64 * 4 + 4
    for ra, rb in zip(a.ranks, b.ranks):
        assert ra.cache == 50 * (row + 27) + 4 * 5_000 and rb.cache == 0
        assert ra.tier_bytes == 5_000 * row and ra.tier_capacity == TOPO.tier_memory
        assert ra.memory == pytest.approx(rb.memory - 5_000 * row + ra.cache)
        assert ra.held + ra.batch == pytest.approx(ra.memory)
        assert ra.tier_io > 0 and ra.cost == pytest.approx(rb.cost + ra.tier)
    t = a.table("t")
    assert (t.cache_load_factor, t.cache_policy, t.cache_rows, t.hit_rate) == (0.01, "lfu", 100, 0.5)
    assert a.table("u").cache_load_factor is None and a.table("u").cache_rows == 0
    text = a.format()
    assert "tier-io" in text and "tiered: 1 table (t 0.01 lfu, hit 0.50)" in text
    assert "cache" not in b.format_ranks()  # no cache columns without a tiered table
    record = a.to_dict()
    assert record["ranks"][0]["cache"] == a.ranks[0].cache and record["tables"][0]["cache_rows"] == 100


def test_a_plan_over_the_tier_is_refused_naming_the_rank():
    tables = [Table("t", 1_000_000, 64)]
    topo = Topology(2, tier_memory="100MiB")
    cons = {"t": TableConstraint(cache_load_factor=0.1, sharding_types=("table_wise",))}
    with pytest.raises(planners.NoPlanError, match=r"248.0 MiB of tiered tables' stores on rank \d, "
                                                   r"whose tier holds 100.0 MiB .*148.0 MiB missing"):
        planners.plan(tables, topo, batch_size=64, constraints=cons)
    stats = planners.plan_with_stats(tables, Topology(2, tier_memory="200MiB"), batch_size=64,
                                     constraints={"t": TableConstraint(cache_load_factor=0.1)}).stats
    assert max(r.tier_bytes for r in stats.ranks) <= 200 * 2**20  # row-wise halves the store


@pytest.mark.parametrize("kw, says", [
    ({"hit_rate": 1.5}, "hit_rate"), ({"hit_rate": -0.1}, "hit_rate"), ({"hit_rate": "0.9"}, "hit_rate"),
    ({"zipf_alpha": 0}, "zipf_alpha"), ({"allow_tier": "no"}, "allow_tier"),
    ({"allow_tier": False, "cache_load_factor": 0.1}, "drop one of them"),
])  # fmt: skip
def test_bad_tier_fields(kw, says):
    with pytest.raises(planners.PlanError, match=says):
        TableConstraint(**kw)


def test_constraint_files_keep_the_tier_fields(tmp_path):
    from planners.files import constraint_record, load_constraints
    import yaml

    c = TableConstraint(cache_load_factor=0.05, hit_rate=0.8, zipf_alpha=1.2)
    d = TableConstraint(allow_tier=False)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"t": constraint_record(c), "u": constraint_record(d)}))
    assert load_constraints(str(path)) == {"t": c, "u": d}
    assert constraint_record(TableConstraint()) == {}
