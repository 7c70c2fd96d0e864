"""What a table's change of placement moves: blocks of rows x columns, each from one old shard to
the new shards that need it. Pure: shard specs in, blocks out, the same list on every rank.

Note [resharding in memory] (modular/resharding/__init__.py) says how the blocks travel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

from planners.types import ShardSpec

__all__ = ["Block", "piece_problem", "row_blocks", "weight_blocks"]


@dataclass(frozen=True)
class Block:
    """One rectangle of a table (or one row range of a row-wise statistic) that an old shard on
    rank `src` gives to the new shards `dst_shards` on rank `dst`: sent when the ranks differ,
    copied on the rank when they are the same."""

    table: int  # index in the module's layout
    src: int
    src_shard: int  # index of the old shard it is read from
    dst: int
    dst_shards: tuple[int, ...]  # new shards on `dst` it is written into (several: column pieces
    # that each keep a copy of the whole row's statistic)
    rows: tuple[int, int]  # [first, end) rows of the table
    cols: Optional[tuple[int, int]]  # [first, end) columns; None for a per-row statistic

    @property
    def moves(self) -> bool:
        return self.src != self.dst

    @property
    def numel(self) -> int:
        rows = self.rows[1] - self.rows[0]
        return rows if self.cols is None else rows * (self.cols[1] - self.cols[0])

    @property
    def shape(self) -> tuple[int, ...]:
        rows = self.rows[1] - self.rows[0]
        return (rows,) if self.cols is None else (rows, self.cols[1] - self.cols[0])


def _overlap(a0: int, a1: int, b0: int, b1: int) -> Optional[tuple[int, int]]:
    lo, hi = max(a0, b0), min(a1, b1)
    return (lo, hi) if lo < hi else None


def _pick(holders: list[tuple[int, int]], dst: int) -> tuple[int, int]:
    """The (rank, shard) a block is read from: `dst`'s own copy when it holds one (nothing moves),
    else the first holder's (a table's data-parallel copies, or column pieces that share a row
    statistic)."""
    for rank, j in holders:
        if rank == dst:
            return rank, j
    return holders[0]


def _holders(old: Iterable[ShardSpec], key) -> dict[tuple, list[tuple[int, int]]]:
    """Old shards grouped by `key(spec)`: shards with one key hold the same values."""
    out: dict[tuple, list[tuple[int, int]]] = {}
    for j, s in enumerate(old):
        if s.num_rows and s.num_cols:
            out.setdefault(key(s), []).append((s.rank, j))
    return out


def weight_blocks(
    table: int, old: tuple[ShardSpec, ...], new: tuple[ShardSpec, ...]
) -> list[Block]:
    """The blocks that fill every new shard of a table's weights (or of state laid out like
    them) from the old shards: each new shard's intersection with each old rectangle. An old
    plan's distinct rectangles cover the table once (data-parallel copies are one rectangle
    held by every rank), so each new element is written exactly once."""
    rects = _holders(old, lambda s: (s.row_offset, s.num_rows, s.col_offset, s.num_cols))
    blocks = []
    for jn, n in enumerate(new):
        for (r0, nr, c0, nc), holders in rects.items():
            rows = _overlap(r0, r0 + nr, n.row_offset, n.row_offset + n.num_rows)
            cols = _overlap(c0, c0 + nc, n.col_offset, n.col_offset + n.num_cols)
            if rows is None or cols is None:
                continue
            src, js = _pick(holders, n.rank)
            blocks.append(Block(table, src, js, n.rank, (jn,), rows, cols))
    return blocks


def row_blocks(
    table: int, old: tuple[ShardSpec, ...], new: tuple[ShardSpec, ...], *, per_piece: bool
) -> list[Block]:
    """The blocks that fill a per-row statistic (row-wise Adagrad's `row_sum`, partial_rowwise's
    `exp_avg_sq`) of every new shard. Every shard holds its rows' statistic of the whole row (a
    table's column pieces each keep a copy, Note [row statistics across column shards]), so any
    old shard over a row range is a source, and one block serves every new column piece of a
    rank over the same rows. With `per_piece` (column_wise_statistic="per_shard" on both plans)
    each piece keeps its own: only the old piece of the same columns is a source."""
    if per_piece:
        key = lambda s: (s.row_offset, s.num_rows, s.col_offset, s.num_cols)  # noqa: E731
    else:
        key = lambda s: (s.row_offset, s.num_rows)  # noqa: E731
    holders = _holders(old, key)
    wanted: dict[tuple, list[int]] = {}  # (dst rank, *key) -> its new shards
    for jn, n in enumerate(new):
        if n.num_rows and n.num_cols:
            wanted.setdefault((n.rank, *key(n)), []).append(jn)
    blocks = []
    for (dst, r0, nr, *cols), shards in wanted.items():
        for (o0, onr, *old_cols), hs in holders.items():
            if old_cols != cols:
                continue
            rows = _overlap(o0, o0 + onr, r0, r0 + nr)
            if rows is None:
                continue
            src, js = _pick(hs, dst)
            blocks.append(Block(table, src, js, dst, tuple(shards), rows, None))
    return blocks


def piece_problem(
    name: str, old: tuple[ShardSpec, ...], new: tuple[ShardSpec, ...], *, old_per_piece: bool,
    new_per_piece: bool,
) -> Optional[str]:
    """Why table `name`'s per-piece row statistics (column_wise_statistic="per_shard") cannot
    follow it to the new plan, or None. A piece's statistic covers its own columns, so it moves
    only to a piece of the same columns; a table that was not cut starts each new piece from
    the whole row's, as `modular.shard` of a fused unsharded table does."""
    if not old_per_piece:
        return None
    before = sorted({(s.col_offset, s.col_offset + s.num_cols) for s in old})
    after = sorted({(s.col_offset, s.col_offset + s.num_cols) for s in new})
    if new_per_piece and before == after:
        return None
    now = f"column pieces {after}" if new_per_piece else "no column pieces"
    return (
        f"table {name!r} keeps one row-wise Adagrad statistic per column piece "
        f"(column_wise_statistic='per_shard', pieces {before}), but the new plan gives it {now}; "
        "a piece's statistic covers its own columns only and cannot become another piece's or "
        "the whole row's. Keep the table column-wise with the same pieces (they may move to other "
        "ranks), or fuse with column_wise_statistic='exact'"
    )
