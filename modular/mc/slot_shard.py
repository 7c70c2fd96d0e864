"""One rank's share of one managed-collision table's collision state: the slots [lo, hi).

Kept as torchrec's `MCHManagedCollisionModule` keeps the whole table, in sorted raw-id order
(an empty slot holds raw id int64-max; empty slots follow in slot order), with the slot of each
entry and the policy's metadata beside it: the same bytes per slot as torchrec's, for 1/world of
the slots (Note [sharded managed collisions] in modular/mc/sharded_mch.py).
"""

from __future__ import annotations

from typing import Optional

import torch

from modular.mc.eviction import MAX, Scoring

__all__ = ["SlotShard"]

RUN = 32_768  # merged positions under one shift that assign copies as a slice, not a gather


class SlotShard:
    """The entries of slots [lo, hi) of one table, sorted by (raw id, slot)."""

    def __init__(self, lo: int, hi: int, scoring: Scoring) -> None:
        self.lo, self.hi, self.scoring = lo, hi, scoring
        n = hi - lo
        self.raw = torch.full((n,), MAX, dtype=torch.int64)
        self.slots = torch.arange(lo, hi, dtype=torch.int64)
        self.counts: Optional[torch.Tensor] = torch.zeros(n, dtype=torch.int64) if scoring.counts else None
        self.access: Optional[torch.Tensor] = torch.zeros(n, dtype=torch.int64) if scoring.access else None

    def load(self, raw: torch.Tensor, slots: torch.Tensor, metadata: dict[str, torch.Tensor]) -> None:
        """Keeps the entries of [lo, hi) from the whole table's (any order)."""
        mine = (slots >= self.lo) & (slots < self.hi)
        if int(mine.sum()) != self.hi - self.lo:
            raise ValueError(f"slots [{self.lo}, {self.hi}) hold {int(mine.sum())} entries, not {self.hi - self.lo}")
        self.raw, self.slots = raw[mine].clone(), slots[mine].clone()
        if self.counts is not None:
            self.counts = metadata["counts"][mine].clone()
        if self.access is not None:
            self.access = metadata["last_access_iter"][mine].clone()
        by_slot = torch.argsort(self.slots, stable=True)
        self._permute(by_slot)
        self._resort()

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """Each id's position here, or -1 where this rank's slots do not hold it."""
        if self.raw.numel() == 0:
            return torch.full_like(ids, -1)
        pos = torch.searchsorted(self.raw, ids).clamp_(max=self.raw.numel() - 1)
        return torch.where(self.raw[pos] == ids, pos, -1)

    def slots_of(self, ids: torch.Tensor) -> torch.Tensor:
        """Each id's slot, or -1 where this rank's slots do not hold it."""
        pos = self.find(ids)
        return torch.where(pos >= 0, self.slots[pos.clamp(min=0)], -1) if pos.numel() else pos

    def update_matched(self, pos: torch.Tensor, counts: torch.Tensor, access: torch.Tensor) -> None:
        """torchrec's metadata update for ids the table holds: counts add, access is replaced."""
        if self.counts is not None:
            self.counts[pos] += counts
        if self.access is not None:
            self.access[pos] = access

    def scores(self, current_iter: int) -> torch.Tensor:
        return self.scoring.scores(current_iter, self.counts, self.access)

    def lowest(self, n: int, scores: torch.Tensor) -> torch.Tensor:
        """Positions of this rank's `n` lowest entries in torchrec's order (score descending,
        then sorted position), in no particular order. O(entries): a selection, not a sort."""
        k = min(n, scores.numel())
        if k == scores.numel():
            return torch.arange(k)
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
        elif (tied := _last_equal(scores, t, k - where.numel())) is not None:  # t is the k-th lowest
            below = where
        else:
            kth = torch.kthvalue(scores, k).values
            below, tied = (scores < kth).nonzero().view(-1), (scores == kth).nonzero().view(-1)
        # tied: ascending positions, the last ranks lowest
        return torch.cat([below, tied[tied.numel() - (k - below.numel()):]])

    def assign(self, slots: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor, access: torch.Tensor,
               candidates: torch.Tensor) -> None:  # fmt: skip
        """New ids take the evicted `slots` (those of [lo, hi), among this rank's `candidates`
        positions) with their interval metadata; the entries stay sorted (a merge, not a sort)."""
        mine = (slots >= self.lo) & (slots < self.hi)
        if not bool(mine.any()):
            return
        by_slot = torch.argsort(self.slots[candidates])
        where = candidates[by_slot]
        evicted = where[torch.searchsorted(self.slots[where], slots[mine])]
        new_ids = ids[mine]
        order = torch.argsort(new_ids)
        new = [new_ids[order], slots[mine][order], counts[mine][order], access[mine][order]]
        pieces, at_new = self._merge_order(torch.sort(evicted).values, new[0])
        for name, fresh in zip(("raw", "slots", "counts", "access"), new):
            old = getattr(self, name)
            if old is None:
                continue
            if len(pieces) == 1 and isinstance(pieces[0][2], torch.Tensor):
                merged = torch.gather(old, 0, pieces[0][2])
            else:
                merged = torch.empty_like(old)
                for a, b, src in pieces:
                    if isinstance(src, int):  # one shift: a copy
                        merged[a:b] = old[a + src : b + src]
                    else:
                        torch.gather(old, 0, src, out=merged[a:b])
            merged[at_new] = fresh.to(old.dtype)
            setattr(self, name, merged)

    def _merge_order(self, gone: torch.Tensor, new_raw: torch.Tensor) -> tuple[list, torch.Tensor]:
        """For the entries with the sorted positions `gone` replaced by as many sorted new raw ids
        (held by no entry): where each merged position's entry was, as pieces (start, stop, src)
        in order, src the old positions of [start, stop) (any where a new id goes) or, for a run
        of at least RUN positions under one shift (e.g. the empty slots past the new ids while
        the table fills), that shift; and the new ids' merged positions. O(new ids log), and
        O(merged positions) outside the runs."""
        n, m = self.raw.numel(), gone.numel()
        before = torch.searchsorted(self.raw, new_raw)  # entries below each new id
        at_new = before - torch.searchsorted(gone, before) + torch.arange(m)
        # A kept entry's old position is its merged position, plus the evicted entries before
        # it, less the new ids before it: a step function, +1 at the first kept entry past each
        # evicted one, -1 past each new id.
        kept_after = gone - torch.arange(m)  # the kept index of the first kept entry past each
        at_kept = kept_after + torch.searchsorted(at_new - torch.arange(m), kept_after, right=True)
        runs = []
        ends = torch.cat([torch.tensor([0]), at_new, torch.tensor([n])])
        if int((ends[1:] - ends[:-1]).max()) > RUN:  # a run needs a gap between new ids at least
            events = torch.sort(torch.cat([torch.tensor([0, n]), at_new, at_new + 1, at_kept]).clamp(max=n)).values
            long = ((events[1:] - events[:-1]) >= RUN).nonzero().view(-1).tolist()
            runs = [(int(events[i]), int(events[i + 1])) for i in long]
        pieces, start = [], 0
        for a, b in runs + [(n, n)]:
            if start < a:
                pieces.append((start, a, self._sources(start, a, at_new, at_kept)))
            if a < b:  # no event inside: the shift is the step function's value at a
                shift = int(torch.searchsorted(at_kept, a, right=True)) - int(torch.searchsorted(at_new, a, right=True))
                pieces.append((a, b, shift))
            start = b
        return pieces, at_new

    @staticmethod
    def _sources(a: int, b: int, at_new: torch.Tensor, at_kept: torch.Tensor) -> torch.Tensor:
        """The old positions of merged positions [a, b) (0 where a new id goes)."""
        kept = at_kept[(at_kept > a) & (at_kept < b)] - a
        fresh = at_new[(at_new >= a) & (at_new < b)] - a
        steps = torch.zeros(b - a, dtype=torch.int64)
        steps.index_add_(0, kept, torch.ones_like(kept))
        steps.index_add_(0, fresh, torch.full_like(fresh, -1))
        steps[0] += int((at_kept <= a).sum()) - int((at_new < a).sum())
        src = torch.arange(a, b) + steps.cumsum(0)
        src[fresh] = 0
        return src

    def held(self) -> int:
        """How many of this rank's slots hold a raw id."""
        return int((self.raw != MAX).sum())

    def _resort(self) -> None:
        # Stable: empty slots (raw int64-max) stay in slot order, as in torchrec's table.
        self._permute(torch.argsort(self.raw, stable=True))

    def _permute(self, order: torch.Tensor) -> None:
        self.raw, self.slots = self.raw[order], self.slots[order]
        if self.counts is not None:
            self.counts = self.counts[order]
        if self.access is not None:
            self.access = self.access[order]


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
