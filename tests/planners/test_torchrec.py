"""Interop with TorchRec: our plan -> TorchRec plan -> our plan is the identity, and TorchRec's
own plans (hand-made and from its planner) convert and price under our cost model."""

from __future__ import annotations

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


def test_every_kind_round_trips():
    tr = planners.to_torchrec(EVERY_KIND, TABLES, module_fqn="sparse.ebc")
    back = planners.from_torchrec(tr, world_size=8, ranks_per_host=4)
    assert back == EVERY_KIND


def test_torchrec_row_wise_has_one_shard_per_rank():
    tr = planners.to_torchrec(EVERY_KIND, TABLES, module_fqn="sparse.ebc", device_type="cpu")
    ps = tr.plan["sparse.ebc"]["t_rw_sub"]
    assert ps.sharding_type == "row_wise" and ps.compute_kernel == "fused"
    shards = ps.sharding_spec.shards
    assert [s.placement.rank() for s in shards] == list(range(8))
    assert [s.shard_sizes[0] for s in shards] == [0, 2, 3, 0, 0, 0, 4, 0]
    assert [s.shard_offsets[0] for s in shards] == [0, 0, 2, 5, 5, 5, 5, 9]
    twrw = tr.plan["sparse.ebc"]["t_twrw"].sharding_spec.shards
    assert [s.placement.rank() for s in twrw] == [4, 5, 6, 7]
    assert [s.shard_sizes[0] for s in twrw] == [259, 259, 0, 259]
    assert tr.plan["sparse.ebc"]["t_dp"].compute_kernel == "dense"


def test_unsorted_row_wise_ranks_cannot_go_to_torchrec():
    plan = ShardingPlan(4, {"": {"t": TablePlacement(T.ROW_WISE, (2, 0))}})
    with pytest.raises(PlanError, match=r"row blocks are not in rank order"):
        planners.to_torchrec(plan, [Table("t", 10, 8)])


@pytest.mark.parametrize("n,world", [(40, 16), (200, 64)])
def test_planner_output_round_trips(n, world):
    tables = synthetic(n, seed=world)
    topo = Topology(world)
    plan = planners.plan(tables, topo, batch_size=512)
    back = planners.from_torchrec(planners.to_torchrec(plan, tables), world_size=world,
                                  ranks_per_host=topo.ranks_per_host)  # fmt: skip
    assert back == plan and back.to_json() == plan.to_json()


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
