"""Small EmbeddingCollections, plans and batches for the sharded EmbeddingCollection's tests.

A model holds two EmbeddingCollections of different dims (5 and 8) and one EBC: 'item' feeds two
tables (keys 'item@s_big', 'item@s_mid'), table 's_big' is shared by 'item' and 'hist'. No row
count divides evenly by 2, 3 or 4, and column-wise pieces of the dim-5 tables are uneven.
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from planners.types import ShardingPlan, ShardingType, TablePlacement, even_split

BATCH = 3
CASES = ("data_parallel", "table_wise", "row_wise", "column_wise", "table_row_wise", "mixed")


def seq_a_tables() -> list[EmbeddingConfig]:
    return [
        EmbeddingConfig(name="s_big", num_embeddings=29, embedding_dim=5, feature_names=["item", "hist"]),
        EmbeddingConfig(name="s_mid", num_embeddings=13, embedding_dim=5, feature_names=["item"]),
        EmbeddingConfig(name="s_small", num_embeddings=7, embedding_dim=5, feature_names=["cat"]),
    ]


def seq_b_tables() -> list[EmbeddingConfig]:
    return [
        EmbeddingConfig(name="u", num_embeddings=11, embedding_dim=8, feature_names=["user_seq"]),
        EmbeddingConfig(name="v", num_embeddings=17, embedding_dim=8, feature_names=["v_seq"]),
    ]


def bag_tables() -> list[EmbeddingBagConfig]:
    return [EmbeddingBagConfig(name="b", num_embeddings=9, embedding_dim=4, feature_names=["dense_id"])]


class SeqModel(nn.Module):
    """Two EmbeddingCollections and an EBC, their outputs into one loss-ready tensor."""

    def __init__(self, device: torch.device | None = None) -> None:
        super().__init__()
        self.seq_a = EmbeddingCollection(tables=seq_a_tables(), device=device)
        self.seq_b = EmbeddingCollection(tables=seq_b_tables(), device=device)
        self.bags = EmbeddingBagCollection(tables=bag_tables(), device=device)

    def forward(self, a: KeyedJaggedTensor, b: KeyedJaggedTensor, c: KeyedJaggedTensor):
        return self.seq_a(a), self.seq_b(b), self.bags(c)


def make_model(*, seed: int = 0, device: torch.device | None = None) -> SeqModel:
    torch.manual_seed(seed)
    return SeqModel(device)


FEATURES = {"seq_a": ["item", "hist", "cat"], "seq_b": ["user_seq", "v_seq"], "bags": ["dense_id"]}
BOUNDS = {"item": 13, "hist": 29, "cat": 7, "user_seq": 11, "v_seq": 17, "dense_id": 9}


def placements_for(case: str, tables: list, world: int) -> dict[str, TablePlacement]:
    names = [t.name for t in tables]
    everyone = tuple(range(world))
    if case == "data_parallel":
        return {n: TablePlacement(ShardingType.DATA_PARALLEL) for n in names}
    if case == "table_wise":
        return {n: TablePlacement(ShardingType.TABLE_WISE, ranks=((world - 1 + i) % world,)) for i, n in enumerate(names)}
    if case == "row_wise":
        return {n: TablePlacement(ShardingType.ROW_WISE) for n in names}
    if case == "column_wise":
        return {n: TablePlacement(ShardingType.COLUMN_WISE) for n in names}
    if case == "table_row_wise":
        return {n: TablePlacement(ShardingType.TABLE_ROW_WISE, ranks=everyone) for n in names}
    if case == "mixed":
        backwards = everyone[::-1]
        kinds = [
            TablePlacement(ShardingType.ROW_WISE, ranks=backwards),
            # world + 1 column pieces: the last rank holds two, one of them 1 column wide
            TablePlacement(ShardingType.COLUMN_WISE, ranks=(world - 1, *everyone)),
            TablePlacement(ShardingType.TABLE_WISE, ranks=(world - 1,)),
            TablePlacement(ShardingType.DATA_PARALLEL),
        ]
        out = {}
        for i, t in enumerate(tables):
            p = kinds[i % len(kinds)]
            if i == 0 and world > 1:  # row shards smaller first, given explicitly
                sizes = tuple(sorted(even_split(t.num_embeddings, world)))
                p = TablePlacement(ShardingType.TABLE_ROW_WISE, ranks=everyone, sizes=sizes)
            out[t.name] = p
        return out
    raise ValueError(f"unknown case {case!r}")


def plan_for(case: str, world: int) -> ShardingPlan:
    return ShardingPlan(
        world_size=world,
        modules={
            "seq_a": placements_for(case, seq_a_tables(), world),
            "seq_b": _mixed_b(world) if case == "mixed" else placements_for(case, seq_b_tables(), world),
            "bags": {"b": TablePlacement(ShardingType.ROW_WISE)},
        },
    )


def _mixed_b(world: int) -> dict[str, TablePlacement]:
    """A data-parallel table beside column pieces (world + 1 of them, the last rank two)."""
    return {
        "u": TablePlacement(ShardingType.COLUMN_WISE, ranks=(world - 1, *range(world))),
        "v": TablePlacement(ShardingType.DATA_PARALLEL),
    }


def make_batch(keys: list[str], *, seed: int, empty_feature: str | None = None, empty: bool = False) -> KeyedJaggedTensor:
    """Sequences of 0-4 ids; the first of every feature is empty (an empty sequence)."""
    g = torch.Generator().manual_seed(seed)
    lengths, values = [], []
    for f in keys:
        n = torch.randint(0, 5, (BATCH,), generator=g)
        n[0] = 0
        if empty or f == empty_feature:
            n.zero_()
        lengths.append(n)
        values.append(torch.randint(0, BOUNDS[f], (int(n.sum()),), generator=g))
    return KeyedJaggedTensor(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))


def rank_batches(world: int, step: int) -> list[dict[str, KeyedJaggedTensor]]:
    """Every rank's batches (per module) for one step. At step 0 rank 0 has no 'cat' ids at all;
    at step 2 the last rank of a world of 2 or more has no ids at all."""
    out = []
    for r in range(world):
        empty = world > 1 and (step, r) == (2, world - 1)
        out.append(
            {
                m: make_batch(
                    keys, seed=1000 * step + 10 * r + i,
                    empty_feature="cat" if (step, r) == (0, 0) else None, empty=empty,
                )
                for i, (m, keys) in enumerate(FEATURES.items())
            }
        )
    return out


def global_batch(batches: list[KeyedJaggedTensor]) -> KeyedJaggedTensor:
    keys = batches[0].keys()
    lengths, values = [], []
    for k in keys:
        for kjt in batches:
            lengths.append(kjt[k].lengths())
            values.append(kjt[k].values())
    return KeyedJaggedTensor(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))
