"""The collision state of a split MCH module (modular/mc/sharded_mch.py) as torchrec keeps it: the
whole table for `state_dict()`, or split across ranks for a checkpoint.

Note [a collision table in a checkpoint]
torchrec's MCH module keeps its table as columns of `zch_size` entries in sorted order (raw id,
then slot: empty slots hold raw id int64-max, in slot order, the miss slot `zch_size - 1` last):
`_mch_sorted_raw_ids`, `_mch_remapped_ids_mapping` and the policy's `_mch_counts` /
`_mch_last_access_iter`. `state_dict()` gathers the whole table on every rank: torchrec's plain
tensors, which users and tests compare with torchrec's own module, and which `export` and
`load_unsharded` pass on. A checkpoint must not hold the whole table on every rank (a `zch_size`
of 100M is 3.2 GB of int64 per column set), so `modular.checkpoint` asks for the state split
(`split_state`):
- save (`SAVE`): the ranks sort their entries together (`sort_across` in
  modular/mc/sample_sort.py: a sample sort on (raw id, slot)) and each column becomes a 1-D
  ShardedTensor of the whole table's shape, rank r holding a contiguous range of sorted
  positions. The keys, global shapes and values are those of the gathered state, so DCP reads
  a checkpoint of either kind into the other (into torchrec's unsharded module, or from a
  checkpoint saved before this split).
- load (`LAYOUT`): each rank reads an even range of positions, whatever the saved chunks were;
  `read_split` sends each entry to the rank whose slots hold it and checks, on every rank, what a
  load of the whole table checks (every slot held once, the miss slot empty). The new shard is
  built beside the live one and put in (`take_split`) only once the whole load can no longer
  fail (Note [all or nothing] in modular/checkpoint/_apply.py).
A rank holds its share of the entries a few times over while it saves or loads (the rows, the
ones it receives, the sorted copy), plus a sample of `SAMPLES` keys from each rank; never the
whole table. `save` then writes each rank's range: every rank writes, where the gathered state
was written by one.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch
from torchrec.modules.mc_modules import MCHManagedCollisionModule

from modular.errors import CheckpointError
from modular.mc.devices import all_gather, to_state
from modular.mc.eviction import MAX
from modular.mc.ragged_gather import gather_rows
from modular.mc.sample_sort import by_key, even_range, sharded_column, sort_across, to_owners
from modular.mc.slot_shard import SlotShard

__all__ = ["LAYOUT", "SAVE", "TableState", "collision_of", "split_state"]

METADATA = {"counts": "_mch_counts", "last_access_iter": "_mch_last_access_iter"}
RAW, MAPPING = "_mch_sorted_raw_ids", "_mch_remapped_ids_mapping"

SAVE, LAYOUT = "save", "layout"
_mode: Optional[str] = None


@contextmanager
def split_state(mode: Optional[str]) -> Iterator[None]:
    """Within it, a split MCH module's `state_dict()` holds its table as 1-D ShardedTensors:
    this rank's range of the sorted entries (`SAVE`, collective), or empty buffers of an even
    range (`LAYOUT`, for a load to read into); None: whole, as outside it. Note [a collision
    table in a checkpoint]."""
    global _mode
    before, _mode = _mode, mode
    try:
        yield
    finally:
        _mode = before


def collision_of(value: object) -> Optional[tuple["TableState", str]]:
    """(module, key) of an entry `split_state` made; None for any other value."""
    return getattr(value, "_modular_collision", None)


class TableState:
    """The state_dict of ShardedMCHModule (which defines the attributes it reads): its collision
    table whole, or split (Note [a collision table in a checkpoint])."""

    def _metadata_names(self) -> list[str]:
        return [m.metadata_name for m in self._eviction_policy.metadata_info if m.is_mch_metadata]

    def state_keys(self) -> list[str]:
        return [RAW, MAPPING] + [METADATA[n] for n in self._metadata_names()]

    def _rows(self) -> torch.Tensor:
        """This rank's entries, (raw id, slot, metadata...) sorted by (raw id, slot)."""
        shard = self._shard
        columns = [shard.raw, shard.slots] + [shard.counts if n == "counts" else shard.access for n in self._metadata_names()]
        return torch.stack(columns, 1)

    def _sentinel_row(self) -> torch.Tensor:
        names = self._metadata_names()
        return torch.tensor([[MAX, self._zch_size - 1] + [int(self._sentinel[n]) for n in names]])

    def _columns(self, rows: torch.Tensor) -> list[torch.Tensor]:
        out = [rows[:, i].contiguous() for i in range(rows.shape[1])]
        out[1] = out[1] + self._output_global_offset
        return out

    def _whole(self) -> dict[str, torch.Tensor]:
        rows = gather_rows(self._rows(), bound=self._most_slots, group=self._group, world=self._world,
                           what="a managed-collision table's state")  # fmt: skip
        rows = torch.cat([by_key(rows), self._sentinel_row()])
        return dict(zip(self.state_keys(), self._columns(rows)))

    def _split(self, mode: str) -> dict[str, torch.Tensor]:
        if mode == SAVE:
            rows = self._rows()
            if self._rank == self._world - 1:  # the largest key: the end of the last rank's
                rows = torch.cat([rows, self._sentinel_row()])
            what = "a managed-collision table's state, sorted across ranks for a checkpoint"
            mine = sort_across(rows, group=self._group, world=self._world, what=what)
            lengths = all_gather(torch.tensor([mine.shape[0]]), group=self._group, world=self._world, what=what)
            columns = self._columns(mine)
            lengths = lengths.view(-1).tolist()
        else:  # buffers a load reads into: never written here, so their pages are not touched
            lengths = [even_range(self._zch_size, r, self._world)[1] for r in range(self._world)]
            columns = [torch.empty(lengths[self._rank], dtype=torch.int64) for _ in self.state_keys()]
        out = {}
        for key, column in zip(self.state_keys(), columns):
            value = sharded_column(column, lengths, group=self._group)
            value._modular_collision = (self, key)
            out[key] = value
        return out

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:  # collective
        super()._save_to_state_dict(destination, prefix, keep_vars)
        state = self._whole() if _mode is None else self._split(_mode)
        for key, value in state.items():
            destination[prefix + key] = value

    # -- loading ---------------------------------------------------------------------------------

    def _owners(self, slots: torch.Tensor) -> torch.Tensor:
        """The rank that holds each slot (`0 <= slot < zch_size - 1`): Note [slots dealt round]."""
        return slots % self._world

    def _problem(self, where: str, found: str) -> str:
        last = self._zch_size - 1
        return (
            f"managed-collision table {self._table!r} in {where}: torchrec's MCH module holds each "
            f"of its {self._zch_size} slots once, slot {last} (the miss slot) with no raw id; "
            f"{found}. Load a state that torchrec's unsharded MCHManagedCollisionModule wrote"
        )

    def _new_shard(self, rows: torch.Tensor) -> SlotShard:
        shard = SlotShard(self._shard.lo, self._shard.hi, self._scoring, step=self._shard.step, empty=False)
        names = self._metadata_names()
        shard.load(rows[:, 0], rows[:, 1], {n: rows[:, 2 + i] for i, n in enumerate(names)})
        return shard

    def _sentinel_of(self, row: torch.Tensor) -> dict[str, torch.Tensor]:
        return {n: row[2 + i].clone() for i, n in enumerate(self._metadata_names())}

    def _load_whole(self, raw: torch.Tensor, mapping: torch.Tensor, metadata: dict[str, torch.Tensor], *, where: str) -> None:
        raw, mapping = to_state(raw), to_state(mapping)
        names = self._metadata_names()
        rows = torch.stack([raw, mapping.to(torch.int64) - self._output_global_offset] + [to_state(metadata[n]) for n in names], 1)
        sentinel = (rows[:, 1] == self._zch_size - 1).nonzero().view(-1)
        if sentinel.numel() != 1 or int(rows[sentinel[0], 0]) != MAX or rows.shape[0] != self._zch_size:
            raise CheckpointError(self._problem(where, f"the state holds {rows.shape[0]} entries, "
                                                       f"{sentinel.numel()} of them in the miss slot"))
        rest = torch.ones(rows.shape[0], dtype=torch.bool)
        rest[sentinel] = False
        self._shard = self._new_shard(rows[rest])  # a new shard: Note [all or nothing] keeps the old
        self._sentinel.update(self._sentinel_of(rows[int(sentinel[0])]))  # once nothing can fail

    def read_split(self, pieces: dict[str, list[torch.Tensor]], *, where: str) -> tuple[Optional[tuple], Optional[str]]:
        """Collective: this rank's shard of the table whose columns' local pieces (an even range
        of sorted positions, `LAYOUT`) are `pieces`, ready for `take_split`, or why not (the same
        on every rank). Nothing of the module changes."""
        columns = [torch.cat(pieces[key]) if pieces[key] else torch.empty(0, dtype=torch.int64) for key in self.state_keys()]
        rows = torch.stack([to_state(c, torch.int64) for c in columns], 1)
        del columns
        rows[:, 1] -= self._output_global_offset
        last = self._zch_size - 1
        slots = rows[:, 1]
        bad = (slots < 0) | (slots > last)
        at = (slots == last).nonzero().view(-1)
        miss = rows[at[0]].clone() if at.numel() else torch.full((rows.shape[1],), -1)
        owners = self._owners(slots.clamp(0, last - 1))
        owners[bad | (slots == last)] = self._world  # sent nowhere
        what = f"a managed-collision table's state, read from {where}"
        got = to_owners(rows, owners, group=self._group, world=self._world, what=what)
        del rows, slots, owners
        # per rank: its entries out of range, its miss-slot entries, the entries it now holds and
        # its miss-slot entry (if any)
        facts = torch.cat([torch.tensor([int(bad.sum()), at.numel(), got.shape[0]]), miss])
        facts = all_gather(facts, group=self._group, world=self._world, what=what)
        sizes = [len(range(r, last, self._world)) for r in range(self._world)]
        one = facts[:, 1] == 1
        outside, misses = int(facts[:, 0].sum()), int(facts[:, 1].sum())
        if outside or misses != 1 or int(facts[one, 3][0]) != MAX or facts[:, 2].tolist() != sizes:
            found = (f"{outside} entries name a slot outside [0, {last}], {misses} the miss slot"
                     + ("" if misses != 1 else " (with raw id " + str(int(facts[one, 3][0])) + ")")
                     + f", and the ranks' slots have {facts[:, 2].tolist()} entries where they "
                     f"hold {sizes} slots")  # fmt: skip
            return None, self._problem(where, found)
        sentinel = self._sentinel_of(facts[one, 3:][0])
        return (self._new_shard(got), sentinel), None

    def take_split(self, prepared: tuple) -> None:
        """Puts in what `read_split` prepared (cannot fail)."""
        self._shard, sentinel = prepared
        self._sentinel.update(sentinel)

    def snapshot(self) -> tuple:
        """What `take_split` / a whole load replace, to put back (nothing is copied: both put
        in new objects)."""
        return self._shard, dict(self._sentinel)

    def restore(self, kept: tuple) -> None:
        self._shard, sentinel = kept
        self._sentinel.clear()
        self._sentinel.update(sentinel)

    def _take_history(self, source: MCHManagedCollisionModule) -> None:
        """A module sharded mid-interval keeps what it recorded (on rank 0, counted once)."""
        self._history_size = source._input_history_buffer_size
        self._history_offset = source._current_history_buffer_offset
        self._history_counts[0] = self._history_offset  # rank 0 holds it
        if self._history_offset and self._rank == 0:
            ids = source._history_accumulator[: self._history_offset].to("cpu", copy=True)
            iters = source._history_metadata.get("last_access_iter")
            iters = iters[: self._history_offset].to("cpu", copy=True) if iters is not None else torch.full_like(ids, self._current_iter)
            self._history.append((ids, iters))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:  # fmt: skip
        keys = self.state_keys()
        absent = [prefix + k for k in keys if prefix + k not in state_dict]
        missing_keys.extend(absent)
        if not absent:
            names = self._metadata_names()
            self._load_whole(state_dict[prefix + RAW], state_dict[prefix + MAPPING],
                             {n: state_dict[prefix + METADATA[n]] for n in names}, where=f"the state_dict under {prefix!r}")  # fmt: skip
        rest = {k: v for k, v in state_dict.items() if k[len(prefix):] not in keys or not k.startswith(prefix)}
        super()._load_from_state_dict(rest, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
