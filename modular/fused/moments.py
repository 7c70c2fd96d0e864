"""The Adam family's update at the end of backward, for every emulated kernel of one module.

Note [fused Adam and LAMB] (modular/fused/adam.py) says what the update is; this runs it on
the module's `AdamFusedKernel`s in phases, with the collectives that make it exact between them,
the same collectives in the same order on every rank:
  1. each kernel's sparse gradient (rows it touched, summed gradients); data-parallel copies
     average theirs over ranks, all kernels' at once (`average_in_place`, Note [emulated fused
     kernels]);
  then the tables held whole take their whole update (`AdamFusedKernel.apply`), and the tables
  cut into column pieces take theirs in phases:
  2. partial_rowwise: each touched row's sum of g**2, a column-wise table's summed over its
     pieces (one all-to-all, `exchange_row_sums`), divided by the whole row's width; then
     partial_rowwise_adam's pieces take their whole update (`apply`, given those means);
  3. LAMB: the moments and each row's r, piece by piece (r is per element), with each touched
     row's sums of w**2 and r**2 over the piece (`directions`), summed over the table's pieces
     (a second all-to-all, two floats per row);
  4. LAMB: the weights (`step_rows`).
Every column piece of a table looks up the same ids (each id goes to every piece), so its pieces
agree on the touched rows, sorted and unique (Note [row statistics across column shards]). A
rank holding no piece of a column-wise table joins the all-to-alls with nothing to send.
"""

from __future__ import annotations

from typing import Optional

import torch

from modular.fused.backward import exchange_row_sums
from modular.fused.config import FusedOptimizerKind
from modular.fused.adam import AdamFusedKernel
from modular.fused.emulated import RowGrad, average_in_place, take_every_pending
from modular.tables.layout import RankLayout

__all__ = ["MomentUpdates"]

PerTable = list[Optional[torch.Tensor]]


class MomentUpdates:
    """Runs the deferred Adam-family updates of one module's kernels (module docstring)."""

    def __init__(
        self,
        kernels: list[AdamFusedKernel],
        *,
        kind: FusedOptimizerKind,
        copies: set[int],
        column_tables: tuple[str, ...],
        at: RankLayout,
    ) -> None:
        """`copies`: ids of the data-parallel copies' kernels; `column_tables`: the tables cut
        into column pieces whose rows need whole-row statistics (the same on every rank)."""
        self.kernels = kernels
        self.kind = kind
        self.copies = copies
        self.column_tables = column_tables
        self.at = at

    def run(self) -> None:
        at = self.at
        grads = dict(zip(map(id, self.kernels), take_every_pending(self.kernels)))
        copies = [k for k in self.kernels if id(k) in self.copies]  # every rank's, at once
        average_in_place(copies, grads, world=at.world, group=at.group)
        # Tables held whole take the update at once, a block of rows at a time (Note [updating
        # rows in blocks]); column pieces in phases, with their exchanges between.
        cut: dict[int, list[Optional[RowGrad]]] = {}
        for k in self.kernels:
            pieces = [table in self.column_tables for table, _ in k.group.shards]
            k.apply([None if p else g for g, p in zip(grads[id(k)], pieces)])
            cut[id(k)] = [g if p else None for g, p in zip(grads[id(k)], pieces)]
        if not self.column_tables:
            return
        means: dict[int, PerTable] = {id(k): [None] * len(k.sizes) for k in self.kernels}
        if self.kind.partial_rowwise():
            sums = {id(k): k.grad_square_sums(cut[id(k)]) for k in self.kernels}
            whole = self._whole_rows(cut, sums)
            for k in self.kernels:  # the whole row's sum over its width
                means[id(k)] = [
                    None if s is None else whole[table] / at.layout.table(table).embedding_dim
                    for (table, _), s in zip(k.group.shards, sums[id(k)])
                ]
        if not self.kind.trust_ratio():  # partial_rowwise_adam: nothing else to combine
            for k in self.kernels:
                k.apply(cut[id(k)], means[id(k)])
            return
        directions = {id(k): k.directions(cut[id(k)], means[id(k)]) for k in self.kernels}
        own = {
            id(k): [None if d is None else d.norm_squares for d in directions[id(k)]]
            for k in self.kernels
        }
        whole = self._whole_rows(cut, own)
        for k in self.kernels:
            norms = [
                None if s is None else whole[table]
                for (table, _), s in zip(k.group.shards, own[id(k)])
            ]
            k.step_rows(cut[id(k)], directions[id(k)], norms)

    def _whole_rows(
        self, grads: dict[int, list[Optional[RowGrad]]], sums: dict[int, PerTable]
    ) -> dict[str, torch.Tensor]:
        """Per column-wise table this rank holds, each touched row's sums over all its pieces:
        this rank's pieces added up, then the other holders' (one all-to-all, which a module
        with column-wise tables runs on every rank; none without)."""
        if not self.column_tables:
            return {}
        mine: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for k in self.kernels:
            for (table, _), g, s in zip(k.group.shards, grads[id(k)], sums[id(k)]):
                if table not in self.column_tables:
                    continue
                if g is None:  # no ids this step: every piece of the table has none
                    continue
                if table in mine:  # another piece on this rank: the same rows
                    rows, total = mine[table]
                    if rows.numel() != g.rows.numel():
                        raise RuntimeError(
                            f"column pieces of table {table!r} on rank {self.at.rank} touched "
                            f"different rows in one step ({rows.numel()} and {g.rows.numel()}); "
                            "every piece looks up the same ids"
                        )
                    total += s
                else:
                    mine[table] = (g.rows, s.clone())
        exchange_row_sums(mine, self.column_tables, self.at)
        return {table: total for table, (_, total) in mine.items()}
