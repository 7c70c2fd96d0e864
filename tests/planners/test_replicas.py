"""The planner's half of 2D sparse parallelism (issue 36): plan one shard group of
world_size / R ranks, and price each replica sync mode (Note [pricing replica groups] in
planners/replicas.py). Pure, single-process."""

from __future__ import annotations

import json

import pytest

import planners
from planners import PlanError, ShardingPlan, ShardingType, Table, TablePlacement, Topology
from planners.__main__ import main
from planners.cost import OUTPUT_BYTES, CostModel, TableArrays
from planners.replicas import ReplicaSync, group_topology, synced_bytes
from tests.planners.helpers import synthetic

BATCH = 256


def test_one_group_is_planned_and_a_world_the_replicas_do_not_divide_is_refused():
    tables = synthetic(12, seed=4, max_rows=1e6)
    for world, host, replicas, group_host in ((16, 8, 2, 8), (16, 8, 4, 4), (32, 8, 2, 8)):
        plan = planners.plan(tables, Topology(world, ranks_per_host=host), batch_size=BATCH,
                             replicas=replicas)  # fmt: skip
        assert plan.world_size == world // replicas and plan.ranks_per_host == group_host
    with pytest.raises(PlanError, match=r"world_size 16 is not divisible by replicas 3.*\[1, 2, 4, 8, 16\]"):
        planners.plan(tables, Topology(16, ranks_per_host=8), batch_size=BATCH, replicas=3)
    with pytest.raises(PlanError, match="12 ranks would sit unevenly on hosts of 8"):
        planners.plan(tables, Topology(24, ranks_per_host=8), batch_size=BATCH, replicas=2)
    with pytest.raises(PlanError, match="unknown replica_sync 'sometimes'"):
        planners.plan(tables, Topology(16), batch_size=BATCH, replicas=2, replica_sync="sometimes")


def test_periodic_is_a_1d_plan_of_one_group():
    """No per-step traffic across replica groups: the plan and its prices are those of a 1D
    world of G ranks with the same per-rank batch."""
    tables = synthetic(20, seed=5, max_rows=5e6)
    two_d = planners.plan_with_stats(tables, Topology(32, ranks_per_host=8), batch_size=BATCH,
                                     replicas=4, replica_sync="periodic")  # fmt: skip
    one_d = planners.plan_with_stats(tables, Topology(8, ranks_per_host=8), batch_size=BATCH)
    assert two_d.plan.modules == one_d.plan.modules and two_d.plan.world_size == one_d.plan.world_size
    assert (two_d.plan.priced_for.replicas, one_d.plan.priced_for.replicas) == (4, 1)
    assert [r.cost for r in two_d.stats.ranks] == [r.cost for r in one_d.stats.ranks]
    assert all(r.replica_sync == 0.0 for r in two_d.stats.ranks)
    assert "replica sync periodic: none per step" in two_d.stats.summary()


@pytest.mark.parametrize("host,same_host_peers", [(2, 0), (4, 1), (8, 3)])
def test_exact_prices_the_other_groups_batches(host, same_host_peers):
    """A table-wise table in a group of G=2 ranks, R=4 replica groups: its copy receives from
    each of the 3 other groups their ids (4 bytes), bag lengths (4) and pooled gradients (4 per
    value), over NVLink from peers on its host and over the NIC from the rest, and replays them
    through its backward."""
    world, replicas, group = 8, 4, 2
    table = Table("t", 10_000, 16, pooling_factor=3.0)
    topology = Topology(world, ranks_per_host=host)
    plan = ShardingPlan(group, {"": {"t": TablePlacement(ShardingType.TABLE_WISE, (0,))}},
                        ranks_per_host=min(host, group))  # fmt: skip
    exact = planners.plan_stats(plan, [table], topology, batch_size=BATCH, replicas=replicas)
    periodic = planners.plan_stats(plan, [table], topology, batch_size=BATCH, replicas=replicas,
                                   replica_sync="periodic")  # fmt: skip
    ids, bags = group * BATCH * 3.0, group * BATCH * 1.0
    per_peer = ids * 4 + bags * 4 + bags * 16 * OUTPUT_BYTES
    beta = (same_host_peers / topology.intra_host_bandwidth
            + (replicas - 1 - same_host_peers) / topology.cross_host_bandwidth)  # fmt: skip
    shard = exact.table("t").shards[0]
    assert shard.replica_sync == pytest.approx(per_peer * beta, rel=1e-12)
    bwd = bags * 16 * OUTPUT_BYTES + ids * (2 * 16 * 4 + 2 * 4)  # row-wise Adagrad: 4 B a row
    replay = (replicas - 1) * bwd / topology.device_memory_bandwidth
    assert shard.lookup - periodic.table("t").shards[0].lookup == pytest.approx(replay, rel=1e-9)
    assert exact.ranks[0].replica_sync == shard.replica_sync and exact.ranks[1].replica_sync == 0
    assert shard.memory - periodic.table("t").shards[0].memory == pytest.approx(3 * per_peer)
    assert exact.max_cost == pytest.approx(periodic.max_cost + shard.replica_sync + replay)


def test_exact_is_searched_with_its_price_and_plan_stats_agrees():
    tables = synthetic(16, seed=6, max_rows=5e6)
    topology = Topology(16, ranks_per_host=8)
    result = planners.plan_with_stats(tables, topology, batch_size=BATCH, replicas=2)
    again = planners.plan_stats(result.plan, tables, topology, batch_size=BATCH, replicas=2)
    assert again.max_cost == pytest.approx(result.stats.max_cost, rel=1e-12)
    assert again.lower_bound == pytest.approx(result.stats.lower_bound, rel=1e-12)
    assert result.stats.max_cost >= result.stats.lower_bound * (1 - 1e-12)
    assert result.stats.slowest_rank.replica_sync > 0
    periodic = planners.plan_stats(result.plan, tables, topology, batch_size=BATCH, replicas=2,
                                   replica_sync="periodic")  # fmt: skip
    assert periodic.max_cost < result.stats.max_cost
    # the bound (and the search) see the sync: more replica groups, more to gather
    more = planners.plan_with_stats(tables, Topology(32, ranks_per_host=8), batch_size=BATCH,
                                    replicas=4)  # fmt: skip
    assert more.stats.lower_bound > result.stats.lower_bound
    text = result.stats.summary()
    assert "2D: 2 replica groups of 8 ranks (16 in all, 8 per host), global batch 4096" in text
    assert "replica sync exact" in text
    assert result.stats.to_dict()["replicas"] == 2


def test_group_topology_keeps_the_device():
    topology = Topology(32, ranks_per_host=8, device_memory="40GiB", cross_host_bandwidth=25e9)
    group, layout = group_topology(topology, 8, "exact")
    assert (group.world_size, group.ranks_per_host) == (4, 4)
    assert group.device_memory == topology.device_memory
    assert group.cross_host_bandwidth == 25e9
    assert (layout.count, layout.group_size, layout.ranks_per_host) == (8, 4, 8)
    assert layout.sync is ReplicaSync.EXACT
    # peers 4 ranks apart: one more in the host of 8, six over the NIC
    assert layout.beta(450e9, 25e9) == pytest.approx(1 / 450e9 + 6 / 25e9)
    model = CostModel(group, BATCH, replicas=layout)
    t = TableArrays.of([Table("t", 100, 8)])
    assert float(model.shard(ShardingType.TABLE_WISE, t, 100.0, 8.0, 1.0).replica_sync[0]) > 0


def test_cli_replicas(tmp_path, capsys):
    tables = tmp_path / "t.yaml"
    tables.write_text(
        "- {name: big, num_embeddings: 2000000, embedding_dim: 64, pooling_factor: 2}\n"
        "- {name: hist, num_embeddings: 1000000, embedding_dim: 64, pooling_factor: 10}\n"
        "- {name: small, num_embeddings: 1000, embedding_dim: 16}\n"
    )  # fmt: skip
    out_json = tmp_path / "p.json"
    assert main(["plan", str(tables), "--world-size", "8", "--ranks-per-host", "4",
                 "--batch-size", "128", "--replicas", "2", "-o", str(out_json)]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "rep-sync" in out and "2D: 2 replica groups of 4 ranks (8 in all, 4 per host)" in out
    plan, recorded = planners.files.load_plan(str(out_json))
    assert plan.world_size == 4 and recorded["replicas"] == 2 and recorded["world_size"] == 8
    assert main(["show", str(out_json)]) == 0
    shown = capsys.readouterr().out
    slowest = [line for line in out.splitlines() if line.startswith(("slowest rank", "2D:"))]
    assert len(slowest) == 2 and all(line in shown.splitlines() for line in slowest)
    assert main(["show", str(out_json), "--replica-sync", "periodic"]) == 0
    periodic = capsys.readouterr().out
    assert "override: replica_sync periodic (the plan records exact)" in periodic
    assert "rep-sync" not in periodic and "none per step" in periodic
    assert main(["show", str(out_json), "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["stats"]["replicas"] == 2 and data["stats"]["replica_sync"] == "exact"
    assert all("replica_sync" in r for r in data["stats"]["ranks"])
    assert main(["plan", str(tables), "--world-size", "8", "--batch-size", "128",
                 "--replicas", "3"]) == 2  # fmt: skip
    assert "not divisible by replicas 3" in capsys.readouterr().err


# Bytes each rank received over its replica group in one exact step, counted by
#   benchmarks/step_2d.py --tables 4 --rows 1000 --dim 16 --batch 8 --pooling 2
# (world 4 as 2 x 2, fused exact row-wise Adagrad; its "counted / priced" lines), per shard rank
# (ranks 2 and 3 received what ranks 0 and 1 did). Row-wise is left out: its shards' id counts
# vary with the batch and each gather pads to the longest replica's.
COUNTED = {
    "table_wise": (2456, 2456),
    "column_wise": (2840, 2840),
    "data_parallel": (2840, 2840),
    "mixed": (1968, 3184),  # rank 0: t0's column piece, t2; rank 1: the other piece, t1, t3
}
KERNELS = {"table_wise": 1, "column_wise": 1, "data_parallel": 1, "mixed": 2}
# ... and what one periodic `modular.sync_replicas` call received there, on the rank receiving most
# (the footnote of its table): every shard and its row-wise Adagrad state, fp32.
SYNC_COUNTED = {"table_wise": 136_000, "row_wise": 136_000, "column_wise": 144_000,
                "data_parallel": 272_000, "mixed": 172_000}  # fmt: skip
# per kernel and peer, unpriced: a replica's (bags, ids, rows), 3 int64, in one gather for all of a
# fused module's kernels
COUNTS_BYTES = 24


def _benchmark_plan(kind: str) -> ShardingPlan:
    """benchmarks/_common.py's `our_plan` of 4 tables on a shard group of 2 ranks."""
    if kind == "mixed":
        placements = {"t0": TablePlacement(ShardingType.COLUMN_WISE, (0, 1))}
        placements |= {f"t{i}": TablePlacement(ShardingType.TABLE_WISE, (i % 2,)) for i in (1, 2, 3)}
    else:
        sharding = ShardingType.parse(kind)
        placements = {
            f"t{i}": TablePlacement(sharding) if sharding is ShardingType.DATA_PARALLEL
            else TablePlacement(sharding, (i % 2,) if sharding is ShardingType.TABLE_WISE else (0, 1))
            for i in range(4)
        }  # fmt: skip
    return ShardingPlan(2, {"ebc": placements})


def test_priced_bytes_are_the_bytes_modular_sends():
    """Priced on links of 1 byte/s, seconds are bytes received per rank. Exact: equal, for each
    plan of the benchmark's config, to what modular's replay gathers moved (less their small
    counts header, which the planner leaves out); column pieces exchange row statistics for
    every replica group's ids (R times a group's), periodic for its own. Periodic: one
    `sync_replicas` call priced apart, equal to what the benchmark counted."""
    tables = [Table(f"t{i}", 1000, 16, features=(f"f{i}",), pooling_factor=2.0) for i in range(4)]
    unit = Topology(4, ranks_per_host=4, intra_host_bandwidth=1.0, cross_host_bandwidth=1.0)
    for kind, counted in COUNTED.items():
        stats = planners.plan_stats(_benchmark_plan(kind), tables, unit, batch_size=8,
                                    module_fqn="ebc", replicas=2)  # fmt: skip
        priced = [r.replica_sync for r in stats.ranks]
        assert priced == [c - KERNELS[kind] * COUNTS_BYTES for c in counted], kind
    _, layout = group_topology(unit, 2, "periodic")
    for kind, counted in SYNC_COUNTED.items():
        held = max(synced_bytes(_benchmark_plan(kind), tables, module_fqn="ebc"))
        assert layout.sync_seconds(held, 1.0, 1.0) == counted, kind
    # a ring over 4 replica groups of 2 ranks receives 2 x 3/4 of it, at the NIC's pace unless
    # all 4 share a host
    _, across = group_topology(Topology(8, ranks_per_host=4), 4, "periodic")
    assert across.sync_seconds(1000.0, 450e9, 25e9) == pytest.approx(1.5 * 1000.0 / 25e9)
    _, one_host = group_topology(Topology(8, ranks_per_host=8), 4, "periodic")
    assert one_host.sync_seconds(1000.0, 450e9, 25e9) == pytest.approx(1.5 * 1000.0 / 450e9)
    plan = _benchmark_plan("column_wise")
    exact, periodic = (
        planners.plan_stats(plan, tables, Topology(8, ranks_per_host=8), batch_size=8,
                            module_fqn="ebc", replicas=4, replica_sync=sync)
        for sync in ("exact", "periodic")
    )  # fmt: skip
    assert exact.ranks[0].stat_exchange == pytest.approx(4 * periodic.ranks[0].stat_exchange)
    assert periodic.ranks[0].stat_exchange > 0
