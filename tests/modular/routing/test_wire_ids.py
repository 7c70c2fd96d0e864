"""Routed ids travel and are looked up as int32 while every shard has fewer than 2**31 rows
(Note [ids on the wire]); a rank with more ids than int32 can count makes every rank send int64
for that step, and a rank that receives that many looks them up with int64 offsets. Each case
trains against the unsharded reference (tests/modular/fused/test_fused.py's `_train`)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

import modular.collection as collection
import modular.pooled.pooled_part as eb
from modular.routing.router import INT32_MAX, Router, wire_dtype
from modular.tables.layout import build_layout
from modular.tables.weights import table_infos
from planners.types import ShardingType, TablePlacement
from tests.dist import run_on_ranks
from tests.modular.fused.test_fused import _train


def test_ids_are_int32_up_to_shards_of_2_31_rows() -> None:
    assert wire_dtype(0) == torch.int32
    assert wire_dtype(INT32_MAX) == torch.int32
    assert wire_dtype(INT32_MAX + 1) == torch.int64


def test_merged_int32_batches_past_int32_offsets_become_int64(monkeypatch) -> None:
    import modular.kernels.lookups as lookups

    def lookup(ids: list[int], lengths: list[int]) -> lookups.Lookup:
        offsets = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
        return lookups.Lookup.of(torch.randn(len(lengths), 4), torch.tensor(ids, dtype=torch.int32), offsets, None)

    batches = [lookup([1, 2, 3], [2, 1]), lookup([4, 5], [0, 2])]  # one route, two bags each
    narrow = lookups.merge_lookups(batches, routes=1)
    monkeypatch.setattr(lookups, "INT32_MAX", 4)  # 5 merged ids are "past int32"
    wide = lookups.merge_lookups(batches, routes=1)
    assert narrow.indices.dtype == narrow.offsets.dtype == torch.int32
    assert wide.indices.dtype == wide.offsets.dtype == torch.int64
    assert wide.indices.tolist() == narrow.indices.tolist() == [1, 2, 3, 4, 5]
    assert wide.offsets.tolist() == narrow.offsets.tolist() == [0, 2, 3, 3, 5]


def _router(rows: int, placement: TablePlacement, world: int) -> Router:
    config = EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=rows, feature_names=["f"])
    tables = table_infos(EmbeddingBagCollection(tables=[config], device=torch.device("meta")), "m")
    shards = (placement.shards(num_embeddings=rows, embedding_dim=8, world_size=world, table="t"),)
    layout = build_layout(tables, (placement,), shards, world_size=world, rank=0)
    return Router(layout, module="m", is_weighted=False, device=torch.device("cpu"))


@pytest.mark.parametrize(
    "rows, placement, expected",
    [
        (3_000_000_000, TablePlacement(ShardingType.TABLE_WISE, ranks=(0,)), torch.int64),
        (3_000_000_000, TablePlacement(ShardingType.COLUMN_WISE, ranks=(0, 1)), torch.int64),
        # Row-wise ids are rows of their shard: 1.5e9 each.
        (3_000_000_000, TablePlacement(ShardingType.ROW_WISE, ranks=(0, 1)), torch.int32),
        (INT32_MAX, TablePlacement(ShardingType.TABLE_WISE, ranks=(0,)), torch.int32),
    ],
)
def test_the_tallest_shard_decides_the_wire_dtype(rows, placement, expected) -> None:
    assert _router(rows, placement, world=2).ids_dtype == expected


def _train_watching_dtypes(case: str, mode: str) -> tuple[float, list[torch.dtype], list[torch.dtype]]:
    """Trains `case`; records the dtype of the ids each lookup receives and of the offsets the
    kernels get. mode "wide_rank0": rank 0 counts any batch as too large for int32; "promote":
    every lookup counts its received ids as too many for int32 offsets."""
    import modular.kernels.lookups as lookups

    received, offsets = [], []
    lookup, pool, saved = eb.PooledPart.lookup, eb.pool, collection.INT32_MAX

    def spy_lookup(self, shards, r):
        received.append(r.values.dtype)
        if mode != "promote":
            return lookup(self, shards, r)
        lookups.INT32_MAX = 0  # batch_offsets: "more ids than int32 offsets can count"
        try:
            return lookup(self, shards, r)
        finally:
            lookups.INT32_MAX = saved

    def spy_pool(kernels, values, offs, weights, bags):
        offsets.append(offs.dtype)
        assert values.dtype == offs.dtype
        return pool(kernels, values, offs, weights, bags)

    eb.PooledPart.lookup, eb.pool = spy_lookup, spy_pool
    if mode == "wide_rank0" and dist.get_rank() == 0:
        collection.INT32_MAX = 0  # where the input dist reads it
    try:
        worst = _train(case, "exact_rowwise_adagrad")["worst"]
    finally:
        eb.PooledPart.lookup, eb.pool, collection.INT32_MAX = lookup, pool, saved
    return worst, received, offsets


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["default", "wide_rank0", "promote"])
@pytest.mark.parametrize("case", ["row_wise", "column_wise", "mixed"])
def test_wire_dtype_and_parity(case: str, mode: str) -> None:
    results = run_on_ranks(2, _train_watching_dtypes, case, mode, timeout=100)
    wire = torch.int64 if mode == "wide_rank0" else torch.int32
    kernel = torch.int32 if mode == "default" else torch.int64
    for rank, (worst, received, offsets) in enumerate(results):
        assert worst < 1e-5, f"rank {rank}: {case}/{mode} differs from the reference by {worst}"
        assert received and set(received) == {wire}, (rank, received)
        assert offsets and set(offsets) == {kernel}, (rank, offsets)
