"""fbgemm's fused kernel over a cache of slots, the rows in a `RowStore` (Note [tiered tables] in
modular/tiered/__init__.py)."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

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


class TieredKernel:
    """`FusedKernel` on caches of `cache_rows[t]` slots per kernel table; `stores[t]` hold all
    rows and state (filled by the caller). `tables[t]` names each for errors and stats."""

    def __init__(self, group, sizes, device, config, *, tables, cache_rows, stores, policy) -> None:
        if device.type != "cpu":
            raise NotImplementedError("tiered tables run on CPU only so far (Note [tiered tables])")
        self.sizes, self.tables, self.stores = list(sizes), list(tables), list(stores)
        cached = [(c, cols) for c, (_, cols) in zip(cache_rows, sizes)]
        self.inner = FusedKernel(group, cached, device, config)
        self.ftm = torch.tensor(group.feature_table_map, dtype=torch.int64)
        self.maps = [SlotMap(t, r, c, policy) for t, (r, _), c in zip(tables, sizes, cache_rows)]
        self.stats = [TierStats(cache_rows=c) for c in cache_rows]
        self.state_names = config.optimizer.state_names()

    def _state(self, t: int) -> list[torch.Tensor]:
        """Table t's state tensors as (cache_rows, width) views."""
        return [s.view(s.shape[0], -1) for s in self.inner.states[t].values()]

    def _move(self, t: int, ids: torch.Tensor, *, step: bool) -> torch.Tensor:
        moves = self.maps[t].assign(ids, step=step)
        weights, states = self.inner.views[t].data, self._state(t)
        store, stats = self.stores[t], self.stats[t]
        cols = weights.shape[1]
        if moves.evict_ids.numel():
            order = torch.argsort(moves.evict_ids)
            s = moves.evict_slots[order]
            store.write(moves.evict_ids[order], torch.cat([weights[s], *(x[s] for x in states)], 1))
            stats.rows_written_back += moves.evict_ids.numel()
        if moves.load_ids.numel():
            order = torch.argsort(moves.load_ids)
            s, records = moves.load_slots[order], store.read(moves.load_ids[order])
            weights[s] = records[:, :cols].to(weights.dtype)
            at = cols
            for x in states:
                x[s] = records[:, at : at + x.shape[1]]
                at += x.shape[1]
            stats.rows_fetched += moves.load_ids.numel()
        if step:
            stats.hits += moves.hits
            stats.misses += ids.numel() - moves.hits
        return moves.slots

    def _renumber(
        self, indices: torch.Tensor, offsets: torch.Tensor, *, step: bool
    ) -> torch.Tensor:
        features = self.ftm.numel()
        bags = (offsets.numel() - 1) // features
        lengths = offsets[1:] - offsets[:-1]
        table_of = self.ftm.repeat_interleave(bags).repeat_interleave(lengths)
        out = torch.empty_like(indices)
        for t in range(len(self.maps)):
            mask = table_of == t
            ids, inverse = torch.unique(indices[mask].long(), return_inverse=True)
            out[mask] = self._move(t, ids, step=step)[inverse].to(indices.dtype)
        return out

    def prefetch(self, indices: torch.Tensor, offsets: torch.Tensor) -> None:
        """Brings the rows of a coming batch into the caches; its step then misses none."""
        self._renumber(indices, offsets, step=False)

    def __call__(
        self, indices: torch.Tensor, offsets: torch.Tensor, weights: Optional[torch.Tensor]
    ) -> torch.Tensor:
        return self.inner(self._renumber(indices, offsets, step=True), offsets, weights)

    def flush(self) -> None:
        """Writes every dirty cached row back (before reading the store as a whole)."""
        for t, m in enumerate(self.maps):
            slots = torch.nonzero(m.dirty & (m.id_of >= 0)).flatten()
            ids = m.id_of[slots]
            order = torch.argsort(ids)
            slots, ids = slots[order], ids[order]
            w = self.inner.views[t].data
            self.stores[t].write(ids, torch.cat([w[slots], *(x[slots] for x in self._state(t))], 1))
            self.stats[t].rows_written_back += ids.numel()
            m.dirty[slots] = False

    def take_stats(self) -> dict[str, dict[str, int]]:
        out = {t: dataclasses.asdict(s) for t, s in zip(self.tables, self.stats)}
        self.stats = [TierStats(cache_rows=s.cache_rows) for s in self.stats]
        return out
