"""The kernels a reshard keeps: an old module's kernels whose shards stay as they are on this
rank, which the new module adopts as they are (Note [reshard memory] in memory.py; Note
[resharding in memory] in modular/resharding/__init__.py)."""

from __future__ import annotations

from typing import Optional

from torch import nn

from modular import lifecycle
from modular.fused.adam import StepCount
from modular.kernels.base import Kernel
from modular.kernels.dense import DenseKernel
from modular.kernels.views import ShardView
from modular.resharding.moves import ModuleMove
from modular.tables.forms import is_sharded, local_pieces
from modular.tables.layout import KernelGroup, kernel_groups

__all__ = ["Adoption", "retire_replaced"]


class Adoption:
    """What a module that `reshard` builds takes in place of shard init (`ShardFill`,
    modular/local_shards.py): the old module's kernels whose shards stay as they are on this
    rank, adopted as they are, with their buffers, optimizer state and replica sync (Note
    [reshard memory]), and the old step count; the other shards are left to the blocks, which
    `_build` writes once every new module is built. Until the swap the old module keeps using
    what the new one adopted; the one change, an adopted dense kernel's new parameter objects
    (on the same storage), is undone (`undo`) where the reshard fails."""

    def __init__(self, move: ModuleMove) -> None:
        old, before, after = move.old, move.old.layout, move.layout
        same = {
            table.name
            for t, table in enumerate(after.tables)
            if before.placements[t].sharding_type is after.placements[t].sharding_type
            and _cuts(before.shards[t]) == _cuts(after.shards[t])
        }  # fmt: skip
        # Kernels whose every table is cut as before (which decides the kernel's kind, Note [fused
        # tables]) and whose group (routes, shards) the new module has on this rank: `adopt` takes
        # one only for the same group and sizes; the others are rebuilt (and staged off CPU).
        groups = {(False, g) for g in kernel_groups(after.routes_to(move.at.rank))}
        groups |= {(True, g) for g in kernel_groups(after.local)}
        self._candidates = [
            (is_local, k)
            for is_local, kernels in ((False, old._kernels), (True, old._local_kernels))
            for k in kernels
            if all(name in same for name, _ in k.group.shards) and (is_local, k.group) in groups
        ]  # fmt: skip
        self._steps = None if old.fused_tables is None else old.fused_tables.steps
        self.taken: list = []
        self._views: list = []  # (dense kernel, its old views) to give back if the reshard fails

    def adopt(self, group: KernelGroup, sizes: list[tuple[int, int]], *, is_local: bool) -> Optional[Kernel]:
        for i, (local, kernel) in enumerate(self._candidates):
            if local == is_local and kernel.group == group and list(kernel.sizes) == list(sizes):
                del self._candidates[i]
                self.taken.append(kernel)
                if isinstance(kernel, DenseKernel):  # a torch optimizer's: parameters of its own
                    self._views.append((kernel, kernel.views))
                    kernel.views = _fresh_views(kernel)
                return kernel
        return None

    def undo(self) -> None:
        """Gives the adopted kernels their old parameters back (the reshard failed)."""
        for kernel, views in self._views:
            kernel.views = views

    def __call__(self, views: dict) -> None:
        """The shards are written by `_build` once every new module is built."""

    def steps(self) -> Optional[StepCount]:
        return self._steps

    def candidate_shards(self) -> frozenset:
        """(table, shard index) of every shard of the kernels this rank may adopt."""
        return frozenset(key for _, kernel in self._candidates for key in kernel.group.shards)

    def adopted_shards(self) -> frozenset:
        """(table, shard index) of every shard of the adopted kernels."""
        return frozenset(key for kernel in self.taken for key in kernel.group.shards)


def _fresh_views(kernel: DenseKernel) -> list[ShardView]:
    """New parameters on an adopted dense kernel's shards: the old ones are retired, so that an
    optimizer built before the reshard raises on every rank, also where its tables stayed."""
    views, start = [], 0
    for rows, cols in kernel.sizes:
        views.append(ShardView(kernel.grads, start, rows, cols))
        start += rows * cols
    return views


def _cuts(shards) -> tuple:
    """A table's shards but for their ranks."""
    return tuple((s.row_offset, s.num_rows, s.col_offset, s.num_cols) for s in shards)


def retire_replaced(old: nn.Module, new: nn.Module, fqn: str) -> None:
    """`retire_tables` for the tensors of `old` that `new` does not hold (an adopted kernel's are
    the new module's too), so that an optimizer over them raises at its next step."""
    held = {id(t) for t in new.local_shard_views().values()}
    held |= {id(t) for _, p in new.named_parameters() for t in _locals(p)}
    for name, p in old.named_parameters():
        for t in _locals(p):
            if id(t) not in held:
                lifecycle.retire(t, f"{name!r} of module {fqn!r}", by="modular.reshard")


def _locals(p) -> list:
    return [piece.tensor for piece in local_pieces(p)] if is_sharded(p) else [p]
