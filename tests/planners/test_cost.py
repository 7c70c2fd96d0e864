"""The cost model against numbers worked out by hand from the formulas in docs/planner.md."""

from __future__ import annotations

import numpy as np
import pytest

from planners import (
    ColumnWiseStatistic, CostModel, Optimizer, PlanError, ShardingType, Table, Topology,
)  # fmt: skip
from planners.cost import TableArrays

T = ShardingType
# W = 16 ranks, H = 8 per host, round bandwidths so the arithmetic is checkable by hand.
TOPO = Topology(16, ranks_per_host=8, device_memory_bandwidth=1e10, intra_host_bandwidth=1e9,
                cross_host_bandwidth=1e8)  # fmt: skip
MODEL = CostModel(TOPO, batch_size=100, optimizer=Optimizer.ROWWISE_ADAGRAD)
# N = 1000 rows, d = 64, P = 2 ids per sample, F = 1 bag per sample, fp32 (e = 4)
TABLE = TableArrays.of([Table("t", 1000, 64, pooling_factor=2.0)])
ALPHA = 7 / 1e9 + 8 / 1e8  # (H - 1) / intra + (W - H) / cross


def shard(kind, rows, cols, k=1):
    c = MODEL.shard(kind, TABLE, float(rows), float(cols), float(k))
    return {name: float(np.asarray(v).ravel()[0]) for name, v in c._asdict().items()}


def test_alpha():
    assert MODEL.alpha == pytest.approx(ALPHA)


def test_table_wise_shard():
    c = shard(T.TABLE_WISE, 1000, 64)
    assert c["input_dist"] == pytest.approx(100 * 2 * 4 * ALPHA)  # B * P * 4 bytes (int32) * alpha
    assert c["output_dist"] == pytest.approx(2 * 100 * 1 * 64 * 4 * ALPHA)  # fwd + bwd
    ids, bags = 16 * 100 * 2, 16 * 100 * 1  # W * B * P ids in, W * B * F bags out
    fwd = ids * 64 * 4 + bags * 64 * 4
    bwd = bags * 64 * 4 + ids * (2 * 64 * 4 + 2 * 4)  # rowwise adagrad: 4 bytes state per row
    assert c["lookup"] == pytest.approx((fwd + bwd) / 1e10)
    assert c["grad_sync"] == 0
    weights = 1000 * 64 * 4 + 1000 * 4
    buffers = ids * 4 + 2 * bags * 64 * 4  # routed ids are int32
    assert c["memory"] == pytest.approx(weights + buffers)


def test_row_wise_shard_pays_full_output_and_a_share_of_input():
    c = shard(T.ROW_WISE, 250, 64, k=4)
    assert c["input_dist"] == pytest.approx(100 * 2 * 0.25 * 4 * ALPHA)
    assert c["output_dist"] == pytest.approx(2 * 100 * 64 * 4 * ALPHA)


def test_routed_ids_are_int32_below_2_31_rows_and_carry_their_weights():
    def input_dist(table: Table) -> float:
        arrays = TableArrays.of([table])
        c = MODEL.shard(T.TABLE_WISE, arrays, float(table.num_embeddings), 64.0, 1.0)
        return float(np.asarray(c.input_dist).ravel()[0])

    B_P = 100 * 2  # ids each other rank sends per step
    assert input_dist(Table("t", 2**31 - 1, 64, pooling_factor=2.0)) == pytest.approx(B_P * 4 * ALPHA)
    assert input_dist(Table("t", 2**31, 64, pooling_factor=2.0)) == pytest.approx(B_P * 8 * ALPHA)
    weighted = Table("t", 1000, 64, pooling_factor=2.0, weighted=True)
    assert input_dist(weighted) == pytest.approx(B_P * (4 + 4) * ALPHA)


def test_data_parallel_holds_its_own_batch_as_int64():
    c = shard(T.DATA_PARALLEL, 1000, 64)
    ids, bags = 100 * 2, 100 * 1
    # fused (row-wise Adagrad): no dense gradient (Note [fused data-parallel copies] in
    # modular/fused/deferred.py), and fbgemm's replay keeps no gather buffers
    weights = 1000 * 64 * 4 + 1000 * 4
    assert c["memory"] == pytest.approx(weights + ids * 8 + 2 * bags * 64 * 4)
    assert c["gradients"] == 0 and c["buffers"] == 0


def test_table_row_wise_reduces_inside_the_host_first():
    c = shard(T.TABLE_ROW_WISE, 250, 64, k=4)
    bag_bytes = 100 * 64 * 4
    intra = 16 * bag_bytes * 3 / 4 / 1e9
    assert c["output_dist"] == pytest.approx(2 * (intra + bag_bytes * ALPHA / 4))


def test_data_parallel_all_reduces_the_whole_table():
    c = shard(T.DATA_PARALLEL, 1000, 64)
    assert c["input_dist"] == 0 and c["output_dist"] == 0
    assert c["grad_sync"] == pytest.approx(2 * 15 / 16 * 1000 * 64 * 4 / 1e8)  # W > H: cross


def test_column_shards_sum_to_the_table_plus_one_input_per_extra_shard():
    whole = shard(T.TABLE_WISE, 1000, 64)
    halves = [shard(T.COLUMN_WISE, 1000, 32) for _ in range(2)]
    for name in ("lookup", "output_dist"):
        # each column shard reads and writes its own rowwise state (4 bytes) for every id
        extra = 16 * 100 * 2 * (2 * 4) / 1e10 if name == "lookup" else 0
        assert sum(h[name] for h in halves) == pytest.approx(whole[name] + extra)
    assert sum(h["input_dist"] for h in halves) == pytest.approx(2 * whole["input_dist"])


def test_column_pieces_under_rowwise_adagrad_run_backward_twice_and_exchange_statistics():
    # modular's Note [row statistics across column shards]: a piece of a split table (k > 1)
    # runs its backward a second time, keeps a scratch statistic per row and sends one fp32 per
    # id to the other pieces; a table-wise table (one piece) does not.
    whole, piece = shard(T.COLUMN_WISE, 1000, 32, k=1), shard(T.COLUMN_WISE, 1000, 32, k=2)
    ids, bags = 16 * 100 * 2, 16 * 100 * 1
    bwd = bags * 32 * 4 + ids * (2 * 32 * 4 + 2 * 4)
    assert piece["lookup"] == pytest.approx(whole["lookup"] + bwd / 1e10)
    assert whole["stat_exchange"] == 0 and piece["grad_sync"] == 0  # no data-parallel sync
    assert piece["stat_exchange"] == pytest.approx(ids * 4 / 1e8)  # W > H: cross-host bandwidth
    assert piece["memory"] == pytest.approx(whole["memory"] + 1000 * 4)
    assert shard(T.COLUMN_WISE, 1000, 32, k=4) == piece  # whether split, not how finely
    assert shard(T.TABLE_WISE, 1000, 32, k=1) == whole
    for other in (Optimizer.SGD, Optimizer.ADAGRAD):  # one pass whatever the split
        model = CostModel(TOPO, batch_size=100, optimizer=other)
        one, two = (model.shard(T.COLUMN_WISE, TABLE, 1000.0, 32.0, float(k)) for k in (1, 2))
        assert float(one.total[0]) == pytest.approx(float(two.total[0]))
        assert float(one.memory[0]) == pytest.approx(float(two.memory[0]))


def test_batch_buffers_are_every_ranks_own_ids_and_bags():
    assert MODEL.batch_buffer_bytes(TABLE) == pytest.approx(100 * 2 * 8 + 2 * 100 * 64 * 4)


PER_SHARD = CostModel(TOPO, batch_size=100, optimizer=Optimizer.ROWWISE_ADAGRAD,
                      column_wise_statistic="per_shard")  # fmt: skip


def priced(model: CostModel, kind, rows, cols, k=1) -> dict[str, float]:
    c = model.shard(kind, TABLE, float(rows), float(cols), float(k))
    return {name: float(np.asarray(v).ravel()[0]) for name, v in c._asdict().items()}


def test_per_shard_column_pieces_pay_no_second_pass_no_scratch_and_no_exchange():
    # fuse_optimizer(..., column_wise_statistic="per_shard"): each piece keeps its own columns'
    # statistic and runs one plain fused pass, so a piece costs exactly what the exact mode
    # charges it less the second backward, the scratch statistic and the exchange.
    exact = shard(T.COLUMN_WISE, 1000, 32, k=2)
    per_shard = priced(PER_SHARD, T.COLUMN_WISE, 1000, 32, k=2)
    ids, bags = 16 * 100 * 2, 16 * 100 * 1
    second_pass = (bags * 32 * 4 + ids * (2 * 32 * 4 + 2 * 4)) / 1e10
    exchange = ids * 4 / 1e8  # one fp32 per id over the cross-host link (W > H)
    assert exact["lookup"] - per_shard["lookup"] == pytest.approx(second_pass)
    assert exact["stat_exchange"] == pytest.approx(exchange) and per_shard["stat_exchange"] == 0
    assert exact["grad_sync"] == per_shard["grad_sync"] == 0
    assert exact["memory"] - per_shard["memory"] == pytest.approx(1000 * 4)  # the scratch
    for name in ("input_dist", "output_dist"):
        assert per_shard[name] == exact[name]
    # a piece is priced like a table of its own columns: whether cut or not, and how finely
    whole = priced(PER_SHARD, T.COLUMN_WISE, 1000, 32, k=1)
    assert priced(PER_SHARD, T.COLUMN_WISE, 1000, 32, k=4) == per_shard == whole
    assert whole == shard(T.COLUMN_WISE, 1000, 32, k=1)


@pytest.mark.parametrize("kind,rows,cols,k", [(T.TABLE_WISE, 1000, 64, 1), (T.ROW_WISE, 250, 64, 4),
                                              (T.TABLE_ROW_WISE, 250, 64, 4),
                                              (T.DATA_PARALLEL, 1000, 64, 1)])  # fmt: skip
def test_the_column_statistic_changes_no_other_sharding_type(kind, rows, cols, k):
    assert priced(PER_SHARD, kind, rows, cols, k) == shard(kind, rows, cols, k)


def test_the_column_statistic_changes_nothing_under_other_optimizers():
    for other in (Optimizer.SGD, Optimizer.ADAGRAD, Optimizer.ADAM):
        exact = CostModel(TOPO, batch_size=100, optimizer=other)
        per_shard = CostModel(TOPO, batch_size=100, optimizer=other,
                              column_wise_statistic="per_shard")  # fmt: skip
        for k in (1, 2):
            one, two = (priced(m, T.COLUMN_WISE, 1000, 32, k) for m in (exact, per_shard))
            assert one == two


def test_column_statistic_is_keyword_only_parsed_and_checked():
    assert MODEL.column_wise_statistic is ColumnWiseStatistic.EXACT  # the default
    assert PER_SHARD.column_wise_statistic is ColumnWiseStatistic.PER_SHARD
    assert CostModel(TOPO, 100, column_wise_statistic=" Per_Shard ") == PER_SHARD
    with pytest.raises(TypeError):
        CostModel(TOPO, 100, Optimizer.ROWWISE_ADAGRAD, "per_shard")  # type: ignore[misc]
    with pytest.raises(PlanError, match=r"unknown column_wise_statistic 'approx'; "
                                        r"expected one of: exact, per_shard$"):  # fmt: skip
        CostModel(TOPO, 100, column_wise_statistic="approx")
