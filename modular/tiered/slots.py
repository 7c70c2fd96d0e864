"""Which cache slot holds which row of a tiered shard, with LRU or LFU replacement (Note [tiered
tables] in modular/tiered/__init__.py). Bookkeeping: 8 bytes per row of the shard (`slot_of`)
and 25 bytes per slot (id, use clock, use count, dirty and pinned flags)."""

from __future__ import annotations

import dataclasses

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
        self.table, self.rows, self.cache_rows, self.policy = table, rows, cache_rows, policy
        self.slot_of = torch.full((rows,), -1, dtype=torch.int64)
        self.id_of = torch.full((cache_rows,), -1, dtype=torch.int64)
        self.used = torch.zeros(cache_rows, dtype=torch.int64)  # clock of the last use
        self.count = torch.zeros(cache_rows, dtype=torch.int64)  # uses since loaded (LFU)
        self.dirty = torch.zeros(cache_rows, dtype=torch.bool)
        self.pinned = torch.zeros(cache_rows, dtype=torch.bool)  # a step's rows until its update
        self.clock = 0

    def assign(self, ids: torch.Tensor, *, step: bool) -> Moves:
        """Slots for the unique `ids`; `step`: a lookup whose update follows (its rows become
        dirty and stay pinned until the next step), else a prefetch (pinned, added to the pins)."""
        from modular.errors import InputError

        if ids.numel() > self.cache_rows:
            raise InputError(
                f"table {self.table!r}: a step looks up {ids.numel()} distinct rows of a shard "
                f"whose cache has {self.cache_rows} slots; raise its cache_load_factor"
            )
        slots = self.slot_of[ids]
        hit = slots >= 0
        missing = ids[~hit]
        n = missing.numel()
        keep = self.pinned.clone() if not step else torch.zeros_like(self.pinned)
        keep[slots[hit]] = True
        if n:
            key = self.used.clone() if self.policy == "lru" else self.count * (1 << 40) + self.used
            key[self.id_of < 0] = -1  # free slots first
            key[keep] = torch.iinfo(torch.int64).max
            victims = torch.topk(key, n, largest=False, sorted=True).indices
            if bool(keep[victims].any()):
                raise InputError(
                    f"table {self.table!r}: the prefetched and current steps look up more distinct "
                    f"rows than the shard's cache has slots ({self.cache_rows}); raise its "
                    "cache_load_factor"
                )
            old = self.id_of[victims]
            gone = (old >= 0) & self.dirty[victims]
            evict_ids, evict_slots = old[gone], victims[gone]
            self.slot_of[old[old >= 0]] = -1
            self.slot_of[missing] = victims
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
        return Moves(slots, int(hit.sum()), evict_ids, evict_slots, missing, victims)
