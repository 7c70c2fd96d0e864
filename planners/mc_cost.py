"""Pricing managed-collision tables: the collision state each rank keeps, and the remap's
collectives and work per step (docs/planner.md, "Managed-collision tables").

Note [pricing managed collisions]
A table behind torchrec's MCH module (`Table.managed_collision`) is planned and placed like any
table of `zch_size` rows; its raw ids are remapped to slots before the input dist, by a
collision state that modular splits by slot over every rank of the world, whatever the
table's placement (Note [sharded managed collisions] in modular/mc/sharded_mch.py). So what it
adds is the same on every rank and does not depend on the plan: the search reserves the memory
as it reserves the batch's, and `plan_stats` adds both parts to every rank (and the time to the
lower bound). With S = zch_size - 1 usable slots, W ranks, n = B * P ids per rank per step of
the table's features (P as in the cost model), I = eviction_interval and m = 1 (LRU, LFU) or 2
(DistanceLFU) metadata columns:
- collision state, kept: rank r's slots (r, r + W, ...: ceil((S - r) / W) of them) x (16 + 8m)
  bytes (raw id, slot and metadata, int64 each), plus the interval's history of its own ids,
  I * n * 16 bytes (id and iteration);
- remap buffers, per step: the global batch's unique ids, gathered with counts and last access
  at an interval (24 bytes) and their slots (8), W * n * 32 bytes (ids taken as unique: skewed
  ids need less);
- collectives, per step: on a call that does not evict, each rank's unique ids gathered (8
  bytes per id from each peer) and their slots all-reduced (a ring's two passes, 16); on one
  that does (once per interval), the ids with their counts and last access (24) ride in the
  collection's id check, padded to the previous interval's most rows on a rank and a quarter
  (FOLD_MARGIN; a rank over it costs a second gather, not priced), then one gather of each
  rank's slot for every id of the interval (8 W per id) with its lowest entries (24 bytes for
  each of at most min(W n, ceil(S / W))); priced per byte from each peer as the input dist is
  (`alpha`), plus the measured latencies of those collectives when calibrated: one gather and
  1 - 1/I all-reduces a step (the id check is the collection's, there without collisions too);
- work: sorting the gathered ids and finding them among the rank's slots,
  W n * 8 * (log2(W n) + log2(S / W)) bytes, and at an interval scoring, selecting and merging
  the rank's entries, 4 passes over them, at the memory bandwidth (the calibrated streaming
  rate when calibrated; the split state lives on CPU, so a CPU calibration prices it right).
The remapped ids then take the table's input dist, priced by its placement like any table's.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import numpy as np

from planners.cost import ID_BYTES, CostModel, TableArrays
from planners.inputs import Table

__all__ = ["CollisionPrice", "collision_price"]

SLOT_BYTES = 2 * ID_BYTES  # a slot's raw id and its slot number, int64
HISTORY_BYTES = 2 * ID_BYTES  # an id of the interval's history and its iteration
GATHERED_BYTES = 4 * ID_BYTES  # per id of the global batch: (id, count, access) rows and its slot
GATHER_BYTES, REDUCE_BYTES = ID_BYTES, 2 * ID_BYTES  # per id from each peer: the ids' gather; the
# slots' all-reduce (calls that do not evict)
INTERVAL_BYTES = 2 * ID_BYTES  # per id from each peer, per interval: counts and last access
LOWEST_BYTES = 3 * ID_BYTES  # per lowest entry: slot, raw id, score
FOLD_MARGIN = 1.25  # the id check pads an interval's unique ids a quarter past the previous most
PASSES = 4  # an interval's passes over a rank's entries: score, select, merge (read + write)


class CollisionPrice(NamedTuple):
    """What a model's managed-collision tables add to each rank, whatever the plan."""

    slots: np.ndarray  # bytes of each rank's slots' entries (not scaling with the batch)
    history: float  # bytes of each rank's ids over the interval
    batch: float  # bytes of the step's remap buffers, on every rank
    remap: float  # seconds per step on every rank: collectives and work
    received: float  # bytes each rank receives per step for the remap

    @property
    def state(self) -> np.ndarray:
        """Bytes each rank keeps across steps: its slots' entries and its ids' history."""
        return self.slots + self.history

    @property
    def reserve(self) -> float:
        """Bytes to keep free on every rank before placing shards (the largest rank's)."""
        return float(self.slots.max(initial=0.0)) + self.history + self.batch


def collision_price(tables: Sequence[Table], model: CostModel) -> CollisionPrice:
    """Note [pricing managed collisions] for the `managed_collision` tables among `tables`
    (all zero when there are none).

        price = collision_price(tables, CostModel(topology, batch_size=4096))
        price.state[r], price.remap, price.received
    """
    topo = model.topology
    world = topo.world_size
    mc = [t for t in tables if t.managed_collision is not None]
    slots, history, batch, seconds, received, work = np.zeros(world), 0.0, 0.0, 0.0, 0.0, 0.0
    if not mc:
        return CollisionPrice(slots, 0.0, 0.0, 0.0, 0.0)
    ranks = np.arange(world)
    cal = topo.calibration
    for t, ids in zip(mc, TableArrays.of(mc).ids.tolist()):
        spec = t.managed_collision
        assert spec is not None
        usable, interval = spec.zch_size - 1, spec.eviction_interval
        n = model.batch_size * ids
        dealt = (usable - ranks + world - 1) // world  # rank r: slots r, r + W, ...
        slots += dealt * (SLOT_BYTES + ID_BYTES * spec.eviction_policy.metadata_columns)
        history += interval * n * HISTORY_BYTES
        batch += world * n * GATHERED_BYTES
        lowest = min(world * n, math.ceil(usable / world))
        per_peer = (n * (GATHER_BYTES + REDUCE_BYTES) * (1 - 1 / interval)
                    + (FOLD_MARGIN * n * (GATHER_BYTES + INTERVAL_BYTES) + world * n * ID_BYTES
                       + lowest * LOWEST_BYTES) / interval)  # fmt: skip
        if world > 1:
            seconds += per_peer * model.alpha
            received += (world - 1) * per_peer
            if cal is not None:  # Note [calibrated prices]: each collective's latency
                seconds += cal.all_to_all_latency + cal.all_reduce_latency * (1 - 1 / interval)
        gathered, mine = max(world * n, 2.0), max(usable / world, 2.0)
        work += gathered * ID_BYTES * (math.log2(gathered) + math.log2(mine))
        work += PASSES * mine * (SLOT_BYTES + ID_BYTES * spec.eviction_policy.metadata_columns) / interval
    bandwidth = topo.device_memory_bandwidth if cal is None else cal.stream_bandwidth
    return CollisionPrice(slots, history, batch, seconds + work / bandwidth, received)
