"""The sharded EmbeddingBagCollection: pooled bags through the one path of modular/collection.py.

A `ShardedEmbeddingBagCollection` replaces a torchrec `EmbeddingBagCollection` in place. It keeps
the unsharded module's parameter names (`embedding_bags.<table>.weight`): sharded tables are
`ShardedTensor`s (or DTensors) whose local shards alias the lookup kernels' buffers, data-parallel
tables are plain replicated parameters that average their own gradients over ranks. The step is
`ShardedCollection`'s; `PooledPart` is what pooling adds to it (Note [collection kinds]): the
kernels pool each bag, every rank's pooled columns travel in one all-to-all, and arriving columns
are added at their output offsets (Note [arrival blocks]), row-wise partial sums included.
"""

from __future__ import annotations

from typing import Optional

import torch
from torchrec.modules.embedding_modules import (
    EmbeddingBagCollection,
    EmbeddingBagCollectionInterface,
)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from modular.collection import (
    CollectionOptions, ShardedCollection, ShardedCollectionModule, Wire,
)  # fmt: skip
from modular.fused.config import FusedConfig
from modular.kernels.base import pool
from modular.kernels.lookups import batch_offsets
from modular.kinds import POOLED
from modular.local_shards import LocalShards
from modular.pooled.arrival import Arrival
from modular.routing.received import Received
from modular.pooled.variable_bags import VariableBags
from modular.tables.forms import TensorType
from modular.tables.layout import RankLayout

__all__ = ["PooledPart", "ShardedEmbeddingBagCollection"]


class PooledPart:
    """Pooled bags: the per-kind part of the step (`KindPart` in modular/collection.py)."""

    variable_batch = True  # Note [variable batch per feature]: `VariableBags` takes those steps

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
        self.bags = VariableBags(at, is_weighted=is_weighted)

    def attach(self, shards: LocalShards) -> None:
        pass  # the kernels are read at each lookup

    def prepare(self, kjt: KeyedJaggedTensor, lengths: torch.Tensor) -> None:
        return None  # a pooled output needs nothing more of the batch

    def lookup(
        self, shards: LocalShards, received: Received
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Pools the received ids (for every rank's batch) and this rank's data-parallel ids."""
        if received.vbe is not None:
            return self.bags.lookup(shards, received)
        rows = self.world * received.batch_size
        remote = torch.zeros(rows, 0, device=self.device)
        if shards.kernels:
            values, offsets = batch_offsets(received.lengths.reshape(-1), received.values)
            remote = pool(shards.kernels, values, offsets, received.weights, rows)
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
        if received.vbe is not None:
            send, input_splits, output_splits, local = self.bags.send(
                remote, local, received.vbe.strides
            )
            return Wire(send if self.has_routes else None, input_splits, output_splits, local)
        batch = received.batch_size
        return Wire(
            send=remote if self.has_routes else None,
            input_splits=[batch * self.my_dim] * self.world,
            output_splits=[batch * d for d in self.recv_dims],
            local=local,
        )

    def place(self, arrived: torch.Tensor, received: Received) -> torch.Tensor:
        if received.vbe is not None:
            return self.bags.place(arrived, received)
        out = self.arrival.arrange(arrived, received.batch_size)  # Note [arrival blocks]
        if self.mean_columns is not None:  # MEAN: the sum of the row-wise pieces, divided once
            lengths = received.kjt.lengths().view(-1, received.batch_size)
            counts = lengths.index_select(0, self.mean_features).t()
            means = out.index_select(1, self.mean_columns) / counts.clamp(min=1).to(out.dtype)
            out = out.index_copy(1, self.mean_columns, means)
        return out

    def wrap(self, out: torch.Tensor, received: Received) -> KeyedTensor:
        torch._dynamo.maybe_mark_dynamic(out, 0)  # the batch size (Note [compiling a sharded model])
        return KeyedTensor(keys=self.keys, length_per_key=self.dims, values=out)


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


class ShardedEmbeddingBagCollection(EmbeddingBagCollectionInterface, ShardedCollectionModule):
    """A torchrec EmbeddingBagCollection whose tables are spread over a process group.

    Built by `modular.shard`; `forward(kjt)` returns the same KeyedTensor as the unsharded EBC on
    this rank's batch. Gradients follow Note [grad scaling across ranks].
    """

    kind = POOLED
    # torchrec's interface comes first in the bases, so that `shard` can turn a model that is
    # itself a collection into this class in place (`lifecycle.replace_module`: CPython allows
    # the `__class__` change only between such layouts); its abstract `forward` is the face's.
    forward = ShardedCollectionModule.forward

    def __init__(
        self,
        ebc: EmbeddingBagCollection,
        at: RankLayout,
        *,
        fused: Optional[FusedConfig] = None,
        output_dtype: torch.dtype = torch.float32,
        comm_dtype: Optional[torch.dtype] = None,
        tensor_type: TensorType = TensorType.SHARDED_TENSOR,
    ) -> None:
        super().__init__()
        # `at`: the tables' layout from the plan, seen from this rank (`RankLayout.build`).
        self._is_weighted = ebc.is_weighted()
        self._configs = ebc.embedding_bag_configs()
        options = CollectionOptions(output_dtype, comm_dtype, tensor_type)
        part = PooledPart(at, is_weighted=self._is_weighted)
        sharded = ShardedCollection(
            at, part, fused=fused, options=options, is_weighted=self._is_weighted
        )
        self._attach(sharded, ebc)  # collective: fills the shards, registers `embedding_bags`

    # -- what torchrec's EBC also offers ----------------------------------------------------

    def is_weighted(self) -> bool:
        return self._is_weighted

    def embedding_bag_configs(self):
        return self._configs
