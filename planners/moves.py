"""What moving a table from one placement to another costs: the bytes each rank receives and
sends, counted as `modular.reshard` cuts its blocks (modular/resharding/blocks.py), and a placement
adapted to a table whose shape changed. `replan` (planners/replan.py, Note [a move within a
budget]) prices moves with these."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from planners.inputs import ColumnWiseStatistic, Optimizer, Table
from planners.types import ShardingType, ShardSpec, TablePlacement

__all__ = ["adapt_placement", "move_bytes", "per_piece_statistic", "shards_of"]

_T = ShardingType


def adapt_placement(placement: TablePlacement, table: Table) -> TablePlacement:
    """`placement` for `table`'s current shape: explicit row sizes that no longer sum to its
    rows are scaled to them (the last shard takes the rounding); column sizes that no longer
    sum to its width become an even split."""
    sizes = placement.sizes
    if sizes is None:
        return placement
    kind = placement.sharding_type
    total = table.embedding_dim if kind is _T.COLUMN_WISE else table.num_embeddings
    if sum(sizes) == total:
        return placement
    if kind is _T.COLUMN_WISE or total < len(sizes):
        return TablePlacement(kind, placement.ranks).with_tier_of(placement)
    scaled = [s * total // sum(sizes) for s in sizes[:-1]]
    scaled.append(total - sum(scaled))
    if min(scaled) < 1:
        return TablePlacement(kind, placement.ranks).with_tier_of(placement)
    return TablePlacement(kind, placement.ranks, tuple(scaled)).with_tier_of(placement)


def shards_of(p: TablePlacement, t: Table, world: int) -> tuple[ShardSpec, ...]:
    """The shards `p` gives table `t` on `world` ranks."""
    return p.shards(num_embeddings=t.num_embeddings, embedding_dim=t.embedding_dim,
                    world_size=world, table=t.name)  # fmt: skip


def _holders(shards: Sequence[ShardSpec], with_cols: bool) -> dict[tuple, list[int]]:
    out: dict[tuple, list[int]] = {}
    for s in shards:
        if s.num_rows and s.num_cols:
            key = (s.row_offset, s.num_rows) + ((s.col_offset, s.num_cols) if with_cols else ())
            out.setdefault(key, []).append(s.rank)
    return out


def per_piece_statistic(p: TablePlacement, optimizer: Optimizer, statistic: ColumnWiseStatistic) -> bool:
    """Whether the table's column pieces each keep their own row statistic (modular's
    `FusedTables.per_piece`): row-wise Adagrad under "per_shard", a table cut into columns."""
    return (optimizer is Optimizer.ROWWISE_ADAGRAD and statistic is ColumnWiseStatistic.PER_SHARD
            and p.sharding_type is _T.COLUMN_WISE and len(p.ranks) != 1)  # fmt: skip


def move_bytes(
    table: Table,
    before: TablePlacement,
    after: TablePlacement,
    world_size: int,
    optimizer: Optimizer | str = Optimizer.ROWWISE_ADAGRAD,
    column_wise_statistic: ColumnWiseStatistic | str = ColumnWiseStatistic.EXACT,
) -> tuple[np.ndarray, np.ndarray]:
    """Bytes each rank receives and sends when `table` goes from `before` to `after`: the
    blocks `modular.reshard` moves (modular/resharding/blocks.py), each new shard's overlap
    with each old rectangle that its rank does not hold, times the bytes of a weight and its
    per-element optimizer state; and the per-row state's row ranges likewise. A block is sent
    by the first rank holding it, as the mover reads it."""
    optimizer = Optimizer.parse(optimizer)
    statistic = ColumnWiseStatistic.parse(column_wise_statistic)
    recv = np.zeros(world_size, dtype=np.int64)
    sent = np.zeros(world_size, dtype=np.int64)
    old, new = shards_of(before, table, world_size), shards_of(after, table, world_size)
    elem = table.dtype.num_bytes
    per_row = int(optimizer.state_bytes_per_row(0, elem))
    per_elem = elem + int(optimizer.state_bytes_per_row(1, elem)) - per_row
    rects = _holders(old, with_cols=True)
    for n in new:
        for (r0, nr, c0, nc), ranks in rects.items():
            if n.rank in ranks:
                continue
            rows = min(r0 + nr, n.row_offset + n.num_rows) - max(r0, n.row_offset)
            cols = min(c0 + nc, n.col_offset + n.num_cols) - max(c0, n.col_offset)
            if rows > 0 and cols > 0:
                recv[n.rank] += rows * cols * per_elem
                sent[ranks[0]] += rows * cols * per_elem
    if per_row:
        pieces = per_piece_statistic(before, optimizer, statistic) and per_piece_statistic(after, optimizer, statistic)
        held = _holders(old, with_cols=pieces)
        for (dst, r0, nr, *cols) in {(n.rank, *k) for n in new
                                     for k in _holders([n], with_cols=pieces)}:  # fmt: skip
            for (o0, onr, *ocols), ranks in held.items():
                rows = min(o0 + onr, r0 + nr) - max(o0, r0)
                if ocols == cols and rows > 0 and dst not in ranks:
                    recv[dst] += rows * per_row
                    sent[ranks[0]] += rows * per_row
    return recv, sent
