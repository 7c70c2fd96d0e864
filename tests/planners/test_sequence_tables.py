"""Sequence tables (an EmbeddingCollection's): read from a model or a file, priced by the rows
of ids they return rather than by bags. Pure: no process group, no torch."""

from __future__ import annotations

import numpy as np
import pytest

from planners import CostModel, Optimizer, PlanError, ShardingType, Table, Topology
from planners.cost import TableArrays
from planners.files import load_tables
from planners.model_tables import tables_from_model

T = ShardingType
TOPO = Topology(16, ranks_per_host=8, device_memory_bandwidth=1e10, intra_host_bandwidth=1e9,
                cross_host_bandwidth=1e8)  # fmt: skip
MODEL = CostModel(TOPO, batch_size=100, optimizer=Optimizer.ROWWISE_ADAGRAD)
ALPHA = 7 / 1e9 + 8 / 1e8
# N = 1000 rows, d = 64, P = 20 ids per sample (the sequence length), F = 1 feature
SEQ = TableArrays.of([Table("s", 1000, 64, pooling_factor=20.0, sequence=True)])
BAG = TableArrays.of([Table("b", 1000, 64, pooling_factor=20.0)])


def shard(tables, kind, rows, cols, k=1):
    c = MODEL.shard(kind, tables, float(rows), float(cols), float(k))
    return {name: float(np.asarray(v).ravel()[0]) for name, v in c._asdict().items()}


def test_a_sequence_table_sends_a_row_per_id_back() -> None:
    seq, bag = shard(SEQ, T.TABLE_WISE, 1000, 64), shard(BAG, T.TABLE_WISE, 1000, 64)
    assert seq["output_dist"] == pytest.approx(2 * 100 * 20 * 64 * 4 * ALPHA)  # B * P rows of d fp32
    assert bag["output_dist"] == pytest.approx(2 * 100 * 1 * 64 * 4 * ALPHA)  # B * F bags
    assert seq["input_dist"] == bag["input_dist"]  # the same ids travel
    ids = 16 * 100 * 20
    fwd = ids * 64 * 4 + ids * 64 * 4  # read each id's row, write it out
    bwd = ids * 64 * 4 + ids * (2 * 64 * 4 + 2 * 4)
    assert seq["lookup"] == pytest.approx((fwd + bwd) / 1e10)


@pytest.mark.parametrize("kind", [T.ROW_WISE, T.TABLE_ROW_WISE])
def test_row_split_sequence_shards_send_only_their_own_ids_rows_whole(kind) -> None:
    # a quarter of the rows: a quarter of the ids, each row whole (no partial sums to reduce)
    c = shard(SEQ, kind, 250, 64, k=4)
    assert c["output_dist"] == pytest.approx(2 * 100 * 20 * 0.25 * 64 * 4 * ALPHA)


def test_column_pieces_send_their_columns_of_every_id() -> None:
    c = shard(SEQ, T.COLUMN_WISE, 1000, 16, k=4)
    assert c["output_dist"] == pytest.approx(2 * 100 * 20 * 16 * 4 * ALPHA)


def test_batch_buffers_hold_a_row_per_id() -> None:
    assert MODEL.batch_buffer_bytes(SEQ) == pytest.approx(100 * 20 * 8 + 2 * 100 * 20 * 64 * 4)
    assert MODEL.batch_buffer_bytes(BAG) == pytest.approx(100 * 20 * 8 + 2 * 100 * 1 * 64 * 4)


class _Config:
    def __init__(self, name, rows, dim, features):
        self.name, self.num_embeddings, self.embedding_dim = name, rows, dim
        self.feature_names, self.data_type = features, "fp32"


class _EC:
    def __init__(self, configs):
        self._configs = configs

    def embedding_configs(self):
        return self._configs


class _EBC:
    def __init__(self, configs):
        self._configs = configs

    def embedding_bag_configs(self):
        return self._configs


class _Model:
    def __init__(self, modules):
        self._modules = modules

    def named_modules(self):
        return [("", self), *self._modules.items()]


def test_tables_from_a_model_with_both_collections() -> None:
    model = _Model({
        "seq": _EC([_Config("item", 100, 8, ["history", "target"])]),
        "user": _EBC([_Config("user", 10, 8, ["user_id"])]),
    })  # fmt: skip
    tables = tables_from_model(model, pooling_factors={"history": 50.0})
    (item,), (user,) = tables["seq"], tables["user"]
    assert item.sequence and item.pooling_factors == (50.0, 1.0)
    assert not user.sequence and user.pooling_factors == (1.0,)


def test_sequence_tables_in_files_and_their_errors(tmp_path) -> None:
    path = tmp_path / "tables.yaml"
    path.write_text("- {name: s, num_embeddings: 10, embedding_dim: 4, pooling_factor: 30, sequence: true}\n"
                    "- {name: b, num_embeddings: 10, embedding_dim: 4}\n")
    s, b = load_tables(str(path))
    assert s.sequence and not b.sequence
    assert s.to_dict()["sequence"] is True and "sequence" not in b.to_dict()
    assert Table(**{k: v for k, v in s.to_dict().items() if k != "dtype"}) == Table("s", 10, 4, pooling_factor=30.0, sequence=True)
    with pytest.raises(PlanError, match="a sequence table .* has no per-id weights"):
        Table("s", 10, 4, weighted=True, sequence=True)


def test_the_cli_counts_sequence_tables(tmp_path, capsys) -> None:
    from planners.__main__ import main

    tables = tmp_path / "tables.yaml"
    tables.write_text(
        "- {name: item, num_embeddings: 100000, embedding_dim: 16, features: [history], pooling_factor: 50, sequence: true}\n"
        "- {name: user, num_embeddings: 5000, embedding_dim: 16, features: [user_id]}\n"
    )
    plan = tmp_path / "plan.json"
    assert main(["plan", str(tables), "--world-size", "2", "--batch-size", "64", "-o", str(plan)]) == 0
    assert "2 tables (1 sequence) on 2 ranks" in capsys.readouterr().out
