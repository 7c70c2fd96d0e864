"""Where every looked-up row goes: back to its sample's rank, into its place in the output.

# Note [sequence output dist]
A rank that holds route r looked up every rank's ids of r, source rank by source rank (the input
dist's order, Note [routes]). It sends each source rank that rank's rows of each of its routes, in
route order, in one all-to-all of floats (`send_rows`); every rank therefore receives, in global
route order (routes are ordered by destination rank), its own ids' rows of every route, then adds
its data-parallel routes' rows. Each received float has one place in the output, which holds the
collection's outputs one after another ((ids of the output's feature, dim) each, all of one
dim): route r of output o carries rows `positions` of o's feature (all of them for whole-row
routes, the ids in its row range for row-wise ones, in batch order as the router sends them) and
columns [col_offset, col_offset + width). Routes of one output cover each of its (id, column)
pairs once (row-wise shards split the rows, column-wise pieces the columns), so one `index_copy`
makes the output: no partial sums, pieces concatenated by where they land. The index is per block
of `Placement.width` floats (a whole row unless column pieces cut it), not per float. Backward runs the same
way reversed: the output's gradient gathered at those places, one all-to-all back to the
routes' ranks (divided by the world size, Note [grad scaling across ranks]), into the kernels.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from modular.tables.layout import ROW_SPLIT, Layout, Route

__all__ = ["Placement", "place_rows", "send_rows"]


class Placement(NamedTuple):
    """Where this rank's ids' rows land in the output, for one batch."""

    counts: list[int]  # this rank's ids in each route: global routes, then local ones
    index: torch.Tensor  # for each arriving block of `width` floats, its block in the output
    rows_per_output: list[int]  # ids of each output's feature
    numel: int
    width: int  # floats per block: the gcd of the dim and every route's columns and offset


def place_rows(layout: Layout, values: torch.Tensor, feature_lengths: list[int]) -> Placement:
    """This rank's Placement for a batch whose features (in `layout.features` order) have
    `feature_lengths` ids, `values` their ids back to back."""
    starts = [0]
    for n in feature_lengths[:-1]:
        starts.append(starts[-1] + n)
    dim = layout.outputs[0].dim if layout.outputs else 0
    rows_per_output = [feature_lengths[layout.features.index(o.feature)] for o in layout.outputs]
    first_row = [0]
    for n in rows_per_output[:-1]:
        first_row.append(first_row[-1] + n)
    device = values.device
    routes = (*layout.routes, *layout.local)
    # Whole rows (table-wise, row-wise, data-parallel) place one index per row; column pieces
    # one per block of the widest width that tiles them all (as Note [arrival blocks] does).
    width = dim
    for r in routes:
        width = math.gcd(width, math.gcd(r.shard.num_cols, r.shard.col_offset))
    width = max(width, 1)
    blocks = dim // width
    counts, pieces = [], []
    for r in routes:
        f = r.feature
        ids = values[starts[f] : starts[f] + feature_lengths[f]]
        rows = _rows_of(layout, r, ids)
        counts.append(rows.numel())
        first = r.shard.col_offset // width
        cols = torch.arange(first, first + r.shard.num_cols // width, device=device)
        pieces.append(((first_row[r.output] + rows).unsqueeze(1) * blocks + cols).reshape(-1))
    index = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64, device=device)
    return Placement(counts, index, rows_per_output, sum(rows_per_output) * dim, width)


def _rows_of(layout: Layout, route: Route, ids: torch.Tensor) -> torch.Tensor:
    """The positions, among its feature's ids, of the ids `route` looks up (batch order)."""
    kind = layout.placements[layout.table_index(route.table)].sharding_type
    if kind not in ROW_SPLIT:
        return torch.arange(ids.numel(), device=ids.device)
    lo = route.shard.row_offset
    inside = (ids >= lo) & (ids < lo + route.shard.num_rows)
    return inside.nonzero().reshape(-1)


def send_rows(
    rows: list[torch.Tensor], per_source: list[list[int]], world: int
) -> tuple[torch.Tensor, list[int]]:
    """What this rank sends each source rank (Note [sequence output dist]): for each source, its
    rows of every route this rank holds, route by route; and the floats per source. `rows[r]`:
    route r's rows, source rank by source rank; `per_source[r][s]`: how many came from s."""
    cuts = [row.split(n) for row, n in zip(rows, per_source)]
    pieces, splits = [], []
    for s in range(world):
        mine = [c[s] for c in cuts]
        splits.append(sum(p.numel() for p in mine))
        pieces.extend(mine)
    if not pieces:
        return torch.zeros(0), splits
    if len({p.shape[1] for p in pieces}) == 1:  # one width (an EC's tables): one copy, no reshape
        return torch.cat(pieces).view(-1), splits
    return torch.cat([p.reshape(-1) for p in pieces]), splits
