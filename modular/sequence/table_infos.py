"""The tables of a torchrec EmbeddingCollection, in the terms of modular/tables/layout.py."""

from __future__ import annotations

from torch import nn
from torchrec.modules.embedding_configs import DataType
from torchrec.modules.embedding_modules import EmbeddingCollection

from modular.errors import ShardingError
from modular.tables.config_fields import check_config_fields
from modular.tables.layout import Pooling, TableInfo
from modular.tables.weights import table_info

__all__ = ["AsBags", "sequence_table_infos"]


def sequence_table_infos(ec: EmbeddingCollection, module: str) -> tuple[TableInfo, ...]:
    """Reads the tables of an EmbeddingCollection, rejecting what sharding does not support.

    Each table is a `Pooling.NONE` table to the layout; Note [sequence lookups] in
    modular/sequence/lookup.py says how each kernel looks it up. FP16 tables keep their dtype
    as the EBC's do (Note [low-precision tables] in modular/kernels/table_dtypes.py), and their
    rows come out in FP32 as torchrec's do (Note [low-precision sequences] in
    modular/sequence/sequence_part.py). torchrec's EC holds every non-FP32 table as FP16, so a BF16 config
    (an FP16 table there) is refused rather than sharded as a BF16 one."""
    infos = []
    for cfg in ec.embedding_configs():
        check_config_fields(cfg, module)  # Note [table config fields]
        if cfg.data_type not in (DataType.FP32, DataType.FP16):
            raise ShardingError(
                f"table {cfg.name!r} of module {module!r} has data type {cfg.data_type.name}; "
                "an EmbeddingCollection's tables can be sharded in FP32 or FP16 (torchrec's "
                "EmbeddingCollection holds every other data type as FP16 weights): use "
                "DataType.FP16 or DataType.FP32"
            )
        infos.append(table_info(cfg, Pooling.NONE))
    return tuple(infos)


class AsBags:
    """An EmbeddingCollection seen through the two names modular/tables/init.py reads
    (`embedding_bag_configs()`, `embedding_bags[table].weight`), so that shard init, its
    agreement and its fingerprints serve both collections."""

    def __init__(self, ec: EmbeddingCollection) -> None:
        self._ec = ec
        self.embedding_bags: nn.ModuleDict = ec.embeddings

    def embedding_bag_configs(self):
        return self._ec.embedding_configs()
