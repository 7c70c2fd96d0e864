"""The EBC cases: the tables, plans and batches of most runtime tests of `modular.shard`.

Every rank body builds the same unsharded EBC (seeded, `make_ebc`), keeps a deep copy as the
reference, shards the other, and compares the two on the *global* batch: the rank-ordered
concatenation of every rank's local batch (`global_batch`). Gradients follow Note [grad scaling
across ranks]: the reference loss is the mean over ranks of the per-rank losses. Table shapes are
chosen so that no row count and no embedding dim divides evenly by 2, 3 or 4.

`CASES` names a plan that puts every table under one sharding type, or the `mixed` plan (one
table per type, ranks out of order, explicit row sizes, a rank with two shards of one table).
The comparisons are in tests/modular/compare.py.
"""

from __future__ import annotations

import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from planners.types import ShardingPlan, ShardingType, TablePlacement, even_split

# -- tables and plans -----------------------------------------------------------------------------

BATCH = 3
CASES = ("data_parallel", "table_wise", "row_wise", "column_wise", "table_row_wise", "mixed")

SUM, MEAN = PoolingType.SUM, PoolingType.MEAN


def unweighted_tables() -> list[EmbeddingBagConfig]:
    """SUM and MEAN tables; 't_sum' is shared by two features, and 'f_a' also feeds 't_small'."""
    return [
        EmbeddingBagConfig(name="t_sum", num_embeddings=13, embedding_dim=5, feature_names=["f_a", "f_b"], pooling=SUM),
        EmbeddingBagConfig(name="t_mean", num_embeddings=11, embedding_dim=7, feature_names=["f_c"], pooling=MEAN),
        EmbeddingBagConfig(name="t_small", num_embeddings=7, embedding_dim=5, feature_names=["f_d", "f_a"], pooling=MEAN),
        EmbeddingBagConfig(name="t_big", num_embeddings=29, embedding_dim=7, feature_names=["f_e"], pooling=SUM),
    ]


def weighted_tables() -> list[EmbeddingBagConfig]:
    """Per-sample weighted tables (SUM only, as in torchrec); 'w_x' is shared by two features."""
    return [
        EmbeddingBagConfig(name="w_x", num_embeddings=17, embedding_dim=7, feature_names=["g_a", "g_b"], pooling=SUM),
        EmbeddingBagConfig(name="w_y", num_embeddings=5, embedding_dim=5, feature_names=["g_c"], pooling=SUM),
        EmbeddingBagConfig(name="w_z", num_embeddings=23, embedding_dim=7, feature_names=["g_d", "g_a"], pooling=SUM),
    ]


def make_ebc(weighted: bool, *, seed: int = 0, device: torch.device | None = None) -> EmbeddingBagCollection:
    torch.manual_seed(seed)
    tables = weighted_tables() if weighted else unweighted_tables()
    return EmbeddingBagCollection(tables=tables, is_weighted=weighted, device=device)


def features_of(ebc: EmbeddingBagCollection) -> list[str]:
    """The KJT keys the EBC reads, in first-use order."""
    out: list[str] = []
    for cfg in ebc.embedding_bag_configs():
        out += [f for f in cfg.feature_names if f not in out]
    return out


def id_bounds(ebc: EmbeddingBagCollection) -> dict[str, int]:
    """The number of valid ids of each feature: the row count of the smallest table it feeds."""
    bounds: dict[str, int] = {}
    for cfg in ebc.embedding_bag_configs():
        for f in cfg.feature_names:
            bounds[f] = min(bounds.get(f, cfg.num_embeddings), cfg.num_embeddings)
    return bounds


def plan_for(case: str, ebc: EmbeddingBagCollection, world: int, module: str = "") -> ShardingPlan:
    """Every table of `ebc` under one sharding type, or the `mixed` plan."""
    return ShardingPlan(world_size=world, modules={module: placements_for(case, ebc, world)})


def placements_for(case: str, ebc: EmbeddingBagCollection, world: int) -> dict[str, TablePlacement]:
    names = [cfg.name for cfg in ebc.embedding_bag_configs()]
    everyone = tuple(range(world))
    if case == "data_parallel":
        return {n: TablePlacement(ShardingType.DATA_PARALLEL) for n in names}
    if case == "table_wise":  # spread over ranks, starting at the last one
        return {n: TablePlacement(ShardingType.TABLE_WISE, ranks=((world - 1 + i) % world,)) for i, n in enumerate(names)}
    if case == "row_wise":
        return {n: TablePlacement(ShardingType.ROW_WISE) for n in names}
    if case == "column_wise":
        return {n: TablePlacement(ShardingType.COLUMN_WISE) for n in names}
    if case == "table_row_wise":
        return {n: TablePlacement(ShardingType.TABLE_ROW_WISE, ranks=everyone) for n in names}
    if case == "mixed":
        return _mixed(ebc, world)
    raise ValueError(f"unknown case {case!r}")


def _mixed(ebc: EmbeddingBagCollection, world: int) -> dict[str, TablePlacement]:
    """One table per type, with ranks out of order, explicit sizes and a rank holding two shards."""
    everyone = tuple(range(world))
    backwards = everyone[::-1]
    rows = {cfg.name: cfg.num_embeddings for cfg in ebc.embedding_bag_configs()}
    if ebc.is_weighted():
        return {
            "w_x": TablePlacement(ShardingType.DATA_PARALLEL),
            # Not on rank 0 (for world > 1): a rank with no shard of a row-wise table.
            "w_y": TablePlacement(ShardingType.ROW_WISE, ranks=backwards[: max(1, world - 1)]),
            # world + 1 column shards: the last rank holds two of them.
            "w_z": TablePlacement(ShardingType.COLUMN_WISE, ranks=(world - 1, *everyone)),
        }
    # Row shards smaller first (the reverse of even_split), given explicitly.
    sizes = tuple(sorted(even_split(rows["t_big"], world)))
    return {
        "t_sum": TablePlacement(ShardingType.ROW_WISE, ranks=backwards),
        "t_mean": TablePlacement(ShardingType.COLUMN_WISE),
        "t_small": TablePlacement(ShardingType.TABLE_WISE, ranks=(world - 1,)),
        "t_big": TablePlacement(ShardingType.TABLE_ROW_WISE, ranks=everyone, sizes=sizes),
    }


# -- batches --------------------------------------------------------------------------------------


def make_batch(
    ebc: EmbeddingBagCollection,
    *,
    seed: int,
    batch_size: int = BATCH,
    keys: list[str] | None = None,
    empty_feature: str | None = None,
    empty: bool = False,
) -> KeyedJaggedTensor:
    """A random batch with 0-3 ids per bag; the first bag of every feature is empty.

    `empty_feature` has no ids at all in this batch, and with `empty` no feature has any.
    Weighted EBCs get weights in [0.5, 1.5).
    """
    g = torch.Generator().manual_seed(seed)
    keys = keys or features_of(ebc)
    bounds = id_bounds(ebc)
    lengths, values = [], []
    for f in keys:
        n = torch.randint(0, 4, (batch_size,), generator=g)
        n[0] = 0
        if empty or f == empty_feature:
            n.zero_()
        lengths.append(n)
        values.append(torch.randint(0, bounds[f], (int(n.sum()),), generator=g))
    all_values = torch.cat(values)
    weights = torch.rand(all_values.numel(), generator=g) + 0.5 if ebc.is_weighted() else None
    return KeyedJaggedTensor(keys=keys, values=all_values, lengths=torch.cat(lengths), weights=weights)


def rank_batches(ebc: EmbeddingBagCollection, world: int, step: int, **kwargs) -> list[KeyedJaggedTensor]:
    """Every rank's local batch for one step (each rank can build all of them: they are seeded).

    At step 0, rank 0 has no ids at all for its last feature; at step 2 the last rank of a world
    of 2 or more has no ids at all.
    """
    return [
        make_batch(
            ebc,
            seed=1000 * step + r,
            empty_feature=features_of(ebc)[-1] if (step, r) == (0, 0) else None,
            empty=world > 1 and (step, r) == (2, world - 1),
            **kwargs,
        )
        for r in range(world)
    ]


def global_batch(batches: list[KeyedJaggedTensor]) -> KeyedJaggedTensor:
    """The rank-ordered concatenation of the ranks' batches, feature by feature."""
    keys = batches[0].keys()
    lengths, values, weights = [], [], []
    for k in keys:
        for kjt in batches:
            jt = kjt[k]
            lengths.append(jt.lengths())
            values.append(jt.values())
            if kjt.weights_or_none() is not None:
                weights.append(jt.weights())
    return KeyedJaggedTensor(
        keys=keys,
        values=torch.cat(values),
        lengths=torch.cat(lengths),
        weights=torch.cat(weights) if weights else None,
    )


def reorder(kjt: KeyedJaggedTensor, keys: list[str]) -> KeyedJaggedTensor:
    """The same batch with its features in another order."""
    jts = kjt.to_dict()
    weighted = kjt.weights_or_none() is not None
    return KeyedJaggedTensor(
        keys=keys,
        values=torch.cat([jts[k].values() for k in keys]),
        lengths=torch.cat([jts[k].lengths() for k in keys]),
        weights=torch.cat([jts[k].weights() for k in keys]) if weighted else None,
    )
