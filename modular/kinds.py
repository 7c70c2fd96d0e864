"""The kinds of torchrec collection `modular.shard` takes, as data: pooled bags and sequences.

# Note [collection kinds]
An EmbeddingBagCollection and an EmbeddingCollection are sharded by one path (`ShardedCollection`
in modular/collection.py: input dist, prefetch, the ids' exchange, the output all-to-all, the
fused arm, the options). What differs between them is in two places only:

  * here, what a model-level call needs to know of a collection before or without sharding it:
    its torchrec class, the attribute its tables live under (the FQNs `embedding_bags.<t>.weight`
    and `embeddings.<t>.weight`), its configs, how its tables read as `TableInfo`s, the facts
    ranks agree on (Note [agreeing on the plan]) and the weights shard init copies;
  * in the per-kind part of the step (`KindPart` in modular/parts.py: `PooledPart` and, for
    variable-batch steps, `VariableBags` in modular/pooled/; `SequencePart` in
    modular/sequence/): how a kernel looks up and how the output dist places what arrives.

Which kind a module is, sharded or not, is decided in one function (`kind_of` in
modular/sharded_types.py, which also knows each kind's sharded class). A third kind is one more
record here, one part and one entry there.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from torch import nn
from torchrec.modules.embedding_configs import DataType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from modular.sequence.table_infos import AsBags, sequence_table_infos
from modular.tables.layout import TableInfo
from modular.tables.weights import table_infos

__all__ = ["CollectionKind", "KINDS", "POOLED", "SEQUENCE", "unsharded_kind"]


@dataclasses.dataclass(frozen=True)
class CollectionKind:
    """One kind of torchrec collection (Note [collection kinds])."""

    name: str  # as errors name it: "EmbeddingBagCollection"
    unsharded: type  # torchrec's module class
    tables_attr: str  # where its tables live: `<tables_attr>.<table>.weight`
    configs: Callable[[nn.Module], list]  # its table configs, sharded or not
    read_tables: Callable[[nn.Module, str], tuple[TableInfo, ...]]  # (module, fqn), checked
    described: Callable[[nn.Module], list]  # the planned facts ranks agree on
    weights_source: Callable[[nn.Module], Any]  # what shard init copies (modular/tables/init.py)


def _dtype(cfg) -> list:
    return [] if cfg.data_type is DataType.FP32 else [cfg.data_type.name]


def _described_bags(module: nn.Module) -> list:
    return [
        [c.name, c.num_embeddings, c.embedding_dim, list(c.feature_names), c.pooling.name]
        + _dtype(c)
        for c in module.embedding_bag_configs()
    ] + [module.is_weighted()]


def _described_sequences(module: nn.Module) -> list:
    return [
        [c.name, c.num_embeddings, c.embedding_dim, list(c.feature_names)] + _dtype(c)
        for c in module.embedding_configs()
    ] + ["sequence"]


POOLED = CollectionKind(
    name="EmbeddingBagCollection",
    unsharded=EmbeddingBagCollection,
    tables_attr="embedding_bags",
    configs=lambda m: m.embedding_bag_configs(),
    read_tables=table_infos,
    described=_described_bags,
    weights_source=lambda m: m,
)

SEQUENCE = CollectionKind(
    name="EmbeddingCollection",
    unsharded=EmbeddingCollection,
    tables_attr="embeddings",
    configs=lambda m: m.embedding_configs(),
    read_tables=sequence_table_infos,
    described=_described_sequences,
    weights_source=AsBags,
)

KINDS = (POOLED, SEQUENCE)


def unsharded_kind(module: nn.Module) -> CollectionKind | None:
    """The kind of a torchrec collection (not a sharded one), or None."""
    for kind in KINDS:
        if isinstance(module, kind.unsharded):
            return kind
    return None
