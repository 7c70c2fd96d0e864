"""Issue 46, the planner's part: managed-collision tables priced (Note [pricing managed
collisions] in planners/mc_cost.py) and shown with their zch_size in the CLI's per-table view.

Pure and single-process: a torchrec `ManagedCollisionEmbeddingBagCollection` is only read for
its configs and collision modules; the CLI runs in this process on files under tmp_path.
"""

from __future__ import annotations

import csv
import io
import math

import pytest
import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
from torchrec.modules.mc_modules import (
    DistanceLFU_EvictionPolicy, LRU_EvictionPolicy, ManagedCollisionCollection, MCHManagedCollisionModule,
)  # fmt: skip

import planners
from planners import EvictionPolicy, ManagedCollision, NoPlanError, PlanError, Table, Topology
from planners.__main__ import main
from planners.files import table_from_record

BATCH = 64


class Model(nn.Module):
    """Two MC tables (LRU every 3 calls, DistanceLFU every call) and a plain EBC."""

    def __init__(self) -> None:
        super().__init__()
        raw = [EmbeddingBagConfig(name="t_user", num_embeddings=1_001, embedding_dim=16, feature_names=["user"]),
               EmbeddingBagConfig(name="t_item", num_embeddings=301, embedding_dim=8,
                                  feature_names=["item", "item2"])]  # fmt: skip
        mch = {
            "t_user": MCHManagedCollisionModule(zch_size=1_001, device=torch.device("cpu"),
                                                eviction_policy=LRU_EvictionPolicy(), eviction_interval=3),
            "t_item": MCHManagedCollisionModule(zch_size=301, device=torch.device("cpu"),
                                                eviction_policy=DistanceLFU_EvictionPolicy(), eviction_interval=1),
        }  # fmt: skip
        mcc = ManagedCollisionCollection(managed_collision_modules=mch, embedding_configs=raw)
        self.mc = ManagedCollisionEmbeddingBagCollection(EmbeddingBagCollection(tables=raw), mcc)
        self.ebc = EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name="t_ctx", num_embeddings=50, embedding_dim=8, feature_names=["ctx"])])  # fmt: skip


@pytest.fixture(scope="module")
def model() -> Model:
    return Model()


def _plain(tables: dict) -> dict:
    """The same tables without their collision modules."""
    return {fqn: [Table(t.name, t.num_embeddings, t.embedding_dim, features=t.features,
                        pooling_factor=t.pooling_factor) for t in group]
            for fqn, group in tables.items()}  # fmt: skip


def test_tables_from_model_reads_each_collision_module(model):
    tables = planners.tables_from_model(model, pooling_factors={"user": 2.0})
    assert list(tables) == ["mc._embedding_module", "ebc"]
    user, item = tables["mc._embedding_module"]
    assert user.managed_collision == ManagedCollision(1_001, 3, EvictionPolicy.LRU)
    assert item.managed_collision == ManagedCollision(301, 1, EvictionPolicy.DISTANCE_LFU)
    assert tables["ebc"][0].managed_collision is None


def test_collision_state_on_every_rank_as_split_by_slot(model):
    """Each rank holds its slots' entries (every world-th slot: Note [slots dealt round]; 16 B +
    8 B per metadata column) and its own ids' history over the interval (16 B per id); plain
    tables hold none."""
    world = 3
    tables = planners.tables_from_model(model, pooling_factors={"user": 2.0})
    plan = planners.plan(tables, Topology(world), batch_size=BATCH)
    stats = planners.plan_stats(plan, tables, Topology(world), batch_size=BATCH)
    plain = planners.plan_stats(plan, _plain(tables), Topology(world), batch_size=BATCH)
    for r in range(world):
        user_slots = len(range(r, 1_000, world))  # 334, 333, 333
        item_slots = len(range(r, 300, world))  # 100 each
        want = (user_slots * (16 + 8) + 3 * BATCH * 2.0 * 16  # LRU: last access; interval 3
                + item_slots * (16 + 16) + 1 * BATCH * 2 * 16)  # DistanceLFU: both; 2 features
        assert stats.ranks[r].collision_state == pytest.approx(want)
        assert plain.ranks[r].collision_state == 0 and plain.ranks[r].remap == 0
        # the held memory gains the state, the batch part the gathered ids (W n 32 B)
        gathered = world * BATCH * (2.0 + 2) * 32
        assert stats.ranks[r].held - plain.ranks[r].held == pytest.approx(want)
        assert stats.ranks[r].batch - plain.ranks[r].batch == pytest.approx(gathered)
        # the remap costs every rank the same, and the plan's shards as much as before
        assert stats.ranks[r].remap > 0
        assert stats.ranks[r].cost == pytest.approx(plain.ranks[r].cost + stats.ranks[r].remap)
    assert stats.lower_bound == pytest.approx(plain.lower_bound + stats.ranks[0].remap)
    assert stats.ranks[0].collision_state != stats.ranks[2].collision_state  # 334 vs 333 slots
    text = stats.format()
    assert "mc-remap" in text and "mc-state" in text
    assert "managed collisions: 2 tables (zch_size 1_001, 301)" in text
    assert "mc-state" not in plain.format() and "managed collisions" not in plain.format()


def test_remap_bytes_follow_the_ids_and_the_world():
    """Per id from each peer: 8 + 16 B on calls that do not evict (the ids' gather, the slots'
    all-reduce), plus per interval 1.25 x 24 B (ids, counts, last access in the id check, padded
    a quarter), 8 W B (every rank's slot of each of the interval's ids) and 24 B per lowest entry;
    nothing at world 1."""
    spec = ManagedCollision(100_001, eviction_interval=4)
    tables = [Table("t_raw", 100_001, 32, pooling_factor=5.0, managed_collision=spec)]
    for world in (1, 2, 8):
        stats = planners.plan_with_stats(tables, Topology(world), batch_size=BATCH).stats
        n = BATCH * 5.0
        lowest = min(world * n, math.ceil(100_000 / world))
        want = (world - 1) * (24 * n * 3 / 4 + (1.25 * 24 * n + 8 * world * n + 24 * lowest) / 4)
        assert stats.remap_bytes == pytest.approx(want)
        assert (stats.ranks[0].remap > 0) and (world > 1 or stats.remap_bytes == 0)


def test_the_search_keeps_room_for_the_collision_state():
    """A table whose weights fit but whose collision state does not is refused; without the
    collision module it is placed."""
    spec = ManagedCollision(4_000_001, eviction_policy="distance_lfu")
    mc = [Table("t_raw", 4_000_001, 4, managed_collision=spec)]
    plain = [Table("t_raw", 4_000_001, 4)]
    # weights 64 MB + row-wise Adagrad state 16 MB, split over the 2 ranks; the collision
    # state, 32 B per slot split over 2 ranks, 64 MB more on each: no split leaves room for it
    topology = Topology(2, device_memory="100MB", reserved_fraction=0.0)
    stats = planners.plan_with_stats(plain, topology, batch_size=BATCH).stats
    assert max(r.memory for r in stats.ranks) < topology.capacity < 40e6 + 64e6
    with pytest.raises(NoPlanError, match=r"each after 61.0 MiB of batch buffers and managed-collision state"):
        planners.plan(mc, topology, batch_size=BATCH, auto_tier=False)
    small = Topology(2, device_memory="60MB", reserved_fraction=0.0)  # less than the slots
    with pytest.raises(NoPlanError, match=r"the managed-collision tables' slots alone take 61.0 MiB "
                                          r"per rank; more ranks \(they split over every rank\)"):
        planners.plan(mc, small, batch_size=BATCH, auto_tier=False)
    roomy = Topology(2, device_memory="400MB", reserved_fraction=0.0)
    stats = planners.plan_with_stats(mc, roomy, batch_size=BATCH).stats
    assert max(r.memory for r in stats.ranks) <= roomy.capacity
    assert min(r.collision_state for r in stats.ranks) >= 2_000_000 * 32


def test_table_records_round_trip_and_refuse_a_wrong_zch_size():
    spec = ManagedCollision(500, eviction_interval=2, eviction_policy=EvictionPolicy.LFU)
    table = Table("t_raw", 500, 8, managed_collision=spec)
    assert table_from_record(table.to_dict()) == table
    assert table_from_record({"name": "t", "num_embeddings": 9, "embedding_dim": 4,
                              "managed_collision": "9"}).managed_collision == ManagedCollision(9)  # fmt: skip
    assert "managed_collision" not in Table("t_plain", 500, 8).to_dict()
    with pytest.raises(PlanError, match=r"table 't_raw': managed_collision zch_size 400 must equal num_embeddings 500"):
        Table("t_raw", 500, 8, managed_collision=ManagedCollision(400))
    with pytest.raises(PlanError, match="unknown eviction policy 'fifo'"):
        ManagedCollision(500, eviction_policy="fifo")


def test_cli_per_table_view_shows_zch_size(tmp_path, capsys):
    tables = tmp_path / "tables.yaml"
    tables.write_text(
        "- {name: t_raw, num_embeddings: 100000, embedding_dim: 64, features: [user_id],\n"
        "   managed_collision: {zch_size: 100000, eviction_interval: 2, eviction_policy: lru}}\n"
        "- {name: t_item, num_embeddings: 5000, embedding_dim: 64}\n"
    )
    plan_path = str(tmp_path / "plan.json")
    assert main(["plan", str(tables), "--world-size", "4", "--batch-size", "1024", "-o", plan_path]) == 0
    planned = capsys.readouterr().out
    assert main(["show", plan_path]) == 0
    shown = capsys.readouterr().out
    for out in (planned, shown):
        lines = out.splitlines()
        head = next(line for line in lines if line.startswith("table "))
        assert head.split()[-1] == "zch_size"
        assert next(line for line in lines if line.startswith("t_raw ")).split()[-1] == "100_000"
        assert next(line for line in lines if line.startswith("t_item ")).split()[-1] == "-"
        assert "managed collisions: 1 table (zch_size 100_000)" in out
        assert "mc-state" in out and "mc-remap" in out
    assert main(["show", plan_path, "--format", "csv"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert {r["table"]: r["zch_size"] for r in rows} == {"t_raw": "100000", "t_item": ""}


def test_calibrated_remap_is_the_measured_latencies_bytes_and_streaming():
    """Note [calibrated prices]: per step, one gather's latency (the ids' gather; at an interval
    the match's, the ids riding in the id check), and the all-reduce's on calls that do not evict,
    the bytes at the measured all-to-all rate, and the work
    at the measured streaming rate."""
    from tests.planners.test_calibration import _calibration

    spec = ManagedCollision(10_001, eviction_interval=2, eviction_policy="lfu")
    tables = [Table("t_raw", 10_001, 16, pooling_factor=3.0, managed_collision=spec)]
    topology = Topology(2, calibration=_calibration())
    stats = planners.plan_with_stats(tables, topology, batch_size=BATCH).stats
    n, usable = BATCH * 3.0, 10_000
    per_peer = 24 * n / 2 + (1.25 * 24 * n + 16 * n + 24 * min(2 * n, usable / 2)) / 2
    latency = 200e-6 + 300e-6 * (1 - 1 / 2)
    work = 2 * n * 8 * (math.log2(2 * n) + math.log2(usable / 2)) + 4 * usable / 2 * (16 + 8) / 2
    want = per_peer / 1e9 + latency + work / 20e9
    assert stats.ranks[0].remap == pytest.approx(want)
    assert stats.remap_bytes == pytest.approx(per_peer)
