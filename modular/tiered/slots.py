"""Which cache slot holds which row of a tiered shard, with LRU or LFU replacement (Note [tiered
tables] in modular/tiered/__init__.py). Bookkeeping: 4 bytes per row of the shard (`slot_of`)
and 27 bytes per slot (row, use clock, use count, dirty, pinned and prefetched flags)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

__all__ = ["Moves", "SlotMap"]


@dataclasses.dataclass
class Moves:
    """What one `SlotMap.assign` decided: the slot of each id, rows to write back, rows to read."""

    slots: torch.Tensor
    hits: int
    evict_ids: torch.Tensor  # dirty rows leaving the cache: written back first
    evict_slots: torch.Tensor
    load_ids: torch.Tensor  # rows read from the store into `load_slots`
    load_slots: torch.Tensor


class SlotMap:
    def __init__(self, table: str, rows: int, cache_rows: int, policy: str) -> None:
        if policy not in ("lru", "lfu"):
            raise ValueError(f'table {table!r}: cache_policy is "lru" or "lfu", not {policy!r}')
        self.table, self.rows, self.policy = table, rows, policy
        # int32: a cache has fewer than 2**31 slots; 4 bytes for every row of the shard
        self.slot_of = torch.full((rows,), -1, dtype=torch.int32)
        self.id_of = torch.full((cache_rows,), -1, dtype=torch.int64)
        self.used = torch.zeros(cache_rows, dtype=torch.int64)  # clock of the last use
        self.count = torch.zeros(cache_rows, dtype=torch.int64)  # uses since loaded (LFU)
        self.dirty = torch.zeros(cache_rows, dtype=torch.bool)
        self.pinned = torch.zeros(cache_rows, dtype=torch.bool)  # a step's rows until its update
        self.ahead = torch.zeros(cache_rows, dtype=torch.bool)  # prefetched, not yet looked up
        self.clock = 0

    @property
    def cache_rows(self) -> int:
        return self.id_of.numel()

    def grow(self, cache_rows: int) -> None:
        """More slots (free), for a step that looks up more distinct rows than there are."""
        more = cache_rows - self.cache_rows
        self.id_of = torch.cat([self.id_of, torch.full((more,), -1, dtype=torch.int64)])
        for name in ("used", "count", "dirty", "pinned", "ahead"):
            old = getattr(self, name)
            setattr(self, name, torch.cat([old, torch.zeros(more, dtype=old.dtype)]))

    def assign(self, ids: torch.Tensor, *, step: bool) -> Optional[Moves]:
        """Slots for the unique `ids`. `step`: a lookup whose update follows: its rows become
        dirty and stay pinned until the next step (the caller has made room for all of them),
        and prefetched rows stay unless they leave no room. Else a prefetch: its rows are kept
        ahead (until a step looks them up) beside the current step's, or None (nothing changed)
        where the other slots cannot take its missing rows."""
        slots = self.slot_of[ids]
        hit = slots >= 0
        missing = ids[~hit]
        n = missing.numel()
        keep = torch.zeros_like(self.pinned) if step else self.pinned | self.ahead
        keep[slots[hit]] = True
        if step and n <= self.cache_rows - int((keep | self.ahead).sum()):
            keep |= self.ahead
        elif step:  # more distinct rows than the slots beside the prefetched ones
            self.ahead.zero_()
        if n > self.cache_rows - int(keep.sum()):
            if step:  # a bug: the caller grows the cache first
                raise AssertionError(f"table {self.table!r}: {ids.numel()} ids, {self.cache_rows} slots")
            return None
        if n:
            key = self.used.clone() if self.policy == "lru" else self.count * (1 << 40) + self.used
            key[self.id_of < 0] = -1  # free slots first
            key[keep] = torch.iinfo(torch.int64).max
            victims = torch.topk(key, n, largest=False, sorted=True).indices
            old = self.id_of[victims]
            gone = (old >= 0) & self.dirty[victims]
            evict_ids, evict_slots = old[gone], victims[gone]
            self.slot_of[old[old >= 0]] = -1
            self.slot_of[missing] = victims.to(torch.int32)
            self.id_of[victims] = missing
            self.count[victims] = 0
            self.dirty[victims] = False
            slots = self.slot_of[ids]
        else:
            evict_ids = evict_slots = victims = torch.empty(0, dtype=torch.int64)
        self.clock += 1
        self.used[slots] = self.clock
        self.count[slots] += 1
        if step:
            self.dirty[slots] = True
            self.pinned.zero_()
            self.pinned[slots] = True
            self.ahead[slots] = False
        else:
            self.ahead[slots] = True
        return Moves(slots, int(hit.sum()), evict_ids, evict_slots, missing, victims)

    def dirty_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, slots) of the dirty cached rows, by row."""
        slots = torch.nonzero(self.dirty & (self.id_of >= 0)).flatten()
        ids = self.id_of[slots]
        order = torch.argsort(ids)
        return ids[order], slots[order]

    def clear(self) -> None:
        """Forgets every cached row (after they were written back): the next lookups read the
        store, which someone may have written."""
        self.slot_of[self.id_of[self.id_of >= 0]] = -1
        self.id_of.fill_(-1)
        self.dirty.zero_()
        self.pinned.zero_()
        self.ahead.zero_()
        self.count.zero_()
