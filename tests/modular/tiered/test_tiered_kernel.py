"""A tiered fused kernel (Note [tiered tables] in modular/tiered/__init__.py) against the same
fbgemm kernel with every row resident: outputs, weights and optimizer state bit for bit, caches
from 1% to 100% of the rows, LRU and LFU, with and without prefetch; one process."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from modular.errors import InputError
from modular.fused.config import FusedConfig, FusedOptimizerKind
from modular.fused.fbgemm import FusedKernel
from modular.tables.layout import KernelGroup, Pooling
from modular.tiered import RowStore, TieredKernel
from modular.tiered.kernel import cache_rows_for

ROWS, COLS, FTM, BAGS, STEPS = (800, 400), (8, 16), (0, 0, 1), 4, 5


def _group() -> KernelGroup:
    routes = tuple(SimpleNamespace(shard=SimpleNamespace(num_cols=COLS[t])) for t in FTM)
    return KernelGroup(pooling=Pooling.SUM, routes=routes, shards=(("a", 0), ("b", 0)), feature_table_map=FTM)


def _batch(gen: torch.Generator, bag: int):
    lengths = torch.randint(0, bag + 1, (len(FTM) * BAGS,), generator=gen)
    rows = torch.tensor([ROWS[t] for t in FTM]).repeat_interleave(BAGS).repeat_interleave(lengths)
    ids = (torch.rand(int(lengths.sum()), generator=gen) ** 3 * rows).long()  # skewed, duplicates
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    return ids, offsets


def _run(optimizer: str, factor: float, policy: str, prefetch: bool, tmp_path, weighted=False):
    config = FusedConfig(FusedOptimizerKind.parse(optimizer), {"lr": 0.05, "eps": 1e-3})
    sizes = list(zip(ROWS, COLS))
    dev = torch.device("cpu")
    ref = FusedKernel(_group(), sizes, dev, config)
    init = [torch.randn(r, c, generator=torch.Generator().manual_seed(r)) for r, c in sizes]
    for view, w in zip(ref.views, init):
        view.data.copy_(w)
    widths = [sum(s.view(r, -1).shape[1] for s in st.values()) for st, r in zip(ref.states, ROWS)]
    stores = [RowStore(str(tmp_path / f"t{t}.npy"), r, c, w) for t, ((r, c), w) in enumerate(zip(sizes, widths))]
    for t, store in enumerate(stores):
        store.fill(init[t], torch.zeros(ROWS[t], widths[t]))
    cache = [cache_rows_for(r, factor) for r in ROWS]
    bag = 1 if factor < 0.05 else 3  # distinct ids per step within a 1% cache (8 and 4 slots)
    tier = TieredKernel(_group(), sizes, dev, config, tables=["a", "b"], cache_rows=cache, stores=stores, policy=policy)
    gen = torch.Generator().manual_seed(7)
    batches = [_batch(gen, bag) for _ in range(STEPS + 1)]
    step_misses = []
    for i in range(STEPS):
        ids, offsets = batches[i]
        grad = torch.randn(BAGS, sum(COLS[t] for t in FTM), generator=gen)
        w = torch.rand(ids.numel(), generator=gen) if weighted else None
        a, b = ref(ids, offsets, w), tier(ids, offsets, w)
        assert torch.equal(a, b), f"step {i}: outputs differ"
        (a * grad).sum().backward()
        (b * grad).sum().backward()
        if prefetch:
            tier.prefetch(*batches[i + 1])
        stats = tier.take_stats()
        step_misses.append(sum(s["misses"] for s in stats.values()))
        if not prefetch:  # rows move only for misses: one read each, dirty ones written back
            assert [s["rows_fetched"] for s in stats.values()] == [s["misses"] for s in stats.values()]
        assert [s["cache_rows"] for s in stats.values()] == cache
    tier.flush()
    for t, store in enumerate(stores):
        state = torch.cat([s.view(ROWS[t], -1) for s in ref.states[t].values()] or [torch.zeros(ROWS[t], 0)], 1)
        got = torch.from_numpy(store.records[:])
        assert torch.equal(got[:, : COLS[t]], ref.views[t].data), f"table {t}: weights differ"
        assert torch.equal(got[:, COLS[t] :], state), f"table {t}: optimizer state differs"
    return step_misses, cache


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad"])
@pytest.mark.parametrize("factor", [0.01, 0.1, 1.0])
def test_tiered_equals_resident(optimizer, factor, tmp_path):
    _run(optimizer, factor, "lru", False, tmp_path)


def test_weighted_ids(tmp_path):
    _run("rowwise_adagrad", 0.01, "lfu", False, tmp_path, weighted=True)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_policies_and_prefetch(policy, tmp_path):
    misses, _ = _run("rowwise_adagrad", 0.1, policy, False, tmp_path / "plain")
    assert sum(misses) > 0  # a 10% cache misses
    misses, _ = _run("rowwise_adagrad", 0.1, policy, True, tmp_path / "pre")
    assert misses[0] > 0 and misses[1:] == [0] * (STEPS - 1), misses  # prefetched steps never miss


def test_step_larger_than_cache(tmp_path):
    with pytest.raises(InputError, match="table 'a'.*raise its cache_load_factor"):
        _run("sgd", 0.005, "lru", False, tmp_path)
