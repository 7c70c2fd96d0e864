"""The sequence cases (test_sequence_*.py): two EmbeddingCollections beside an EBC.

`SeqModel` holds `seq_a` (three tables, one of them read by two features), `seq_b` (two tables)
and an EBC `bags` of one table; every rank body builds the same seeded model (`make_seq_model`),
keeps a deep copy as the reference and shards the other by `seq_plan_for` (the EBC cases' `CASES`
over the EC tables, plus a row-wise bag table), then compares the two on the global batch
(`seq_global_batch`: every rank's sequences of a feature, in rank order), as the EBC cases do.
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from planners.types import ShardingPlan, ShardingType, TablePlacement, even_split
from tests.modular.ebc_cases import BATCH


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


def make_seq_model(*, seed: int = 0, device: torch.device | None = None) -> SeqModel:
    torch.manual_seed(seed)
    return SeqModel(device)


SEQ_FEATURES = {"seq_a": ["item", "hist", "cat"], "seq_b": ["user_seq", "v_seq"], "bags": ["dense_id"]}
SEQ_BOUNDS = {"item": 13, "hist": 29, "cat": 7, "user_seq": 11, "v_seq": 17, "dense_id": 9}


def seq_placements_for(case: str, tables: list, world: int) -> dict[str, TablePlacement]:
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


def seq_plan_for(case: str, world: int) -> ShardingPlan:
    return ShardingPlan(
        world_size=world,
        modules={
            "seq_a": seq_placements_for(case, seq_a_tables(), world),
            "seq_b": _seq_mixed_b(world) if case == "mixed" else seq_placements_for(case, seq_b_tables(), world),
            "bags": {"b": TablePlacement(ShardingType.ROW_WISE)},
        },
    )


def _seq_mixed_b(world: int) -> dict[str, TablePlacement]:
    """A data-parallel table beside column pieces (world + 1 of them, the last rank two)."""
    return {
        "u": TablePlacement(ShardingType.COLUMN_WISE, ranks=(world - 1, *range(world))),
        "v": TablePlacement(ShardingType.DATA_PARALLEL),
    }


def seq_make_batch(keys: list[str], *, seed: int, empty_feature: str | None = None, empty: bool = False) -> KeyedJaggedTensor:
    """Sequences of 0-4 ids; the first of every feature is empty (an empty sequence)."""
    g = torch.Generator().manual_seed(seed)
    lengths, values = [], []
    for f in keys:
        n = torch.randint(0, 5, (BATCH,), generator=g)
        n[0] = 0
        if empty or f == empty_feature:
            n.zero_()
        lengths.append(n)
        values.append(torch.randint(0, SEQ_BOUNDS[f], (int(n.sum()),), generator=g))
    return KeyedJaggedTensor(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))


def seq_rank_batches(world: int, step: int) -> list[dict[str, KeyedJaggedTensor]]:
    """Every rank's batches (per module) for one step. At step 0 rank 0 has no 'cat' ids at all;
    at step 2 the last rank of a world of 2 or more has no ids at all."""
    out = []
    for r in range(world):
        empty = world > 1 and (step, r) == (2, world - 1)
        out.append(
            {
                m: seq_make_batch(
                    keys, seed=1000 * step + 10 * r + i,
                    empty_feature="cat" if (step, r) == (0, 0) else None, empty=empty,
                )
                for i, (m, keys) in enumerate(SEQ_FEATURES.items())
            }
        )
    return out


def seq_global_batch(batches: list[KeyedJaggedTensor]) -> KeyedJaggedTensor:
    keys = batches[0].keys()
    lengths, values = [], []
    for k in keys:
        for kjt in batches:
            lengths.append(kjt[k].lengths())
            values.append(kjt[k].values())
    return KeyedJaggedTensor(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))
