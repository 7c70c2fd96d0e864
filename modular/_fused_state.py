"""How a fused table's optimizer state is laid out, and why a saved layout may not fit.

See Note [fused tables] in modular/optim.py.
"""

from __future__ import annotations

import enum
from typing import Optional

import torch
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import ShardedTensor

from modular.optim import ColumnWiseStatistic
from planners.types import ShardSpec


class StateForm(enum.Enum):
    """How a table's optimizer state is laid out (Note [fused tables] in modular/optim.py)."""

    WEIGHT = "weight"  # like the weight (Adagrad's `sum`)
    ROWS = "rows"  # one value per row (row-wise Adagrad)
    PIECES = "pieces"  # one per row and column piece: (rows, pieces), column j is piece j's

    def shape(self, table, pieces: int) -> tuple[int, ...]:
        rows = table.num_embeddings
        return {
            StateForm.WEIGHT: (rows, table.embedding_dim),
            StateForm.ROWS: (rows,),
            StateForm.PIECES: (rows, pieces),
        }[self]

    def offsets(self, spec: ShardSpec, pieces: dict[int, int]) -> list[int]:
        """Where shard `spec`'s state starts in the table's state."""
        if self is StateForm.WEIGHT:
            return [spec.row_offset, spec.col_offset]
        if self is StateForm.ROWS:
            return [spec.row_offset]
        return [spec.row_offset, pieces[spec.col_offset]]

    def region(self, spec: ShardSpec, pieces: dict[int, int]) -> tuple:
        """Shard `spec`'s state in the table's whole state tensor (an index)."""
        rows = slice(spec.row_offset, spec.row_offset + spec.num_rows)
        if self is StateForm.WEIGHT:
            return rows, slice(spec.col_offset, spec.col_offset + spec.num_cols)
        if self is StateForm.ROWS:
            return (rows,)
        return rows, pieces[spec.col_offset]

    def shard(self, m: ShardMetadata, pieces: dict[int, int]) -> Optional[ShardMetadata]:
        """The state's shard for the weight's shard `m`; None for a row-wise table's column
        shards after the first, which hold copies of the first one's rows."""
        (row, col), (rows, _) = m.shard_offsets, m.shard_sizes
        if self is StateForm.WEIGHT:
            return m
        if self is StateForm.ROWS:
            return None if col != 0 else ShardMetadata([row], [rows], m.placement)
        return ShardMetadata([row, pieces[col]], [rows, 1], m.placement)


def column_statistic_mismatch(
    what: str,
    got: tuple[int, ...],
    expected: tuple[int, ...],
    statistic: ColumnWiseStatistic,
    dim: int,
) -> Optional[str]:
    """Why row-wise Adagrad state of shape `got` cannot load where shape `expected` is kept, if
    the two differ in column pieces only: one statistic per row (exact, or a table not cut into
    column pieces) against one per row and piece (`column_wise_statistic="per_shard"`), or
    another number of pieces. None when they differ otherwise (another table size, or a state
    as wide as the `dim`-column table, Adagrad's)."""
    if got == expected or {len(got), len(expected)} - {1, 2} or got[0] != expected[0]:
        return None
    if any(len(shape) == 2 and shape[1] >= dim for shape in (got, expected)):
        return None
    exact = statistic is ColumnWiseStatistic.EXACT

    def held(shape: tuple[int, ...]) -> str:
        if len(shape) == 1:
            return "one statistic per row, over all its columns"
        return f"one statistic per row for each of {shape[1]} column pieces"

    if len(got) == 1:
        saved = "column_wise_statistic='exact', or the table not cut into column pieces"
    else:
        saved = "column_wise_statistic='per_shard' on a plan that cut the table so"
    if len(expected) == 2:
        keeps = "column_wise_statistic='per_shard' on this plan"
    elif exact:
        keeps = "column_wise_statistic='exact'"
    else:
        keeps = "this plan does not cut the table into column pieces"
    if len(expected) == 2 and len(got) == 1:
        fix = (
            "fuse with column_wise_statistic='exact', or shard the table without cutting its "
            "columns, to load it (a piece's own statistic cannot be recovered from the whole "
            "row's)"
        )
    elif exact:
        fix = (
            f"fuse with column_wise_statistic='per_shard' and shard the table into {got[1]} "
            "column pieces, as when it was saved, to load it"
        )
    else:
        fix = (
            f"shard the table into {got[1]} column pieces, as when it was saved, to load it "
            "(per-piece statistics belong to the pieces that made them)"
        )
    return (
        f"{what} has shape {got}, {held(got)} ({saved}), but this optimizer keeps {expected}, "
        f"{held(expected)} ({keeps}); {fix}"
    )


def local_piece(
    source: ShardedTensor, form: StateForm, spec: ShardSpec, pieces: dict[int, int]
) -> Optional[torch.Tensor]:
    """The local shard of `source` that holds `spec`'s state, or None (row-wise column copies)."""
    want = form.offsets(spec, pieces)
    for shard in source.local_shards():
        if list(shard.metadata.shard_offsets) == want:
            return shard.tensor
    if form is StateForm.ROWS and spec.col_offset != 0:
        return None
    raise ValueError(
        f"optimizer state has no local shard at offsets {want}; load it through "
        "modular.checkpoint (DCP reshards it to this plan)"
    )
