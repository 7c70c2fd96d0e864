"""This rank's shards of one sharded collection (an EBC's or an EC's): the kernels that hold them,
their views, and the tables' weights made from them.

Both sharded collections own one `LocalShards`, built from the collection's `RankLayout` and its
fused config: it picks each kernel in one place (`choose_kernel` in modular/fused/choice.py, for
fused and unfused modules alike), fills the shards (Note [agreeing on the shards' init] in
modular/tables/init.py) and makes each table's weight under its unsharded name.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

import torch

from modular.fused.choice import KernelChoice, KernelFacts, KernelKind, choose_kernel
from modular.describe import logs_kernel_choice
from modular.fused.config import FusedConfig
from modular.fused.tables import FusedTables
from modular.fused.adam import StepCount
from modular.kernels.base import Kernel
from modular.kernels.dense import DenseKernel
from modular.tables.forms import TensorType
from modular.tables.init import init_shards
from modular.tables.replicas import copy_from_first_replica
from modular.tables.layout import KernelGroup, RankLayout, kernel_groups
from modular.tables.weights import ShardedTable, table_weight
from modular.tiered.kernel import TieredKernel

__all__ = ["LocalShards", "ShardFill"]


class ShardFill(Protocol):
    """What `reshard` gives a module it builds in place of shard init (the sharded class's
    `fill=`, Note [resharding in memory]): kernels it adopts from the old module as they are, and what
    fills the other shards."""

    def adopt(self, group: KernelGroup, sizes: list[tuple[int, int]], *, is_local: bool) -> Optional[Kernel]:
        """The old module's kernel over exactly these shards, taken as it is, or None."""

    def __call__(self, views: dict) -> None:
        """Fills the shards (the adopted kernels' too, which it leaves as they are)."""

    def steps(self) -> Optional[StepCount]:
        """The old module's step count, which the new module and its kernels continue (Note
        [fused Adam and LAMB]): one object, so that an adopted kernel counts with the others."""


class LocalShards:
    """The kernels of one collection on this rank: `kernels` look up the routes this rank holds
    (for every rank's batch), `local_kernels` its data-parallel copies (for its own batch)."""

    def __init__(
        self, *, at: RankLayout, fused: Optional[FusedConfig], fill: Optional[ShardFill] = None
    ) -> None:
        """`fill`: reshard's, in place of shard init; None builds and initialises every kernel."""
        self.at = at
        # The fused optimizer's part (Note [fused tables]): it picks every fused kernel.
        self.fused_tables = None if fused is None else FusedTables(fused, at=at)
        self._fill = fill
        self.adopted: set[int] = set()  # ids of the kernels taken from an old module as they are
        self.choices: list[tuple[KernelGroup, KernelChoice]] = []  # each built kernel's, and why
        steps = None if self._fill is None else self._fill.steps()
        if self.fused_tables is not None and steps is not None:
            self.fused_tables.steps = steps
        layout = at.layout
        self.kernels = [self._kernel(g, False) for g in kernel_groups(layout.routes_to(at.rank))]
        self.local_kernels = [self._kernel(g, True) for g in kernel_groups(layout.local)]
        if self.fused_tables is not None:
            self.fused_tables.attach(self.kernels, self.local_kernels)

    @logs_kernel_choice  # at DEBUG: the class each group got (modular/describe.py)
    def _kernel(self, group: KernelGroup, is_local: bool) -> Kernel:
        layout = self.at.layout
        sizes = []
        for table, j in group.shards:
            spec = layout.shards[layout.table_index(table)][j]
            sizes.append((spec.num_rows, spec.num_cols))
        adopted = None if self._fill is None else self._fill.adopt(group, sizes, is_local=is_local)
        if adopted is not None:  # its sync (data-parallel, replica groups) is set up already
            self.adopted.add(id(adopted))
            return adopted
        if self.fused_tables is not None:
            facts = self.fused_tables.facts(group, sizes, is_local=is_local)
        else:
            replicas = self.at.replicas
            facts = KernelFacts(
                device_type=self.at.device.type, optimizer=None,
                exact_replicas=replicas is not None and replicas.exact,
            )  # fmt: skip
        choice = choose_kernel(facts)
        self.choices.append((group, choice))
        if choice.kernel is not KernelKind.DENSE:
            return self.fused_tables.kernel(group, sizes, choice)
        kernel = DenseKernel(group, sizes, self.at.device)
        if choice.across_replicas:  # Note [exact replicas]
            kernel.replicate_across(self.at.replicas)
        return kernel

    def views(self) -> dict[tuple[str, int], torch.Tensor]:
        """Every local shard's weights, by (table, shard index); a tiered shard's are its
        store's, made current (Note [tiered tables])."""
        self.sync_tiers()
        views = {}
        for k in (*self.kernels, *self.local_kernels):
            for key, view in zip(k.group.shards, k.views):
                views[key] = view
        return views

    def sync_tiers(self) -> None:
        """Writes the tiered kernels' dirty cached rows back and empties their caches, so that
        their stores (the tables' weights and fused state) can be read and written."""
        for k in self.kernels:
            if isinstance(k, TieredKernel):
                k.sync()

    def build_tables(
        self,
        source: Any,
        *,
        global_rank: int,
        tensor_type: TensorType = TensorType.SHARDED_TENSOR,
    ) -> dict[str, ShardedTable]:
        """Fills the shards from `source`'s weights (or their init_fn on meta), then makes each
        table's weight in table order (both collective), then has dense data-parallel copies
        average their gradients over ranks (Note [dense data-parallel copies])."""
        views = self.views()
        copies = [view for k in self.local_kernels for view in k.views]
        moved, self._fill = self._fill, None  # reshard's blocks fill every replica group's copies
        if moved is not None:  # alike (Note [resharding in memory]): nothing to broadcast
            moved(views)
        else:
            init_shards(source, views, copies, at=self.at)  # Note [agreeing on the shards' init]
            if self.at.replicas is not None:  # every replica group starts from the first one's
                copy_from_first_replica(list(views.values()), self.at.replicas)
        tables = {}
        for t, table in enumerate(self.at.layout.tables):
            weight = table_weight(
                t, views, at=self.at, global_rank=global_rank, tensor_type=tensor_type
            )
            tables[table.name] = ShardedTable(weight)
        if self.at.world > 1:
            for k in self.local_kernels:
                if isinstance(k, DenseKernel) and id(k) not in self.adopted:
                    k.data_parallel_over(self.at.group, self.at.world)
        return tables
