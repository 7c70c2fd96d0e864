"""SlotShard's selection and merge (modular/mc/slot_shard.py) against sorts of the whole shard:
`lowest` is torchrec's order (score ascending, then the later sorted position first) however
its sampled threshold falls, and `assign` leaves the entries as a stable sort would."""

from __future__ import annotations

import torch

from modular.mc.eviction import MAX, Scoring
from modular.mc.slot_shard import RUN, SlotShard


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
