"""Pricing tiered tables: a cache of hot rows in memory over a slower tier (docs/planner.md,
"Tiered tables"; the runtime is Note [tiered tables] in modular/tiered/__init__.py).

Note [pricing tiered tables]
A tiered shard of R rows keeps every row, with its fused optimizer state, on the tier (files on
local disk on CPU ranks, host memory on CUDA) and C = max(1, ceil(R * f)) of them in a cache in
the memory the kernels use, f being the table's cache_load_factor. With row bytes
b = c * e + s(c) (the shard's c columns of e bytes, and the optimizer's state per row):
- memory (the rank's capacity): the cache, C * b, and its bookkeeping, 4 bytes per shard row
  (the row -> slot map) + 27 per slot (slot -> row, last use, use count, flags);
- tier (`Topology.tier_memory` per rank, a budget of its own): the store, R * b;
- time per step, beyond the lookup (which reads the cache as a resident shard reads its rows):
  the shard's n ids of the step touch D = R (1 - exp(-n / R)) distinct rows (the uniform
  estimate, at most n); a share h of lookups hits the cache, so D (1 - h) rows are read from
  the tier, and as many dirty rows are written back to make room (the fused update writes every
  row a step touches, so every evicted row is dirty): 2 D (1 - h) b bytes at
  `Topology.tier_bandwidth` (the "tier-io" seconds). The bookkeeping's work, a unique over the
  n ids (n * 8 * log2 n bytes) and the map and slot updates of the D rows (31 bytes each), runs
  at the memory bandwidth (the measured streaming rate when calibrated), inside the step.
- prefetch (`plan(..., prefetch=True)`: the training loop calls `modular.prefetch`): the next
  batch's reads and the write-backs that make room for them run in a background thread during
  the current step, so a shard's price has only the bookkeeping and the search takes the
  traffic as hidden; `plan_stats` then charges each rank what of its tier-io exceeds the rest of
  its step (the next step waits for the thread), and shows the tier-io per rank
  (`RankStats.tier_io`). Without prefetch the step pays the tier-io in full.
The hit rate h is the table's `TableConstraint.hit_rate` when given; otherwise the share of
lookups that land in the C most popular of R rows when ids follow Zipf(alpha)
(`TableConstraint.zipf_alpha`, default 1.05): H(C, alpha) / H(R, alpha), H the generalised
harmonic number (summed exactly over its first 100 terms, the rest by the midpoint integral
with its first Euler-Maclaurin correction).
That is the hit rate of a cache that always holds the hottest rows (LFU at its best); LRU
does a little worse.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import numpy as np

__all__ = [
    "CACHE_LADDER", "DEFAULT_ZIPF_ALPHA", "ROW_MAP_BYTES", "SLOT_BYTES", "TierCost", "TierSpec",
    "cache_rows", "harmonic", "tier_cost", "zipf_hit_rate",
]  # fmt: skip

ROW_MAP_BYTES = 4  # per shard row: the row -> slot map (int32)
SLOT_BYTES = 27  # per slot: slot -> row, last use, use count, dirty, pinned and prefetched flags
ID_BYTES = 8  # the step's ids, int64, through the unique
DEFAULT_ZIPF_ALPHA = 1.05
# The cache load factors `plan` tries, largest first, when it must tier tables by itself.
CACHE_LADDER = (0.5, 0.2, 0.1, 0.05, 0.02, 0.01)
_EXACT_TERMS = 100


class TierSpec(NamedTuple):
    """One table's tier as the cost model prices it: its cache and how its ids are skewed."""

    cache_load_factor: float
    cache_policy: str = "lru"
    hit_rate: float | None = None  # given; None estimates it from Zipf(zipf_alpha)
    zipf_alpha: float = DEFAULT_ZIPF_ALPHA


def cache_rows(rows: np.ndarray | float, factor: np.ndarray | float) -> np.ndarray:
    """Slots of a shard of `rows` rows at `factor`: max(1, ceil(rows * factor)), as modular's."""
    return np.maximum(1.0, np.ceil(np.asarray(rows, dtype=np.float64) * factor - 1e-9))


def harmonic(n: np.ndarray | float, alpha: np.ndarray | float) -> np.ndarray:
    """H(n, alpha) = sum over i = 1..n of i**-alpha: exact to 100 terms, then the integral of
    x**-alpha from 100.5 to n + 0.5 with the midpoint rule's first correction (exact to ~1e-9
    of the sum)."""
    n, alpha = np.broadcast_arrays(np.asarray(n, dtype=np.float64),
                                   np.asarray(alpha, dtype=np.float64))  # fmt: skip
    terms = np.minimum(np.floor(n), _EXACT_TERMS).astype(np.int64)
    head = np.zeros(n.shape)
    for a in np.unique(alpha):  # a model's tables share one exponent or a few
        here = alpha == a
        head[here] = _partial_sums(float(a))[terms[here]]
    lo, hi = _EXACT_TERMS + 0.5, np.maximum(np.floor(n), _EXACT_TERMS) + 0.5
    one = np.abs(alpha - 1.0) < 1e-12
    with np.errstate(divide="ignore", invalid="ignore"):
        power = (hi ** (1 - alpha) - lo ** (1 - alpha)) / np.where(one, 1.0, 1 - alpha)
    # the midpoint rule's first correction, -(f'(hi) - f'(lo)) / 24 for f(x) = x**-alpha
    tail = np.where(one, np.log(hi / lo), power) + alpha / 24 * (hi ** (-alpha - 1) - lo ** (-alpha - 1))
    return head + np.where(n > _EXACT_TERMS, tail, 0.0)


@functools.lru_cache(maxsize=256)
def _partial_sums(alpha: float) -> np.ndarray:
    """H(k, alpha) for k = 0..100."""
    i = np.arange(1, _EXACT_TERMS + 1, dtype=np.float64)
    return np.concatenate([[0.0], np.cumsum(i**-alpha)])


def zipf_hit_rate(cached: np.ndarray | float, rows: np.ndarray | float,
                  alpha: np.ndarray | float) -> np.ndarray:  # fmt: skip
    """The share of Zipf(alpha) lookups over `rows` rows that land in the `cached` most popular:
    H(min(cached, rows), alpha) / H(rows, alpha); 1 where the cache holds every row."""
    rows = np.maximum(np.asarray(rows, dtype=np.float64), 1.0)
    cached = np.minimum(np.asarray(cached, dtype=np.float64), rows)
    return np.minimum(harmonic(cached, alpha) / harmonic(rows, alpha), 1.0)


class TierCost(NamedTuple):
    """What tiering adds to a shard (Note [pricing tiered tables]); zeros for resident ones."""

    cache: np.ndarray  # bytes in memory: the slots' rows and state, and the bookkeeping
    store: np.ndarray  # bytes on the tier: every row of the shard with its state
    seconds: np.ndarray  # in the step: bookkeeping, and the tier-io unless prefetched
    io: np.ndarray  # seconds of tier traffic: misses read, dirty rows written back
    hit_rate: np.ndarray
    slots: np.ndarray  # cache rows


def tier_cost(*, factor: np.ndarray, hit_rate: np.ndarray, alpha: np.ndarray, rows: np.ndarray,
              row_bytes: np.ndarray, ids: np.ndarray, tier_bandwidth: float,
              memory_bandwidth: float, prefetch: bool) -> TierCost:  # fmt: skip
    """Note [pricing tiered tables] for shards of `rows` rows of `row_bytes` bytes (weights and
    state) that look up `ids` ids a step; `factor` 0 marks a resident shard (all zeros), a
    `hit_rate` below 0 one whose hit rate is estimated from Zipf(`alpha`)."""
    tiered = factor > 0
    if not tiered.any():  # most shards: nothing to price (the search prices them by the million)
        zero = np.zeros(np.shape(tiered))
        return TierCost(zero, zero, zero, zero, zero, zero)
    slots = np.where(tiered, cache_rows(rows, factor), 0.0)
    # the Zipf estimate only where it is read (elementwise, so the same floats): the search
    # prices resident and tiered tables together
    shape = np.broadcast(slots, hit_rate, rows, alpha).shape
    estimated = np.nonzero(np.broadcast_to(tiered & (hit_rate < 0), shape))
    zipf = np.zeros(shape)
    zipf[estimated] = zipf_hit_rate(*(np.broadcast_to(x, shape)[estimated] for x in (slots, rows, alpha)))
    hit = np.where(hit_rate >= 0, hit_rate, zipf)
    safe_rows = np.maximum(rows, 1.0)
    distinct = safe_rows * -np.expm1(-ids / safe_rows)
    io = np.where(tiered, 2 * distinct * (1 - hit) * row_bytes / tier_bandwidth, 0.0)
    unique = ids * ID_BYTES * np.log2(np.maximum(ids, 2.0)) + distinct * (ROW_MAP_BYTES + SLOT_BYTES)
    work = np.where(tiered, unique / memory_bandwidth, 0.0)
    cache = np.where(tiered, slots * (row_bytes + SLOT_BYTES) + rows * ROW_MAP_BYTES, 0.0)
    return TierCost(cache, np.where(tiered, rows * row_bytes, 0.0),
                    work + (0.0 if prefetch else io), io, np.where(tiered, hit, 0.0), slots)


def tier_arrays(tiers: Sequence[TierSpec | None]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(cache_load_factor, given hit rate or -1, zipf alpha) per table; 0 for resident ones."""
    factor = [0.0 if s is None else float(s.cache_load_factor) for s in tiers]
    hit = [-1.0 if s is None or s.hit_rate is None else float(s.hit_rate) for s in tiers]
    alpha = [DEFAULT_ZIPF_ALPHA if s is None else float(s.zipf_alpha) for s in tiers]
    return (np.array(factor, dtype=np.float64), np.array(hit, dtype=np.float64),
            np.array(alpha, dtype=np.float64))  # fmt: skip
