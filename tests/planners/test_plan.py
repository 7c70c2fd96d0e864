"""plan(): golden plans, validity on many inputs, determinism, constraints, the lower bound."""

from __future__ import annotations

import pytest

import planners
from planners import PlanError, ShardingType, Table, TableConstraint, Topology
from tests.planners.helpers import check_valid, synthetic

T = ShardingType

SMALL = [
    Table("t_user", 2_000_000, 128, features=("user_id",), pooling_factor=1.0),
    Table("t_item", 500_000, 64, features=("item_id", "item_hist"), pooling_factor=(1.0, 20.0)),
    Table("t_cat", 1000, 32, pooling_factor=3.0),
    Table("t_big", 50_000_000, 256, pooling_factor=2.0),
]
SMALL_TOPO = Topology(4, ranks_per_host=2, device_memory="48GiB")

GOLDEN_SMALL = (
    '{"format": 1, "world_size": 4, "ranks_per_host": 2, "priced_for": {"batch_size": 256, '
    '"optimizer": "rowwise_adagrad", "column_wise_statistic": "exact", "comm_dtype": "fp32", '
    '"replicas": 1, "replica_sync": "exact"}, "modules": {"": {'
    '"t_user": {"sharding_type": "column_wise", "ranks": [2, 3, 0, 1], "sizes": [60, 24, 24, 20]}, '
    '"t_item": {"sharding_type": "table_row_wise", "ranks": [2, 3], "sizes": [244457, 255543]}, '
    '"t_cat": {"sharding_type": "table_wise", "ranks": [3]}, '
    '"t_big": {"sharding_type": "column_wise", "ranks": [0, 1]}}}}'
)  # routed ids priced as int32 (WIRE_ID_BYTES); column pieces pay row-wise Adagrad's second pass


def test_golden_small_plan():
    plan = planners.plan(SMALL, SMALL_TOPO, batch_size=256)
    assert plan.to_json(indent=None) == GOLDEN_SMALL
    stats = check_valid(plan, SMALL, SMALL_TOPO, 256)
    assert stats.bound_ratio < 1.05


def test_golden_two_equal_tables_go_to_two_ranks():
    tables = [Table("t_a", 1000, 64), Table("t_b", 1000, 64)]
    only_tw = {t.name: TableConstraint(sharding_types=(T.TABLE_WISE,)) for t in tables}
    plan = planners.plan(tables, Topology(2), batch_size=64, constraints=only_tw)
    assert plan.to_dict()["modules"] == {"": {
        "t_a": {"sharding_type": "table_wise", "ranks": [0]},
        "t_b": {"sharding_type": "table_wise", "ranks": [1]},
    }}  # fmt: skip


@pytest.mark.parametrize("n,world,per_host", [(1, 1, 1), (3, 2, 2), (20, 8, 8), (50, 16, 8),
                                              (30, 64, 8), (200, 32, 4)])  # fmt: skip
def test_every_plan_is_valid(n, world, per_host):
    tables = synthetic(n, seed=n + world, max_rows=1e7)
    topo = Topology(world, ranks_per_host=per_host)
    plan = planners.plan(tables, topo, batch_size=512)
    check_valid(plan, tables, topo, 512)


def test_memory_tight_plan_is_valid():
    # 12 tables of ~7.6 GiB (with optimizer state) on 4 ranks of 24 GiB: needs ~85% fill
    tables = [Table(f"t{i}", 15_000_000, 128, pooling_factor=1.0 + i) for i in range(12)]
    topo = Topology(4, device_memory="28GiB")
    plan = planners.plan(tables, topo, batch_size=128)
    stats = check_valid(plan, tables, topo, 128)
    assert max(r.memory for r in stats.ranks) > 0.8 * topo.capacity


def test_plan_is_deterministic():
    tables = synthetic(300, seed=7)
    topo = Topology(64, ranks_per_host=8)
    first = planners.plan(tables, topo, batch_size=512).to_json()
    second = planners.plan(list(tables), Topology(64, ranks_per_host=8), batch_size=512).to_json()
    assert first == second


@pytest.mark.parametrize("n,world", [(10, 8), (100, 64), (1000, 256)])
@pytest.mark.parametrize("optimizer,statistic,within", [("sgd", "exact", 1.05),
                                                        ("rowwise_adagrad", "exact", 1.10),
                                                        ("rowwise_adagrad", "per_shard", 1.05)])  # fmt: skip
def test_close_to_the_lower_bound(n, world, optimizer, statistic, within):
    # With sgd a table cut into column pieces costs what it costs whole, so the search can
    # balance ranks almost exactly. Under row-wise Adagrad every piece of a cut table pays a
    # second backward (planners/cost.py), while the bound still assumes each table's work can be
    # spread at its cheapest: plans sit further above it (1.02-1.08 on these inputs). With the
    # per_shard statistic a piece pays no second pass, and plans sit as close as sgd's.
    tables = synthetic(n, seed=1)
    result = planners.plan_with_stats(tables, Topology(world), batch_size=512, optimizer=optimizer,
                                      column_wise_statistic=statistic)  # fmt: skip
    assert result.stats.lower_bound > 0
    assert result.stats.bound_ratio <= within
    assert result.seconds < 5


def test_at_the_frontier_plans_stay_valid_and_near_the_bound():
    # 1,000 tables on 4,096 ranks: past 2**20 tables x ranks (Note [where the sweep stops] in
    # planners/search.py), with row-wise candidates in closed form. Issue 38's figure for it is
    # 1.048 of the bound in ~1 s on its tables (benchmarks/planner_bench.py); these plan at 1.071
    # in about as long. Row-wise Adagrad's exact statistic: within 1.10 as in
    # test_close_to_the_lower_bound; the time is generous for a loaded machine.
    tables = synthetic(1000, seed=5)
    topology = Topology(4096, ranks_per_host=8)
    result = planners.plan_with_stats(tables, topology, batch_size=512)
    check_valid(result.plan, tables, topology, 512)
    assert result.stats.bound_ratio <= 1.10
    assert result.seconds < 20
    again = planners.plan(list(tables), Topology(4096, ranks_per_host=8), batch_size=512)
    assert again.to_json() == result.plan.to_json()


@pytest.mark.parametrize("optimizer,statistic", [("sgd", "exact"), ("rowwise_adagrad", "exact"),
                                                 ("rowwise_adagrad", "per_shard")])  # fmt: skip
def test_the_search_prices_its_plan_as_the_stats_do(monkeypatch, optimizer, statistic):
    # The search keeps per-rank loads as it cuts, moves, peels and merges shards (a column piece
    # priced differently from the table whole under row-wise Adagrad); the plan it returns must
    # cost what plan_stats says, or it compared plans by the wrong numbers.
    import planners.api as api

    found = []
    original = api.search
    monkeypatch.setattr(api, "search", lambda *a, **k: found.append(original(*a, **k)) or found[-1])
    for n, world, per_host in [(10, 8, 8), (30, 16, 4), (100, 64, 8)]:
        topo = Topology(world, ranks_per_host=per_host)
        result = planners.plan_with_stats(synthetic(n, seed=1), topo, batch_size=512,
                                          optimizer=optimizer, column_wise_statistic=statistic)
        kinds = {p.sharding_type for p in result.plan.modules[""].values()}
        assert found[-1].max_load == pytest.approx(result.stats.max_cost, rel=1e-9), (n, world)
    assert T.COLUMN_WISE in kinds  # pieces were priced (100 tables on 64 ranks cut some)


# Three equal tables on four ranks: whole, one rank stays idle; cut into column pieces, the four
# ranks share the work, but under the exact row statistic every piece pays a second backward and
# an exchange, which costs more than the idle rank saves.
THREE = [Table(f"t{i}", 100_000, 128, pooling_factor=5.0) for i in range(3)]
FOUR = Topology(4)


def test_per_shard_statistic_lets_the_planner_cut_where_exact_does_not():
    exact = planners.plan_with_stats(THREE, FOUR, batch_size=128)
    per_shard = planners.plan_with_stats(THREE, FOUR, batch_size=128,
                                         column_wise_statistic="per_shard")  # fmt: skip
    assert {t: p.sharding_type for t, p in exact.plan.modules[""].items()} == dict.fromkeys(
        ("t0", "t1", "t2"), T.TABLE_WISE)  # fmt: skip
    assert exact.stats.bound_ratio == pytest.approx(1.0)  # whole tables are optimal under exact
    assert {t: p.sharding_type for t, p in per_shard.plan.modules[""].items()} == dict.fromkeys(
        ("t0", "t1", "t2"), T.COLUMN_WISE)  # fmt: skip
    check_valid(per_shard.plan, THREE, FOUR, 128)

    def cost(plan, statistic: str) -> float:
        return planners.plan_stats(plan, THREE, FOUR, batch_size=128,
                                   column_wise_statistic=statistic).max_cost  # fmt: skip

    # each plan is priced as it was planned, and is the better one under its own statistic
    assert per_shard.stats.max_cost == cost(per_shard.plan, "per_shard")
    assert per_shard.stats.column_wise_statistic is planners.ColumnWiseStatistic.PER_SHARD
    assert exact.stats.max_cost == cost(exact.plan, "exact")
    assert cost(per_shard.plan, "per_shard") < 0.8 * cost(exact.plan, "per_shard")
    assert cost(per_shard.plan, "exact") > cost(exact.plan, "exact")
    assert "optimizer rowwise_adagrad (column_wise_statistic per_shard)" in per_shard.stats.summary()
    assert "column_wise_statistic" not in exact.stats.summary()  # the default reads as before


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_column_statistic_changes_no_plan_under_other_optimizers(optimizer):
    tables = synthetic(30, seed=2, max_rows=1e6)
    topo = Topology(16, ranks_per_host=8)
    exact, per_shard = (
        planners.plan_with_stats(tables, topo, batch_size=512, optimizer=optimizer,
                                 column_wise_statistic=statistic)
        for statistic in ("exact", "per_shard")
    )  # fmt: skip
    # the same placements; each plan records the statistic it was told
    assert per_shard.plan.modules == exact.plan.modules
    assert per_shard.plan.priced_for.column_wise_statistic is planners.ColumnWiseStatistic.PER_SHARD
    assert per_shard.stats.max_cost == exact.stats.max_cost
    assert "column_wise_statistic" not in per_shard.stats.summary()


def test_bad_column_statistic_is_a_plan_error_naming_the_values():
    expected = r"unknown column_wise_statistic 'approximate'; expected one of: exact, per_shard"
    with pytest.raises(PlanError, match=expected):
        planners.plan(THREE, FOUR, batch_size=128, column_wise_statistic="approximate")
    plan = planners.plan(THREE, FOUR, batch_size=128)
    with pytest.raises(PlanError, match=expected):
        planners.plan_stats(plan, THREE, FOUR, batch_size=128, column_wise_statistic="approximate")


def test_stats_report_the_slowest_rank_and_its_tables():
    result = planners.plan_with_stats(SMALL, SMALL_TOPO, batch_size=256)
    stats = result.stats
    slow = stats.slowest_rank
    assert slow.cost == stats.max_cost
    assert slow.tables and all(name in {t.name for t in SMALL} for name, _ in slow.tables)
    assert stats.imbalance == pytest.approx(stats.max_cost / stats.mean_cost)
    text = stats.format()
    assert "slowest rank" in text and "lower bound" in text and "in-dist" in text
    for r in stats.ranks:
        assert r.cost == pytest.approx(r.lookup + r.input_dist + r.output_dist + r.grad_sync
                                       + r.stat_exchange)
    # the column pieces' statistic exchange is not a data-parallel gradient sync
    pieces = [t for t in stats.tables if t.sharding_type is T.COLUMN_WISE and len(t.shards) > 1]
    for t in pieces:
        assert all(s.stat_exchange > 0 and s.grad_sync == 0 for s in t.shards)
    for t in stats.tables:
        if t.sharding_type is not T.DATA_PARALLEL:
            assert all(s.grad_sync == 0 for s in t.shards)


def test_constraints_are_honoured():
    tables = synthetic(40, seed=3, max_rows=1e6)
    topo = Topology(16, ranks_per_host=8)
    cons = {
        "t0": TableConstraint(sharding_types=(T.ROW_WISE,)),
        "t1": TableConstraint(ranks=(5,)),
        "t2": TableConstraint(sharding_types=(T.COLUMN_WISE,), min_shards=3, max_shards=3),
        "t3": TableConstraint(sharding_types=(T.TABLE_ROW_WISE,), ranks=(8, 9, 10, 11)),
        "t4": TableConstraint(sharding_types=(T.DATA_PARALLEL,)),
        "t5": TableConstraint(sharding_types=(T.TABLE_WISE, T.COLUMN_WISE), max_shards=1),
        "t6": TableConstraint(ranks=(0, 1, 2)),
    }
    plan = planners.plan(tables, topo, batch_size=256, constraints=cons)
    check_valid(plan, tables, topo, 256)
    p = plan.modules[""]
    assert p["t0"].sharding_type is T.ROW_WISE
    assert p["t1"].ranks == (5,)
    assert p["t2"].sharding_type is T.COLUMN_WISE and len(p["t2"].ranks) == 3
    assert p["t3"].sharding_type is T.TABLE_ROW_WISE and set(p["t3"].ranks) <= {8, 9, 10, 11}
    assert p["t4"].sharding_type is T.DATA_PARALLEL
    assert p["t5"].sharding_type is T.TABLE_WISE
    assert p["t6"].sharding_type is not T.DATA_PARALLEL and set(p["t6"].ranks) <= {0, 1, 2}


def test_constraint_for_unknown_table_or_rank_is_an_error():
    with pytest.raises(PlanError, match=r"unknown table\(s\) \['t_nope'\]"):
        planners.plan(SMALL, SMALL_TOPO, batch_size=8, constraints={"t_nope": TableConstraint()})
    with pytest.raises(PlanError, match="'t_cat' is pinned to rank 9 but the world size is 4"):
        planners.plan(SMALL, SMALL_TOPO, batch_size=8,
                      constraints={"t_cat": TableConstraint(ranks=(9,))})  # fmt: skip


def test_module_fqn_and_mapping_inputs():
    plan = planners.plan(SMALL, SMALL_TOPO, batch_size=64, module_fqn="sparse.ebc")
    assert set(plan.modules) == {"sparse.ebc"}
    two = planners.plan({"a.ebc": SMALL[:2], "b.ebc": SMALL[2:]}, SMALL_TOPO, batch_size=64)
    assert set(two.modules) == {"a.ebc", "b.ebc"}
    assert set(two.modules["b.ebc"]) == {"t_cat", "t_big"}


def test_duplicate_features_or_tables_are_errors():
    with pytest.raises(PlanError, match="feature 'x' of module '' is looked up in both"):
        planners.plan([Table("a", 10, 8, features=("x",)), Table("b", 10, 8, features=("x",))],
                      Topology(1), batch_size=1)  # fmt: skip
    with pytest.raises(PlanError, match="two tables named 'a'"):
        planners.plan([Table("a", 10, 8), Table("a", 10, 8, features=("y",))], Topology(1),
                      batch_size=1)  # fmt: skip


def test_model_on_meta_is_read_by_ebc_fqn():
    torch = pytest.importorskip("torch")
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.sparse = torch.nn.Module()
            self.sparse.ebc = EmbeddingBagCollection(tables=[
                EmbeddingBagConfig(name="t_user", embedding_dim=64, num_embeddings=100_000,
                                   feature_names=["user_id"]),
                EmbeddingBagConfig(name="t_item", embedding_dim=32, num_embeddings=5_000,
                                   feature_names=["item_id", "item_cat"]),
            ], device=torch.device("meta"))  # fmt: skip
            self.dense = torch.nn.Linear(4, 4, device="meta")

    model = Model()
    with pytest.raises(PlanError, match=r"pooling_factors names feature\(s\) \['cat'\] that no "
                       r"EmbeddingBagCollection of Model looks up; its features are 'item_cat', "
                       r"'item_id', 'user_id'"):  # fmt: skip
        planners.tables_from_model(model, pooling_factors={"cat": 5.0, "item_id": 2.0})
    tables = planners.tables_from_model(model, pooling_factors={"item_cat": 5.0})
    assert list(tables) == ["sparse.ebc"]
    assert tables["sparse.ebc"][1].features == ("item_id", "item_cat")
    assert tables["sparse.ebc"][1].pooling_factors == (1.0, 5.0)
    topo = Topology(4)
    plan = planners.plan(model, topo, batch_size=128)
    assert set(plan.modules) == {"sparse.ebc"}
    assert set(plan.modules["sparse.ebc"]) == {"t_user", "t_item"}
    stats = planners.plan_stats(plan, model, topo, batch_size=128)
    assert stats.num_tables == 2 and not stats.over_capacity
    # validate_plan takes the tables in any form plan() does: the model, a mapping, a list
    planners.validate_plan(plan, model, topo)
    planners.validate_plan(plan, tables, topo)
    planners.validate_plan(plan, list(tables["sparse.ebc"]), topo, module_fqn="sparse.ebc")
    with pytest.raises(PlanError, match="not among the tables given"):
        planners.validate_plan(plan, list(tables["sparse.ebc"]), topo)  # module "" has none
    with pytest.raises(PlanError, match="the plan is for 4 ranks but the topology has 2"):
        planners.validate_plan(plan, model, Topology(2))
