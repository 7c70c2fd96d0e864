"""A DLRM whose categorical features go through one EmbeddingBagCollection.

The layout follows the DLRM paper and the MLPerf reference:

    dense [B, 13] --bottom MLP--> d [B, D]
    sparse KJT    --EBC (SUM)---> e [B, F, D]        (model.sparse.ebc)
    interaction: pairwise dot products of the F + 1 vectors [d, e_0, ..., e_{F-1}],
                 upper triangle without the diagonal, concatenated with d
    top MLP -> one logit per sample

The embedding collection lives at the fully-qualified name `sparse.ebc`, so a plan
names its tables `t_cat_{i}` under that module, and `modular.shard(model, plan)` can
replace its lookups in place while every FQN stays the same.
"""

from collections.abc import Sequence

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.modules.embedding_configs import PoolingType

NUM_DENSE_FEATURES = 13

# Criteo Terabyte cardinalities as used by the MLPerf DLRM (v1) reference, ids capped at
# 40M per feature (see /work/shared/data/recsys_tables.md).
CRITEO_TB: tuple[int, ...] = (
    45833188, 36746, 17245, 7413, 20243, 3, 7114, 1441, 62, 29275261, 1572176, 345138, 10,
    2209, 11267, 128, 4, 974, 14, 48937457, 11316796, 40094537, 452104, 12606, 104, 35,
)  # fmt: skip


def table_name(i: int) -> str:
    return f"t_cat_{i}"


def feature_name(i: int) -> str:
    return f"f_cat_{i}"


def feature_names(num_features: int) -> list[str]:
    """The KJT keys the model expects, in order: f_cat_0, ..., f_cat_{num_features - 1}."""
    return [feature_name(i) for i in range(num_features)]


def criteo_table_configs(
    scale_rows_to: int | None,
    dim: int,
    cardinalities: Sequence[int] = CRITEO_TB,
) -> list[EmbeddingBagConfig]:
    """One SUM-pooled table per Criteo categorical feature, sized so it fits a machine.

    Table i is named `t_cat_{i}` and reads feature `f_cat_{i}`. With `scale_rows_to=20_000`
    every table has min(cardinality, 20_000) rows (the small tables keep their true size);
    with None the true Criteo Terabyte sizes are used (about 91 GB at dim 128, so build
    those on the `meta` device).
    """
    if scale_rows_to is not None and scale_rows_to < 1:
        raise ValueError(f"scale_rows_to must be at least 1 row or None, got {scale_rows_to}")
    if dim < 1:
        raise ValueError(f"embedding dim must be at least 1, got {dim}")
    return [
        EmbeddingBagConfig(
            num_embeddings=rows if scale_rows_to is None else min(rows, scale_rows_to),
            embedding_dim=dim,
            name=table_name(i),
            feature_names=[feature_name(i)],
            pooling=PoolingType.SUM,
        )
        for i, rows in enumerate(cardinalities)
    ]


def _mlp(in_features: int, sizes: Sequence[int], *, relu_last: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, out_features in enumerate(sizes):
        layers.append(nn.Linear(in_features, out_features))
        if relu_last or i < len(sizes) - 1:
            layers.append(nn.ReLU())
        in_features = out_features
    return nn.Sequential(*layers)


class SparseArch(nn.Module):
    """Pools each categorical feature into one vector: KJT -> [B, F, D]."""

    def __init__(self, tables: Sequence[EmbeddingBagConfig], *, device: torch.device) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(tables=list(tables), device=device)
        self.feature_names: list[str] = [f for t in tables for f in t.feature_names]

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.ebc(features).to_dict()
        # Stack by name rather than reshaping the flat KeyedTensor, so the result does not
        # depend on the key order a sharded EBC returns.
        return torch.stack([pooled[f] for f in self.feature_names], dim=1)


def dot_interaction(dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
    """[B, D] and [B, F, D] -> [B, D + (F + 1) * F / 2]: d followed by every <x_i, x_j>, i < j."""
    vectors = torch.cat([dense.unsqueeze(1), sparse], dim=1)
    dots = torch.bmm(vectors, vectors.transpose(1, 2))
    n = vectors.shape[1]
    rows, cols = torch.triu_indices(n, n, offset=1, device=dots.device)
    return torch.cat([dense, dots[:, rows, cols]], dim=1)


class DLRM(nn.Module):
    """DLRM with one EmbeddingBagCollection at `model.sparse.ebc`.

    Build it on CPU for single-process training, or with `device="meta"` to get the
    embedding tables as shapes only (for sharding: `modular.shard` materialises each rank's
    shards); the dense MLPs are always built, initialised, on CPU:

        tables = criteo_table_configs(scale_rows_to=20_000, dim=32)
        model = DLRM(tables, bottom_mlp=[64, 32], top_mlp=[64, 32])
        logits = model(batch.dense, batch.sparse)  # [B]

    The dense MLPs are initialised before the tables, so under the same
    `torch.manual_seed` a meta-device model has the same dense weights as a CPU one.

    Args:
        tables: one SUM-pooled config per categorical feature, all with embedding dim D.
        bottom_mlp: output sizes of the bottom MLP's layers (ReLU after each); the last
            must equal D, since the dense vector takes part in the dot interaction.
        top_mlp: hidden sizes of the top MLP (ReLU after each); a final Linear to one
            logit is appended.
        dense_in_features: number of dense features (13 for Criteo).
        device: where the embedding tables are built ("cpu" or "meta").
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        *,
        bottom_mlp: Sequence[int],
        top_mlp: Sequence[int],
        dense_in_features: int = NUM_DENSE_FEATURES,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        if not tables:
            raise ValueError("DLRM needs at least one embedding table, got none")
        if not bottom_mlp:
            raise ValueError("bottom_mlp needs at least one layer size, got none")
        dims = {t.name: t.embedding_dim for t in tables}
        dim = bottom_mlp[-1]
        wrong = {name: d for name, d in dims.items() if d != dim}
        if wrong:
            raise ValueError(
                f"every table's embedding dim must equal the bottom MLP's output size {dim} "
                f"(bottom_mlp={list(bottom_mlp)}), but tables {wrong} differ; "
                f"change their embedding_dim or the last bottom_mlp size"
            )
        not_sum = [t.name for t in tables if t.pooling != PoolingType.SUM]
        if not_sum:
            raise ValueError(f"tables {not_sum} must use SUM pooling")
        shared = {t.name: t.feature_names for t in tables if len(t.feature_names) != 1}
        if shared:
            raise ValueError(f"each table must read exactly one feature, got {shared}")
        num_vectors = len(tables) + 1
        # Dense parts first, so their init draws the same random numbers whatever `device`
        # the tables go on (meta tables draw none).
        dense_arch = _mlp(dense_in_features, bottom_mlp, relu_last=True)
        over_arch = _mlp(dim + num_vectors * (num_vectors - 1) // 2, [*top_mlp, 1], relu_last=False)
        self.dense = dense_arch
        self.sparse = SparseArch(tables, device=torch.device(device))
        self.over = over_arch

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        """dense [B, 13] float and sparse KJT with keys f_cat_0.. -> logits [B]."""
        d = self.dense(dense)
        e = self.sparse(sparse)
        # A fresh tensor, not a view: FSDP2 warns when a root module returns a view (B floats).
        return self.over(dot_interaction(d, e)).reshape(-1).clone()
