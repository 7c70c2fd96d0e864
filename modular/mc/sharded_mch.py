"""torchrec's MCH managed-collision module with its collision state split across ranks.

Note [sharded managed collisions]
torchrec's `MCHManagedCollisionModule` keeps, for a table of `zch_size` slots, the raw ids it
holds in sorted order (`_mch_sorted_raw_ids`), the slot of each (`_mch_remapped_ids_mapping`)
and its policy's metadata per entry (`_mch_counts`, `_mch_last_access_iter`). Each training call
appends the batch's ids to a history; every `eviction_interval` calls it coalesces the history
(unique ids, counts, last access), adds the counts of ids it holds, scores all entries and the
new ids together, keeps the top `zch_size`, and hands each evicted slot to a new id. Then (and
in eval mode, only this) it remaps: a held id to its slot, any other id to slot `zch_size - 1`.
The last sorted entry is never evicted (torchrec gives it the top score), so it is always the
empty entry of slot `zch_size - 1`: the table holds `zch_size - 1` ids, and that slot is the
miss slot.

`ShardedMCHModule` replaces the torchrec module in its `ManagedCollisionCollection` (same
FQN and state_dict keys) and keeps the `zch_size - 1` usable slots split by slot: rank r holds
slots r, r + W, r + 2W, ... (Note [slots dealt round]) in a `SlotShard`
(modular/mc/slot_shard.py), sorted as torchrec sorts its table. Nothing moves between ranks: a new
id takes the evicted slot's place on the rank that holds that slot. It equals torchrec's module fed the global batch (every
rank's batch in rank order) because every step of torchrec's algorithm is rebuilt from data
that is either this rank's or small and gathered:
- history: each rank keeps its own ids, cut where torchrec's history buffer (sized from the
  first global batch) would cut the global batch, which per-feature counts gathered from every
  rank locate; at the interval, each rank's unique ids, counts and last access are gathered and
  merged, so every rank holds the interval's global unique ids (batch-sized, replicated).
  They ride in the collection's id check (`fold_piece`): each rank's rows as its history would
  hold them if it kept the whole batch, with their count, padded to a bound every rank knows
  (the previous interval's most rows on a rank, plus a quarter and 8; none before the first
  interval). They are read only after the check passed, and only when the gathered counts say
  the history kept the whole batch and no rank's rows overflowed the bound; otherwise (the same
  on every rank, from gathered data) the interval gathers its rows apart, as before.
- matching and eviction, one gather: each rank finds the interval's `u` ids among its slots,
  updates their metadata, scores its entries with torchrec's own ops and sends, for every id,
  its slot or -1 together with its `u` lowest entries. The max over ranks tells every rank
  which ids are new (`n <= u` of them, in torchrec's frequency order). torchrec drops the `n`
  lowest of (table entries, new ids) under a stable descending sort; a rank's share of those is
  among its `n` lowest, so among its `u`, and a subset kept in torchrec's relative order drops
  the same entries in the same order. Every rank runs `decide` (modular/mc/eviction.py) on the
  gathered entries and the new ids and gets torchrec's evicted slots and their new ids, paired
  as torchrec pairs them.
- remap: after an eviction whose history kept the whole batch, every rank already holds the
  slot of each of the interval's ids (the match carries slots, the decision patches them);
  otherwise each rank gathers the ranks' unique ids, looks up those its slots hold, and an
  all_reduce (max) gives every rank each id's slot.
What it costs per table and call: the collection's id check gathers every rank's id count per
feature with it (one all_gather for the whole collection, which also sizes every later gather,
so each is one collective) and, for each table that evicts in the call, the interval's unique
ids; a call that evicts adds one collective (the match with the lowest entries; two when the
fold fell back) and needs no remap lookup; any other call, two.
Per interval each rank does O(its slots) work, a few passes: the scores and a selection of its
lowest entries below a threshold from a sample (`SlotShard.lowest`; neither while its last empty
slots are its lowest: Note [empty slots first]) and, on a rank whose slots were evicted, a merge
for the new ids (`SlotShard.assign`: gathers, slice copies for long runs of one shift), no sort.
Collective bytes scale with the global batch, not the table; state per rank is its share of
torchrec's, plus the interval's history of its own ids. Like torchrec's unsharded module, an
evicted slot's embedding row and optimizer state stay as they were (`evict()` still reports
the slots). The state_dict gathers the whole table in torchrec's layout and a load keeps this
rank's share; `modular.checkpoint` saves and loads it split, under the same keys and values
(Note [a collision table in a checkpoint] in modular/mc/table_state.py), at any world size.

Note [slots dealt round]
Rank r holds slots r, r + W, r + 2W, ... (of `zch_size - 1`; the miss slot is no rank's). While a
table fills, torchrec hands the interval's new ids the highest empty slots (empty entries tie,
and of tied entries it evicts the last in sorted order: the highest slots). Split by contiguous
ranges, every eviction then landed on the last rank, which alone merged the new entries in
(`SlotShard.assign`, a merge of its recent entries every few steps) while the other ranks waited
for it at the next collective; dealt round, the highest n empty slots are n/W on each rank, and
so is that work. A full table's evictions fall wherever the lowest scores are, either way.
Nothing else depends on which slots a rank holds: `decide` orders the gathered candidates by
(raw id, slot) itself, and the state_dict and checkpoints hold the whole table in torchrec's
layout (Note [a collision table in a checkpoint]), so a checkpoint saved under contiguous ranges
loads as any other.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torchrec.modules.mc_modules import MCHManagedCollisionModule
from torchrec.sparse.jagged_tensor import JaggedTensor

from modular.mc.devices import all_gather, all_reduce, to_state
from modular.mc.eviction import MAX, Scoring, as_bits, decide, from_bits
from modular.mc.ragged_gather import gather_rows
from modular.mc.slot_shard import SlotShard
from modular.mc.table_state import METADATA, TableState

__all__ = ["ShardedMCHModule"]


class ShardedMCHModule(TableState, nn.Module):
    """A wrapper in place of one torchrec `MCHManagedCollisionModule`: this rank's share of its
    collision state, remapping and evicting as torchrec's module on the global batch."""

    def __init__(self, source: MCHManagedCollisionModule, scoring: Scoring, group: Optional[ProcessGroup]) -> None:
        super().__init__()
        self._group, self._world, self._rank = group, dist.get_world_size(group), dist.get_rank(group)
        for name in ("_name", "_zch_size", "_input_hash_size", "_input_hash_func", "_eviction_interval",
                     "_eviction_policy", "_output_global_offset", "_buckets", "_current_iter",
                     "_last_eviction_iter", "_evicted", "_evicted_emb_indices"):  # fmt: skip
            setattr(self, name, getattr(source, name))
        self._scoring = scoring
        self._table = source._name  # split_collisions names it by its table
        meta = source._mch_sorted_raw_ids.is_meta
        segments = torch.tensor([self._output_global_offset, self._output_global_offset + self._zch_size] + [-1] * 1023)
        self.register_buffer("_output_segments_tensor", segments if meta else source._output_segments_tensor.clone())
        self.register_buffer("_current_iter_tensor", torch.zeros(1, dtype=torch.int64) if meta else source._current_iter_tensor.clone())
        usable = self._zch_size - 1
        self._shard = SlotShard(self._rank, usable, scoring, step=self._world)  # Note [slots dealt round]
        self._sentinel = {name: torch.zeros((), dtype=torch.int64) for name in METADATA}
        self._history_size, self._history_offset = -1, 0
        self._history: list[tuple[torch.Tensor, torch.Tensor]] = []  # (ids, their iterations)
        self._history_counts = torch.zeros(self._world, dtype=torch.int64)  # ids each rank kept
        self._lengths: Optional[torch.Tensor] = None  # this call's id counts, per rank and feature
        self._interval_slots: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self._whole_batch_kept = False
        self._fold_bound = 0  # rows per rank the id check carries for an evicting call; 0: none yet
        self._folded: Optional[torch.Tensor] = None  # this call's rows, gathered with the check
        # evicting calls whose unique ids rode in the check, and the others by why not
        self._folds = {"folded": 0, "overflow": 0, "cut": 0, "no bound": 0}
        self._most_slots = -(-usable // self._world)
        if not meta:
            self._load_whole(source._mch_sorted_raw_ids, source._mch_remapped_ids_mapping,
                             {k: v for k, v in source._mch_metadata.items()}, where="the module as sharded")  # fmt: skip
            self._take_history(source)

    # -- torchrec's interface -------------------------------------------------------------------

    def forward(self, features: dict[str, JaggedTensor], mutate_miss_lengths: bool = True) -> dict[str, JaggedTensor]:
        return self.remap(self.profile(self.preprocess(features)))

    def preprocess(self, features: dict[str, JaggedTensor]) -> dict[str, JaggedTensor]:
        return MCHManagedCollisionModule.preprocess(self, features)

    def profile(self, features: dict[str, JaggedTensor]) -> dict[str, JaggedTensor]:
        if not self.training:
            return features
        if self._current_iter == -1:
            self._current_iter = int(self._current_iter_tensor.item())
            self._last_eviction_iter = self._current_iter
        self._current_iter += 1
        self._current_iter_tensor.data += 1
        for feature in features.values():
            self._record(feature)
        if self._current_iter - self._last_eviction_iter == self._eviction_interval:
            self._coalesce_and_evict()
            self._last_eviction_iter = self._current_iter
        return features

    def remap(self, features: dict[str, JaggedTensor], mutate_miss_lengths: bool = True,
              write_weights: Optional[torch.Tensor] = None) -> dict[str, JaggedTensor]:  # fmt: skip
        out = {}
        for name, feature in features.items():
            out[name] = JaggedTensor(values=self._slots_of(feature), lengths=feature.lengths(),
                                     offsets=feature.offsets(), weights=feature.weights_or_none())  # fmt: skip
        return out

    def evict(self) -> Optional[torch.Tensor]:
        if not self._evicted:
            return None
        self._evicted = False
        return self._evicted_emb_indices

    def open_slots(self) -> torch.Tensor:
        held = torch.tensor([self._shard.held()], dtype=torch.int64)
        all_reduce(held, group=self._group, what="a count of a managed-collision table's held ids")
        return torch.tensor([self._zch_size - 1], dtype=torch.int64) - held

    def output_size(self) -> int:
        return self._zch_size

    def buckets(self) -> int:
        return self._buckets

    def input_size(self) -> int:
        return self._input_hash_size

    # -- the history and the eviction (Note [sharded managed collisions]) -------------------------

    def _per_rank_lengths(self, feature: JaggedTensor) -> torch.Tensor:
        """(world, features of the table): every rank's id count per feature in this call; the
        collection hands them over from its id check's gather (Note [sharded managed
        collisions]), else one all_gather here."""
        lengths, self._lengths = self._lengths, None
        if lengths is None:  # the collection passes lengths per key as the weights
            per_key = feature.weights().to(torch.int64).view(-1)
            lengths = all_gather(per_key, group=self._group, world=self._world, what="managed-collision id counts")
        return lengths

    def _record(self, feature: JaggedTensor) -> None:
        """Keeps this rank's ids that torchrec's history buffer would keep of the global batch,
        and how many every rank kept."""
        table = self._per_rank_lengths(feature)
        self._lengths = table  # the remap of this call reads them too
        if self._history_size == -1:
            self._history_size = int(int(table.sum()) * self._eviction_interval * 1.25)
        free = self._history_size - self._history_offset
        totals = table.sum(0)
        starts = totals.cumsum(0) - totals + table.cumsum(0) - table  # each rank's first global place
        keep = (free - starts).clamp(min=0).minimum(table)  # (world, features)
        values = to_state(feature.values(), torch.int64)
        pieces = [chunk[:k] for chunk, k in zip(torch.split(values, table[self._rank].tolist()), keep[self._rank].tolist())]
        kept = torch.cat(pieces) if pieces else values[:0]
        self._history.append((kept, torch.full_like(kept, self._current_iter)))
        self._history_counts = self._history_counts + keep.sum(1)
        self._whole_batch_kept = bool((keep == table).all())
        self._history_offset += min(int(totals.sum()), free)
        if not self._whole_batch_kept and self._folded is not None:  # the history keeps a prefix
            self._folded = None
            self._folds["cut"] += 1

    def fold_piece(self, values: torch.Tensor) -> Optional[torch.Tensor]:
        """This rank's piece of the collection's id check for an evicting call, once a bound is
        known (the same on every rank; else None): its row count, then its rows of the interval's
        unique ids (id, count, last access) as `_record` would keep them if the history keeps the
        whole batch, padded or cut to the bound. `values`: this rank's ids of the table."""
        it, last = self._current_iter, self._last_eviction_iter
        if it == -1:
            it = last = int(self._current_iter_tensor.item())
        if not self.training or self._fold_bound == 0 or it + 1 - last != self._eviction_interval:
            return None
        if self._input_hash_func is not None:
            values = self._input_hash_func(values, self._input_hash_size)
        now = to_state(values, torch.int64)  # Note [collision state on a GPU rank]
        rows = self._unique_rows(torch.cat([v for v, _ in self._history] + [now]),
                                 torch.cat([i for _, i in self._history] + [torch.full_like(now, it + 1)]))  # fmt: skip
        return self._piece(rows, self._fold_bound)

    def take_folded(self, got: torch.Tensor) -> None:
        """Every rank's `fold_piece`, gathered with the check (the check passed); `_record` drops
        them when the history cuts the batch, the interval when a rank overflowed the bound."""
        self._folded = got

    @staticmethod
    def _unique_rows(ids: torch.Tensor, iters: torch.Tensor) -> torch.Tensor:
        unique, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
        access = torch.zeros_like(counts).scatter_reduce_(0, inverse, iters, reduce="amax", include_self=False)
        return torch.stack([unique, counts, access], 1)

    @staticmethod
    def _piece(rows: torch.Tensor, bound: int) -> torch.Tensor:
        out = torch.full((1 + 3 * bound,), -1, dtype=torch.int64)
        out[0] = rows.shape[0]
        n = min(rows.shape[0], bound)
        out[1 : 1 + 3 * n] = rows[:n].reshape(-1)
        return out

    def _coalesce_and_evict(self) -> None:
        got, self._folded = self._folded, None
        folded = got is not None and int(got[:, 0].max()) <= self._fold_bound  # else: a rank overflowed
        if folded or got is not None:
            self._folds["folded" if folded else "overflow"] += 1
        elif not self._fold_bound:
            self._folds["no bound"] += 1
        if not folded:
            ids = torch.cat([v for v, _ in self._history]) if self._history else torch.empty(0, dtype=torch.int64)
            iters = torch.cat([i for _, i in self._history]) if self._history else ids
            bound = max(int(self._history_counts.max()), 1)  # gloo: a non-empty piece
            got = all_gather(self._piece(self._unique_rows(ids, iters), bound), group=self._group, world=self._world,
                             what="a managed-collision interval's unique ids")  # fmt: skip
        # the next evicting call's bound: this interval's most rows on a rank, and a margin
        most = int(got[:, 0].max())
        self._fold_bound = most + most // 4 + 8
        rows = got[:, 1:].reshape(self._world, -1, 3)
        rows = rows[torch.arange(rows.shape[1]) < got[:, :1]]  # each rank's row count
        unique, inverse = torch.unique(rows[:, 0], return_inverse=True)
        counts = torch.zeros_like(unique).scatter_add_(0, inverse, rows[:, 1])
        access = torch.zeros_like(unique).scatter_reduce_(0, inverse, rows[:, 2], reduce="amax", include_self=False)
        self._history, self._history_offset = [], 0
        self._history_counts = torch.zeros(self._world, dtype=torch.int64)
        self._update_and_evict(unique, counts, access)

    def _update_and_evict(self, unique: torch.Tensor, counts: torch.Tensor, access: torch.Tensor) -> None:
        """`unique`: the interval's ids, sorted; `counts` and `access` theirs."""
        by_count = torch.argsort(counts, descending=True, stable=True)
        ids, counts, access = unique[by_count], counts[by_count], access[by_count]
        pos = self._shard.find(unique)[by_count]  # sorted queries search faster
        mine = pos >= 0
        self._shard.update_matched(pos[mine], counts[mine], access[mine])
        self._sentinel["counts"].fill_(MAX)
        self._sentinel["last_access_iter"].fill_(self._current_iter)
        # One gather carries the match (this rank's slot of each id, or -1) and this rank's u
        # lowest entries (u: the interval's ids, at least the new ones): a superset of the
        # candidates `decide` needs (Note [sharded managed collisions]).
        u, bound = ids.numel(), min(ids.numel(), self._most_slots)
        lowest, scores = self._shard.lowest_scored(u, self._current_iter)
        sent = torch.full((max(u + 3 * bound, 1),), -1, dtype=torch.int64)  # gloo: a non-empty piece
        sent[:u] = torch.where(mine, self._shard.slot_at(pos.clamp(min=0)), -1) if u else pos
        sent[u : u + 3 * lowest.numel()] = torch.stack(
            [self._shard.slot_at(lowest), self._shard.raw_at(lowest), as_bits(scores)], 1).view(-1)  # fmt: skip
        got = all_gather(sent, group=self._group, world=self._world,
                         what="a managed-collision match and lowest entries").view(self._world, -1)  # fmt: skip
        slots = got[:, :u].amax(0)
        rows = got[:, u : u + 3 * bound].reshape(-1, 3)
        rows = rows[rows[:, 0] >= 0]
        new = slots < 0
        new_ids, new_counts, new_access = ids[new], counts[new], access[new]
        new_scores = self._scoring.scores(self._current_iter, new_counts, new_access)
        evicted, selected = decide(from_bits(rows[:, 2], scores), rows[:, 1], rows[:, 0], new_scores)
        self._shard.assign(evicted, new_ids[selected], new_counts[selected], new_access[selected], lowest)
        # every id of the interval's slot after the eviction, the same on every rank: the remap
        # of this call reads it when the history kept the whole batch
        slots[torch.isin(slots, evicted)] = -1
        slots[new.nonzero().view(-1)[selected]] = evicted
        in_order = torch.empty_like(slots)  # `unique` is sorted (torch.unique): by_count's inverse
        in_order[by_count] = slots
        self._interval_slots = (unique, in_order)
        evicted = evicted + self._output_global_offset
        if self._evicted:
            self._evicted_emb_indices = torch.unique(torch.cat([self._evicted_emb_indices.to(evicted.device), evicted]))
        else:
            self._evicted_emb_indices = evicted
        self._evicted = True

    def _slots_of(self, feature: JaggedTensor) -> torch.Tensor:
        values, device = to_state(feature.values()), feature.values().device
        known, self._interval_slots = self._interval_slots, None
        lengths, self._lengths = self._lengths, None
        if known is not None and self._whole_batch_kept:  # every id of the batch is in `known`
            ids, slots = known
            mine = slots[torch.searchsorted(ids, values)] if values.numel() else values.clone()
        else:
            if lengths is None:
                lengths = self._per_rank_lengths(feature)
            unique = torch.unique(values).to(torch.int64)
            ids = torch.unique(gather_rows(unique.view(-1, 1), bound=int(lengths.sum(1).max()), group=self._group,
                                           world=self._world, what="a managed-collision batch's unique ids"))  # fmt: skip
            slots = self._shard.slots_of(ids)
            all_reduce(slots, group=self._group, what="a managed-collision remap", op=dist.ReduceOp.MAX)
            mine = slots[torch.searchsorted(ids, values)] if values.numel() else values.clone()
        out = torch.where(mine >= 0, mine, self._zch_size - 1) + self._output_global_offset
        return out.to(device, values.dtype)

    # torchrec's names for the state, for code that reaches it by attribute (DCP's FQN walk):
    # this rank's share of it, in sorted order; the state_dict holds the whole table.
    _mch_sorted_raw_ids = property(lambda self: self._shard.raw)
    _mch_remapped_ids_mapping = property(lambda self: self._shard.slots + self._output_global_offset)
    _mch_counts = property(lambda self: self._shard.counts)
    _mch_last_access_iter = property(lambda self: self._shard.access)
