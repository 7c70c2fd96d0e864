"""Column pieces under optimizers whose statistics span whole rows: what a piece sends to the
table's other pieces per step, and the scratch statistic a rank's pieces keep (Note [what a rank
holds] in planners/cost.py prices both into a shard and a rank).
"""

from __future__ import annotations

from typing import Sequence

from planners.inputs import ColumnWiseStatistic, Optimizer

__all__ = ["STAT_BYTES", "column_scratch_bytes", "column_stat_floats"]

STAT_BYTES = 4  # a column piece's row statistic (row-wise Adagrad, exact), one fp32 per id


def column_stat_floats(optimizer: Optimizer, statistic: ColumnWiseStatistic) -> int:
    """FP32 values per row that a column piece of a table sends to the table's other pieces at
    the end of backward, so that each piece updates with statistics of the whole row (modular's
    Note [row statistics across column shards] and Note [fused Adam and LAMB]):
    exact row-wise Adagrad 1 (the row's sum of g**2 over the piece's columns; per id),
    partial_rowwise_adam 1 (the same, for its row-wise second moment), lamb 2 (the piece's parts
    of ||w_row||**2 and ||update_row||**2), partial_rowwise_lamb 3 (all three); 0 for the rest
    (per-element statistics, or row-wise Adagrad keeping each piece's own under "per_shard")."""
    if optimizer is Optimizer.ROWWISE_ADAGRAD:
        return 1 if statistic is ColumnWiseStatistic.EXACT else 0
    return {
        Optimizer.PARTIAL_ROWWISE_ADAM: 1, Optimizer.LAMB: 2, Optimizer.PARTIAL_ROWWISE_LAMB: 3,
    }.get(optimizer, 0)  # fmt: skip


def column_scratch_bytes(optimizer: Optimizer, statistic: ColumnWiseStatistic,
                         pieces: Sequence[tuple[int, int, str, bool]]) -> float:  # fmt: skip
    """Bytes of the scratch statistic that one rank's column pieces keep under exact row-wise
    Adagrad: `pieces` are (rows, cols, dtype, sequence) of each column piece (of a table cut in
    k > 1) on the rank. Pass 1 of Note [row statistics across column shards] reads a pooling
    kernel where a kernel group's pieces have one width, and otherwise runs fbgemm's backward
    into a scratch state as large as the group's row-wise state (one fp32 per row of each of
    its pieces), made on first use and kept. A rank's pooled column pieces form one kernel group
    per weights' dtype (pieces of a width fbgemm cannot take, emulated, one of their own; a
    sequence group has one width), as modular/tables/layout.py's `kernel_groups` cuts them."""
    if optimizer is not Optimizer.ROWWISE_ADAGRAD or statistic is not ColumnWiseStatistic.EXACT:
        return 0.0
    groups: dict[str, list[tuple[int, int]]] = {}
    for rows, cols, dtype, sequence in pieces:
        if not sequence and cols % 4 == 0:
            groups.setdefault(dtype, []).append((rows, cols))
    return float(sum(STAT_BYTES * sum(r for r, _ in g) for g in groups.values()
                     if len({c for _, c in g}) > 1))  # fmt: skip
