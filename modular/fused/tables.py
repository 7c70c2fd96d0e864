"""The fused optimizer's part of one sharded EBC: which kernel each shard group gets.

See Note [fused tables] in modular/fused/choice.py. A `FusedTables` is owned by its module
(`ShardedEmbeddingBagCollection.fused_tables`) and built from the fused config and the module's
`RankLayout`; it builds every fused kernel (`kernel`) as `choose_kernel` says, and once the
module has its kernels
(`attach`) it owns the end-of-backward work (`EndOfBackward`, modular/fused/backward.py) and
reads and writes their optimizer state (modular/fused/state.py).
"""

from __future__ import annotations

from typing import Optional

import torch

from modular.fused.adam import AdamFusedKernel, StepCount
from modular.kernels.base import Kernel
from modular.fused.deferred import (
    DeferredFusedKernel,
    GatheredFusedKernel,
    RowForm,
    RowStatsFusedKernel,
)
from modular.fused.backward import EndOfBackward
from modular.fused.choice import KernelChoice, KernelFacts, KernelKind, emulation_reason
from modular.fused.config import FusedConfig
from modular.fused.emulated import EmulatedFusedKernel
from modular.fused.fbgemm import FusedKernel
from modular.fused.moments import MomentUpdates
from modular.tables.layout import KernelGroup, RankLayout
from modular.tiered.build import tiered_kernel
from modular.tiered.kernel import TieredKernel
from planners.types import ShardingType

__all__ = ["FusedTables"]


class FusedTables:
    """Chooses and holds the fused kernels of one sharded EBC (Note [fused tables])."""

    def __init__(self, config: FusedConfig, *, at: RankLayout) -> None:
        self.config = config
        self.at = at
        # Tables whose column pieces exchange row statistics (Note [row statistics across column
        # shards]): none unless the optimizer needs whole rows' (row-wise Adagrad keeping the
        # exact statistic, partial_rowwise, LAMB).
        self.column_rowwise: tuple[str, ...] = () if config.per_shard_rows else self._column_cut()
        # Column-cut tables whose pieces keep their own row statistic (Note [fused tables]).
        self.per_piece: tuple[str, ...] = self._column_cut() if config.per_shard_rows else ()
        self.steps = StepCount()  # Note [fused Adam and LAMB]
        self.kernels: list[Kernel] = []
        self.local_kernels: list[Kernel] = []
        self.end_of_backward: Optional[EndOfBackward] = None

    def facts(self, group: KernelGroup, sizes: list[tuple[int, int]], *, is_local: bool) -> KernelFacts:
        """What `choose_kernel` reads of one kernel group of this module."""
        replicas = self.at.replicas
        return KernelFacts(
            device_type=self.at.device.type,
            optimizer=self.config.optimizer,
            weight_decay=self.config.weight_decay,
            widths=tuple(cols for _, cols in sizes),
            data_parallel=is_local and self.at.world > 1,
            column_rows=any(table in self.column_rowwise for table, _ in group.shards),
            exact_replicas=replicas is not None and replicas.exact,
        )

    def kernel(self, group: KernelGroup, sizes: list[tuple[int, int]], choice: KernelChoice) -> Kernel:
        """The fused kernel `choice` names (`choose_kernel`) for one kernel group."""
        device, config = self.at.device, self.config
        kernel: Kernel
        if group.tiered:  # Note [tiered tables]; `shard` refused tiers on any other kernel
            if choice.kernel not in (KernelKind.FBGEMM, KernelKind.ADAM) or choice.across_replicas:
                raise AssertionError(f"a tiered kernel group got {choice}")
            return tiered_kernel(group, sizes, at=self.at, config=config, steps=self.steps)
        if choice.kernel is KernelKind.FBGEMM:
            return FusedKernel(group, sizes, device, config, steps=self.steps)
        if choice.kernel is KernelKind.ADAM:
            kernel = AdamFusedKernel(group, sizes, device, config, steps=self.steps)
        elif choice.kernel is KernelKind.EMULATED:
            kernel = EmulatedFusedKernel(group, sizes, device, config)
        elif choice.kernel is KernelKind.REPLAYED:
            kernel = GatheredFusedKernel(group, sizes, device, config)
        elif choice.kernel is KernelKind.ROW_STATISTICS:
            forms = tuple(
                None if table not in self.column_rowwise else self._row_form(table)
                for table, _ in group.shards
            )
            kernel = RowStatsFusedKernel(group, sizes, device, config, forms)
        else:
            raise ValueError(f"{choice.kernel} is not a fused kernel")  # a bug: `choose_kernel` chose
        if choice.across_replicas:  # copies in other replica groups (Note [exact replicas])
            kernel.replicate_across(self.at.replicas)
        return kernel

    def attach(self, kernels: list[Kernel], local_kernels: list[Kernel]) -> None:
        """Takes the module's kernels (made by `kernel`): remote routes', then data-parallel."""
        self.kernels, self.local_kernels = kernels, local_kernels
        if self.config.optimizer.adam_family():
            self._attach_moments()
            return
        pending = [
            k
            for k in (*kernels, *local_kernels)
            if isinstance(k, (EmulatedFusedKernel, DeferredFusedKernel))
        ]
        # A rank holding no shard of the column-wise tables still joins their statistics'
        # all-to-all (with nothing to send), or the ranks that hold them wait on it forever.
        if pending or (self.column_rowwise and not self.at.local):
            copies = {id(k) for k in local_kernels} if self.at.world > 1 else set()
            per_id = all(self._row_form(t) is RowForm.IDS for t in self.column_rowwise)
            self.end_of_backward = EndOfBackward(
                pending, copies=copies, column_rowwise=self.column_rowwise, at=self.at,
                per_id=per_id,
            )  # fmt: skip

    def _attach_moments(self) -> None:
        """The Adam family's end of backward (Note [fused Adam and LAMB]): its emulated kernels'
        updates, and on a rank holding no piece of its column-wise tables, their exchanges."""
        every = (*self.kernels, *self.local_kernels)
        # a tiered kernel's cache kernel, through the tiered one (Note [tiered tables])
        kernels = [k for k in every if isinstance(getattr(k, "inner", k), AdamFusedKernel)]
        if kernels or (self.column_rowwise and not self.at.local):
            copies = {id(k) for k in self.local_kernels} if self.at.world > 1 else set()
            moments = MomentUpdates(
                kernels, kind=self.config.optimizer, copies=copies,
                column_tables=self.column_rowwise, at=self.at,
            )  # fmt: skip
            self.end_of_backward = EndOfBackward(
                [], copies=set(), column_rowwise=(), at=self.at, moments=moments.run
            )

    def states(self) -> dict[tuple[str, int], dict[str, torch.Tensor]]:
        """Every local shard's optimizer state, keyed by (table, shard index); a tiered shard's
        is its store's, made current (Note [tiered tables])."""
        out = {}
        for k in (*self.kernels, *self.local_kernels):
            if isinstance(k, TieredKernel):
                k.sync()
            for key, st in zip(k.group.shards, k.states):
                out[key] = st
        return out

    def _column_cut(self) -> tuple[str, ...]:
        """Tables cut into two or more column pieces, under an optimizer whose rows need
        statistics of the whole row (row-wise Adagrad, partial_rowwise, LAMB)."""
        if not self.config.optimizer.whole_row_statistics():
            return ()
        layout = self.at.layout
        return tuple(
            t.name
            for t, p, shards in zip(layout.tables, layout.placements, layout.shards)
            if p.sharding_type is ShardingType.COLUMN_WISE and len(shards) > 1
        )

    def _row_form(self, table: str) -> RowForm:
        """How every holder of column-wise `table` exchanges its row statistics: per id, unless
        one of its shards is emulated, whose statistics come per unique row (Note [row
        statistics across column shards])."""
        layout = self.at.layout
        widths = [s.num_cols for s in layout.shards[layout.table_index(table)]]
        emulated = emulation_reason(
            device_type=self.at.device.type, optimizer=self.config.optimizer,
            weight_decay=self.config.weight_decay, widths=tuple(widths),
            deferred="column pieces sharing whole rows' statistic",
        )  # fmt: skip
        return RowForm.IDS if emulated is None else RowForm.ROWS
