"""A sharded EBC's lookup and output dist when features have their own bag counts (Note [variable
batch per feature] in modular/routing/variable_batch.py): padded kernel batches, each rank sent
only its own bags, and the deduplicated output expanded to the batch on arrival."""

from __future__ import annotations

import math
from typing import Optional

import torch

from modular.comm import KeptBuffers
from modular.kernels.base import pool
from modular.kernels.lookups import batch_offsets
from modular.routing.received import Received
from modular.routing.variable_batch import element_positions, padded_lengths
from modular.tables.layout import RankLayout

__all__ = ["VariableBags"]


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


class VariableBags:
    """One sharded EBC's static maps for variable-batch steps; every per-step index is made from
    them and the step's strides, without a loop over routes or features."""

    def __init__(self, at: RankLayout, *, is_weighted: bool) -> None:
        layout = at.layout
        self.world, self.rank, self.device = at.world, at.rank, at.device
        self.is_weighted = is_weighted
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

    # -- lookup -----------------------------------------------------------------------------

    def lookup(self, shards, received: Received) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The kernels' pooled bags: routed ones padded to the longest route's bag count, local
        ones to the largest stride any rank has for their features (replicas gather equal
        shapes, Note [dense replicas])."""
        strides = received.vbe.strides
        remote = torch.zeros(0, self.my_dim, device=self.device)
        if shards.kernels:
            bags = strides[:, self.mine_feature].sum(0)  # each route's bags, from every rank
            padded = max(int(bags.max()), 1)
            lengths = padded_lengths(received.lengths, bags, padded)
            values, offsets = batch_offsets(lengths, received.values)
            remote = pool(shards.kernels, values, offsets, received.weights, padded)
        local = None
        if received.local is not None:
            kjt = received.local
            padded = max(int(strides[:, self.local_feature].max()), 1)
            lengths = padded_lengths(kjt.lengths(), strides[self.rank, self.local_feature], padded)
            values, offsets = batch_offsets(lengths, kjt.values())
            weights = kjt.weights().float() if self.is_weighted else None
            local = pool(shards.local_kernels, values.long(), offsets.long(), weights, padded)
        return remote, local

    # -- output dist ------------------------------------------------------------------------

    def send(self, remote: torch.Tensor, local: Optional[torch.Tensor], strides: torch.Tensor):
        """(send buffer, input splits, output splits, local part): for each rank, each of this
        rank's routes' bags of that rank's samples; the local part, this rank's own bags."""
        u = self.unit
        per_rank = strides[:, self.mine_feature]  # (ranks, my routes)
        first = (torch.cumsum(per_rank, 0) - per_rank).reshape(-1)  # each block's first bag
        n = per_rank.numel()
        at = element_positions(
            first * (self.my_dim // u) + (self.mine_col // u).repeat(self.world),
            per_rank.reshape(-1), (self.mine_width // u).repeat(self.world),
            torch.full((n,), self.my_dim // u, dtype=torch.int64),
        )  # fmt: skip
        send = _Gather.apply(remote.reshape(-1, u), at.to(remote.device), self.buffers, "send")
        send = send.reshape(-1)
        input_splits = (per_rank * self.mine_width).sum(1).tolist()
        mine = strides[self.rank]
        arriving = mine[self.block_feature] * self.block_width
        output_splits = torch.zeros(self.world, dtype=torch.int64).index_add_(
            0, self.arrive_source, arriving[: self.arrive_source.numel()]
        ).tolist()
        flat_local = None
        if local is not None:
            rows = mine[self.local_feature]
            at = element_positions(
                self.local_col // u, rows, self.local_width // u,
                torch.full_like(rows, self.local_dim // u),
            )  # fmt: skip
            flat_local = local.reshape(-1, u).index_select(0, at.to(local.device)).reshape(-1)
        return send, input_splits, output_splits, flat_local

    def place(self, arrived: torch.Tensor, received: Received) -> torch.Tensor:
        """The output (batch, output dim): the arrivals added into each feature's own bags,
        row-wise MEAN divided once, then every sample given its bag (`inverse_indices`)."""
        strides, inverse = received.vbe.strides[self.rank], received.vbe.inverse
        bags = strides[self.out_feature]
        sizes = bags * self.out_dim
        start = _starts(sizes)
        u = self.unit
        rows = strides[self.block_feature]
        at = element_positions(
            (start[self.block_output] + self.block_col) // u, rows, self.block_width // u,
            self.out_dim[self.block_output] // u,
        )  # fmt: skip
        device = arrived.device
        # Each output block of each sample reads its bag's: one gather, whose backward sums
        # the samples of each bag.
        block_output = self.col_output[::u]
        columns = (start[block_output] + self.col_within[::u]).to(device).view(1, -1) // u
        rows_of = inverse.long().index_select(0, self.out_feature[block_output].to(device))
        where = columns + rows_of.t() * (self.out_dim[block_output] // u).to(device).view(1, -1)
        if not self.sums and not self.mean_outputs:  # every bag's block arrived once: gather it
            source = torch.empty(int(sizes.sum()) // u, dtype=torch.int64)
            source[at] = torch.arange(at.numel())
            where = source.to(device)[where.reshape(-1)]
            out = _Gather.apply(arrived.view(-1, u), where, self.buffers, "output")
            return out.view(inverse.shape[1], -1)
        bagged = arrived.new_zeros(int(sizes.sum()) // u, u)
        bagged = bagged.index_add(0, at.to(device), arrived.view(-1, u)).view(-1)
        if self.mean_outputs:
            bagged = bagged / self._bag_counts(received, bags, sizes, start).to(bagged.dtype)
        out = _Gather.apply(bagged.view(-1, u), where.reshape(-1), self.buffers, "output")
        return out.view(inverse.shape[1], -1)

    def _bag_counts(self, received: Received, bags, sizes, start) -> torch.Tensor:
        """Divisors of the bagged output: each row-wise MEAN output's bags' id counts (at least
        one), ones elsewhere."""
        kjt = received.kjt
        lengths = kjt.lengths()
        feature_start = _starts(received.vbe.strides[self.rank])
        divisor = torch.ones(int(sizes.sum()), device=lengths.device)
        for o in self.mean_outputs:
            f = int(self.out_feature[o])
            n = int(bags[o])
            s0 = int(feature_start[f])
            counts = lengths[s0 : s0 + n].clamp(min=1).to(divisor.dtype)
            d = int(self.out_dim[o])
            b0 = int(start[o])
            divisor[b0 : b0 + n * d] = counts.repeat_interleave(d)
        return divisor
