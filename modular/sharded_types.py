"""Which kind a collection is, and its sharded class: decided here, once (Note [collection kinds]
in modular/kinds.py). The calls that act on every sharded module (fusing, composing, clipping,
checkpoints, unshard) ask `kind_of` or test against `SHARDED_COLLECTIONS`."""

from __future__ import annotations

from typing import Optional

from torch import nn

from modular.embedding import ShardedEmbeddingCollection
from modular.embedding_bag import ShardedEmbeddingBagCollection
from modular.kinds import KINDS, CollectionKind, unsharded_kind

__all__ = ["SHARDED_COLLECTIONS", "kind_of", "sharded_class", "tables_name"]

SHARDED_COLLECTIONS = (ShardedEmbeddingBagCollection, ShardedEmbeddingCollection)
_SHARDED_CLASS = {cls.kind: cls for cls in SHARDED_COLLECTIONS}
assert set(_SHARDED_CLASS) == set(KINDS), "every kind has one sharded class"


def kind_of(module: nn.Module) -> Optional[CollectionKind]:
    """The kind of a torchrec collection or of a sharded one; None for any other module."""
    if isinstance(module, SHARDED_COLLECTIONS):
        return module.kind
    return unsharded_kind(module)


def sharded_class(kind: CollectionKind) -> type:
    """The module `modular.shard` (and `fuse_optimizer`, for a materialised one) makes of a kind."""
    return _SHARDED_CLASS[kind]


def tables_name(module: nn.Module) -> str:
    """The attribute that holds a collection's tables, as in the unsharded module's FQNs:
    `embedding_bags.<table>.weight` or `embeddings.<table>.weight`."""
    return kind_of(module).tables_attr
