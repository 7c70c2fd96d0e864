"""A tiered fused kernel (Note [tiered tables] in modular/tiered/__init__.py) against the same
fbgemm kernel with every row resident: outputs, weights and optimizer state bit for bit, caches
from 1% to 100% of the rows, LRU and LFU, with and without prefetch; one process."""

from __future__ import annotations

import gc
import os
from types import SimpleNamespace

import pytest
import torch

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
    kind = config.optimizer
    stores = [
        RowStore(str(tmp_path / f"t{t}"), r, c, {n: (r,) if kind.row_state(n) else (r, c) for n in kind.state_names()})
        for t, (r, c) in enumerate(sizes)
    ]
    for t, store in enumerate(stores):
        store.weights.copy_(init[t])
    cache = [cache_rows_for(r, factor) for r in ROWS]
    bag = 1 if factor < 0.05 else 3  # distinct ids per step within a 1% cache (8 and 4 slots)
    tier = TieredKernel(
        _group(), sizes, dev, config, tables=["a", "b"], cache_rows=cache, stores=stores, policies=[policy] * 2
    )
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
        grown = [s["cache_rows"] for s in stats.values()]
        assert all(g >= c for g, c in zip(grown, cache)), (grown, cache)
    tier.sync()
    for t, store in enumerate(stores):
        assert torch.equal(tier.views[t], ref.views[t].data), f"table {t}: weights differ"
        for name, state in ref.states[t].items():
            assert torch.equal(tier.states[t][name], state), f"table {t}: optimizer state {name} differs"
    return step_misses, cache, grown


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad"])
@pytest.mark.parametrize("factor", [0.01, 0.1, 1.0])
def test_tiered_equals_resident(optimizer, factor, tmp_path):
    _run(optimizer, factor, "lru", False, tmp_path)


def test_weighted_ids(tmp_path):
    _run("rowwise_adagrad", 0.01, "lfu", False, tmp_path, weighted=True)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_policies_and_prefetch(policy, tmp_path):
    misses, _, _ = _run("rowwise_adagrad", 0.1, policy, False, tmp_path / "plain")
    assert sum(misses) > 0  # a 10% cache misses
    misses, _, _ = _run("rowwise_adagrad", 0.1, policy, True, tmp_path / "pre")
    assert misses[0] > 0 and misses[1:] == [0] * (STEPS - 1), misses  # prefetched steps never miss


def test_step_larger_than_cache_grows_it(tmp_path):
    """A step with more distinct rows than a cache has slots grows that cache (with a warning
    naming the table) and stays exact."""
    with pytest.warns(UserWarning, match="tiered table 'a': a step looks up .* the cache grows"):
        _, cache, grown = _run("rowwise_adagrad", 0.005, "lru", False, tmp_path)
    assert cache[0] == 4 and grown[0] > 4, (cache, grown)


def _mapping_of(tensor: torch.Tensor) -> str:
    """The line of /proc/self/maps whose range holds `tensor`'s data."""
    ptr = tensor.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= ptr < hi:
                return line.strip()
    return ""


def test_stores_and_load_staging_are_files_not_anonymous_memory(tmp_path):
    """A store's tensors are mapped from its files, and a checkpoint load stages a tiered
    shard in a file beside them (unlinked at once), so neither holds the shard in anonymous
    memory; an ordinary tensor gets no file."""
    from modular.checkpoint._entries import _fresh
    from modular.tiered.store import file_backed_like

    store = RowStore(str(tmp_path / "s"), 5000, 16, {"row_sum": (5000,)})
    assert str(tmp_path / "s.weight.npy") in _mapping_of(store.weights)
    staged = _fresh(store.weights, (5000, 16), torch.float32)
    line = _mapping_of(staged)
    assert "staging." in line and "(deleted)" in line, line
    assert not [f for f in tmp_path.iterdir() if f.name.startswith("staging.")]
    assert file_backed_like(torch.zeros(5000, 16), (5000, 16), torch.float32) is None
    paths = list(store.paths)
    del store
    gc.collect()
    assert not any(os.path.exists(p) for p in paths)


class _Advice:
    """Records a mapping's madvise calls as page sets."""

    def __init__(self) -> None:
        self.pages: list[set[int]] = []

    def madvise(self, option: int, start: int, length: int) -> None:
        import mmap

        assert option == mmap.MADV_WILLNEED and start % mmap.PAGESIZE == 0 and length > 0
        self.pages.append(set(range(start // mmap.PAGESIZE, (start + length) // mmap.PAGESIZE)))


@pytest.mark.parametrize("cols", [1, 16, 64, 2000])
def test_will_need_asks_for_exactly_the_rows_pages_in_disjoint_runs(cols, tmp_path):
    """`RowStore.will_need` covers every page of the rows asked for and no other, one call per
    run of touching pages (rows narrower and wider than a page, duplicates, unsorted)."""
    import mmap

    store = RowStore(str(tmp_path / "s"), 10_000, cols, {})
    offset = store._maps[0][1]
    advice = _Advice()
    store._maps = [(advice, offset, cols * 4)]
    ids = torch.tensor([9_999, 3, 4, 5, 700, 701, 5, 4_096, 0, 9_000])
    store.will_need(ids)
    want = {p for i in ids.tolist()
            for p in range((offset + i * cols * 4) // mmap.PAGESIZE, (offset + (i + 1) * cols * 4 - 1) // mmap.PAGESIZE + 1)}
    got = [p for run in advice.pages for p in run]
    assert sorted(got) == sorted(want), "pages asked for differ from the rows' pages"
    assert len(got) == len(set(got)), "runs overlap"
    runs = sorted((min(r), max(r)) for r in advice.pages)
    assert all(b[0] > a[1] + 1 for a, b in zip(runs, runs[1:])), f"touching runs not merged: {runs}"
