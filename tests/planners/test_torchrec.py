"""Interop with TorchRec: our plan -> TorchRec plan -> our plan is the identity, and TorchRec's
own plans (hand-made and from its planner) convert and price under our cost model."""

from __future__ import annotations

import warnings

import pytest

import planners
from planners import PlanError, ShardingPlan, ShardingType, Table, TablePlacement, Topology
from tests.planners.helpers import check_valid, synthetic

torch = pytest.importorskip("torch")
pytest.importorskip("torchrec")

T = ShardingType
TABLES = [
    Table("t_tw", 1000, 64),
    Table("t_cw", 5000, 128, features=("f_cw",)),
    Table("t_rw", 10_001, 32, features=("f_rw",)),
    Table("t_twrw", 777, 16, features=("f_twrw",)),
    Table("t_dp", 100, 8, features=("f_dp",)),
    Table("t_rw_sub", 9, 8, features=("f_rw_sub",)),
]
EVERY_KIND = ShardingPlan(8, {"sparse.ebc": {
    "t_tw": TablePlacement(T.TABLE_WISE, (3,)),
    "t_cw": TablePlacement(T.COLUMN_WISE, (5, 1, 2), sizes=(60, 64, 4)),
    "t_rw": TablePlacement(T.ROW_WISE, tuple(range(8))),  # TorchRec always lists the ranks
    "t_twrw": TablePlacement(T.TABLE_ROW_WISE, (4, 5, 7)),
    "t_dp": TablePlacement(T.DATA_PARALLEL),
    "t_rw_sub": TablePlacement(T.ROW_WISE, (1, 2, 6), sizes=(2, 3, 4)),
}}, ranks_per_host=4)  # fmt: skip


# EVERY_KIND as TorchRec holds it: row-wise tables in its block split over every rank of the
# world (table-row-wise: of the host), 0-row shards dropped (Note [row-wise layouts in TorchRec]).
AS_TORCHREC = ShardingPlan(8, {"sparse.ebc": {
    **EVERY_KIND.modules["sparse.ebc"],
    "t_rw": TablePlacement(T.ROW_WISE, tuple(range(8)), sizes=(1251,) * 7 + (1244,)),
    "t_twrw": TablePlacement(T.TABLE_ROW_WISE, (4, 5, 6, 7), sizes=(195, 195, 195, 192)),
    "t_rw_sub": TablePlacement(T.ROW_WISE, (0, 1, 2, 3, 4)),  # 2/2/2/2/1: the even split
}}, ranks_per_host=4)  # fmt: skip


def _converted(plan, tables, **kwargs):
    """to_torchrec's plan and the tables its TorchRecLayoutWarning names (in its order)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tr = planners.to_torchrec(plan, tables, **kwargs)
    messages = [str(w.message) for w in caught if issubclass(w.category, planners.TorchRecLayoutWarning)]
    assert len(messages) <= 1, "one warning per call, listing every table"
    moved = [line.split("'")[1] for m in messages for line in m.splitlines()[1:]]
    return tr, moved, "".join(messages)


def test_torchrec_layouts_round_trip_silently():
    with warnings.catch_warnings():
        warnings.simplefilter("error", planners.TorchRecLayoutWarning)
        tr = planners.to_torchrec(AS_TORCHREC, TABLES, module_fqn="sparse.ebc")
    assert planners.from_torchrec(tr, world_size=8, ranks_per_host=4) == AS_TORCHREC


def test_other_row_splits_become_torchrecs_block_split():
    tr, moved, text = _converted(EVERY_KIND, TABLES, module_fqn="sparse.ebc")
    assert moved == ["sparse.ebc.t_rw", "sparse.ebc.t_twrw", "sparse.ebc.t_rw_sub"]
    assert planners.from_torchrec(tr, world_size=8, ranks_per_host=4) == AS_TORCHREC
    # The warning names the way to keep one layout in both: the placement AS_TORCHREC has.
    assert "place it as TablePlacement(TABLE_ROW_WISE, ranks=(4, 5, 6, 7), sizes=(195, 195, 195, 192))" in text
    assert "rows 0-1 on rank 1, 2-4 on rank 2, 5-8 on rank 6" in text
    assert text.endswith("6-7 on rank 3, 8 on rank 4; to keep one layout in both, place it as "
                         "TablePlacement(ROW_WISE, ranks=(0, 1, 2, 3, 4))")


def test_issue_24_thousand_rows_over_three_ranks():
    # The planner's even split 334/333/333 is not how TorchRec routes ids: blocks of 334.
    tables = [Table("t", 1000, 8)]
    plan = ShardingPlan(3, {"": {"t": TablePlacement(T.ROW_WISE)}})
    tr, moved, text = _converted(plan, tables, device_type="cpu")
    shards = tr.plan[""]["t"].sharding_spec.shards
    assert [(s.placement.rank(), s.shard_offsets[0], s.shard_sizes[0]) for s in shards] == [
        (0, 0, 334), (1, 334, 334), (2, 668, 332)]  # fmt: skip
    assert moved == ["t"]
    assert ("table 't' is row_wise with rows 0-333 on rank 0, 334-666 on rank 1, 667-999 on rank 2, "
            "but TorchRec routes row_wise ids in blocks of ceil(1000 / 3) = 334 rows over ranks 0-2: "
            "it gets rows 0-333 on rank 0, 334-667 on rank 1, 668-999 on rank 2; to keep one layout "
            "in both, place it as TablePlacement(ROW_WISE, ranks=(0, 1, 2), sizes=(334, 334, 332))") in text  # fmt: skip
    # table-row-wise over the host likewise
    plan = ShardingPlan(3, {"": {"t": TablePlacement(T.TABLE_ROW_WISE, (0, 1, 2))}}, ranks_per_host=3)
    tr, moved, _ = _converted(plan, tables, device_type="cpu")
    assert [s.shard_sizes[0] for s in tr.plan[""]["t"].sharding_spec.shards] == [334, 334, 332]
    assert moved == ["t"]


def test_torchrec_row_wise_has_one_shard_per_rank():
    tr, _, _ = _converted(EVERY_KIND, TABLES, module_fqn="sparse.ebc")
    ps = tr.plan["sparse.ebc"]["t_rw_sub"]
    assert ps.sharding_type == "row_wise" and ps.compute_kernel == "fused"
    shards = ps.sharding_spec.shards
    assert [s.placement.rank() for s in shards] == list(range(8))
    assert [s.shard_sizes[0] for s in shards] == [2, 2, 2, 2, 1, 0, 0, 0]
    assert [s.shard_offsets[0] for s in shards] == [0, 2, 4, 6, 8, 9, 9, 9]
    twrw = tr.plan["sparse.ebc"]["t_twrw"].sharding_spec.shards
    assert [s.placement.rank() for s in twrw] == [4, 5, 6, 7]
    assert [s.shard_sizes[0] for s in twrw] == [195, 195, 195, 192]
    assert tr.plan["sparse.ebc"]["t_dp"].compute_kernel == "dense"


def test_table_row_wise_needs_whole_hosts():
    plan = ShardingPlan(2, {"": {"t": TablePlacement(T.TABLE_ROW_WISE, (0, 1))}}, ranks_per_host=8)
    with pytest.raises(PlanError, match=r"table 't' is table_row_wise with 8 ranks per host, but the world "
                                        r"has 2 ranks, not a multiple of 8.*LOCAL_WORLD_SIZE"):
        planners.to_torchrec(plan, [Table("t", 10, 8)])
    assert planners.to_torchrec(plan, [Table("t", 10, 8)], ranks_per_host=2).plan[""]["t"].ranks == [0, 1]


def test_row_blocks_out_of_rank_order_become_rank_order():
    plan = ShardingPlan(4, {"": {"t": TablePlacement(T.ROW_WISE, (2, 0))}})
    tr, moved, text = _converted(plan, [Table("t", 10, 8)])
    assert moved == ["t"] and "rows 0-4 on rank 2, 5-9 on rank 0" in text
    assert [s.shard_sizes[0] for s in tr.plan[""]["t"].sharding_spec.shards] == [3, 3, 3, 1]


def test_column_cuts_move_to_multiples_of_four():
    tables = [Table("c", 10, 20)]
    plan = ShardingPlan(3, {"": {"c": TablePlacement(T.COLUMN_WISE, (2, 0, 2), sizes=(7, 9, 4))}})
    tr, moved, text = _converted(plan, tables, device_type="cpu")
    shards = tr.plan[""]["c"].sharding_spec.shards
    assert [(s.placement.rank(), s.shard_offsets[1], s.shard_sizes[1]) for s in shards] == [
        (2, 0, 8), (0, 8, 8), (2, 16, 4)]  # fmt: skip
    assert moved == ["c"] and "place it as TablePlacement(COLUMN_WISE, ranks=(2, 0, 2), sizes=(8, 8, 4))" in text
    # The dense kernel takes any width: the plan's cuts stay.
    tr, moved, _ = _converted(plan, tables, device_type="cpu", compute_kernel="dense")
    assert [s.shard_sizes[1] for s in tr.plan[""]["c"].sharding_spec.shards] == [7, 9, 4] and not moved


def test_what_torchrecs_fused_kernel_cannot_run_is_a_plan_error():
    tw = ShardingPlan(2, {"": {"odd": TablePlacement(T.TABLE_WISE, (1,))}})
    with pytest.raises(PlanError, match=r"table 'odd' is 6 columns wide, but TorchRec's fused kernel needs "
                                        r"every shard to be a multiple of 4 columns wide.*compute_kernel='dense'.*e\.g\. 8"):
        planners.to_torchrec(tw, [Table("odd", 10, 6)])
    assert planners.to_torchrec(tw, [Table("odd", 10, 6)], compute_kernel="dense").plan[""]["odd"].compute_kernel == "dense"
    cw = ShardingPlan(3, {"": {"c": TablePlacement(T.COLUMN_WISE)}})
    with pytest.raises(PlanError, match=r"table 'c' \(8 columns\) is cut into 3 column pieces \(3, 3, 2\).*"
                                        r"so at most 2; use at most 2 ranks \(e\.g\. sizes=\(4, 4\)\)"):
        planners.to_torchrec(cw, [Table("c", 10, 8)])
    with pytest.raises(PlanError, match=r"compute_kernel must be one of \('fused', 'dense'\), got 'sparse'"):
        planners.to_torchrec(tw, [Table("odd", 10, 8)], compute_kernel="sparse")


def test_zero_row_shard_under_the_fused_kernel_on_cpu_is_a_plan_error():
    # 4 rows over 3 ranks: TorchRec's blocks of 2 leave rank 2 empty; fbgemm's fused CPU kernel
    # fails on that (tests/interop runs the dense kernel with it).
    plan = ShardingPlan(3, {"": {"t": TablePlacement(T.ROW_WISE, (0, 1))}})
    tables = [Table("t", 4, 8)]
    with pytest.raises(PlanError, match=r"table 't' has 4 rows, and TorchRec's row_wise puts blocks of "
                                        r"ceil\(4 / 3\) = 2 rows on ranks 0-2, which leaves rank\(s\) \[2\] "
                                        r"with 0 rows.*table_wise, column_wise or data_parallel"):
        planners.to_torchrec(plan, tables, device_type="cpu")
    for kwargs in ({"device_type": "cpu", "compute_kernel": "dense"}, {"device_type": "cuda"}):
        tr, moved, _ = _converted(plan, tables, **kwargs)  # 2/2 on ranks 0-1 already: no warning
        assert [s.shard_sizes[0] for s in tr.plan[""]["t"].sharding_spec.shards] == [2, 2, 0] and not moved


def _torchrec_row_wise(sizes, ranks=None):
    from torch.distributed._shard.sharding_spec import EnumerableShardingSpec, ShardMetadata
    from torchrec.distributed.types import EmbeddingModuleShardingPlan, ParameterSharding
    from torchrec.distributed.types import ShardingPlan as TorchRecPlan

    ranks = ranks or list(range(len(sizes)))
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    spec = EnumerableShardingSpec([ShardMetadata([o, 0], [n, 8], f"rank:{r}/cpu")
                                   for r, o, n in zip(ranks, offsets, sizes)])  # fmt: skip
    ps = ParameterSharding(sharding_type="row_wise", compute_kernel="fused", ranks=ranks, sharding_spec=spec)
    return TorchRecPlan({"": EmbeddingModuleShardingPlan({"t": ps})})


def test_from_torchrec_refuses_row_shards_torchrec_does_not_route_by():
    with pytest.raises(PlanError, match=r"table 't' is row_wise in the TorchRec plan with \(rank, rows\) shards "
                                        r"\[\(0, 334\), \(1, 333\), \(2, 333\)\], but TorchRec routes its ids in "
                                        r"blocks of ceil\(1000 / 3\) = 334 rows.*\[\(0, 334\), \(1, 334\), \(2, 332\)\]"):
        planners.from_torchrec(_torchrec_row_wise([334, 333, 333]), world_size=3)
    with pytest.raises(PlanError, match=r"shard i on rank 0 \+ i"):
        planners.from_torchrec(_torchrec_row_wise([334, 334, 332], ranks=[2, 1, 0]), world_size=3)
    ours = planners.from_torchrec(_torchrec_row_wise([334, 334, 332]), world_size=3)
    assert ours.modules[""]["t"] == TablePlacement(T.ROW_WISE, (0, 1, 2), sizes=(334, 334, 332))


def _as_torchrec_holds(plan: ShardingPlan, tables) -> ShardingPlan:
    """`plan` with each row-wise table in TorchRec's block split, written out independently."""
    host = plan.ranks_per_host or plan.world_size
    modules = {}
    for fqn, placements in plan.modules.items():
        rows = {t.name: t.num_embeddings for t in tables}
        out = {}
        for name, p in placements.items():
            if p.sharding_type in (T.ROW_WISE, T.TABLE_ROW_WISE):
                first, n = (0, plan.world_size) if p.sharding_type is T.ROW_WISE else (p.ranks[0] // host * host, host)
                block = -(-rows[name] // n)
                sizes = [min(block, rows[name] - i * block) for i in range(n)]
                kept = [(first + i, x) for i, x in enumerate(sizes) if x > 0]
                ranks, sizes = tuple(r for r, _ in kept), tuple(x for _, x in kept)
                even = sizes == planners.even_split(rows[name], len(sizes))
                p = TablePlacement(p.sharding_type, ranks, None if even else sizes)
            out[name] = p
        modules[fqn] = out
    return ShardingPlan(plan.world_size, modules, ranks_per_host=plan.ranks_per_host)


@pytest.mark.parametrize("n,world", [(40, 16), (200, 64)])
def test_planner_output_converts_to_torchrecs_layout(n, world):
    tables = synthetic(n, seed=world)
    topo = Topology(world)
    plan = planners.plan(tables, topo, batch_size=512)
    tr, moved, _ = _converted(plan, tables)
    back = planners.from_torchrec(tr, world_size=world, ranks_per_host=topo.ranks_per_host)
    expected = _as_torchrec_holds(plan, tables)
    assert back == expected
    changed = sorted(name for name, p in plan.modules[""].items() if p != expected.modules[""][name])
    assert sorted(moved) == changed
    # TorchRec's layout is a fixed point: converting it again moves nothing.
    _, again, _ = _converted(back, tables)
    assert again == []


def test_hand_made_torchrec_plan_converts():
    from torchrec.distributed.sharding_plan import (
        column_wise, construct_module_sharding_plan, data_parallel, row_wise, table_row_wise,
        table_wise,
    )  # fmt: skip
    from torchrec.distributed.types import ShardingPlan as TorchRecPlan
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    ebc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=t.name, embedding_dim=t.embedding_dim,
                           num_embeddings=t.num_embeddings, feature_names=list(t.features))
        for t in TABLES[:5]], device=torch.device("meta"))  # fmt: skip
    module_plan = construct_module_sharding_plan(ebc, {
        "t_tw": table_wise(rank=2), "t_cw": column_wise(ranks=[0, 3]), "t_rw": row_wise(),
        "t_twrw": table_row_wise(host_index=1), "t_dp": data_parallel(),
    }, local_size=4, world_size=8, device_type="cuda")  # fmt: skip
    ours = planners.from_torchrec(TorchRecPlan({"": module_plan}), world_size=8, ranks_per_host=4)
    p = ours.modules[""]
    assert p["t_tw"] == TablePlacement(T.TABLE_WISE, (2,))
    assert p["t_cw"] == TablePlacement(T.COLUMN_WISE, (0, 3))
    # TorchRec splits 10_001 rows as ceil blocks: 1251 x 7 + 1244
    assert p["t_rw"] == TablePlacement(T.ROW_WISE, tuple(range(8)), sizes=(1251,) * 7 + (1244,))
    assert p["t_twrw"].sharding_type is T.TABLE_ROW_WISE and p["t_twrw"].ranks == (4, 5, 6, 7)
    assert p["t_dp"] == TablePlacement(T.DATA_PARALLEL)
    with warnings.catch_warnings():  # TorchRec's own layouts go back unchanged, silently
        warnings.simplefilter("error", planners.TorchRecLayoutWarning)
        again = planners.to_torchrec(ours, TABLES[:5], ranks_per_host=4)
    assert planners.from_torchrec(again, world_size=8, ranks_per_host=4) == ours
    shards = {n: [(s.placement.rank(), s.shard_offsets, s.shard_sizes) for s in ps.sharding_spec.shards]
              for n, ps in module_plan.items() if ps.sharding_spec is not None}
    assert {n: [(s.placement.rank(), s.shard_offsets, s.shard_sizes) for s in ps.sharding_spec.shards]
            for n, ps in again.plan[""].items() if ps.sharding_spec is not None} == shards
    stats = planners.plan_stats(ours, TABLES[:5], Topology(8, ranks_per_host=4), batch_size=64)
    assert stats.max_cost >= stats.lower_bound


def test_torchrec_planner_plan_is_no_better_than_ours():
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
    from torchrec.distributed.planner import Topology as TorchRecTopology
    from torchrec.distributed.planner.stats import NoopEmbeddingStats
    from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    tables = synthetic(8, seed=11, max_rows=1e6)
    ebc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=t.name, embedding_dim=t.embedding_dim,
                           num_embeddings=t.num_embeddings, feature_names=list(t.features))
        for t in tables], device=torch.device("meta"))  # fmt: skip
    kinds = [k.value for k in T]
    constraints = {t.name: ParameterConstraints(sharding_types=kinds, compute_kernels=["fused", "dense"],
                                                pooling_factors=list(t.pooling_factors))
                   for t in tables}  # fmt: skip
    planner = EmbeddingShardingPlanner(
        topology=TorchRecTopology(world_size=4, compute_device="cuda", local_world_size=4),
        batch_size=256, constraints=constraints, debug=False, stats=[NoopEmbeddingStats()],
        storage_reservation=FixedPercentageStorageReservation(percentage=0.1))  # fmt: skip
    theirs = planners.from_torchrec(planner.plan(ebc, [EmbeddingBagCollectionSharder()]),
                                    world_size=4, ranks_per_host=4)  # fmt: skip
    topo = Topology(4)
    their_stats = check_valid(theirs, tables, topo, 256)
    ours = planners.plan_stats(planners.plan(tables, topo, batch_size=256), tables, topo, batch_size=256)
    assert ours.max_cost <= their_stats.max_cost * (1 + 1e-9)


def test_modular_fuses_with_the_planners_column_wise_statistic():
    # One enum: the statistic a model was fused with (FusedOptimizer.column_wise_statistic) is
    # what the planner prices.
    from modular import optim

    assert optim.ColumnWiseStatistic is planners.ColumnWiseStatistic


# -- torchrec's own table descriptions as the planner's input (issue 24, part 3) ----------------


def _configs():
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    return [
        EmbeddingBagConfig(name="t_user", num_embeddings=1_000_000, embedding_dim=64, feature_names=["user"]),
        EmbeddingBagConfig(name="t_hist", num_embeddings=200_000, embedding_dim=32, feature_names=["hist", "hist2"]),
        EmbeddingBagConfig(name="t_ctx", num_embeddings=100, embedding_dim=8, feature_names=["ctx"]),
    ]  # fmt: skip


AS_TABLES = [
    Table("t_user", 1_000_000, 64, features=("user",)),
    Table("t_hist", 200_000, 32, features=("hist", "hist2"), pooling_factor=(40.0, 1.0)),
    Table("t_ctx", 100, 8, features=("ctx",)),
]


def test_plan_takes_embedding_bag_configs_and_an_ebc():
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    topo = Topology(4, device_memory="1GiB")
    want = planners.plan(AS_TABLES, topo, batch_size=512, module_fqn="ebc")
    pooling = {"hist": 40.0}
    assert planners.plan(_configs(), topo, batch_size=512, module_fqn="ebc", pooling_factors=pooling) == want
    result = planners.plan_with_stats(_configs(), topo, batch_size=512, module_fqn="ebc", pooling_factors=pooling)
    assert result.plan == want
    ebc = EmbeddingBagCollection(tables=_configs(), device=torch.device("meta"))
    from_ebc = planners.plan(ebc, topo, batch_size=512, pooling_factors=pooling)
    assert from_ebc.modules[""] == want.modules["ebc"]
    # Without pooling factors every feature counts 1.0 id per sample: another input, priced so.
    assert planners.plan_stats(want, _configs(), topo, batch_size=512, module_fqn="ebc").max_cost < result.stats.max_cost
    planners.validate_plan(want, _configs(), topo, module_fqn="ebc")
    tables = planners.tables_from_configs(_configs(), pooling_factors=pooling)
    assert list(tables) == AS_TABLES


def test_to_torchrec_takes_configs_and_an_ebc():
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    plan = ShardingPlan(4, {"": {"t_user": TablePlacement(T.ROW_WISE), "t_hist": TablePlacement(T.COLUMN_WISE),
                                 "t_ctx": TablePlacement(T.DATA_PARALLEL)}})  # fmt: skip
    ebc = EmbeddingBagCollection(tables=_configs(), device=torch.device("meta"))
    expected = planners.to_torchrec(plan, AS_TABLES)
    for tables in (_configs(), ebc):
        got = planners.to_torchrec(plan, tables)
        assert {n: str(ps) for n, ps in got.plan[""].items()} == {n: str(ps) for n, ps in expected.plan[""].items()}


def test_config_input_errors_name_the_feature_and_the_fix():
    topo = Topology(4)
    with pytest.raises(PlanError, match=r"pooling_factors names feature\(s\) \['histt'\] that no config looks "
                                        r"up; their features are 'ctx', 'hist', 'hist2', 'user'"):
        planners.tables_from_configs(_configs(), pooling_factors={"histt": 4.0})
    with pytest.raises(PlanError, match=r"pooling_factors names feature\(s\) \['histt'\] that no table looks up"):
        planners.plan(_configs(), topo, batch_size=8, pooling_factors={"histt": 4.0})
    with pytest.raises(PlanError, match=r"pooling_factors names feature\(s\) \['user'\] of planners.Table "
                                        r"'t_user', which has its own pooling_factor \(1.0,\); set it there"):
        planners.plan(AS_TABLES, topo, batch_size=8, pooling_factors={"user": 4.0})
    with pytest.raises(PlanError, match=r"module '': expected planners.Table or torchrec EmbeddingBagConfig, got dict"):
        planners.plan([{"name": "t"}], topo, batch_size=8)


def test_interop_is_listed_and_importing_planners_imports_no_torch():
    import subprocess
    import sys

    for name in ("to_torchrec", "from_torchrec", "TorchRecLayoutWarning", "tables_from_configs"):
        assert name in dir(planners) and name in planners.__all__
    code = "import sys, planners; planners.to_torchrec; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
