"""One sharded module's part of a reshard: its blocks of weights and optimizer state (`Item`s),
read from the old module's shards and written into the new module's.

Note [resharding in memory] (modular/resharding/__init__.py) says how they travel.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from modular.fused.tables import FusedTables
from modular.resharding.blocks import Block, piece_problem, row_blocks, weight_blocks
from modular.resharding.memory import KEEP_CHUNK_BYTES, Releaser
from modular.tables.layout import Layout, RankLayout
from planners.inputs import format_bytes
from planners.types import ShardSpec

__all__ = ["Item", "Kept", "ModuleMove", "Shards", "WEIGHT", "keep", "kept_blocks", "kept_whole_warning"]

WEIGHT = "weight"  # an item of the table's weights; any other `what` names an optimizer state


@dataclass(frozen=True)
class Item:
    """One block of one tensor kind (`what`: the weights, or an optimizer state by name) of one
    module's table; what travels in the all-to-all of its `dtype`."""

    module: int  # index among the reshard's modules
    what: str
    block: Block
    dtype: torch.dtype


class ModuleMove:
    """The move of one sharded module (`old`) to its new layout (`at`): the blocks of every table,
    its weights and, for a fused module, each state its optimizer keeps."""

    def __init__(self, index: int, fqn: str, old: nn.Module, at: RankLayout) -> None:
        self.index, self.fqn, self.at = index, fqn, at
        self.old: Optional[nn.Module] = old  # dropped once the new module replaces it
        before, after = old.layout, at.layout
        fused = old.fused_tables
        self.state_names: tuple[str, ...] = () if fused is None else fused.config.optimizer.state_names()
        # Which tables keep a statistic per column piece, before and after (Note [fused tables]).
        old_pieces = () if fused is None else fused.per_piece
        new_pieces = () if fused is None else FusedTables(fused.config, at=at).per_piece
        self.problem: Optional[str] = None
        self.items: list[Item] = []
        self.changed: list[str] = []
        for t, table in enumerate(after.tables):
            old_shards, new_shards = before.shards[t], after.shards[t]
            if (before.placements[t].sharding_type, old_shards) != (
                after.placements[t].sharding_type, new_shards
            ):
                self.changed.append(table.name)
            for block in weight_blocks(t, old_shards, new_shards):
                self.items.append(Item(index, WEIGHT, block, table.dtype))
            for name in self.state_names:
                if not fused.config.optimizer.row_state(name):
                    blocks = weight_blocks(t, old_shards, new_shards)
                else:
                    was, will = table.name in old_pieces, table.name in new_pieces
                    self.problem = self.problem or piece_problem(
                        table.name, old_shards, new_shards, old_per_piece=was, new_per_piece=will
                    )
                    blocks = row_blocks(t, old_shards, new_shards, per_piece=was and will)
                # Optimizer state is FP32 whatever the table's dtype (Note [low-precision tables]).
                self.items.extend(Item(index, name, b, torch.float32) for b in blocks)

    @property
    def layout(self) -> Layout:
        return self.at.layout

    def reader(self) -> Shards:
        """The old module's shards, which blocks are read from (this rank's)."""
        old = self.old
        states = {} if old.fused_tables is None else old.fused_tables.states()
        return Shards(old.layout, old.local_shard_views(), states)

    def writer(self, views: dict, states: Optional[dict] = None, adopted: frozenset = frozenset()) -> Shards:
        """The new module's shards (this rank's `views`, and `states` once it is built), but for
        those of the kernels it `adopted` from the old module, which hold their values already."""
        return Shards(self.layout, views, states or {}, adopted)


class Shards:
    """One module's local shards and their optimizer state, by (table, shard index), seen as
    blocks of the table (`Block.rows` and `cols` are the table's, not the shard's)."""

    def __init__(self, layout: Layout, views: dict, states: dict, adopted: frozenset = frozenset()) -> None:
        self.layout, self.views, self.states = layout, views, states
        self.adopted = adopted  # (table, shard) of kernels the new module took as they were

    def region(self, what: str, block: Block, shard: int) -> torch.Tensor:
        table = self.layout.tables[block.table]
        spec = self.layout.shards[block.table][shard]
        key = (table.name, shard)
        tensor = self.views[key].detach() if what == WEIGHT else self.states[key][what]
        return _region(tensor, spec, block)

    def sources(self) -> list[tuple[str, int, int, ShardSpec, torch.Tensor]]:
        """Every local tensor of this module's shards: (what, table index, shard index, its spec,
        tensor), each a tensor of its own (`detach`) on the shard's storage, which nothing else
        holds: Note [reshard memory] counts them."""
        out = []
        for (name, j), view in self.views.items():
            t = self.layout.table_index(name)
            spec = self.layout.shards[t][j]
            out.append((WEIGHT, t, j, spec, view.detach()))
            for what, state in self.states.get((name, j), {}).items():
                out.append((what, t, j, spec, state.detach()))
        return out

    def read(self, item: Item) -> torch.Tensor:
        return self.region(item.what, item.block, item.block.src_shard)

    @torch.no_grad()
    def write(self, item: Item, data: torch.Tensor) -> None:
        table = self.layout.tables[item.block.table].name
        for shard in item.block.dst_shards:
            if (table, shard) not in self.adopted:
                copy_block(self.region(item.what, item.block, shard), data)


def _region(tensor: torch.Tensor, spec: ShardSpec, block: Block) -> torch.Tensor:
    """`block` (the table's rows and columns) of shard `spec`'s `tensor`."""
    rows = slice(block.rows[0] - spec.row_offset, block.rows[1] - spec.row_offset)
    if block.cols is None:
        return tensor[rows]
    return tensor[rows, block.cols[0] - spec.col_offset : block.cols[1] - spec.col_offset]


def copy_block(target: torch.Tensor, data: torch.Tensor) -> None:
    """Writes one block into a new shard: the one write of every reshard (tests make it fail)."""
    target.copy_(data.view(target.shape))


@dataclass(frozen=True)
class Kept:
    """One old local tensor of a reshard's module (`what` of shard `shard` of table `table`) and
    the blocks this rank keeps from it."""

    module: int
    what: str
    table: int
    shard: int
    spec: ShardSpec
    tensor: torch.Tensor
    items: tuple[Item, ...]
    adopted: bool = False  # the new module holds it too (an adopted kernel's): never given back


def kept_blocks(
    moves: list[ModuleMove], readers: list[Shards], writers: list[Shards], rank: int
) -> list[Kept]:
    """Every old local tensor of the moving modules with the blocks this rank keeps from it; read
    before the reshard's last agreement, so that a block whose old shard this rank cannot find
    raises on every rank while the old shards are still whole. A block only into shards of
    kernels the new module adopted (`writers`' `adopted`) is not kept: it is there already; an
    adopted old tensor is listed only where another new shard takes a block from it, and
    marked, so that it is never given back."""
    kept: dict[tuple, list[Item]] = {}
    for move in moves:
        adopted, names = writers[move.index].adopted, move.layout.tables
        for item in move.items:
            block = item.block
            if block.moves or block.dst != rank:
                continue
            if all((names[block.table].name, j) in adopted for j in block.dst_shards):
                continue
            key = (move.index, item.what, block.table, block.src_shard)
            kept.setdefault(key, []).append(item)
    out = []
    for m, reader in enumerate(readers):
        adopted = writers[m].adopted
        for what, t, j, spec, tensor in reader.sources():
            items = tuple(kept.pop((m, what, t, j), ()))
            mine = (reader.layout.tables[t].name, j) in adopted
            if items or not mine:
                out.append(Kept(m, what, t, j, spec, tensor, items, adopted=mine))
    if kept:
        lost = sorted((moves[m].fqn, moves[m].layout.tables[t].name, w, j) for m, w, t, j in kept)
        raise RuntimeError(f"blocks to keep from old shards this rank does not hold: {lost}")
    return out


def keep(kept: list[Kept], writers: list[Shards], *, collect: bool) -> list[Kept]:
    """Copies the blocks this rank keeps (`kept_blocks`) from the old shards into the new ones,
    row chunk by row chunk, giving each chunk of an old tensor back as soon as it is copied, and
    old tensors that were sent away whole (Note [reshard memory] in memory.py). Past the swap
    only, when `kept` holds the old shards' only tensors the mover has: a storage that something
    else holds too (a user's `state_dict()`, a view) is kept whole. Returns those kept whole.
    `collect`: whether the collector may free some of those holders (`Releaser`)."""
    releaser = Releaser([k.tensor for k in kept if not k.adopted], collect=collect)
    for k in kept:
        spec, tensor = k.spec, k.tensor
        row = max(1, tensor[0].numel() * tensor.element_size()) if tensor.numel() else 1
        step = max(1, KEEP_CHUNK_BYTES // row)
        for a in range(0, spec.num_rows, step):
            b = min(a + step, spec.num_rows)
            lo, hi = spec.row_offset + a, spec.row_offset + b
            for item in k.items:
                r0, r1 = max(lo, item.block.rows[0]), min(hi, item.block.rows[1])
                if r0 < r1:
                    block = dataclasses.replace(item.block, rows=(r0, r1))
                    part = dataclasses.replace(item, block=block)
                    writers[k.module].write(part, _region(tensor, spec, block))
            if not k.adopted:
                releaser.release(tensor, a, b)
    return [k for k in kept if not k.adopted and releaser.held_outside(k.tensor)]


def kept_whole_warning(whole: list[Kept], moves: list[ModuleMove], rank: int) -> str:
    """What `keep` returned, said to the user: the tables whose old shards stayed whole, what
    they hold after the call, and how far the peak went over the bound (the blocks copied
    beside them)."""
    tables: dict[str, list[str]] = {}
    storages, copied = {}, 0
    for k in whole:
        names = tables.setdefault(moves[k.module].fqn, [])
        name = moves[k.module].layout.tables[k.table].name
        if name not in names:
            names.append(name)
        storage = k.tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        copied += sum(item.block.numel for item in k.items) * k.tensor.element_size()
    which = " and ".join(
        f"{'table' if len(ns) == 1 else 'tables'} {', '.join(map(repr, ns))} of module {fqn!r}"
        for fqn, ns in tables.items()
    )
    return (
        f"modular.reshard on rank {rank}: the old shards of {which} are still referenced outside "
        "the model (a state_dict(), a view, the old parameters or an optimizer over them, or the "
        "last step's loss, whose autograd graph holds them?), so they were kept whole and read as "
        "before: "
        f"{format_bytes(sum(storages.values()))} stay held until those references are dropped, "
        f"and this rank's peak memory was up to {format_bytes(copied)} above the bound (Note "
        "[reshard memory]). Drop such references before resharding (`del loss, opt`; clone what "
        "must outlive the call)"
    )
