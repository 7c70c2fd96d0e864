"""planners.replan (issue 39): a plan for drifted tables within a budget of moved bytes, counted
as modular.reshard moves them. Pure, single-process."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import numpy as np
import pytest

import planners
from planners import Optimizer, ShardingType, Table, TablePlacement, Topology
from planners.__main__ import main
from planners.replan import adapt_placement, move_bytes
from tests.planners.helpers import synthetic

_T = ShardingType
BATCH = 512


def _drift(tables: list[Table], seed: int) -> list[Table]:
    rng = np.random.default_rng(seed)
    return [dataclasses.replace(t, pooling_factor=tuple(p * float(rng.uniform(0.2, 4.0))
                                                        for p in t.pooling_factors))
            for t in tables]  # fmt: skip


@pytest.fixture(scope="module")
def drifted():
    tables = synthetic(30, seed=1, max_rows=2e7)
    topology = Topology(16, ranks_per_host=8)
    old = planners.plan(tables, topology, batch_size=BATCH)
    return old, _drift(tables, 3), topology


def _placements(world: int) -> list[TablePlacement]:
    return [
        TablePlacement(_T.TABLE_WISE, (0,)), TablePlacement(_T.TABLE_WISE, (2,)),
        TablePlacement(_T.ROW_WISE, (0, 1, 2)), TablePlacement(_T.ROW_WISE, (1, 2), (7, 13)),
        TablePlacement(_T.COLUMN_WISE, (0, 1)), TablePlacement(_T.COLUMN_WISE, (2, 0, 1), (4, 8, 4)),
        TablePlacement(_T.TABLE_ROW_WISE, (0, 1)), TablePlacement(_T.DATA_PARALLEL),
    ]  # fmt: skip


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adagrad", "adam",
                                       "partial_rowwise_adam"])
def test_move_bytes_counts_what_reshard_moves(optimizer):
    """Every pair of placements at world 3: the bytes each rank receives and sends are those of
    modular.reshard's blocks that change rank (weights, per-element state in the weights' blocks,
    per-row state in row blocks), each at its bytes per element."""
    from modular.resharding.blocks import row_blocks, weight_blocks

    world, table = 3, Table("t", 20, 16, dtype="fp16")
    opt = Optimizer.parse(optimizer)
    per_row = int(opt.state_bytes_per_row(0))
    per_elem = 2 + int(opt.state_bytes_per_row(1)) - per_row
    for a, b in itertools.product(_placements(world), repeat=2):
        old = a.shards(num_embeddings=20, embedding_dim=16, world_size=world)
        new = b.shards(num_embeddings=20, embedding_dim=16, world_size=world)
        recv, sent = np.zeros(world, int), np.zeros(world, int)
        for blk in weight_blocks(0, old, new):
            if blk.moves:
                recv[blk.dst] += blk.numel * per_elem
                sent[blk.src] += blk.numel * per_elem
        if per_row:
            for blk in row_blocks(0, old, new, per_piece=False):
                if blk.moves:
                    recv[blk.dst] += blk.numel * per_row
                    sent[blk.src] += blk.numel * per_row
        got_recv, got_sent = move_bytes(table, a, b, world, optimizer)
        assert got_recv.tolist() == recv.tolist(), (a, b)
        assert got_sent.tolist() == sent.tolist(), (a, b)
        if a == b:
            assert got_recv.sum() == 0


def test_zero_budget_is_the_old_plan_repriced(drifted):
    old, tables, topology = drifted
    result = planners.replan(old, tables, topology, batch_size=BATCH, max_moved_bytes=0)
    assert result.plan == old
    assert result.moved_bytes == 0 and result.moves == ()
    again = planners.plan_stats(old, tables, topology, batch_size=BATCH)
    assert result.stats.max_cost == pytest.approx(again.max_cost, rel=1e-12)
    assert result.old_stats.max_cost == pytest.approx(again.max_cost, rel=1e-12)
    assert result.left  # the drift made plan() move tables that the budget keeps


def test_unlimited_budget_is_as_good_as_plan(drifted):
    old, tables, topology = drifted
    fresh = planners.plan_with_stats(tables, topology, batch_size=BATCH).stats
    for budget in (None, math.inf):
        result = planners.replan(old, tables, topology, batch_size=BATCH, max_moved_bytes=budget)
        assert result.stats.max_cost <= fresh.max_cost * (1 + 1e-12)
        assert result.stats.max_cost < result.old_stats.max_cost
        # renaming ranks keeps some bytes in place: it moves no more than plan()'s own ranks would
        plain = sum(int(move_bytes(t, old.placement("", t.name),
                                   planners.plan(tables, topology, batch_size=BATCH).placement("", t.name),
                                   16)[0].sum()) for t in tables)  # fmt: skip
        assert result.moved_bytes <= plain


def test_budget_is_respected_and_the_report_adds_up(drifted):
    old, tables, topology = drifted
    full = planners.replan(old, tables, topology, batch_size=BATCH, max_moved_bytes=None)
    gains = []
    for share in (0.02, 0.1, 0.3):
        budget = int(share * full.moved_bytes)
        r = planners.replan(old, tables, topology, batch_size=BATCH, max_moved_bytes=budget)
        assert r.moved_bytes <= budget
        assert r.stats.max_cost <= r.old_stats.max_cost
        # the bytes are the tables' own moves, as move_bytes counts them, per rank
        recv = sum(move_bytes(t, old.placement("", t.name), r.plan.placement("", t.name), 16)[0]
                   for t in tables)  # fmt: skip
        assert list(r.received) == recv.tolist()
        assert sum(r.sent) == sum(r.received) == sum(m.bytes for m in r.moves)
        moved = {m.name for m in r.moves}
        for t in tables:
            same = r.plan.placement("", t.name) == old.placement("", t.name)
            assert same == (t.name not in moved)
        stats = planners.plan_stats(r.plan, tables, topology, batch_size=BATCH)
        assert r.stats.max_cost == pytest.approx(stats.max_cost, rel=1e-12)
        assert r.bound == pytest.approx(stats.lower_bound, rel=1e-12)
        assert r.stats.slowest_rank.rank == stats.slowest_rank.rank
        assert not stats.over_capacity
        gains.append(r.old_stats.max_cost - r.stats.max_cost)
    assert gains[-1] > 0  # a third of the full move buys something
    text = r.format()
    assert f"slowest rank {r.old_stats.slowest_rank.rank} " in text
    assert "per rank (received / sent)" in text
    for m in r.moves:
        assert m.name in text and m.slowest_after < m.slowest_before


def test_new_rows_scale_the_old_shards():
    p = TablePlacement(_T.ROW_WISE, (0, 1, 2), (10, 20, 70))
    grown = adapt_placement(p, Table("t", 200, 8))
    assert grown.sizes == (20, 40, 140) and grown.ranks == p.ranks
    cw = adapt_placement(TablePlacement(_T.COLUMN_WISE, (0, 1), (4, 12)), Table("t", 10, 8))
    assert cw.sizes is None
    tables = [Table("a", 1000, 16, pooling_factor=5.0), Table("b", 1000, 16)]
    topology = Topology(2, ranks_per_host=2)
    old = planners.ShardingPlan(2, {"": {"a": p.__class__(_T.ROW_WISE, (0, 1), (300, 700)),
                                         "b": TablePlacement(_T.TABLE_WISE, (1,))}},
                                ranks_per_host=2)  # fmt: skip
    bigger = [dataclasses.replace(tables[0], num_embeddings=2000), tables[1]]
    r = planners.replan(old, bigger, topology, batch_size=64, max_moved_bytes=0)
    assert r.plan.placement("", "a").sizes == (600, 1400)


def test_refusals(drifted):
    old, tables, topology = drifted
    with pytest.raises(planners.PlanError, match="is not in the old plan"):
        planners.replan(old, tables + [Table("extra", 10, 8)], topology, batch_size=BATCH,
                        max_moved_bytes=0)  # fmt: skip
    with pytest.raises(planners.PlanError, match="places 30 tables but 29"):
        planners.replan(old, tables[:-1], topology, batch_size=BATCH, max_moved_bytes=0)
    with pytest.raises(planners.PlanError, match="reshard keeps the world size"):
        planners.replan(old, tables, Topology(8), batch_size=BATCH, max_moved_bytes=0)


def test_cli_replan(tmp_path, capsys):
    tables = tmp_path / "old.yaml"
    tables.write_text(
        "- {name: big, num_embeddings: 2000000, embedding_dim: 64, pooling_factor: 2}\n"
        "- {name: hist, num_embeddings: 1000000, embedding_dim: 64, pooling_factor: 10}\n"
        "- {name: mid, num_embeddings: 500000, embedding_dim: 32, pooling_factor: 4}\n"
        "- {name: small, num_embeddings: 100000, embedding_dim: 32, pooling_factor: 3}\n"
    )  # fmt: skip
    new = tmp_path / "new.yaml"
    new.write_text(tables.read_text().replace("pooling_factor: 10", "pooling_factor: 80"))
    old_json, new_json = tmp_path / "old.json", tmp_path / "new.json"
    args = ["--world-size", "4", "--ranks-per-host", "4", "--batch-size", "256"]
    assert main(["plan", str(tables), *args, "-o", str(old_json)]) == 0
    capsys.readouterr()
    assert main(["replan", str(old_json), "--tables", str(new), "--max-moved", "0"]) == 0
    out = capsys.readouterr().out
    assert "moved: 0 B" in out and "left in place" in out
    assert main(["replan", str(old_json), "--tables", str(new), "--max-moved", "20GiB",
                 "-o", str(new_json)]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert f"wrote {new_json}" in out
    plan, recorded = planners.files.load_plan(str(new_json))
    assert recorded["tables_path"] == str(new)
    old_plan, _ = planners.files.load_plan(str(old_json))
    loaded = planners.files.load_tables(str(new))
    topology = Topology(4, ranks_per_host=4)
    r = planners.replan(old_plan, loaded, topology, batch_size=256, max_moved_bytes=20 * 2**30)
    assert plan == r.plan and r.stats.max_cost < r.old_stats.max_cost
    assert f"{r.stats.max_cost * 1e6:.2f} us" in out
    for m in r.moves:
        assert m.name in out
    with pytest.raises(SystemExit) as exit_:
        main(["replan", str(old_json), "--tables", str(new), "--max-moved", "20"])
    assert exit_.value.code == 2
    assert "needs a unit" in capsys.readouterr().err
    json.loads(new_json.read_text())


def _hot_on_rank_0(kind: str = "table_wise") -> tuple[list[Table], planners.ShardingPlan, Topology]:
    """Rank 0 holds only `hot`, whose pooling factor grew tenfold; ranks 1-3 one table each, and
    `ctx` is data-parallel."""
    tables = [Table("hot", 2_000_000, 64, pooling_factor=40.0),
              *(Table(n, 1_000_000, 64, pooling_factor=4.0) for n in "abc"),
              Table("ctx", 50_000, 32, pooling_factor=2.0)]  # fmt: skip
    hot = (TablePlacement(_T.TABLE_WISE, (0,)) if kind == "table_wise"
           else TablePlacement(_T.COLUMN_WISE, (0, 1)))  # fmt: skip
    placements = {"hot": hot, "ctx": TablePlacement(_T.DATA_PARALLEL)}
    placements.update({n: TablePlacement(_T.TABLE_WISE, (r,)) for r, n in enumerate("abc", 1)})
    return tables, planners.ShardingPlan(4, {"": placements}, ranks_per_host=4), Topology(4, ranks_per_host=4)


def test_a_recut_wins_within_a_budget():
    """Moving `hot` whole costs more than the budget, so only cutting it anew can take load off
    rank 0: part of it is peeled onto other ranks, the rest stays where it is."""
    tables, old, topology = _hot_on_rank_0()
    whole = int(move_bytes(tables[0], old.placement("", "hot"), TablePlacement(_T.TABLE_WISE, (1,)), 4)[0].sum())
    # A data-parallel table sharded moves nothing (every rank holds it): a 1-byte budget takes it.
    r = planners.replan(old, tables, topology, batch_size=BATCH, max_moved_bytes=1)
    assert r.moved_bytes == 0 and r.plan.placement("", "ctx").sharding_type is not _T.DATA_PARALLEL
    assert r.plan.placement("", "hot") == old.placement("", "hot")
    floor = r.stats.max_cost  # the best that leaves `hot` whole: rank 0 holds nothing else
    for budget in (whole // 4, whole // 2):
        r = planners.replan(old, tables, topology, batch_size=BATCH, max_moved_bytes=budget)
        hot = r.plan.placement("", "hot")
        assert hot.sharding_type in (_T.ROW_WISE, _T.COLUMN_WISE) and 0 in hot.ranks, hot
        assert 0 < r.moved_bytes <= budget
        assert r.stats.max_cost < 0.9 * floor
        assert "cut anew" in r.format()
        # the report's bytes are the mover's: `hot`'s blocks that change rank
        recv = move_bytes(tables[0], old.placement("", "hot"), hot, 4)[0]
        assert r.received == tuple(int(x) for x in recv)
        stats = planners.plan_stats(r.plan, tables, topology, batch_size=BATCH)
        assert r.stats.max_cost == pytest.approx(stats.max_cost, rel=1e-12) and not stats.over_capacity
        floor = r.stats.max_cost  # a larger budget does better still
    unlimited = planners.replan(old, tables, topology, batch_size=BATCH, max_moved_bytes=None)
    assert unlimited.stats.max_cost <= r.stats.max_cost


def test_a_recut_keeps_constraints_and_per_piece_statistics():
    tables, old, topology = _hot_on_rank_0()
    budget = 2**30
    only_whole = {"hot": planners.TableConstraint(sharding_types=("table_wise",))}
    r = planners.replan(old, tables, topology, batch_size=BATCH, max_moved_bytes=budget,
                        constraints=only_whole)  # fmt: skip
    assert r.plan.placement("", "hot").sharding_type is _T.TABLE_WISE
    # Column pieces that keep their own row statistic take no other cut (modular.reshard refuses
    # one), though they may move; under the exact statistic the same pieces are cut anew.
    tables, old, topology = _hot_on_rank_0("column_wise")
    cuts = {}
    for statistic in ("per_shard", "exact"):
        r = planners.replan(old, tables, topology, batch_size=BATCH, max_moved_bytes=budget,
                            column_wise_statistic=statistic)  # fmt: skip
        hot = r.plan.placement("", "hot")
        cuts[statistic] = (hot.sharding_type, len(hot.ranks), hot.sizes)
    assert cuts["per_shard"] == (_T.COLUMN_WISE, 2, None)
    assert cuts["exact"] != cuts["per_shard"]


def test_the_walkthrough_tables_buy_more_with_a_larger_budget():
    """docs/planner.md's replan section: examples/tables_ranking.yaml planned for 16 ranks, then
    item_hist, query_terms, user_id and city drift; 1 GiB buys a re-cut plan, 8 GiB a better one."""
    tables = list(planners.files.load_tables("examples/tables_ranking.yaml"))
    topology = Topology(16, ranks_per_host=8, device_memory="80GiB")
    old = planners.plan(tables, topology, batch_size=1024)
    drift = {"item_hist": 3.0, "query_terms": 4.0, "user_id": 3.0, "city": 20.0}
    tables = [dataclasses.replace(t, pooling_factor=tuple(p * drift.get(t.name, 1.0) for p in t.pooling_factors))
              for t in tables]  # fmt: skip
    small, large = (planners.replan(old, tables, topology, batch_size=1024, max_moved_bytes=b * 2**30)
                    for b in (1, 8))  # fmt: skip
    assert small.moved_bytes <= 2**30 and large.moved_bytes <= 8 * 2**30
    assert large.stats.max_cost < small.stats.max_cost < 0.9 * small.old_stats.max_cost
    recut = [m for m in small.moves
             if (m.before.sharding_type, len(m.before.ranks)) != (m.after.sharding_type, len(m.after.ranks))
             or m.before.sizes != m.after.sizes]  # fmt: skip
    assert recut, small.format()
