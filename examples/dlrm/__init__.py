"""The model and data pieces of the end-to-end DLRM example.

`model` holds a DLRM whose 26 categorical features go through one torchrec
`EmbeddingBagCollection` at `model.sparse.ebc` (the module that `modular.shard` shards);
`data` yields `Batch`es from a synthetic generator with a learnable signal or from a
Criteo-format TSV file; `metrics` computes an exact ROC AUC.
"""

from examples.dlrm.data import Batch, SyntheticCriteo, concat_batches, read_criteo_tsv
from examples.dlrm.metrics import auc
from examples.dlrm.model import (
    CRITEO_TB,
    DLRM,
    NUM_DENSE_FEATURES,
    criteo_table_configs,
    feature_names,
)

__all__ = [
    "Batch",
    "CRITEO_TB",
    "DLRM",
    "NUM_DENSE_FEATURES",
    "SyntheticCriteo",
    "auc",
    "concat_batches",
    "criteo_table_configs",
    "feature_names",
    "read_criteo_tsv",
]
