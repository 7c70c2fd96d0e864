"""The exact column-wise row statistic for every table at once, one float per id.

# Note [row means without a loop over tables]
Note [row statistics across column shards] (modular/fused/deferred.py) gives each column
piece's rank, for every id its step looked up, the whole row's mean of g**2: its own pieces'
cols * s, plus what the other holders of the table send, divided by the table's dim. Where every
column-wise table reports per id (`RowForm.IDS`: none of its shards is emulated, a property of
the layout, so every rank agrees), this runs on flat tensors, with no Python per table or
feature (issue 29, tests/modular/test_step_python.py):
  - a *slot* is one of the module's outputs (a feature read from a table) whose table is
    column-wise and has a piece here; every piece of that table looks up the slot's ids in the
    same order (each id goes to every piece), so a slot's ids line up across pieces and ranks;
  - slots are ordered by the table's place in `column_rowwise`, then by output: the order in
    which the per-table form sends them (a peer gets, per table both hold, the table's routes one
    after another), so the bytes on the wire are those of the general path;
  - each kernel's ids add cols * s into their slot's entries (`index_add_` through one index per
    id, built from the routes' id counts), one all-to-all with each peer exchanges the entries of
    the slots both hold, and each id's state changes by entry / dim - s in one `index_copy_`.
Only the peers are looped over (the all-to-all's splits), as in every collective of a step.
"""

from __future__ import annotations

import enum
from typing import Optional

import torch

from modular.comm import all_to_all
from modular.fused.deferred import RowStatsFusedKernel
from modular.kernels.lookups import Lookup
from modular.tables.layout import RankLayout

__all__ = ["IdRowMeans"]


class PeerShare(enum.Enum):
    """How many of this rank's slots a peer also holds: the all-to-all sends it every entry,
    none, or a picked subset."""

    ALL = "all"
    NONE = "none"
    SOME = "some"


class IdRowMeans:
    """Pass 2's state adjustment of a module's column pieces, all tables at once."""

    def __init__(self, kernels: list[RowStatsFusedKernel], column_rowwise: tuple[str, ...], at: RankLayout) -> None:
        layout, device = at.layout, at.device
        self.at = at
        self.kernels = kernels
        place = {name: i for i, name in enumerate(column_rowwise)}
        outputs = {r.output for k in kernels for r in k.group.routes if r.table in place}
        slots = sorted(outputs, key=lambda o: (place[layout.outputs[o].table], o))
        slot_of = {o: i for i, o in enumerate(slots)}
        as_long = dict(dtype=torch.int64, device=device)
        self.slots = len(slots)
        self._route_slot = [torch.tensor([slot_of[r.output] for r in k.group.routes], **as_long) for k in kernels]
        self._route_cols = [
            torch.tensor([float(r.shard.num_cols) for r in k.group.routes], device=device) for k in kernels
        ]
        self._slot_dim = torch.tensor([float(layout.outputs[o].dim) for o in slots], device=device)
        holders = {
            name: {spec.rank for spec in layout.shards[layout.table_index(name)]} for name in column_rowwise
        }
        # For each peer, which of this rank's slots it also holds (none for this rank itself).
        self._shared = [
            torch.tensor(
                [p != at.rank and p in holders[layout.outputs[o].table] for o in slots],
                dtype=torch.bool, device=device,
            )
            for p in range(at.world)
        ]  # fmt: skip
        # The usual shapes, taken without index tensors: a kernel whose routes are consecutive
        # slots (its ids are then one run of entries), one width per kernel, one dim for all
        # tables, peers holding every slot or none.
        self._first_slot = [
            int(rs[0]) if rs.numel() and torch.equal(rs, rs[0] + torch.arange(rs.numel(), device=device))
            else None
            for rs in self._route_slot
        ]  # fmt: skip
        self._cols = [float(c[0]) if c.numel() and bool((c == c[0]).all()) else None for c in self._route_cols]
        dims = set(self._slot_dim.tolist())
        self._dim = dims.pop() if len(dims) == 1 else None
        self._shares = [
            PeerShare.ALL if bool(shared.all()) and self.slots
            else PeerShare.NONE if not bool(shared.any()) else PeerShare.SOME
            for shared in self._shared
        ]

    def run(self, stats: list[Optional[tuple[Lookup, torch.Tensor, torch.Tensor]]]) -> None:
        """`stats[i]`: kernel i's `id_stats()`. Adjusts every kernel's state and runs its update;
        joins the all-to-all even with nothing pending (its peers may have ids)."""
        device = self.at.device
        counts: list[Optional[torch.Tensor]] = []
        slot_ids = torch.zeros(self.slots, dtype=torch.int64, device=device)
        for k, got, route_slot in zip(self.kernels, stats, self._route_slot):
            if got is None:
                counts.append(None)
                continue
            batch = got[0]
            bags = (batch.offsets.numel() - 1) // len(k.group.routes)
            per_route = batch.offsets[::bags].diff().long() if bags else torch.zeros_like(route_slot)
            counts.append(per_route)
            slot_ids.scatter_(0, route_slot, per_route)  # every piece of a slot has its ids
        starts = torch.cumsum(slot_ids, 0) - slot_ids
        total = int(slot_ids.sum()) if self.slots else 0
        entries = torch.zeros(total, device=device)
        places: list = []
        for i, (got, per_route) in enumerate(zip(stats, counts)):
            if got is None:
                places.append(None)
                continue
            batch, _, s = got
            n = batch.indices.numel()
            route_slot = self._route_slot[i]
            if not torch.equal(slot_ids[route_slot], per_route):
                raise RuntimeError(
                    f"column pieces on rank {self.at.rank} looked up different numbers of ids for "
                    f"one feature in one step ({per_route.tolist()} against "
                    f"{slot_ids[route_slot].tolist()}); every piece must see the same ids"
                )
            if self._first_slot[i] is not None:  # one run of entries, in the ids' order
                lo = int(starts[self._first_slot[i]])
                place = slice(lo, lo + n)
            else:
                route_start = torch.cumsum(per_route, 0) - per_route
                place = torch.arange(n, device=device) + (
                    starts[route_slot] - route_start
                ).repeat_interleave(per_route, output_size=n)
            places.append(place)
            if self._cols[i] is not None:
                contribution = s * self._cols[i]
            else:
                contribution = s * self._route_cols[i].repeat_interleave(per_route, output_size=n)
            if isinstance(place, slice):
                entries[place] += contribution
            else:
                entries.index_add_(0, place, contribution)
        self._exchange(entries, slot_ids)
        if self._dim is not None:
            means = entries.div_(self._dim)
        else:
            slot_of_entry = torch.repeat_interleave(
                torch.arange(self.slots, device=device), slot_ids, output_size=total
            )
            means = entries.div_(self._slot_dim[slot_of_entry])
        for k, got, place in zip(self.kernels, stats, places):
            if got is not None:
                _, keys, s = got
                k.update_ids(keys, means[place] - s)

    def _exchange(self, entries: torch.Tensor, slot_ids: torch.Tensor) -> None:
        """Adds the other holders' sums into `entries`: one all-to-all, each peer sent this
        rank's entries of the slots both hold, in slot order (their order on the peer too)."""
        if self.at.local:
            return
        picks: list = []
        for shares, shared in zip(self._shares, self._shared):
            if shares is PeerShare.ALL:
                picks.append(slice(None))
            elif shares is PeerShare.NONE:
                picks.append(slice(0, 0))
            else:
                slot_of_entry = torch.repeat_interleave(
                    torch.arange(self.slots, device=entries.device), slot_ids,
                    output_size=entries.numel(),
                )  # fmt: skip
                picks.append(torch.nonzero(shared[slot_of_entry]).view(-1))
        chunks = [entries[p] for p in picks]
        splits = [int(c.numel()) for c in chunks]
        nonempty = [c for c in chunks if c.numel()]
        send = nonempty[0] if len(nonempty) == 1 else torch.cat(chunks) if chunks else entries[:0]
        received = all_to_all(
            send, input_splits=splits, output_splits=splits,
            group=self.at.group, what="the all-to-all of column-wise row statistics",
        )  # fmt: skip
        for pick, got in zip(picks, received.split(splits)):
            if isinstance(pick, slice):
                entries[pick] += got
            else:
                entries.index_add_(0, pick, got)
