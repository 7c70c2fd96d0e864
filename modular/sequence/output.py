"""Where every looked-up row goes: back to its sample's rank, into its place in the output.

# Note [sequence output dist]
A rank that holds route r looked up every rank's ids of r, source rank by source rank (the input
dist's order, Note [routes]). It sends each source rank that rank's rows of each of its routes, in
route order, in one all-to-all of floats (`RowGather`); every rank therefore receives, in global
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
Neither direction loops over routes in Python: `RowPlacer` makes the index (Note [placing rows
without a loop over routes]) and `RowGather` the send buffer (Note [gathering rows without a
loop over routes]).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence

import torch

from modular.kernels.base import Kernel
from modular.tables.layout import ROW_SPLIT, Layout

__all__ = ["Placement", "RowGather", "RowPlacer", "place_rows"]


class Placement(NamedTuple):
    """Where this rank's ids' rows land in the output, for one batch."""

    counts: list[int]  # this rank's ids in each route: global routes, then local ones
    index: torch.Tensor  # for each arriving block of `width` floats, its block in the output
    rows_per_output: list[int]  # ids of each output's feature
    numel: int
    width: int  # floats per block: the gcd of the dim and every route's columns and offset
    # floats arriving from each rank in the output dist (this rank's ids' rows of the global
    # routes each rank holds); None where nothing is sent
    arriving: Optional[list[int]] = None


class RowPlacer:
    """Makes each batch's `Placement` for one layout, with no loop over routes or features.

    # Note [placing rows without a loop over routes]
    Route r (global routes, then local ones) carries the ids of its feature f_r that fall in its
    row range [lo_r, hi_r) (every id for whole-row routes), in batch order, each as
    `blocks_r` blocks of `width` floats from block `first_r` of its row. So the index is built
    for all routes at once: every route's candidate positions 0..n_f - 1 laid end to end (one
    `repeat_interleave`), the row-split routes' ids outside their range dropped by one mask, and
    each kept (route, position) expanded to its blocks. The per-route loop this replaces ran
    about 14 Python calls per route (slices, aranges, a `nonzero` per row-wise piece); this runs
    the same few calls for 4 routes or 4,000 (tests/modular/test_step_python.py).
    """

    def __init__(self, layout: Layout) -> None:
        routes = (*layout.routes, *layout.local)
        self.dim = dim = layout.outputs[0].dim if layout.outputs else 0
        # Whole rows (table-wise, row-wise, data-parallel) place one index per row; column pieces
        # one per block of the widest width that tiles them all (as Note [arrival blocks] does).
        width = dim
        for r in routes:
            width = math.gcd(width, math.gcd(r.shard.num_cols, r.shard.col_offset))
        self.width = width = max(width, 1)
        self.blocks = dim // width
        self.num_routes = len(routes)
        self.num_global = len(layout.routes)
        self.world = layout.world_size
        long = dict(dtype=torch.int64)
        self._route_feature = torch.tensor([r.feature for r in routes], **long)
        self._route_output = torch.tensor([r.output for r in routes], **long)
        self._output_feature = torch.tensor(
            [layout.features.index(o.feature) for o in layout.outputs], **long
        )
        split = [
            layout.placements[layout.table_index(r.table)].sharding_type in ROW_SPLIT
            for r in routes
        ]
        self._any_split = any(split)
        self._lo = torch.tensor([r.shard.row_offset if s else 0 for r, s in zip(routes, split)], **long)
        self._hi = torch.tensor(
            [r.shard.row_offset + r.shard.num_rows if s else 2**62 for r, s in zip(routes, split)],
            **long,
        )
        self._first = torch.tensor([r.shard.col_offset // width for r in routes], **long)
        blocks = [r.shard.num_cols // width for r in routes]
        self._one_block = all(b == 1 for b in blocks)  # a block per row: no expansion
        self._blocks = torch.tensor(blocks, **long)
        # floats of one id's row per global route, and the rank holding it (output dist splits)
        self._route_rank = torch.tensor([r.shard.rank for r in layout.routes], **long)
        self._route_floats = torch.tensor([r.shard.num_cols for r in layout.routes], **long)
        self._on_device: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    def _statics(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        got = self._on_device.get(device)
        if got is None:
            got = self._on_device[device] = tuple(
                t.to(device) for t in (self._lo, self._hi, self._first, self._blocks)
            )
        return got

    def __call__(self, values: torch.Tensor, feature_lengths: list[int]) -> Placement:
        """This rank's Placement for a batch whose features (in the layout's order) have
        `feature_lengths` ids, `values` their ids back to back."""
        device = values.device
        lengths = torch.tensor(feature_lengths, dtype=torch.int64)
        rows_per_output = lengths[self._output_feature]
        numel = int(rows_per_output.sum()) * self.dim
        if self.num_routes == 0:
            empty = torch.zeros(0, dtype=torch.int64, device=device)
            return Placement([], empty, rows_per_output.tolist(), numel, self.width)
        feature_start = torch.cumsum(lengths, 0) - lengths
        first_row = torch.cumsum(rows_per_output, 0) - rows_per_output
        n = lengths[self._route_feature]  # candidate ids of each route
        total = int(n.sum())
        segment = torch.cumsum(n, 0) - n  # where each route's candidates start
        # (route, position in its feature) of every candidate, route-major, in batch order
        route = torch.repeat_interleave(torch.arange(self.num_routes), n, output_size=total)
        pos = torch.arange(total) - segment[route]
        route, pos = route.to(device), pos.to(device)
        lo, hi, first, blocks = self._statics(device)
        if self._any_split:
            ids = values[(feature_start[self._route_feature] - segment).to(device)[route]
                         + torch.arange(total, device=device)]  # fmt: skip
            keep = (ids >= lo[route]) & (ids < hi[route])
            route, pos = route[keep], pos[keep]
        counts = torch.bincount(route, minlength=self.num_routes)
        base = (first_row[self._route_output].to(device)[route] + pos) * self.blocks + first[route]
        if self._one_block:
            index = base
        else:
            per = blocks[route]
            k = int(per.sum())
            index = torch.repeat_interleave(base, per, output_size=k)
            index = index + torch.arange(k, device=device) - torch.repeat_interleave(
                torch.cumsum(per, 0) - per, per, output_size=k
            )
        counts_host = counts.cpu()
        arriving = None
        if self.num_global:
            arriving = torch.zeros(self.world, dtype=torch.int64).index_add_(
                0, self._route_rank, counts_host[: self.num_global] * self._route_floats
            ).tolist()
        return Placement(
            counts_host.tolist(), index, rows_per_output.tolist(), numel, self.width, arriving
        )


class RowGather:
    """Puts the rows a set of kernels looked up in the order the output dist sends them, in one
    copy per kernel and no loop over routes or sources.

    # Note [gathering rows without a loop over routes]
    The kernels take consecutive routes h = 0..H-1 of this rank, and route h's ids came from
    source ranks s = 0..S-1, n[h, s] of them, in that order (route by route, source by source,
    Note [sequence output dist]). A bags-of-one kernel returns (N, its routes' widths side by
    side), route h's i-th row in its row i (rows past its count are padding); a `nobag` kernel
    returns its routes' rows one after another. The send buffer wants, source by source, every
    route's rows from that source, route by route. Every row is cut in blocks of `width` floats
    (the gcd of the routes' widths), and each kernel's output goes into its place with one
    `index_copy_` whose destinations come from n alone: the block offset of (h, s) in the send
    buffer (a cumulative sum over (s, h)), and which (h, s) a kernel row belongs to (one
    `searchsorted` over the (h, s) segments' first rows). Padding rows go to one spare block past
    the end. Backward gathers each kernel's gradient at the same places (padding rows get
    zeros). With S = 1 (a world of one, or a rank's own data-parallel routes) the buffer is the
    routes' rows in route order.
    """

    def __init__(self, kernels: Sequence[Kernel]) -> None:
        widths = [r.shard.num_cols for k in kernels for r in k.group.routes]
        g = 0
        for w in widths:
            g = math.gcd(g, w)
        self.width = g = max(g, 1)
        self.num_routes = len(widths)
        long = dict(dtype=torch.int64)
        self._blocks = torch.tensor([w // g for w in widths], **long)
        self._kernels = []  # (first route, routes, nobag, route of each block column, block within)
        first = 0
        for k in kernels:
            routes = k.group.routes
            per = [r.shard.num_cols // g for r in routes]
            route_of = [first + h for h, b in enumerate(per) for _ in range(b)]
            within = [j for b in per for j in range(b)]
            self._kernels.append(
                (first, len(routes), k.nobag, torch.tensor(route_of, **long), torch.tensor(within, **long))
            )
            first += len(routes)
        self._on_device: dict[torch.device, list[tuple[torch.Tensor, ...]]] = {}

    def _statics(self, device: torch.device) -> tuple[torch.Tensor, list[tuple[torch.Tensor, ...]]]:
        got = self._on_device.get(device)
        if got is None:
            got = self._on_device[device] = [self._blocks.to(device)] + [
                (route_of.to(device), within.to(device)) for *_, route_of, within in self._kernels
            ]
        return got[0], got[1:]

    def __call__(self, outs: list[torch.Tensor], n: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """The send buffer (1-D) of the kernels' outputs `outs`, and the floats it holds for
        each source; `n`: (routes, sources) ids per route and source, int64 on the host."""
        sources = n.shape[1]
        per_pair = n * self._blocks.view(-1, 1)  # blocks of (h, s)
        splits = (per_pair.sum(0) * self.width).tolist()
        if not outs:
            return torch.zeros(0), splits
        device = outs[0].device
        by_source = per_pair.t().reshape(-1)
        offset = (torch.cumsum(by_source, 0) - by_source).view(sources, -1).t().reshape(-1)
        flat_n = n.reshape(-1)
        starts = torch.cumsum(flat_n, 0) - flat_n  # first row of (h, s), route-major
        counts_host = n.sum(1)
        total = int(per_pair.sum())
        blocks, columns = self._statics(device)
        offset, starts, counts = offset.to(device), starts.to(device), counts_host.to(device)
        route_start = starts[:: sources]
        places, padded = [], []
        for (first, k, nobag, *_), (route_of, within), out in zip(self._kernels, columns, outs):
            rows = out.shape[0]
            # a bags-of-one kernel's rows past a route's count are padding (none when every
            # route of the kernel has as many ids as the kernel has rows)
            pad = not nobag and k > 0 and int(counts_host[first:first + k].min()) < rows
            padded.append(pad)
            p = torch.arange(rows, device=device)
            if nobag:  # route-major rows, each of the kernel's one width
                key = (route_start[first] + p).unsqueeze(1)
                within = torch.arange(out.shape[1] // self.width, device=device)
            else:  # row p of each route's block columns
                key = route_start[route_of] + p.unsqueeze(1)  # (rows, block columns)
            if sources == 1 and not nobag:
                seg = route_of.expand_as(key)  # route h's one segment
            else:  # the (h, s) segment each row falls in
                seg = torch.searchsorted(starts, key.reshape(-1), right=True).view(key.shape) - 1
            place = offset[seg] + (key - starts[seg]) * blocks[seg // sources] + within
            if pad:  # padding rows (past their route's count) to the spare block
                place = torch.where(p.unsqueeze(1) < counts[route_of], place, total)
            places.append(place.reshape(-1))
        send = _Gather.apply(total, self.width, places, padded, *outs)
        return send.view(-1), splits


class _Gather(torch.autograd.Function):
    """`RowGather`'s copy: each kernel output's blocks to their places (the spare block past the
    end takes padding); backward gathers them back, padding zeroed."""

    @staticmethod
    def forward(ctx, total: int, width: int, places: list[torch.Tensor], padded: list[bool],
                *outs):  # type: ignore[override]  # fmt: skip
        ctx.places, ctx.padded, ctx.total = places, padded, total
        ctx.shapes = [o.shape for o in outs]
        send = outs[0].new_empty(total + 1, width)
        for place, out in zip(places, outs):
            send.index_copy_(0, place, out.reshape(-1, width))
        return send[:total]

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        grad = grad.contiguous()
        width = grad.shape[1]
        grads = []
        for place, pad, shape in zip(ctx.places, ctx.padded, ctx.shapes):
            if not pad:  # every row is a route's: a plain gather
                grads.append(grad.index_select(0, place).view(shape))
                continue
            padding = place == ctx.total
            g = grad.index_select(0, place.clamp(max=max(ctx.total - 1, 0))) if ctx.total else (
                grad.new_zeros(place.numel(), width))
            grads.append(g.masked_fill_(padding.unsqueeze(1), 0).view(shape))
        return (None, None, None, None, *grads)


def place_rows(flat: torch.Tensor, placement: Placement) -> torch.Tensor:
    """The output (1-D, `placement.numel` floats) with each arriving block of `flat` at its place.

    Every block of the output is some route's (Note [sequence output dist]: the routes of an
    output cover each of its (id, column) pairs once), so the output starts empty, not zeroed,
    and is written once; backward gathers the output's gradient at the same places."""
    g, blocks = placement.width, placement.numel // placement.width
    if placement.index.numel() != blocks:  # a layout bug, never a user's input
        raise RuntimeError(
            f"sequence output dist: {placement.index.numel()} arriving blocks of {g} floats for an "
            f"output of {blocks} blocks; the routes must cover the output once"
        )
    return _Place.apply(flat.view(-1, g), placement.index, blocks).view(-1)


class _Place(torch.autograd.Function):
    """`place_rows`' scatter into an empty output; backward gathers at the same places."""

    @staticmethod
    def forward(ctx, blocks: torch.Tensor, index: torch.Tensor, num_blocks: int):  # type: ignore[override]
        ctx.index = index
        return blocks.new_empty(num_blocks, blocks.shape[1]).index_copy_(0, index, blocks)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad.contiguous().index_select(0, ctx.index), None, None
