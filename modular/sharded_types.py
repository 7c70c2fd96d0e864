"""The sharded modules `modular.shard` makes, one per kind of torchrec collection: the pooled
`ShardedEmbeddingBagCollection` and the sequence `ShardedEmbeddingCollection`. The calls that
act on every sharded module (fusing, composing, clipping, checkpoints) test against this tuple."""

from __future__ import annotations

from torch import nn

from modular.embedding import ShardedEmbeddingCollection
from modular.embedding_bag import ShardedEmbeddingBagCollection

__all__ = ["SHARDED_COLLECTIONS", "tables_name"]

SHARDED_COLLECTIONS = (ShardedEmbeddingBagCollection, ShardedEmbeddingCollection)


def tables_name(module: nn.Module) -> str:
    """The attribute that holds a sharded module's tables, as in the unsharded module's FQNs:
    `embedding_bags.<table>.weight` or `embeddings.<table>.weight`."""
    return "embeddings" if isinstance(module, ShardedEmbeddingCollection) else "embedding_bags"
