"""The sharded EmbeddingBagCollection: pooled bags through the one path of modular/collection.py.

A `ShardedEmbeddingBagCollection` replaces a torchrec `EmbeddingBagCollection` in place. It keeps
the unsharded module's parameter names (`embedding_bags.<table>.weight`): sharded tables are
`ShardedTensor`s (or DTensors) whose local shards alias the lookup kernels' buffers, data-parallel
tables are plain per-rank copies that average their own gradients over ranks. The step is
`ShardedCollection`'s; what pooling adds to it is in modular/pooled/ (Note [collection kinds]):
`PooledPart` for a batch with one bag per sample and `VariableBags` for one whose features have
their own bag counts, which the input dist picks per step.
"""

from __future__ import annotations

from typing import Optional

import torch
from torchrec.modules.embedding_modules import (
    EmbeddingBagCollection,
    EmbeddingBagCollectionInterface,
)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from modular.collection import CollectionOptions, ShardedCollection, ShardedCollectionModule
from modular.fused.config import FusedConfig
from modular.local_shards import ShardFill
from modular.kinds import POOLED
from modular.pooled.pooled_part import PooledPart
from modular.pooled.variable_bags import VariableBags
from modular.tables.forms import TensorType
from modular.tables.layout import RankLayout

__all__ = ["ShardedEmbeddingBagCollection"]


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
        fill: Optional[ShardFill] = None,
    ) -> None:
        super().__init__()
        # `at`: the tables' layout from the plan, seen from this rank (`RankLayout.build`).
        self._is_weighted = ebc.is_weighted()
        self._configs = ebc.embedding_bag_configs()
        options = CollectionOptions(output_dtype, comm_dtype, tensor_type)
        sharded = ShardedCollection(
            at,
            PooledPart(at, is_weighted=self._is_weighted),
            variable_part=VariableBags(at, is_weighted=self._is_weighted),
            fused=fused,
            options=options,
            is_weighted=self._is_weighted,
            fill=fill,
        )
        self._attach(sharded, ebc)  # collective: fills the shards, registers `embedding_bags`

    # -- what torchrec's EBC also offers ----------------------------------------------------

    def is_weighted(self) -> bool:
        return self._is_weighted

    def embedding_bag_configs(self):
        return self._configs
