"""The pooled part of a step whose batch has one bag per sample and feature (`KindPart` in
modular/parts.py): the kernels pool each bag, every rank's pooled columns travel in one
all-to-all, and arriving columns are added at their output offsets (Note [arrival blocks]),
row-wise partial sums included; MEAN is divided once, after the row-wise pieces are summed."""

from __future__ import annotations

from typing import Optional

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from modular.kernels.base import pool
from modular.kernels.lookups import batch_offsets
from modular.local_shards import LocalShards
from modular.parts import Wire
from modular.pooled.arrival import Arrival
from modular.routing.received import Received
from modular.tables.layout import RankLayout

__all__ = ["PooledPart", "keyed_output"]


class PooledPart:
    """Pooled bags, one per sample and feature: the per-kind part of a uniform step."""

    def __init__(self, at: RankLayout, *, is_weighted: bool) -> None:
        layout = at.layout
        self.world, self.device, self.is_weighted = at.world, at.device, is_weighted
        self.recv_dims = layout.dims_per_rank()
        self.my_dim = self.recv_dims[at.rank]
        local_dim = sum(r.shard.num_cols for r in layout.local)
        self.has_routes = bool(layout.routes)
        self.arrival = Arrival(
            [*self.recv_dims, local_dim], layout.output_columns(), layout.output_dim, at.device
        )
        self.keys = [o.key for o in layout.outputs]
        self.dims = [o.dim for o in layout.outputs]
        self.mean_columns, self.mean_features = _mean_column_maps(at)

    def attach(self, shards: LocalShards) -> None:
        pass  # the kernels are read at each lookup

    def prepare(self, kjt: KeyedJaggedTensor, lengths: torch.Tensor, vbe: None) -> None:
        return None  # a pooled output needs nothing more of the batch

    def lookup(
        self, shards: LocalShards, received: Received
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Pools the received ids (for every rank's batch) and this rank's data-parallel ids."""
        rows = self.world * received.batch_size
        remote = torch.zeros(rows, 0, device=self.device)
        weights = received.weights
        # A rank with no route still runs learned weights' backward (Note [learned per-sample
        # weights] in modular/routing/learned_weights.py)
        if shards.kernels or (weights is not None and weights.requires_grad):
            values, offsets = batch_offsets(received.lengths.reshape(-1), received.values)
            remote = pool(shards.kernels, values, offsets, weights, rows)
        local = None
        if received.local is not None:
            kjt = received.local
            local = pool(
                shards.local_kernels,
                kjt.values().long(),
                kjt.offsets().long(),
                kjt.weights().float() if self.is_weighted else None,  # FP32, as routed ones
                kjt.stride(),
            )
        return remote, local

    def send(self, looked: tuple[torch.Tensor, Optional[torch.Tensor]], received: Received) -> Wire:
        remote, local = looked
        batch = received.batch_size
        return Wire(
            send=remote if self.has_routes else None,
            input_splits=[batch * self.my_dim] * self.world,
            output_splits=[batch * d for d in self.recv_dims],
            local=local,
        )

    def place(self, arrived: torch.Tensor, received: Received) -> torch.Tensor:
        out = self.arrival.arrange(arrived, received.batch_size)  # Note [arrival blocks]
        if self.mean_columns is not None:  # MEAN: the sum of the row-wise pieces, divided once
            lengths = received.kjt.lengths().view(-1, received.batch_size)
            counts = lengths.index_select(0, self.mean_features).t()
            means = out.index_select(1, self.mean_columns) / counts.clamp(min=1).to(out.dtype)
            out = out.index_copy(1, self.mean_columns, means)
        return out

    def wrap(self, out: torch.Tensor, received: Received) -> KeyedTensor:
        return keyed_output(out, self.keys, self.dims)


def keyed_output(out: torch.Tensor, keys: list[str], dims: list[int]) -> KeyedTensor:
    """The pooled output as torchrec's EBC returns it, whichever part made it."""
    torch._dynamo.maybe_mark_dynamic(out, 0)  # the batch size (Note [compiling a sharded model])
    return KeyedTensor(keys=keys, length_per_key=dims, values=out)


def _mean_column_maps(at: RankLayout) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The output columns of MEAN tables and, per column, its feature's index."""
    layout = at.layout
    cols, feats = [], []
    for i in layout.mean_outputs():
        o = layout.outputs[i]
        f = layout.features.index(o.feature)
        cols.extend(range(o.col, o.col + o.dim))
        feats.extend([f] * o.dim)
    if not cols:
        return None, None
    as_long = dict(dtype=torch.int64, device=at.device)
    return torch.tensor(cols, **as_long), torch.tensor(feats, **as_long)
