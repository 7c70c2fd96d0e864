"""The pooled part of a step whose features have their own bag counts (`KindPart` in
modular/parts.py; Note [variable batch per feature] in modular/routing/variable_batch.py): padded
kernel batches, each rank sent only its own bags, and the deduplicated output expanded to the
batch on arrival. The indices that depend on the strides alone are made once per distinct
strides (`VariableBags.indices`); a step makes only the expansion's, from its inverse indices."""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from modular.comm import KeptBuffers
from modular.kernels.base import pool
from modular.kernels.lookups import batch_offsets
from modular.local_shards import LocalShards
from modular.parts import Wire
from modular.pooled.pooled_part import keyed_output
from modular.routing.received import Received
from modular.routing.variable_batch import VariableBatch, bag_positions, element_positions
from modular.tables.layout import RankLayout

__all__ = ["VariableBags"]

_KEPT_STRIDES = 64  # distinct strides whose indices a module keeps; more start it afresh


class _Gather(torch.autograd.Function):
    """Rows of `source` (n, unit) at `index`; backward adds each gradient row back into a zeroed
    (n, unit). Both into kept buffers: a step makes two gathers of the output's size, and fresh
    tensors that size cost page faults on CPU (Note [kept receive buffers] in modular/comm.py)."""

    @staticmethod
    def forward(ctx, source, index, buffers: KeptBuffers, key: str):  # type: ignore[override]
        unit = source.shape[1]
        out = buffers.empty(key, index.numel() * unit, source).view(-1, unit)
        torch.index_select(source, 0, index, out=out)
        ctx.save_for_backward(index)
        ctx.rows, ctx.buffers, ctx.key = source.shape[0], buffers, key
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (index,) = ctx.saved_tensors
        unit = grad.shape[1]
        out = ctx.buffers.empty(ctx.key + " grad", ctx.rows * unit, grad).view(-1, unit).zero_()
        return out.index_add_(0, index, grad.contiguous()), None, None, None


def _long(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _starts(sizes: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(sizes, 0) - sizes


def _unit_sources(blocks, outputs, unit: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each output unit (outputs in order, `unit` columns each), where every output column
    arrives in one block: that block, the unit's place within a row of it, and its width in
    units."""
    block_of, offset, step = [], [], []
    for o, out in enumerate(outputs):
        for col in range(0, out.dim, unit):
            k = next(
                k for k, r in enumerate(blocks)
                if r.output == o and r.shard.col_offset <= col < r.shard.col_offset + r.shard.num_cols
            )  # fmt: skip
            block_of.append(k)
            offset.append((col - blocks[k].shard.col_offset) // unit)
            step.append(blocks[k].shard.num_cols // unit)
    return _long(block_of), _long(offset), _long(step)


class _StepIndices(NamedTuple):
    """What a variable-batch step's lookup, send and place read that depends on the strides
    alone (`VariableBags.indices`, kept by the strides)."""

    padded: int  # the longest route's bags: the padded kernels' bag count
    padded_at: torch.Tensor  # where each route's bags sit in its padded batch
    send_at: torch.Tensor  # each sent unit's place in the padded kernel output
    input_splits: list[int]
    output_splits: list[int]
    local_padded: int
    local_padded_at: Optional[torch.Tensor]
    local_at: Optional[torch.Tensor]  # this rank's own bags in the local kernels' padded output
    out_bags: torch.Tensor  # each output's bags on this rank
    out_start: torch.Tensor  # each output's first element in the bagged output
    bagged: int  # elements of the bagged output
    at: torch.Tensor  # each arriving block-row's place in the bagged output, in units
    # Sample b's output unit c reads unit `columns[c] + bag * unit_dims[c]` (its bag in its
    # feature) of the arrivals where each bag's block arrives once, else of the bagged output.
    columns: torch.Tensor  # (1, output units)
    unit_dims: torch.Tensor  # (1, output units)


class VariableBags:
    """Pooled bags, each feature with its own bag count: the per-kind part of a variable-batch
    step. It keeps one sharded EBC's static maps; every per-step index is made from them and the
    step's strides, without a loop over routes or features."""

    def __init__(self, at: RankLayout, *, is_weighted: bool) -> None:
        layout = at.layout
        self.world, self.rank, self.device = at.world, at.rank, at.device
        self.is_weighted = is_weighted
        self.has_routes = bool(layout.routes)
        self.keys = [o.key for o in layout.outputs]
        self.dims = [o.dim for o in layout.outputs]
        self.out_width = sum(self.dims)  # a batch of 0 samples is (0, out_width) too
        mine = layout.routes_to(at.rank)
        self.mine_feature = _long([r.feature for r in mine])
        self.mine_width = _long([r.shard.num_cols for r in mine])
        self.mine_col = _starts(self.mine_width)
        self.my_dim = int(self.mine_width.sum())
        # What arrives, in the order it arrives: each rank's routes, then the local ones.
        arriving = [r for src in range(at.world) for r in layout.routes_to(src)]
        self.arrive_source = _long([r.shard.rank for r in arriving])
        local = layout.local
        self.local_feature = _long([r.feature for r in local])
        self.local_width = _long([r.shard.num_cols for r in local])
        self.local_col = _starts(self.local_width)
        self.local_dim = int(self.local_width.sum())
        blocks = (*arriving, *local)
        self.block_feature = _long([r.feature for r in blocks])
        self.block_width = _long([r.shard.num_cols for r in blocks])
        self.block_output = _long([r.output for r in blocks])
        self.block_col = _long([r.shard.col_offset for r in blocks])
        # Every index below counts blocks of `unit` floats, the widest that divides every
        # route's columns and offset and every output's dim: e.g. one block per row of 64
        # columns where the tables are 64 wide (Note [arrival blocks] does the same).
        unit = 0
        for r in (*layout.routes, *local):
            unit = math.gcd(unit, r.shard.num_cols, r.shard.col_offset)
        for o in layout.outputs:
            unit = math.gcd(unit, o.dim)
        self.unit = max(unit, 1)
        outputs = layout.outputs
        self.out_feature = _long([layout.features.index(o.feature) for o in outputs])
        self.out_dim = _long([o.dim for o in outputs])
        # For each output column: its output and its column within that output.
        self.col_output = torch.repeat_interleave(torch.arange(len(outputs)), self.out_dim)
        self.col_within = torch.arange(int(self.out_dim.sum())) - _starts(self.out_dim)[
            self.col_output
        ]
        self.mean_outputs = layout.mean_outputs()
        self.buffers = KeptBuffers()
        # Whether some output adds several arrivals (row-wise pieces); if none does, each bag's
        # block arrives once and the output is one gather from the arrivals.
        outputs_hit = [r.output for r in blocks]
        self.sums = len(outputs_hit) != len(set(zip(outputs_hit, (r.shard.col_offset for r in blocks))))
        # Each output unit's feature, on the device: the rows of `inverse_indices` it reads.
        self._unit_features = self.out_feature[self.col_output[:: self.unit]].to(self.device)
        self._direct = not self.sums and not self.mean_outputs
        if self._direct:  # each output unit's arriving block, its unit in it, the block's width
            self._unit_block, self._unit_offset, self._unit_step = _unit_sources(
                blocks, outputs, self.unit
            )
        self._kept: dict[bytes, _StepIndices] = {}  # by the strides' bytes (`indices`)

    # -- per-step indices ---------------------------------------------------------------------

    def indices(self, strides: torch.Tensor) -> _StepIndices:
        """The step's indices, made once per distinct strides: batches of one shape (the same
        requests per batch) reuse them step after step."""
        key = strides.numpy().tobytes()
        got = self._kept.get(key)
        if got is None:
            if len(self._kept) >= _KEPT_STRIDES:
                self._kept.clear()
            got = self._kept[key] = self._make_indices(strides)
        return got

    def _make_indices(self, strides: torch.Tensor) -> _StepIndices:
        u, world = self.unit, self.world
        per_rank = strides[:, self.mine_feature]  # (ranks, my routes)
        bags = per_rank.sum(0)  # each route's bags, from every rank
        padded = max(int(bags.max()), 1) if bags.numel() else 1
        routes = bags.numel()
        padded_at = bag_positions(torch.arange(routes) * padded, bags)
        # Each rank's bags of each route, out of the padded kernel output (rank by rank).
        first = (torch.cumsum(per_rank, 0) - per_rank).reshape(-1)  # each block's first bag
        send_at = element_positions(
            first * (self.my_dim // u) + (self.mine_col // u).repeat(world),
            per_rank.reshape(-1), (self.mine_width // u).repeat(world),
            torch.full((per_rank.numel(),), self.my_dim // u, dtype=torch.int64),
        )  # fmt: skip
        mine = strides[self.rank]
        arriving = mine[self.block_feature] * self.block_width
        output_splits = torch.zeros(world, dtype=torch.int64).index_add_(
            0, self.arrive_source, arriving[: self.arrive_source.numel()]
        ).tolist()
        local_padded, local_padded_at, local_at = 1, None, None
        if self.local_feature.numel():
            rows = mine[self.local_feature]
            local_padded = max(int(strides[:, self.local_feature].max()), 1)
            local_padded_at = bag_positions(torch.arange(rows.numel()) * local_padded, rows)
            local_padded_at = local_padded_at.to(self.device)
            local_at = element_positions(
                self.local_col // u, rows, self.local_width // u,
                torch.full_like(rows, self.local_dim // u),
            ).to(self.device)  # fmt: skip
        out_bags = mine[self.out_feature]
        sizes = out_bags * self.out_dim
        out_start = _starts(sizes)
        bagged = int(sizes.sum())
        at = element_positions(
            (out_start[self.block_output] + self.block_col) // u, mine[self.block_feature],
            self.block_width // u, self.out_dim[self.block_output] // u,
        )  # fmt: skip
        block_output = self.col_output[::u]
        if self._direct:  # unit c of a sample in bag j: unit columns[c] + j * step[c] arrived
            block_start = _starts(mine[self.block_feature] * self.block_width // u)
            columns = (block_start[self._unit_block] + self._unit_offset).view(1, -1)
            unit_dims = self._unit_step.view(1, -1)
        else:  # ... of the bagged output
            columns = (out_start[block_output] + self.col_within[::u]).view(1, -1) // u
            unit_dims = (self.out_dim[block_output] // u).view(1, -1)
        return _StepIndices(
            padded=padded, padded_at=padded_at.to(self.device), send_at=send_at.to(self.device),
            input_splits=(per_rank * self.mine_width).sum(1).tolist(), output_splits=output_splits,
            local_padded=local_padded, local_padded_at=local_padded_at, local_at=local_at,
            out_bags=out_bags, out_start=out_start, bagged=bagged, at=at.to(self.device),
            columns=columns.to(self.device), unit_dims=unit_dims.to(self.device),
        )  # fmt: skip

    # -- the step -----------------------------------------------------------------------------

    def attach(self, shards: LocalShards) -> None:
        pass  # the kernels are read at each lookup

    def prepare(self, kjt: KeyedJaggedTensor, lengths: torch.Tensor, vbe: VariableBatch) -> None:
        return None  # the strides and inverse indices travel in `Received.vbe`

    def lookup(
        self, shards: LocalShards, received: Received
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The kernels' pooled bags: routed ones padded to the longest route's bag count, local
        ones to the largest stride any rank has for their features (data-parallel copies gather
        equal shapes, Note [dense data-parallel copies])."""
        ix = self.indices(received.vbe.strides)
        remote = torch.zeros(0, self.my_dim, device=self.device)
        weights = received.weights  # learned: Note [learned per-sample weights], even with no route
        if shards.kernels or (weights is not None and weights.requires_grad):
            lengths = received.lengths.new_zeros(ix.padded * self.mine_feature.numel())
            lengths = lengths.index_copy(0, ix.padded_at, received.lengths)
            values, offsets = batch_offsets(lengths, received.values)
            remote = pool(shards.kernels, values, offsets, weights, ix.padded)
        local = None
        if received.local is not None:
            kjt = received.local
            lengths = kjt.lengths().new_zeros(ix.local_padded * self.local_feature.numel())
            lengths = lengths.index_copy(0, ix.local_padded_at, kjt.lengths())
            values, offsets = batch_offsets(lengths, kjt.values())
            weights = kjt.weights().float() if self.is_weighted else None
            local = pool(shards.local_kernels, values.long(), offsets.long(), weights, ix.local_padded)
        return remote, local

    def send(self, looked: tuple[torch.Tensor, Optional[torch.Tensor]], received: Received) -> Wire:
        """For each rank, each of this rank's routes' bags of that rank's samples; the local
        part, this rank's own bags."""
        remote, local = looked
        ix = self.indices(received.vbe.strides)
        u = self.unit
        send = None
        if self.has_routes:
            send = _Gather.apply(remote.reshape(-1, u), ix.send_at, self.buffers, "send").reshape(-1)
        flat_local = None
        if local is not None:
            flat_local = local.reshape(-1, u).index_select(0, ix.local_at).reshape(-1)
        return Wire(send, ix.input_splits, ix.output_splits, flat_local)

    def place(self, arrived: torch.Tensor, received: Received) -> torch.Tensor:
        """The output (batch, output dim): the arrivals added into each feature's own bags,
        row-wise MEAN divided once, then every sample given its bag (`inverse_indices`)."""
        ix = self.indices(received.vbe.strides)
        inverse = received.vbe.inverse
        u = self.unit
        # Each output block of each sample reads its bag's: one gather, whose backward sums
        # the samples of each bag.
        rows_of = inverse.long().index_select(0, self._unit_features)
        where = (ix.columns + rows_of.t() * ix.unit_dims).reshape(-1)
        if self._direct:  # every bag's block arrived once: gather it from the arrivals
            out = _Gather.apply(arrived.view(-1, u), where, self.buffers, "output")
            return out.view(inverse.shape[1], self.out_width)
        bagged = arrived.new_zeros(ix.bagged // u, u)
        bagged = bagged.index_add(0, ix.at, arrived.view(-1, u)).view(-1)
        if self.mean_outputs:
            divisor = self._bag_counts(received, ix.out_bags, ix.bagged, ix.out_start)
            bagged = bagged / divisor.to(bagged.dtype)
        out = _Gather.apply(bagged.view(-1, u), where, self.buffers, "output")
        return out.view(inverse.shape[1], self.out_width)

    def wrap(self, out: torch.Tensor, received: Received) -> KeyedTensor:
        return keyed_output(out, self.keys, self.dims)

    def _bag_counts(self, received: Received, bags, size: int, start) -> torch.Tensor:
        """Divisors of the bagged output: each row-wise MEAN output's bags' id counts (at least
        one), ones elsewhere."""
        kjt = received.kjt
        lengths = kjt.lengths()
        feature_start = _starts(received.vbe.strides[self.rank])
        divisor = torch.ones(size, device=lengths.device)
        for o in self.mean_outputs:
            f = int(self.out_feature[o])
            n = int(bags[o])
            s0 = int(feature_start[f])
            counts = lengths[s0 : s0 + n].clamp(min=1).to(divisor.dtype)
            d = int(self.out_dim[o])
            b0 = int(start[o])
            divisor[b0 : b0 + n * d] = counts.repeat_interleave(d)
        return divisor
