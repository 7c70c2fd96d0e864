"""One rank's share of one managed-collision table's collision state: the slots lo, lo + step, ...
below hi (every world-th slot from the rank's own).

Kept as torchrec's `MCHManagedCollisionModule` keeps the whole table, in sorted raw-id order
(an empty slot holds raw id int64-max; empty slots follow in slot order), with the slot of each
entry and the policy's metadata beside it: the same bytes per slot as torchrec's, for 1/world of
the slots (Note [sharded managed collisions] in modular/mc/sharded_mch.py).

Note [a shard's recent entries]
An eviction hands a few thousand slots to new ids, while a rank holds up to a million entries
in sorted order. Merging the new ids in at every eviction moved every entry (its raw id, slot
and metadata: ~4 ms a step for 500k entries here, all on the last rank while a table fills,
since torchrec hands out the highest empty slots first, and the other ranks waited for it).
So an evicted entry of the sorted main part only leaves it in place (its slot set to -1, it
scores above every entry), and the new ids join a small sorted part of recent entries; once the
evicted entries are more than 1/RECENT_SHARE of the main part, one merge (at the end of the
eviction) puts the recent entries in their places, as before. A position below the main
part's length is the main part's, above it a recent entry's. Lookups search both parts. torchrec breaks ties of
score by sorted position: the main part's positions are in sorted order, and recent entries
hold ids, never empty slots, so among tied entries an order by raw id (stable in position)
is torchrec's. Between evictions the recent entries are at most 1/RECENT_SHARE of the main
part's (their bytes per entry are the same, and a -1 slot costs nothing more): a rank's state
is at most 1 + 1/16 of its share, which the planner does not add (Note [pricing managed
collisions] prices the merged state). Readers of the whole state (`raw`, `slots`, `counts`,
`access`: the state_dict, the tests) get the merged main part.

Note [empty slots first]
While a table fills, a rank's lowest entries are its empty slots: an empty slot's count is 0
and its access the oldest, so under every policy it scores at most as a held entry, and of tied
entries torchrec evicts the last in sorted order, where the empty slots are (raw id int64-max).
So while a rank has at least u live empty slots, its u lowest are its last u, found from the
end of the main part without scoring its entries (`lowest_scored`; ~2 ms a call saved on each
rank for 500k entries). `_empties_first` says the premise holds: the metadata of empty slots is
as torchrec starts it (counts 0, one access for all, not above any held entry's), and what
`update_matched` and `assign` write keeps it (counts >= 0, accesses not older, no raw id
int64-max); otherwise it is False until the next load, and every call scans.
"""

from __future__ import annotations

from typing import Optional

import torch

from modular.mc.eviction import MAX, Scoring, key_order
from modular.mc.slot_merge import merge_order, merged_column

__all__ = ["SlotShard"]

# Recent entries are merged into the main part once they are more than this share of it: Note
# [a shard's recent entries].
RECENT_SHARE = 16


class SlotShard:
    """The entries of slots lo, lo + step, ... below hi of one table, sorted by (raw id, slot): a
    sorted main part and a small sorted part of entries added since it was last merged (Note [a
    shard's recent entries])."""

    def __init__(self, lo: int, hi: int, scoring: Scoring, *, step: int = 1, empty: bool = True) -> None:
        """The slots lo, lo + step, ... below hi. `empty`: every slot empty, as torchrec starts a
        table; False: no entries until `load`."""
        self.lo, self.hi, self.step, self.scoring = lo, hi, step, scoring
        self.size = len(range(lo, hi, step))
        n = self.size if empty else 0
        self._raw = torch.full((n,), MAX, dtype=torch.int64)
        self._slots = torch.arange(lo, lo + n * step, step, dtype=torch.int64)  # -1: an entry evicted since the merge
        self._counts: Optional[torch.Tensor] = torch.zeros(n, dtype=torch.int64) if scoring.counts else None
        self._access: Optional[torch.Tensor] = torch.zeros(n, dtype=torch.int64) if scoring.access else None
        self._recent = self._no_recent()
        self._dead = 0  # main entries evicted since the merge (as many as recent entries)
        self._empties_first, self._empty_access = True, 0  # Note [empty slots first]

    # The entries, merged and sorted (a merge when entries were added since the last one).
    raw = property(lambda self: self._merged()._raw)
    slots = property(lambda self: self._merged()._slots)
    counts = property(lambda self: self._merged()._counts)
    access = property(lambda self: self._merged()._access)

    def load(self, raw: torch.Tensor, slots: torch.Tensor, metadata: dict[str, torch.Tensor]) -> None:
        """Keeps the entries of this shard's slots from the whole table's (any order)."""
        mine = self.holds(slots)
        if int(mine.sum()) != self.size:
            raise ValueError(f"slots {range(self.lo, self.hi, self.step)} hold {int(mine.sum())} entries, not {self.size}")
        self._raw, self._slots = raw[mine].clone(), slots[mine].clone()
        if self._counts is not None:
            self._counts = metadata["counts"][mine].clone()
        if self._access is not None:
            self._access = metadata["last_access_iter"][mine].clone()
        self._recent, self._dead = self._no_recent(), 0
        self._permute(key_order(self._raw, self._slots))
        empty = self._raw == MAX
        self._empties_first, self._empty_access = True, 0
        if self._counts is not None:
            self._empties_first = not bool(self._counts[empty].any()) and bool((self._counts >= 0).all())
        if self._access is not None and bool(empty.any()):
            self._empty_access = int(self._access[empty].min())
            self._empties_first &= bool((self._access[empty] == self._empty_access).all()) and \
                int(self._access.min()) >= self._empty_access

    def holds(self, slots: torch.Tensor) -> torch.Tensor:
        """Which of `slots` are this shard's."""
        mine = (slots >= self.lo) & (slots < self.hi)
        return mine if self.step == 1 else mine & ((slots - self.lo) % self.step == 0)

    # -- positions: [0, main) the main part's, [main, main + recent) the recent entries' -----------

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """Each id's position here, or -1 where this rank's slots do not hold it."""
        n = self._raw.numel()
        if n == 0:
            return torch.full_like(ids, -1)
        pos = torch.searchsorted(self._raw, ids).clamp_(max=n - 1)
        hit = self._raw[pos] == ids
        if self._dead:
            hit &= self._slots[pos] >= 0
        pos = torch.where(hit, pos, -1)
        recent = self._recent["raw"]
        if recent.numel():
            at = torch.searchsorted(recent, ids).clamp_(max=recent.numel() - 1)
            pos = torch.where(recent[at] == ids, n + at, pos)
        return pos

    def slot_at(self, pos: torch.Tensor) -> torch.Tensor:
        return self._column("slots", pos)

    def raw_at(self, pos: torch.Tensor) -> torch.Tensor:
        return self._column("raw", pos)

    def slots_of(self, ids: torch.Tensor) -> torch.Tensor:
        """Each id's slot, or -1 where this rank's slots do not hold it."""
        pos = self.find(ids)
        return torch.where(pos >= 0, self.slot_at(pos.clamp(min=0)), -1) if pos.numel() else pos

    def update_matched(self, pos: torch.Tensor, counts: torch.Tensor, access: torch.Tensor) -> None:
        """torchrec's metadata update for ids the table holds: counts add, access is replaced."""
        n = self._raw.numel()
        main, recent = pos < n, pos >= n
        self._keep_empties_first(self._raw[pos[main]], counts, access)
        for name, value, add in (("counts", counts, True), ("access", access, False)):
            column = getattr(self, "_" + name)
            if column is None:
                continue
            for part, where, at in ((column, main, pos), (self._recent[name], recent, pos - n)):
                if add:
                    part[at[where]] += value[where]
                else:
                    part[at[where]] = value[where]

    def scores(self, current_iter: int) -> torch.Tensor:
        """Every position's score; an entry evicted since the merge scores above every other."""
        main = self.scoring.scores(current_iter, self._counts, self._access)
        if not self._dead:
            return main
        n = main.numel()
        out = torch.empty(n + self._recent["raw"].numel(), dtype=main.dtype)
        torch.where(self._slots < 0, _top(main.dtype), main, out=out[:n])
        out[n:] = self.scoring.scores(current_iter, self._recent["counts"], self._recent["access"])
        return out

    def lowest_scored(self, n: int, current_iter: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`lowest(n, scores(current_iter))` and those entries' scores; the last live empty
        slots, unscored, while they are the lowest (Note [empty slots first])."""
        empties = self._last_empties(n)
        if empties is None:
            scores = self.scores(current_iter)
            low = self.lowest(n, scores)
            return low, scores[low]
        counts = None if self._counts is None else self._counts[empties]
        return empties, self.scoring.scores(current_iter, counts, None if self._access is None else self._access[empties])

    def _last_empties(self, n: int) -> Optional[torch.Tensor]:
        """Positions of the last n live empty slots, if there are n and they are the lowest."""
        if not self._empties_first or n <= 0:
            return None
        size = self._raw.numel()
        first = int(torch.searchsorted(self._raw, torch.tensor(MAX)))  # the empty slots: [first, size)
        width = min(size - first, n + self._dead + 4096)
        while width > 0:
            start = size - width
            live = (self._slots[start:] >= 0).nonzero().view(-1)  # evicted since the merge: slot -1
            if live.numel() >= n:
                return live[live.numel() - n :] + start
            if start == first:
                return None
            width = min(size - first, 8 * width)
        return None

    def _keep_empties_first(self, raw: torch.Tensor, counts: torch.Tensor, access: torch.Tensor) -> None:
        """Whether held entries given this metadata keep empty slots the lowest."""
        if not self._empties_first:
            return
        ok = not bool((raw == MAX).any())
        if self._counts is not None:
            ok = ok and bool((counts >= 0).all())
        if self._access is not None:
            ok = ok and bool((access >= self._empty_access).all())
        self._empties_first = ok

    def lowest(self, n: int, scores: torch.Tensor) -> torch.Tensor:
        """Positions of this rank's `n` lowest entries in torchrec's order (score descending,
        then sorted position), in no particular order. O(entries): a selection, not a sort."""
        live = scores.numel() - self._dead  # the entries evicted since the merge score at the top
        k = min(n, live)
        if k == live:
            return self._live() if self._dead else torch.arange(live)
        if k == 0:
            return torch.empty(0, dtype=torch.int64)
        # A threshold from a strided sample, a little above the k-th lowest's expected place,
        # usually leaves a few k entries below it (select among those) or makes it the k-th
        # lowest itself (ties); the full selection is the fallback. Exact whatever the sample.
        sample = scores[:: max(1, scores.numel() // 8192)]
        t = torch.kthvalue(sample, min(sample.numel(), -(-5 * k * sample.numel() // (4 * scores.numel())) + 16)).values
        where = (scores < t).nonzero().view(-1)
        if where.numel() >= k:
            sub = scores[where]
            kth = torch.kthvalue(sub, k).values
            below, tied = where[sub < kth], where[sub == kth]
        elif (tied := self._last_equal(scores, t, k - where.numel())) is not None:  # t is the k-th lowest
            return torch.cat([where, tied])
        else:
            kth = torch.kthvalue(scores, k).values
            below, tied = (scores < kth).nonzero().view(-1), (scores == kth).nonzero().view(-1)
        return torch.cat([below, self._last_in_order(tied, k - below.numel(), scores.numel())])

    def assign(self, slots: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor, access: torch.Tensor,
               candidates: torch.Tensor) -> None:  # fmt: skip
        """New ids take the evicted `slots` (those of this shard, among its `candidates`
        positions) with their interval metadata: the entries they replace leave, the new ones
        join the recent entries, merged into the main part once they are many."""
        mine = self.holds(slots)
        if not bool(mine.any()):
            return
        slots, n = slots[mine], self._raw.numel()
        self._keep_empties_first(ids[mine], counts[mine], access[mine])
        by_slot = torch.argsort(self.slot_at(candidates))
        where = candidates[by_slot]
        evicted = where[torch.searchsorted(self.slot_at(where), slots)]
        gone = evicted[evicted < n]
        self._slots[gone] = -1
        self._dead += gone.numel()
        recent = self._recent
        left = evicted[evicted >= n] - n
        if left.numel():
            keep = torch.ones(recent["raw"].numel(), dtype=torch.bool)
            keep[left] = False
            recent = {name: column[keep] for name, column in recent.items()}
        order = torch.argsort(ids[mine])  # distinct ids, none empty: by raw id is by (raw, slot)
        new = {"raw": ids[mine][order], "slots": slots[order], "counts": counts[mine][order], "access": access[mine][order]}
        # a merge of two sorted runs: a new entry's place is its own index plus the recent
        # entries below it; the recent entries keep the other places, in order
        at_new = torch.searchsorted(recent["raw"], new["raw"]) + torch.arange(order.numel())
        old = torch.ones(recent["raw"].numel() + order.numel(), dtype=torch.bool)
        old[at_new] = False
        merged = {}
        for name, column in recent.items():
            out = torch.empty(old.numel(), dtype=column.dtype)
            out[old], out[at_new] = column, new[name].to(column.dtype)
            merged[name] = out
        self._recent = merged
        if self._dead > n // RECENT_SHARE:
            self._merged()

    def held(self) -> int:
        """How many of this rank's slots hold a raw id."""
        main = (self._raw != MAX) & (self._slots >= 0) if self._dead else self._raw != MAX
        return int(main.sum()) + self._recent["raw"].numel()

    def _merged(self) -> "SlotShard":
        """Merges the recent entries into the main part, in place of the entries they evicted:
        the main part's order, as a stable sort by (raw id, slot) would leave it."""
        if not self._dead:
            return self
        gone = (self._slots < 0).nonzero().view(-1)
        recent = self._recent
        pieces, at_new = merge_order(self._raw, gone, recent["raw"])
        for name in ("raw", "slots", "counts", "access"):
            old = getattr(self, "_" + name)
            if old is not None:
                setattr(self, "_" + name, merged_column(old, pieces, at_new, recent[name]))
        self._recent, self._dead = self._no_recent(), 0
        return self

    def _no_recent(self) -> dict[str, torch.Tensor]:
        empty = torch.empty(0, dtype=torch.int64)
        return {"raw": empty, "slots": empty, "counts": empty, "access": empty}

    def _column(self, name: str, pos: torch.Tensor) -> torch.Tensor:
        main, n = getattr(self, "_" + name), self._raw.numel()
        if not self._recent["raw"].numel():
            # a shard of no slots (a table of fewer slots than ranks) has no position to read
            return main[pos] if n else torch.full_like(pos, -1)
        return torch.where(pos < n, main[pos.clamp(max=n - 1)], self._recent[name][(pos - n).clamp(min=0)])

    def _live(self) -> torch.Tensor:
        n = self._raw.numel()
        main = (self._slots >= 0).nonzero().view(-1) if self._dead else torch.arange(n)
        return torch.cat([main, torch.arange(n, n + self._recent["raw"].numel())])

    def _last_in_order(self, tied: torch.Tensor, need: int, positions: int) -> torch.Tensor:
        """The last `need` of the ascending positions `tied` (of `positions`) in sorted (raw id,
        slot) order: the main part's positions are in that order; recent entries (the last
        positions) hold ids, never empty slots."""
        n = positions - self._recent["raw"].numel()
        if need <= 0:
            return tied[:0]
        if tied.numel() == 0 or int(tied[-1]) < n:
            return tied[tied.numel() - need :]
        order = torch.argsort(self.raw_at(tied), stable=True)  # empty slots: by position
        return tied[order[order.numel() - need :]]

    def _last_equal(self, scores: torch.Tensor, value: torch.Tensor, need: int) -> Optional[torch.Tensor]:
        """The last `need` positions equal to `value` in sorted order, or None if fewer are:
        the main part's from its end (`_last_equal`), with the recent entries'."""
        n = scores.numel() - self._recent["raw"].numel()
        recent = (scores[n:] == value).nonzero().view(-1) + n
        main = _last_equal(scores[:n], value, need)
        if main is None:
            main = (scores[:n] == value).nonzero().view(-1)
        tied = torch.cat([main, recent])
        return None if tied.numel() < need else self._last_in_order(tied, need, scores.numel())

    def _permute(self, order: torch.Tensor) -> None:
        self._raw, self._slots = self._raw[order], self._slots[order]
        if self._counts is not None:
            self._counts = self._counts[order]
        if self._access is not None:
            self._access = self._access[order]


def _top(dtype: torch.dtype) -> torch.Tensor:
    """A score above every entry's."""
    return torch.tensor(float("inf") if dtype.is_floating_point else torch.iinfo(dtype).max, dtype=dtype)


def _last_equal(scores: torch.Tensor, value: torch.Tensor, need: int) -> Optional[torch.Tensor]:
    """Ascending positions of the last `need` entries equal to `value`, or None if fewer are: a
    search from the end in growing windows (the entries of a common low score, e.g. empty
    slots, are many, and only the last are wanted)."""
    n = scores.numel()
    width = min(n, max(4 * need, 4096))
    while True:
        start = n - width
        hits = (scores[start:] == value).nonzero().view(-1)
        if hits.numel() >= need:
            return hits[hits.numel() - need :] + start
        if start == 0:
            return None
        width = min(n, 8 * width)
