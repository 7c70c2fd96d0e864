"""Inputs: validation of tables, topology, constraints and byte sizes."""

from __future__ import annotations

import pytest

from planners import (
    DataType, PlanError, ShardingType, Table, TableConstraint, Topology, parse_bytes,
)  # fmt: skip


def test_table_defaults_to_one_feature_named_after_it():
    t = Table("t_user", 1000, 64)
    assert t.features == ("t_user",)
    assert t.pooling_factors == (1.0,)
    assert t.dtype is DataType.FP32 and t.weighted is False


def test_table_pooling_factor_is_broadcast_per_feature():
    t = Table("t", 10, 8, features=("a", "b"), pooling_factor=3)
    assert t.pooling_factors == (3.0, 3.0)


def test_table_pooling_factor_count_must_match_features():
    with pytest.raises(PlanError, match=r"'t' has 2 features .* but 3 pooling factors"):
        Table("t", 10, 8, features=("a", "b"), pooling_factor=(1.0, 2.0, 3.0))


@pytest.mark.parametrize("field,value", [("num_embeddings", 0), ("embedding_dim", -4),
                                         ("num_embeddings", 1.5), ("embedding_dim", True)])  # fmt: skip
def test_table_sizes_must_be_positive_integers(field, value):
    kwargs = {"name": "t_bad", "num_embeddings": 10, "embedding_dim": 8, field: value}
    with pytest.raises(PlanError, match=rf"table 't_bad': {field} must be a positive integer"):
        Table(**kwargs)


def test_table_dtype_parses_strings_and_rejects_unknown():
    assert Table("t", 10, 8, dtype="fp16").dtype is DataType.FP16
    with pytest.raises(PlanError, match="unknown dtype 'int3'"):
        Table("t", 10, 8, dtype="int3")


def test_topology_defaults_and_capacity():
    topo = Topology(4)
    assert topo.ranks_per_host == 4  # min(8, world size)
    assert topo.device_memory == 80 * 2**30
    assert topo.capacity == int(80 * 2**30 * 0.9)
    assert Topology(64, ranks_per_host=8, device_memory="40GiB").hosts == 8


def test_topology_must_leave_memory_for_tables():
    with pytest.raises(PlanError, match=r"device_memory 1 B less the reserved 10% leaves no memory for tables"):
        Topology(2, device_memory=1)
    assert Topology(2, device_memory=2, reserved_fraction=0).capacity == 2


def test_topology_world_must_be_whole_hosts():
    with pytest.raises(PlanError, match="world_size 12 is not a multiple of ranks_per_host 8"):
        Topology(12, ranks_per_host=8)


@pytest.mark.parametrize("text,expected", [("80GiB", 80 * 2**30), ("80 GB", 80 * 10**9),
                                           ("1.5e9", 1_500_000_000), (1024, 1024),
                                           ("512MiB", 512 * 2**20)])  # fmt: skip
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["80 parsecs", "", "-5GB", "GiB"])
def test_parse_bytes_rejects(text):
    with pytest.raises(PlanError, match="byte count|must be positive"):
        parse_bytes(text, "device_memory")


def test_constraint_parses_types_and_checks_bounds():
    c = TableConstraint(sharding_types=("row_wise", "CoLuMn_WiSe"), ranks=(3, 1))
    assert c.sharding_types == (ShardingType.ROW_WISE, ShardingType.COLUMN_WISE)
    assert c.ranks == (1, 3)
    assert c.allows(ShardingType.ROW_WISE) and not c.allows(ShardingType.TABLE_WISE)
    with pytest.raises(PlanError, match="max_shards 2 is below min_shards 3"):
        TableConstraint(min_shards=3, max_shards=2)
    with pytest.raises(PlanError, match="unknown sharding type 'diagonal'"):
        TableConstraint(sharding_types=("diagonal",))
