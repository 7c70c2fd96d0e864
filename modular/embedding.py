"""The sharded EmbeddingCollection: sequences through the one path of modular/collection.py.

A `ShardedEmbeddingCollection` replaces a torchrec `EmbeddingCollection` in place under the same
contract as the sharded EBC (modular/embedding_bag.py): the unsharded parameter names
(`embeddings.<table>.weight`, ShardedTensors or DTensors, or data-parallel copies), the same
step and options (`ShardedCollection`: checks, router, the ids' exchange, prefetch, `output_dtype`,
`comm_dtype`, the fused arm). `SequencePart` (modular/sequence/sequence_part.py) is what sequences
add to it (Note [collection kinds]): fbgemm's sequence kernels where they take it, each id a bag
of one elsewhere (Note [sequence lookups] in modular/sequence/lookup.py), and an output dist that
returns each id's row to its sample's rank (Note [sequence output dist] in
modular/sequence/output.py).
"""

from __future__ import annotations

from typing import Optional

import torch
from torchrec.modules.embedding_modules import EmbeddingCollection, EmbeddingCollectionInterface

from modular.collection import CollectionOptions, ShardedCollection, ShardedCollectionModule
from modular.fused.config import FusedConfig
from modular.local_shards import ShardFill
from modular.kinds import SEQUENCE
from modular.sequence.sequence_part import SequencePart
from modular.tables.forms import TensorType
from modular.tables.layout import RankLayout

__all__ = ["ShardedEmbeddingCollection"]


class ShardedEmbeddingCollection(EmbeddingCollectionInterface, ShardedCollectionModule):
    """A torchrec EmbeddingCollection whose tables are spread over a process group.

    Built by `modular.shard`; `forward(kjt)` returns what the unsharded EmbeddingCollection
    returns on this rank's batch (the same keys in the same order, each a JaggedTensor of the
    feature's rows and lengths). Gradients follow Note [grad scaling across ranks].
    """

    kind = SEQUENCE
    forward = ShardedCollectionModule.forward  # as the sharded EBC's (modular/embedding_bag.py)

    def __init__(
        self,
        ec: EmbeddingCollection,
        at: RankLayout,
        *,
        fused: Optional[FusedConfig] = None,
        output_dtype: torch.dtype = torch.float32,
        comm_dtype: Optional[torch.dtype] = None,
        tensor_type: TensorType = TensorType.SHARDED_TENSOR,
        fill: Optional[ShardFill] = None,
    ) -> None:
        super().__init__()
        self._configs = ec.embedding_configs()
        self._need_indices = ec.need_indices()
        self._embedding_dim = ec.embedding_dim()
        self._names_by_table = ec.embedding_names_by_table()
        options = CollectionOptions(output_dtype, comm_dtype, tensor_type)
        part = SequencePart(at, embedding_dim=self._embedding_dim, need_indices=self._need_indices)
        sharded = ShardedCollection(
            at, part, fused=fused, options=options, is_weighted=False, fill=fill
        )
        self._attach(sharded, ec)  # collective: fills the shards, registers `embeddings`

    # -- what torchrec's EmbeddingCollection also offers ------------------------------------

    def embedding_configs(self):
        return self._configs

    def need_indices(self) -> bool:
        return self._need_indices

    def embedding_dim(self) -> int:
        return self._embedding_dim

    def embedding_names_by_table(self) -> list[list[str]]:
        return self._names_by_table
