"""The end of backward of a fused module: the one driver of every kernel's deferred update.

Kernels that cannot update inside their own backward (the torch emulation, Note [emulated fused
kernels]; the deferred fbgemm kernels, Note [row statistics across column shards] and Note
[fused data-parallel copies]) record their lookups; once autograd has run every backward of the
step, this driver runs the collectives that complete them and then each kernel's update, the
same collectives in the same order on every rank.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from modular.comm import all_to_all
from modular.kernels.base import Kernel
from modular.fused.deferred import GatheredFusedKernel, RowStatsFusedKernel, gather_across_replicas
from modular.fused.emulated import EmulatedFusedKernel, average_in_place, take_every_pending
from modular.kernels.lookups import Lookup, gather_batch, gather_lengths
from modular.fused.row_means import IdRowMeans
from modular.profiling import FUSED_UPDATE, labelled
from modular.tables.layout import RankLayout

__all__ = ["EndOfBackward"]


class EndOfBackward:
    """Runs the deferred updates of one module's kernels once backward has finished."""

    def __init__(
        self,
        kernels: list[Kernel],
        *,
        copies: set[int],
        column_rowwise: tuple[str, ...],
        at: RankLayout,
        per_id: bool = False,
        moments: Optional[Callable[[], None]] = None,
    ) -> None:
        """`per_id`: every column-wise table reports its statistics per id (a property of the
        layout, the same on every rank), so they are combined all at once (Note [row means
        without a loop over tables] in modular/fused/row_means.py). `moments`: the Adam family's
        updates, run last (`MomentUpdates.run`, modular/fused/moments.py)."""
        self.moments = moments
        self.kernels = kernels  # those with deferred work, remote routes' first
        self.copies = copies  # ids of data-parallel copies' kernels (gradients averaged)
        self.column_rowwise = column_rowwise
        self.at = at
        two_pass = [k for k in kernels if isinstance(k, RowStatsFusedKernel)]
        self._id_means = IdRowMeans(two_pass, column_rowwise, at) if per_id and column_rowwise else None

    def arm(self, out: torch.Tensor) -> None:
        """Queues `run` for the end of the backward that reaches `out` (the module's output)."""
        if out.requires_grad:
            out.register_hook(self._queue)

    def _queue(self, grad: torch.Tensor) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(self.run)

    @labelled(FUSED_UPDATE)  # Note [profiler labels] in modular/profiling.py
    def run(self) -> None:
        """End of backward (Note [emulated fused kernels], Note [row statistics across column
        shards]): one all-to-all of the column-wise tables' row statistics, then the data-parallel
        gradients of every kernel at once (the same collectives in the same order on every
        rank), then each kernel's update on the rows it touched. Under exact replicas, every
        kernel's batch or gradients are first every replica group's, all kernels' of a kind in
        two all-gathers."""
        gather_across_replicas(self.kernels)
        emulated = [k for k in self.kernels if isinstance(k, EmulatedFusedKernel)]
        grads = dict(zip(map(id, emulated), take_every_pending(emulated)))
        two_pass: list[RowStatsFusedKernel] = []
        row_means: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        if self._id_means is not None:  # no emulated shard holds a column-wise table
            self._id_means.run([k.id_stats() for k in self._id_means.kernels])
        else:
            two_pass = [k for k in self.kernels if isinstance(k, RowStatsFusedKernel)]
        stats = {id(k): k.row_stats() for k in two_pass}
        if self.column_rowwise and self._id_means is None:
            row_means = self._column_row_means(emulated, grads, two_pass, stats)
        copies = [k for k in emulated if id(k) in self.copies]  # data-parallel: every rank's
        average_in_place(copies, grads, world=self.at.world, group=self.at.group)
        for k in emulated:
            means = [row_means.get(name) for name, _ in k.group.shards]
            k.apply(grads[id(k)], [None if m is None else m[1] for m in means])
        for k in two_pass:
            if stats[id(k)] is None:
                continue
            k.update(
                [
                    None if piece is None or table not in row_means
                    else (piece[0], row_means[table][1] - piece[1])
                    for (table, _), piece in zip(k.group.shards, stats[id(k)])
                ]
            )  # fmt: skip
        for k in self.kernels:
            if isinstance(k, GatheredFusedKernel):
                batch = k.take_batch()  # every replica group's (Note [exact replicas])
                if id(k) in self.copies:  # a data-parallel table: every rank's of the group
                    batch = self._global_batch(k, batch)
                if batch is not None:
                    k.run_backward(batch)
        if self.moments is not None:
            self.moments()

    def _global_batch(self, k: GatheredFusedKernel, mine: Optional[Lookup]) -> Optional[Lookup]:
        """Every rank's lookup batch for data-parallel copy kernel `k`, merged in rank order,
        gradients divided by the world size (Note [fused data-parallel copies]); the same
        collectives on every rank."""
        if mine is None:  # no lookup on any rank: forward ran on all or none
            return None
        lengths = gather_lengths(mine, self.at.group, self.at.world)
        return gather_batch(mine, lengths, len(k.group.routes), self.at.group, self.at.world)

    def _column_row_means(self, emulated, grads, two_pass, stats):
        """Per column-wise table this rank holds, its rows (one per id, or per touched row) and
        the whole row's mean of grad**2 on each (Note [row statistics across column shards]):
        this rank's shards' sums of g**2, plus those of the other ranks holding the table,
        exchanged in one all-to-all (every rank calls it; a rank sends a peer one float per row
        of each table both hold, tables in `column_rowwise` order)."""
        local: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for k in emulated:
            for t, ((table, _), g) in enumerate(zip(k.group.shards, grads[id(k)])):
                if table in self.column_rowwise:
                    if g is None:
                        rows = torch.zeros(0, dtype=torch.int64, device=self.at.device)
                        local.setdefault(table, []).append((rows, rows.float()))
                    else:
                        decayed = k.decayed(t, g)
                        local.setdefault(table, []).append((g.rows, (decayed * decayed).sum(1)))
        for k in two_pass:
            pieces = stats[id(k)]
            for (table, _), (_, cols), piece in zip(k.group.shards, k.sizes, pieces or ()):
                if piece is not None:  # a column-wise table's (rows, s): one per id or per row
                    rows, s = piece
                    local.setdefault(table, []).append((rows, s * cols))  # s: mean over cols
        mine: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for table, parts in local.items():
            rows, total = parts[0][0], parts[0][1].clone()
            for other_rows, part in parts[1:]:  # this rank's other shards: the same rows
                if other_rows.numel() != rows.numel():
                    raise RuntimeError(
                        f"column shards of table {table!r} on rank {self.at.rank} reported "
                        f"{rows.numel()} and {other_rows.numel()} row statistics in one step; "
                        "they look up the same ids and must agree"
                    )
                total += part
            mine[table] = (rows, total)
        exchange_row_sums(mine, self.column_rowwise, self.at)
        return {
            n: (rows, total.div_(self.at.layout.table(n).embedding_dim))
            for n, (rows, total) in mine.items()
        }


def exchange_row_sums(
    mine: dict[str, tuple[torch.Tensor, torch.Tensor]], tables: tuple[str, ...], at: RankLayout
) -> None:
    """Adds, in place, the other holders' shares to this rank's per-row sums of column-wise
    tables: `mine[table] = (rows, sums)`, sums of shape (rows,) or (rows, n), this rank's pieces
    already added up, rows in the order every holder of the table has them (Note [row statistics
    across column shards]). One all-to-all, which every rank of the group joins (a rank holding
    none of `tables` sends and receives nothing): a peer is sent the sums of each table both
    hold, in `tables` order."""
    if at.local:
        return
    holders = {
        name: {spec.rank for spec in at.layout.shards[at.layout.table_index(name)]}
        for name in tables
    }
    shared = [  # per peer, the tables both hold, in `tables` order
        [n for n in tables if n in mine and p in holders[n]] if p != at.rank else []
        for p in range(at.world)
    ]
    splits = [sum(mine[n][1].numel() for n in names) for names in shared]
    if any(splits):
        send = torch.cat([mine[n][1].reshape(-1) for names in shared for n in names])
    else:
        send = torch.zeros(0, device=at.device)
    received = all_to_all(
        send, input_splits=splits, output_splits=splits, group=at.group,
        what="the all-to-all of column-wise row statistics",
    )  # fmt: skip
    for names, chunk in zip(shared, received.split(splits)):
        for n, piece in zip(names, chunk.split([mine[n][1].numel() for n in names])):
            mine[n][1].add_(piece.view(mine[n][1].shape))
