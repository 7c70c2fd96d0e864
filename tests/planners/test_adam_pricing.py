"""What the Adam family costs the planner: the column pieces' exchange of whole-row statistics
(modular's MomentUpdates, modular/fused/moments.py: partial_rowwise's row sum of g**2, LAMB's
||w_row||**2 and ||update_row||**2, per touched row, to the table's other pieces) and the ways
out that a NoPlanError names for heavy optimizer state."""

from __future__ import annotations

import math

import numpy as np
import pytest

import planners
from planners import CostModel, NoPlanError, Optimizer, ShardingType, Table, Topology
from planners.cost import STAT_BYTES, TableArrays, column_stat_floats
from planners.inputs import ColumnWiseStatistic

T = ShardingType
# 16 ranks, 8 a host, round bandwidths (as in test_cost.py): the exchange crosses hosts at 1e8.
TOPO = Topology(16, ranks_per_host=8, device_memory_bandwidth=1e10, intra_host_bandwidth=1e9,
                cross_host_bandwidth=1e8)  # fmt: skip
TABLE = TableArrays.of([Table("t", 1000, 64, pooling_factor=2.0)])
IDS = 16 * 100 * 2  # a column piece looks up every rank's ids: W * B * P
# What each piece sends per touched row (modular/fused/moments.py, MomentUpdates.run).
FLOATS = {"adam": 0, "partial_rowwise_adam": 1, "lamb": 2, "partial_rowwise_lamb": 3}


def priced(optimizer: str, kind: ShardingType, cols: int, k: int, **kw) -> dict[str, float]:
    model = CostModel(TOPO, batch_size=100, optimizer=optimizer, **kw)
    c = model.shard(kind, TABLE, 1000.0, float(cols), float(k))
    return {name: float(np.asarray(v).ravel()[0]) for name, v in c._asdict().items()}


def test_floats_each_optimizer_exchanges_per_row():
    exact, per_shard = ColumnWiseStatistic.EXACT, ColumnWiseStatistic.PER_SHARD
    assert {n: column_stat_floats(Optimizer.parse(n), exact) for n in FLOATS} == FLOATS
    # modular always combines the Adam family's whole-row statistics (fuse_optimizer takes only
    # "exact" for them); row-wise Adagrad's exact statistic is one float, per_shard none.
    assert {n: column_stat_floats(Optimizer.parse(n), per_shard) for n in FLOATS} == FLOATS
    assert column_stat_floats(Optimizer.ROWWISE_ADAGRAD, exact) == 1
    assert column_stat_floats(Optimizer.ROWWISE_ADAGRAD, per_shard) == 0
    for other in (Optimizer.SGD, Optimizer.ADAGRAD):
        assert column_stat_floats(other, exact) == 0


@pytest.mark.parametrize("name", sorted(FLOATS))
def test_column_pieces_pay_their_row_statistics_exchange(name: str):
    whole, piece = priced(name, T.COLUMN_WISE, 64, 1), priced(name, T.COLUMN_WISE, 32, 2)
    half = priced(name, T.COLUMN_WISE, 32, 1)  # the same columns, not cut: nothing to exchange
    touched = 1000 * (1 - math.exp(-IDS / 1000))  # distinct rows of 3,200 uniform ids: 959.2
    assert touched < IDS
    assert whole["stat_exchange"] == half["stat_exchange"] == 0
    assert piece["stat_exchange"] == pytest.approx(touched * FLOATS[name] * STAT_BYTES / 1e8)
    # One pass (the emulation holds the sparse gradient; no second backward, no scratch
    # statistic): everything else is the uncut table's price of those columns.
    for part in ("lookup", "input_dist", "output_dist", "grad_sync", "memory", "replica_sync"):
        assert piece[part] == half[part], part
    assert priced(name, T.COLUMN_WISE, 32, 4) == piece  # whether cut, not how finely
    assert priced(name, T.COLUMN_WISE, 32, 2, column_wise_statistic="per_shard") == piece
    for kind, rows_k in ((T.TABLE_WISE, 1), (T.ROW_WISE, 4), (T.DATA_PARALLEL, 1)):
        assert priced(name, kind, 64, rows_k)["stat_exchange"] == 0, kind


def test_the_exchange_follows_the_floats_and_never_passes_the_ids():
    sends = [priced(n, T.COLUMN_WISE, 32, 2)["stat_exchange"] for n in sorted(FLOATS, key=FLOATS.get)]
    assert sends[0] == 0 and sends[1] > 0
    assert sends[2] == pytest.approx(2 * sends[1]) and sends[3] == pytest.approx(3 * sends[1])
    # A table looked up by far fewer ids than it has rows: about one row per id; by far more:
    # every row once.
    for rows, ids in ((10**7, 3200), (100, 3200)):
        table = TableArrays.of([Table("t", rows, 64, pooling_factor=2.0)])
        model = CostModel(TOPO, batch_size=100, optimizer="lamb")
        got = float(model.shard(T.COLUMN_WISE, table, float(rows), 32.0, 2.0).stat_exchange[0])
        assert got * 1e8 / (2 * STAT_BYTES) == pytest.approx(min(rows, ids), rel=1e-3)


def test_a_plan_prices_cut_tables_under_lamb_and_not_under_adam():
    tables = [Table("wide", 10_000, 128, pooling_factor=5.0)]
    plan = planners.ShardingPlan(4, {"": {"wide": planners.TablePlacement(T.COLUMN_WISE, (0, 1))}})
    stats = {n: planners.plan_stats(plan, tables, Topology(4), batch_size=128, optimizer=n)
             for n in FLOATS}  # fmt: skip
    assert all(r.stat_exchange == 0 for r in stats["adam"].ranks)
    lamb = stats["lamb"].ranks
    assert lamb[0].stat_exchange > 0 and lamb[1].stat_exchange > 0 and lamb[2].stat_exchange == 0
    assert lamb[0].stat_exchange == pytest.approx(2 * stats["partial_rowwise_adam"].ranks[0].stat_exchange)


def _too_big(optimizer: str) -> str:
    # 30 tables of 30M x 128 on 4 ranks of 72 GiB: too big under any optimizer
    tables = [Table(f"t{i}", 30_000_000, 128) for i in range(30)]
    with pytest.raises(NoPlanError) as e:
        planners.plan(tables, Topology(4), batch_size=512, optimizer=optimizer, auto_tier=False)
    return str(e.value)


def test_ways_out_name_the_optimizers_state_and_lighter_ones():
    lighter = {
        "adam": "less state than adam's 8c bytes per row of c columns: partial_rowwise_adam "
                "(4c + 4 bytes) or rowwise_adagrad (4 bytes)",
        "lamb": "less state than lamb's 8c bytes per row of c columns: partial_rowwise_lamb "
                "(4c + 4 bytes) or rowwise_adagrad (4 bytes)",
        "partial_rowwise_adam": "less state than partial_rowwise_adam's 4c + 4 bytes per row of "
                                "c columns: rowwise_adagrad (4 bytes)",
        "partial_rowwise_lamb": "less state than partial_rowwise_lamb's 4c + 4 bytes per row of "
                                "c columns: rowwise_adagrad (4 bytes)",
        "adagrad": "less state than adagrad's 4c bytes per row of c columns: rowwise_adagrad "
                   "(4 bytes)",
    }  # fmt: skip
    for name, way in lighter.items():
        assert way in _too_big(name), name
    for name in ("rowwise_adagrad", "sgd"):  # nothing lighter to suggest
        assert "less state than" not in _too_big(name), name
