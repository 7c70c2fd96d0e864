"""SlotShard's selection and merge (modular/mc/slot_shard.py) against sorts of the whole shard:
`lowest` is torchrec's order (score ascending, then the later sorted position first) however
its sampled threshold falls, and `assign` leaves the entries as a stable sort would."""

from __future__ import annotations

import pytest
import torch

from modular.mc import slot_shard
from modular.mc.eviction import MAX, Scoring, as_bits
from modular.mc.slot_merge import RUN
from modular.mc.slot_shard import SlotShard


def _scores(kind: int, n: int, g: torch.Generator) -> torch.Tensor:
    if kind == 0:  # a few values: ties everywhere
        return torch.randint(0, 3, (n,), generator=g)
    if kind == 1:  # DistanceLFU-like floats
        return torch.randint(0, 6, (n,), generator=g) / torch.randint(1, 5, (n,), generator=g).float()
    if kind == 2:  # mostly empty slots (score 0) at the end, as before a table fills
        return torch.cat([torch.rand(n // 4, generator=g) + 0.5, torch.zeros(n - n // 4)])
    return torch.sort(torch.randint(0, 50, (n,), generator=g)).values.flip(0)  # sorted: the sample misleads


def test_lowest_is_the_n_lowest_in_torchrecs_order_for_any_threshold() -> None:
    g = torch.Generator().manual_seed(0)
    shard = SlotShard(0, 1, Scoring("lfu"))
    for trial in range(240):
        n = int(torch.randint(1, 3000, (1,), generator=g)) if trial % 6 else 40_000
        scores = _scores(trial % 4, n, g)
        k = int(torch.randint(0, n + 2, (1,), generator=g))
        # torchrec's order, lowest first: score ascending, then the later position
        order = torch.argsort(scores.flip(0), stable=True)
        want = (n - 1 - order)[: min(k, n)]
        got = shard.lowest(k, scores)
        assert torch.equal(torch.sort(got).values, torch.sort(want).values), f"trial {trial}: n {n}, k {k}"


def test_assign_keeps_the_entries_as_a_stable_sort_would() -> None:
    g = torch.Generator().manual_seed(1)
    for trial in range(120):
        # every 20th: a shard past RUN (modular/mc/slot_shard.py), whose long runs are copied
        n = int(torch.randint(1, 400, (1,), generator=g)) if trial % 20 else 3 * RUN + int(torch.randint(0, 99, (1,), generator=g))
        lo = int(torch.randint(0, 30, (1,), generator=g))
        shard = SlotShard(lo, lo + n, Scoring("distance_lfu"))
        raw = torch.full((n,), MAX)
        held = int(torch.randint(0, n + 1, (1,), generator=g))
        if trial % 20 == 0:  # a filling table: few held ids, the last empty slots evicted
            held = n // 20
        raw[:held] = torch.randperm(10 * n, generator=g)[:held] * 2  # even: new ids are odd
        shard.load(raw, torch.randperm(n, generator=g) + lo,
                   {"counts": torch.randint(0, 9, (n,), generator=g), "last_access_iter": torch.randint(0, 9, (n,), generator=g)})  # fmt: skip
        candidates = torch.randperm(n, generator=g)[: int(torch.randint(0, n + 1, (1,), generator=g))]
        if trial % 20 == 0:
            candidates = torch.arange(n - 2000, n)[torch.randperm(2000, generator=g)]
        gone = candidates[: int(torch.randint(0, candidates.numel() + 1, (1,), generator=g))]
        slots = torch.cat([shard.slots[gone], torch.arange(lo + n, lo + n + 3)])  # 3 of another rank
        ids = torch.randperm(20 * n, generator=g)[: slots.numel()] * 2 + 1
        counts, access = torch.randint(0, 9, ids.shape, generator=g), torch.randint(0, 9, ids.shape, generator=g)
        # the reference: replace in place, then a stable sort by raw id (empty slots by slot)
        want = {name: getattr(shard, name).clone() for name in ("raw", "slots", "counts", "access")}
        m = gone.numel()
        for name, value in zip(("raw", "counts", "access"), (ids, counts, access)):
            want[name][gone] = value[:m]
        by_slot = torch.argsort(want["slots"], stable=True)
        order = by_slot[torch.argsort(want["raw"][by_slot], stable=True)]
        shard.assign(slots, ids, counts, access, candidates)
        for name in want:
            assert torch.equal(getattr(shard, name), want[name][order]), f"trial {trial}: {name}"


def _sorted(raw: torch.Tensor, slots: torch.Tensor, *cols: torch.Tensor) -> list[torch.Tensor]:
    by_slot = torch.argsort(slots, stable=True)
    order = by_slot[torch.argsort(raw[by_slot], stable=True)]
    return [t[order] for t in (raw, slots, *cols)]


@pytest.mark.parametrize("policy", ["distance_lfu", "lfu", "lru"])
def test_recent_entries_find_score_select_and_merge_as_one_sorted_table(policy: str, monkeypatch) -> None:
    """Many intervals on one shard, its recent entries merged only now and then (a small
    RECENT_SHARE): each interval's lookups, its n lowest (torchrec's order; `lowest_scored`'s
    too, the last empty slots while the table fills: Note [empty slots first]) and,
    after each eviction, the whole state equal those of a table re-sorted at every interval;
    evicted ids come back, and recent entries are evicted again."""
    monkeypatch.setattr(slot_shard, "RECENT_SHARE", 4)
    g = torch.Generator().manual_seed(2)
    lo, n = 7, 600
    scoring = Scoring(policy)
    shard = SlotShard(lo, lo + n, scoring)
    ref = {"raw": torch.full((n,), MAX), "slots": torch.arange(lo, lo + n), "counts": torch.zeros(n, dtype=torch.int64),
           "access": torch.zeros(n, dtype=torch.int64)}  # fmt: skip
    merges = recent_evicted = unscored = 0
    for it in range(1, 80):
        ids = torch.unique(torch.randint(0, 900, (int(torch.randint(1, 120, (1,), generator=g)),), generator=g))
        pos, want_pos = shard.find(ids), torch.searchsorted(ref["raw"], ids).clamp(max=n - 1)
        held = ref["raw"][want_pos] == ids
        assert torch.equal(pos >= 0, held), f"interval {it}: which ids are held"
        assert torch.equal(shard.slot_at(pos[held]), ref["slots"][want_pos[held]]), f"interval {it}: slots"
        counts, access = torch.randint(1, 5, ids.shape, generator=g), torch.full(ids.shape, it)
        shard.update_matched(pos[held], counts[held], access[held])
        ref["counts"][want_pos[held]] += counts[held]
        ref["access"][want_pos[held]] = it
        k = int((~held).sum())
        scores = shard.scores(it)
        low = shard.lowest(k, scores)
        ref_scores = scoring.scores(it, ref["counts"] if scoring.counts else None, ref["access"] if scoring.access else None)
        order = torch.argsort(ref_scores.flip(0), stable=True)
        want = (n - 1 - order)[:k]
        assert torch.equal(torch.sort(shard.slot_at(low)).values, torch.sort(ref["slots"][want]).values), f"interval {it}: lowest"
        assert torch.equal(as_bits(scores[low]).sort().values, as_bits(ref_scores[want]).sort().values), f"interval {it}"
        unscored += shard._last_empties(k) is not None
        fast, fast_scores = shard.lowest_scored(k, it)
        assert torch.equal(torch.sort(fast).values, torch.sort(low).values), f"interval {it}: lowest_scored"
        assert torch.equal(as_bits(fast_scores).sort().values, as_bits(scores[low]).sort().values), f"interval {it}"
        # the new ids take the lowest slots (in no particular pairing)
        evicted = shard.slot_at(low)
        recent_evicted += int((low >= shard._raw.numel()).sum())
        shard.assign(torch.cat([evicted, torch.tensor([lo + n])]), torch.cat([ids[~held], torch.tensor([5])]),
                     torch.cat([counts[~held], torch.tensor([1])]), torch.cat([access[~held], torch.tensor([it])]), low)  # fmt: skip
        merges += k > 0 and shard._dead == 0  # else the assign left recent entries
        assert shard._dead == shard._recent["raw"].numel() <= n // 4, f"interval {it}: recent entries"
        at = torch.searchsorted(torch.sort(ref["slots"]).values, evicted)
        by_slot = torch.argsort(ref["slots"])
        for name, value in (("raw", ids[~held]), ("counts", counts[~held]), ("access", access[~held])):
            ref[name][by_slot[at]] = value
        ref = dict(zip(("raw", "slots", "counts", "access"), _sorted(ref["raw"], ref["slots"], ref["counts"], ref["access"])))
        assert shard.held() == int((ref["raw"] != MAX).sum()), f"interval {it}: held"
        if it % 10 == 0:  # the merged state (a merge here too)
            for name in ("raw", "slots") + (("counts",) if scoring.counts else ()) + (("access",) if scoring.access else ()):
                assert torch.equal(getattr(shard, name), ref[name]), f"interval {it}: {name}"
    # LRU never evicts an entry newer than the last merge: every older one ranks lower
    assert merges >= 3 and (recent_evicted >= 10 or policy == "lru"), (merges, recent_evicted)
    assert 5 <= unscored < 79, unscored  # the empty slots answered while the table filled, then scans


@pytest.mark.parametrize("policy", ["distance_lfu", "lfu", "lru"])
def test_empty_slots_are_taken_unscored_only_while_they_are_the_lowest(policy: str) -> None:
    """Note [empty slots first]: a loaded state whose empty slots carry a count (or, under LRU,
    an access newer than a held entry's) is scanned, and so is one where a held entry took
    metadata below the empty slots'; either way `lowest_scored` is `lowest`."""
    g = torch.Generator().manual_seed(4)
    scoring, n = Scoring(policy), 500
    raw = torch.full((n,), MAX)
    raw[:300] = torch.randperm(10_000, generator=g)[:300]
    metadata = {"counts": torch.randint(1, 9, (n,), generator=g), "last_access_iter": torch.randint(1, 9, (n,), generator=g)}
    metadata["counts"][300:], metadata["last_access_iter"][300:] = 0, 0
    for case in ("as torchrec starts them", "an empty slot with a count", "an empty slot accessed late", "a negative count"):
        shard = SlotShard(0, n, scoring)
        m = {k: v.clone() for k, v in metadata.items()}
        if case == "an empty slot with a count":
            m["counts"][400] = 3
        elif case == "an empty slot accessed late":
            m["last_access_iter"][400] = 20
        elif case == "a negative count":
            m["counts"][5] = -1
        shard.load(raw, torch.randperm(n, generator=g), m)
        premise = case == "as torchrec starts them" or (case == "an empty slot with a count" and policy == "lru") or \
            (case == "an empty slot accessed late" and policy == "lfu") or (case == "a negative count" and policy == "lru")
        assert (shard._last_empties(50) is not None) == premise, case
        for k in (1, 50, 199, 200, 201, 499):
            scores = shard.scores(30)
            got, got_scores = shard.lowest_scored(k, 30)
            assert torch.equal(torch.sort(got).values, torch.sort(shard.lowest(k, scores)).values), (case, k)
            assert torch.equal(as_bits(got_scores).sort().values, as_bits(scores[shard.lowest(k, scores)]).sort().values)
    shard = SlotShard(0, n, scoring)
    shard.load(raw, torch.arange(n), metadata)
    pos = shard.find(raw[:3])
    shard.update_matched(pos, torch.ones(3, dtype=torch.int64), torch.full((3,), -1))  # an access before theirs
    assert (shard._last_empties(50) is not None) == (not scoring.access)
