"""`Table.batch_fraction` (issue 37): a deduplicated feature's bags per sample. Pure, one process.

A feature with fraction f moves and looks up f x batch bags, so every cost and byte of its table
equals that of the same table at a batch f times as large; one number or one per feature;
refused above 1, at or below 0, on a sequence table; read from a tables file and written back."""

from __future__ import annotations

import numpy as np
import pytest

from planners import CostModel, Optimizer, PlanError, ShardingType, Table, Topology
from planners.cost import TableArrays
from planners.files import load_tables

TOPO = Topology(8, ranks_per_host=4)


def _costs(table: Table, batch: int, kind: ShardingType) -> dict[str, float]:
    model = CostModel(TOPO, batch_size=batch, optimizer=Optimizer.ROWWISE_ADAGRAD)
    arrays = TableArrays.of([table])
    cost = model.shard(kind, arrays, 500.0 if kind is ShardingType.ROW_WISE else 1000.0, 64.0, 2.0)
    out = {name: float(np.asarray(v).ravel()[0]) for name, v in cost._asdict().items()}
    out["batch_buffer"] = model.batch_buffer_bytes(arrays)
    return out


@pytest.mark.parametrize("kind", [ShardingType.TABLE_WISE, ShardingType.ROW_WISE, ShardingType.COLUMN_WISE, ShardingType.DATA_PARALLEL])
def test_a_fraction_prices_the_table_at_that_batch(kind: ShardingType) -> None:
    deduped = _costs(Table("t", 1000, 64, pooling_factor=3.0, batch_fraction=0.125), 1024, kind)
    smaller = _costs(Table("t", 1000, 64, pooling_factor=3.0), 128, kind)
    assert deduped == pytest.approx(smaller, rel=1e-12)
    full = _costs(Table("t", 1000, 64, pooling_factor=3.0), 1024, kind)
    assert deduped["lookup"] < full["lookup"] and (kind is ShardingType.DATA_PARALLEL or deduped["output_dist"] < full["output_dist"])


def test_one_fraction_per_feature() -> None:
    two = Table("t", 1000, 64, features=("user", "item"), pooling_factor=(1.0, 4.0), batch_fraction=(0.25, 1.0))
    assert two.batch_fractions == (0.25, 1.0)
    arrays = TableArrays.of([two])
    assert float(arrays.bags[0]) == 1.25 and float(arrays.ids[0]) == 0.25 + 4.0
    assert two.to_dict()["batch_fraction"] == [0.25, 1.0]
    assert "batch_fraction" not in Table("t", 10, 4).to_dict()  # plan files of old stay the same


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(batch_fraction=1.5), "at most 1 (one bag per sample)"),
        (dict(batch_fraction=0.0), "batch_fraction"),
        (dict(features=("a", "b"), batch_fraction=(0.5,)), "2 features ('a', 'b') but 1 batch fractions"),
        (dict(sequence=True, batch_fraction=0.5), "a sequence table (an EmbeddingCollection's) takes one bag per sample"),
    ],
)
def test_bad_fractions_are_refused_naming_the_table(kwargs, message: str) -> None:
    with pytest.raises(PlanError, match=None) as e:
        Table("t_user", 100, 8, **kwargs)
    assert "'t_user'" in str(e.value) and message in str(e.value), str(e.value)


def test_a_tables_file_carries_the_fraction(tmp_path) -> None:
    path = tmp_path / "tables.yaml"
    path.write_text("- {name: t_geo, num_embeddings: 50000, embedding_dim: 64, batch_fraction: 0.125}\n")
    (table,) = load_tables(str(path))
    assert table.batch_fractions == (0.125,)
