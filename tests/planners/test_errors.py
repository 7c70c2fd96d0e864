"""Infeasible inputs: the error names the tables, gives the numbers and the ways out."""

from __future__ import annotations

import pytest

import planners
from planners import NoPlanError, ShardingType, Table, TableConstraint, Topology

T = ShardingType


def test_table_too_big_for_its_allowed_shards_names_it_and_the_rank_count():
    # 4e9 rows x 128 x 4 bytes + 4 bytes of state per row = 1922 GiB; at most 4 shards of 72 GiB
    tables = [Table("t_huge", 4_000_000_000, 128), Table("t_small", 1000, 16)]
    cons = {"t_huge": TableConstraint(max_shards=4)}
    with pytest.raises(NoPlanError) as e:
        planners.plan(tables, Topology(32), batch_size=512, constraints=cons)
    msg = str(e.value)
    assert e.value.tables == ("t_huge",)
    assert "'t_huge' (4_000_000_000 rows x 128, fp32, 1.9 TiB with optimizer state)" in msg
    assert "smallest allowed shard needs 480.6 GiB but a rank has" in msg
    assert "raise max_shards above 4" in msg
    assert "row_wise over 27+ ranks" in msg  # ceil(1922 GiB / 72 GiB)
    assert "smaller batch" not in msg  # its buffers are tiny next to its weights


def test_table_wise_only_constraint_suggests_row_wise():
    tables = [Table("t_user", 200_000_000, 128)]  # 95 GiB of weights
    cons = {"t_user": TableConstraint(sharding_types=(T.TABLE_WISE,))}
    with pytest.raises(NoPlanError, match="allow row_wise for 't_user'") as e:
        planners.plan(tables, Topology(8), batch_size=512, constraints=cons)
    assert e.value.tables == ("t_user",)
    assert "no plan fits: 1 table cannot fit on any rank" in str(e.value)


def test_total_memory_too_small_says_how_many_ranks():
    # 30 tables of 14.9 GiB each (with rowwise adagrad state): 447 GiB on 4 x 72 GiB
    tables = [Table(f"t{i}", 30_000_000, 128) for i in range(30)]
    with pytest.raises(NoPlanError) as e:
        planners.plan(tables, Topology(4), batch_size=512)
    msg = str(e.value)
    assert msg.startswith("no plan fits: the tables need ")
    assert "use at least 7 ranks" in msg
    assert "largest: t0 (" in msg
    assert len(e.value.tables) == 5


def test_batch_buffers_alone_too_big_suggests_a_batch_size():
    tables = [Table(f"t{i}", 1000, 256, pooling_factor=500.0) for i in range(50)]
    with pytest.raises(NoPlanError, match=r"batch buffers .* use a batch size of at most \d+"):
        planners.plan(tables, Topology(2, device_memory="4GiB"), batch_size=200_000)


def test_pinned_tables_that_cannot_share_a_rank():
    # each 45 GiB of weights, both pinned to rank 0 of 72 GiB
    tables = [Table("t_a", 90_000_000, 128), Table("t_b", 90_000_000, 128, features=("b",))]
    cons = {name: TableConstraint(ranks=(0,)) for name in ("t_a", "t_b")}
    with pytest.raises(NoPlanError) as e:
        planners.plan(tables, Topology(2), batch_size=64, constraints=cons)
    msg = str(e.value)
    assert "found no rank with room left" in msg
    assert "pinned to ranks [0]" in msg
    assert len(e.value.tables) == 1 and e.value.tables[0] in ("t_a", "t_b")
