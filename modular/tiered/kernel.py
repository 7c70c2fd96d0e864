"""fbgemm's fused kernel over a cache of slots, the rows in a `RowStore` (Note [tiered tables] in
modular/tiered/__init__.py)."""

from __future__ import annotations

import dataclasses
import math
import threading
import warnings
from typing import Optional

import torch

from modular.fused.adam import AdamFusedKernel
from modular.fused.fbgemm import FusedKernel
from modular.tiered.slots import SlotMap
from modular.tiered.store import RowStore

__all__ = ["TierStats", "TieredKernel", "cache_rows_for"]


def cache_rows_for(rows: int, load_factor: float) -> int:
    return max(1, min(rows, math.ceil(rows * load_factor)))


@dataclasses.dataclass
class TierStats:
    """Counts of one tiered table since the last `tier_stats` call."""

    cache_rows: int = 0
    hits: int = 0
    misses: int = 0  # ids missing at a step's lookup (prefetched rows are hits)
    rows_fetched: int = 0  # rows read from the store, by steps and prefetches
    rows_written_back: int = 0
    bytes_fetched: int = 0  # what those rows and their optimizer state took between the tiers
    bytes_written_back: int = 0


class TieredKernel:
    """`FusedKernel` on caches of `cache_rows[t]` slots per kernel table over `stores[t]`, which
    hold every row and its state. `views` and `states` are the stores' (what the module's table
    weights and the fused optimizer's state alias); `sync` makes them current. `tables[t]` names
    each kernel table for errors and stats."""

    def __init__(
        self, group, sizes, device, config, *, tables: list[str], cache_rows: list[int],
        stores: list[RowStore], policies: list[str], steps=None,
    ) -> None:  # fmt: skip
        self.group, self.sizes, self.config, self.device = group, list(sizes), config, device
        self.tables, self.stores, self._steps = list(tables), list(stores), steps
        self.views = [torch.nn.Parameter(s.weights, requires_grad=False) for s in stores]
        self.states = [dict(s.states) for s in stores]
        self.maps = [SlotMap(t, r, c, p) for t, (r, _), c, p in zip(tables, sizes, cache_rows, policies)]
        self.stats = [TierStats(cache_rows=c) for c in cache_rows]
        self.ftm = torch.tensor(group.feature_table_map, dtype=torch.int64, device=device)
        self.inner = self._cache(cache_rows)
        self.nobag = self.inner.nobag
        # A background prefetch (Note [tiered prefetch]) against `sync` from the caller's thread.
        self._lock = threading.Lock()

    def _cache(self, cache_rows: list[int]):
        """The kernel over the caches: fbgemm's fused TBE, or the Adam family's emulation
        (Note [fused Adam and LAMB]), whose end-of-backward update reaches it through this
        kernel (`__getattr__`), so that a grown cache is the one updated."""
        sizes = [(c, cols) for c, (_, cols) in zip(cache_rows, self.sizes)]
        if self.config.optimizer.adam_family():
            return AdamFusedKernel(self.group, sizes, self.device, self.config, steps=self._steps)
        return FusedKernel(self.group, sizes, self.device, self.config, steps=self._steps)

    def __getattr__(self, name: str):
        if name == "inner":  # not built yet
            raise AttributeError(name)
        return getattr(self.inner, name)  # the cache kernel's update and its pending gradients

    def _grow(self, t: int, need: int) -> None:
        """Table t's cache takes `need` slots at least: a step's distinct rows must all be in
        it at once. Rebuilt larger, the cached rows and state copied as they are (slots keep
        their numbers); only ever from a forward, never while a backward updates the cache."""
        old = self.inner
        rows = [m.cache_rows for m in self.maps]
        rows[t] = max(need, math.ceil(rows[t] * 1.25))
        warnings.warn(
            f"tiered table {self.tables[t]!r}: a step looks up {need} distinct rows of a shard "
            f"whose cache has {self.maps[t].cache_rows} slots; the cache grows to {rows[t]} slots "
            "(raise its cache_load_factor to start there)",
            stacklevel=4,
        )
        self.inner = self._cache(rows)
        for u, m in enumerate(self.maps):
            n = m.cache_rows
            self.inner.views[u].data[:n] = old.views[u].data
            for name, x in self.inner.states[u].items():
                x[:n] = old.states[u][name]
        self.maps[t].grow(rows[t])
        self.stats[t].cache_rows = rows[t]

    def _cached(self, t: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Table t's cache: weights and state, as `.data` so that filling a slot does not bump
        the version of the tensors fbgemm's forward saved for its backward (a prefetch writes
        other slots between a step's forward and backward: Note [tiered prefetch])."""
        return self.inner.views[t].data, {n: x.data for n, x in self.inner.states[t].items()}

    def _move(self, ids: list[torch.Tensor], *, step: bool) -> list[Optional[torch.Tensor]]:
        """Slots for the unique `ids[t]` of each table, the rows moved between the tiers: every
        table's slots chosen first, then every missing row asked of the store at once
        (`will_need`), then the moves. A prefetch that does not fit a table gives None there."""
        if step:
            for t, u in enumerate(ids):
                if u.numel() > self.maps[t].cache_rows:
                    self._grow(t, u.numel())
        ids = [u.cpu() for u in ids]  # the slot maps live on the host, as the stores do
        moves = [m.assign(u, step=step) for m, u in zip(self.maps, ids)]
        for t, mv in enumerate(moves):
            if mv is not None and mv.load_ids.numel():
                self.stores[t].will_need(mv.load_ids)
        for t, (mv, u) in enumerate(zip(moves, ids)):
            if mv is not None:
                self._apply(t, mv, u.numel() if step else None)
        return [None if mv is None else mv.slots.to(self.device) for mv in moves]

    def _apply(self, t: int, moves, looked_up: Optional[int]) -> None:
        """Writes table t's evicted dirty rows back, reads its missing rows in; `looked_up`: a
        step's distinct ids (counted as hits or misses), None for a prefetch."""
        cache, states = self._cached(t)
        store, stats = self.stores[t], self.stats[t]
        if moves.evict_ids.numel():
            order = torch.argsort(moves.evict_ids)
            s = moves.evict_slots[order].to(self.device)
            store.write(moves.evict_ids[order], cache[s].cpu(), {n: x[s].cpu() for n, x in states.items()})
            stats.rows_written_back += moves.evict_ids.numel()
            stats.bytes_written_back += moves.evict_ids.numel() * store.row_bytes
        if moves.load_ids.numel():
            order = torch.argsort(moves.load_ids)
            s = moves.load_slots[order].to(self.device)
            rows, loaded = store.read(moves.load_ids[order])
            cache[s] = rows.to(self.device, cache.dtype, non_blocking=True)
            for name, x in states.items():
                x[s] = loaded[name].to(self.device, non_blocking=True)
            stats.rows_fetched += moves.load_ids.numel()
            stats.bytes_fetched += moves.load_ids.numel() * store.row_bytes
        if looked_up is not None:
            stats.hits += moves.hits
            stats.misses += looked_up - moves.hits

    def _tables_of(self, offsets: torch.Tensor) -> torch.Tensor:
        """Each id's kernel table (every route holds the same number of bags)."""
        bags = (offsets.numel() - 1) // self.ftm.numel()
        lengths = offsets[1:] - offsets[:-1]
        return self.ftm.repeat_interleave(bags).repeat_interleave(lengths)

    def _renumber(self, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        table_of = self._tables_of(offsets)
        out = torch.empty_like(indices)
        masks = [table_of == t for t in range(len(self.maps))]
        found = [torch.unique(indices[m].long(), return_inverse=True) for m in masks]
        with self._lock:
            slots = self._move([ids for ids, _ in found], step=True)
        for mask, (_, inverse), s in zip(masks, found, slots):
            out[mask] = s[inverse].to(indices.dtype)
        return out

    def prefetch_rows(self, ids: list[torch.Tensor]) -> None:
        """Brings rows `ids[t]` of each kernel table (a coming step's) into the cache, beside
        the current step's; a table whose free slots cannot take them is left to its step."""
        unique = [torch.unique(rows.long()) for rows in ids]
        with self._lock:
            self._move(unique, step=False)

    def prefetch(self, indices: torch.Tensor, offsets: torch.Tensor) -> None:
        """`prefetch_rows` for a coming lookup of this kernel."""
        table_of = self._tables_of(offsets)
        self.prefetch_rows([indices[table_of == t] for t in range(len(self.maps))])

    def __call__(
        self, indices: torch.Tensor, offsets: torch.Tensor, weights: Optional[torch.Tensor]
    ) -> torch.Tensor:
        slots = self._renumber(indices, offsets)  # may grow a cache: a new `inner`
        return self.inner(slots, offsets, weights)

    def cached_rows(self, t: int, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of kernel table t as the current step looks them up (all cached)."""
        slots = self.maps[t].slot_of[ids.long().cpu()].to(self.device)
        return self.inner.views[t].data[slots]

    def sync(self) -> None:
        """Writes every dirty cached row back and empties the caches: the stores (`views`,
        `states`) are then current, and what is written into them is what the next lookups
        read."""
        with self._lock:
            for t, m in enumerate(self.maps):
                ids, slots = m.dirty_rows()
                cache, states = self._cached(t)
                slots = slots.to(self.device)
                self.stores[t].write(ids, cache[slots].cpu(), {n: x[slots].cpu() for n, x in states.items()})
                self.stats[t].rows_written_back += ids.numel()
                self.stats[t].bytes_written_back += ids.numel() * self.stores[t].row_bytes
                m.clear()

    def take_stats(self) -> dict[str, dict[str, int]]:
        out = {t: dataclasses.asdict(s) for t, s in zip(self.tables, self.stats)}
        self.stats = [TierStats(cache_rows=s.cache_rows) for s in self.stats]
        return out
