"""One eviction interval's decision over the whole table, from small gathered data.

torchrec's `MCHEvictionPolicy` scores the table's `zch_size` entries (in sorted raw-id order)
and the interval's new ids (in frequency order) in one tensor, then keeps the top `zch_size` by
`argsort(descending=True, stable=True)`: ties go to the lower index, so to an entry of the table
before a new id, to a lower raw id before a higher one, to an empty slot of lower number first.
The `n` dropped are the `n` lowest of that order, and they lie among each rank's `n` lowest
entries and the new ids: every rank gathers those and runs the same stable sort on them, in the
same relative order, so every rank reaches torchrec's decision (Note [sharded managed
collisions] in modular/mc/sharded_mch.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torchrec.modules.mc_modules import (
    DistanceLFU_EvictionPolicy, LFU_EvictionPolicy, LRU_EvictionPolicy, MCHEvictionPolicy,
)  # fmt: skip

__all__ = ["Scoring", "decide", "key_order", "scoring_for"]

MAX = torch.iinfo(torch.int64).max


@dataclass(frozen=True)
class Scoring:
    """What one torchrec eviction policy keeps per slot and how it scores a slot (lower: evicted
    first), with torchrec's own tensor ops, so that equal inputs give equal scores bit for bit."""

    kind: str  # "lfu", "lru" or "distance_lfu"
    decay: float = 1.0

    @property
    def counts(self) -> bool:
        return self.kind in ("lfu", "distance_lfu")

    @property
    def access(self) -> bool:
        return self.kind in ("lru", "distance_lfu")

    def scores(self, current_iter: int, counts: Optional[torch.Tensor], access: Optional[torch.Tensor]) -> torch.Tensor:
        if self.kind == "lfu":
            return counts
        distance = (current_iter + 1) - access
        # torch.pow(x, 1.0) copies x into the promoted (default float) dtype: the same bits
        distance = distance.to(torch.get_default_dtype()) if self.decay == 1.0 else torch.pow(distance, self.decay)
        if self.kind == "lru":
            return torch.neg(distance)
        return torch.div(counts, distance)


def scoring_for(policy: MCHEvictionPolicy) -> tuple[Optional[Scoring], str]:
    """The policy's Scoring, or None and why modular cannot split its state exactly."""
    if policy._threshold_filtering_func is not None:
        return None, "its eviction policy filters ids by a threshold (experimental in torchrec)"
    kind = {LFU_EvictionPolicy: "lfu", LRU_EvictionPolicy: "lru",
            DistanceLFU_EvictionPolicy: "distance_lfu"}.get(type(policy))  # fmt: skip
    if kind is None:
        return None, f"its eviction policy is a {type(policy).__name__}"
    return Scoring(kind, float(getattr(policy, "_decay_exponent", 1.0))), ""


def as_bits(scores: torch.Tensor) -> torch.Tensor:
    """Scores as int64, exactly (float32 widened to float64, whose bits are kept)."""
    return scores if scores.dtype == torch.int64 else scores.double().view(torch.int64)


def from_bits(bits: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return bits if like.dtype == torch.int64 else bits.view(torch.float64).to(like.dtype)


def key_order(raw: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The permutation that puts entries in torchrec's sorted order: by raw id, then by slot (the
    empty slots, raw id int64-max, in slot order)."""
    by_slot = torch.argsort(slots, stable=True)
    return by_slot[torch.argsort(raw[by_slot], stable=True)]


def decide(
    existing_scores: torch.Tensor, existing_raw: torch.Tensor, existing_slots: torch.Tensor,
    new_scores: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots to evict, indices of the new ids that take them), paired in order, as torchrec's
    `_compute_selected_eviction_and_replacement_indices` pairs them, from the table's candidate
    entries (each rank's lowest, any order) and all of the interval's new ids (frequency order)."""
    order = key_order(existing_raw, existing_slots)
    merged = torch.cat([existing_scores[order], new_scores.to(existing_scores.dtype)])
    ranked = torch.argsort(merged, descending=True, stable=True)
    n_existing, kept = order.numel(), merged.numel() - new_scores.numel()
    dropped, winners = ranked[kept:], ranked[:kept]
    evicted = existing_slots[order[dropped[dropped < n_existing]]]
    selected = winners[winners >= n_existing] - n_existing
    return evicted, selected
