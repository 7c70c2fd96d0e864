"""Fused kernels whose update waits for the end of backward: fbgemm's CPU backward ops run by
the owning module once its collectives have completed the batch (column-wise row statistics,
data-parallel copies, exact 2D replica groups). See Note [row statistics across column shards]
and Note [fused data-parallel copies] below, and Note [fused tables] in modular/fused/choice.py.
"""

from __future__ import annotations

import enum
from typing import Optional

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode

from modular.fused.config import FusedOptimizerKind
from modular.kernels.base import KernelLookup, sum_weights
from modular.fused.fbgemm import FusedKernel
from modular.kernels.lookups import Lookup, merge_lookups
from modular.kernels.exact_replicas import gather_every_replica
from modular.fused.row_sums import RowGradSquares
from modular.tables.layout import KernelGroup
from modular.tables.replicas import Replicas


def gather_across_replicas(kernels: list) -> None:
    """Under exact replicas, makes each deferred kernel's pending lookups every replica group's
    batch, for all of a module's kernels in the same two all-gathers (Note [exact replicas] in
    modular/kernels/exact_replicas.py); run once a step before any `take_batch`. Other kernels are
    left as they are."""
    held = [
        k for k in kernels
        if isinstance(k, DeferredFusedKernel) and k._across is not None and k.pending
    ]  # fmt: skip
    if not held:
        return
    routes = [len(k.group.routes) for k in held]
    mine = [k.take_batch() for k in held]
    for k, batch in zip(held, gather_every_replica(mine, routes, held[0]._across)):
        k.pending = [batch]


class RowForm(enum.Enum):
    """How a RowStatsFusedKernel reports a table's row statistics (Note [row statistics across
    column shards]): one per id of the step, in the order the ids arrived, or one per touched
    row, sorted and unique."""

    IDS = "ids"
    ROWS = "rows"


class DeferredFusedKernel(FusedKernel):
    """fbgemm's fused kernel (CPU) whose update runs at the end of backward, on a batch the
    owning module may first complete with other ranks' data (subclasses say how)."""

    replays_sum_backward = True  # sequences as bags of one (Note [sequence lookups])

    def __init__(
        self, group: KernelGroup, sizes: list[tuple[int, int]], device: torch.device, config
    ) -> None:
        super().__init__(group, sizes, device, config)
        self.pending: list[Lookup] = []
        self._placeholder = torch.zeros(0, device=device, requires_grad=True)
        self._across: Optional[Replicas] = None

    def replicate_across(self, replicas: Replicas) -> None:
        """Makes this kernel's batch every replica group's (Note [exact replicas] in
        modular/kernels/exact_replicas.py)."""
        self._across = replicas

    def __call__(
        self, indices: torch.Tensor, offsets: torch.Tensor, weights: Optional[torch.Tensor]
    ) -> torch.Tensor:
        self._sync_lr()
        return KernelLookup.apply(self._placeholder, self, indices, offsets, weights)

    def backward(self, batch: Lookup) -> None:
        """Records what the update at the end of backward needs (the owning module runs it after
        its collectives)."""
        self.pending.append(batch)

    def take_batch(self) -> Optional[Lookup]:
        """The lookups since the last update as one batch (several are merged, so their
        gradients add up before one update); None if there were none. Under exact replicas,
        every replica group's batch, which `gather_across_replicas` made it."""
        pending, self.pending = self.pending, []
        if not pending:
            return None
        return pending[0] if len(pending) == 1 else merge_lookups(pending, len(self.group.routes))

    def run_backward(
        self,
        batch: Lookup,
        *,
        state: Optional[torch.Tensor] = None,
        lr: Optional[torch.Tensor] = None,
    ) -> None:
        """fbgemm's fused CPU backward on `batch`: the update, with this kernel's state and
        learning rate unless others are given (SUM mode with per-id weights: `sum_weights`)."""
        tbe, kind = self.tbe, self.config.optimizer
        weights = sum_weights(self.group.pooling, batch.offsets, batch.weights)
        lr = tbe.learning_rate_tensor if lr is None else lr
        common = (
            batch.grad_out, tbe.weights_host, tbe.weights_placements, tbe.weights_offsets,
            tbe.D_offsets, tbe.max_D, tbe.hash_size_cumsum, tbe.total_hash_size_bits,
            batch.indices, batch.offsets, int(PoolingMode.SUM), weights,
            False,  # stochastic rounding
        )  # fmt: skip
        with torch.no_grad():
            if kind is FusedOptimizerKind.EXACT_SGD:
                torch.ops.fbgemm.split_embedding_backward_codegen_sgd_cpu(*common, lr, 0)
                return
            momentum = (
                (tbe.momentum1_host if state is None else state).detach(),
                tbe.momentum1_placements,
                tbe.momentum1_offsets,
            )
            if kind is FusedOptimizerKind.EXACT_ADAGRAD:
                torch.ops.fbgemm.split_embedding_backward_codegen_adagrad_cpu(
                    *common, *momentum, lr, self.config.eps, 0
                )
            else:  # weight decay and max norm 0: weight decay takes the torch emulation on CPU
                torch.ops.fbgemm.split_embedding_backward_codegen_rowwise_adagrad_cpu(
                    *common, *momentum, lr, self.config.eps, 0.0, 0, 0.0, 0
                )


class RowStatsFusedKernel(DeferredFusedKernel):
    """fbgemm's fused row-wise Adagrad, with the row statistic of whole rows for column shards.

    # Note [row statistics across column shards]
    Row-wise Adagrad keeps one statistic per row, the running sum of mean(g**2) over the row's
    columns; a column shard alone sees only its own columns, which is the approximation TorchRec
    makes. Exact, with fbgemm's kernel doing the work, in two passes on CPU:
      1. at the end of backward, each touched row's s = mean over this shard's columns of g**2:
         from one pooling kernel over the pooled gradients where the group's routes have one
         width (Note [row statistics from a pooling kernel], modular/fused/row_sums.py: a
         fraction of a backward's cost), else from fbgemm's row-wise Adagrad backward with
         learning rate 0 into a scratch state that is zero (the weights are left as they are:
         w -= 0 * ...);
      2. the owning module sums cols * s over the table's column shards, which gives every shard
         the whole row's mean m, sets the row's state to state + m - s, and runs the same
         backward with the real learning rate: fbgemm adds s back, so the state grows by m and
         the update divides by the exact statistic. Where every column-wise table reports per
         id, this runs for all tables at once (`id_stats`, `update_ids`; Note [row means without
         a loop over tables] in modular/fused/row_means.py), else table by table.
    Every column shard of a table looks up the same ids in the same order (each id is routed to
    all of them, and they arrive source rank by source rank, feature by feature), so the holders
    agree on the statistics' order without sorting anything: s travels as one float per id of
    the step (`RowForm.IDS`), read from the scratch at the id's row, only between the ranks
    that hold shards of the table (one all-to-all for all column-wise tables). A row looked up
    twice carries the same s, m and state twice, so setting the state (not adding to it) is
    right whichever copy lands. A table with a shard on the torch emulation (widths fbgemm
    cannot take, weight decay; Note [emulated fused kernels]) uses the emulation's form instead,
    its touched rows sorted and unique (`RowForm.ROWS`). The backward form of pass 1 clears its
    scratch on the rows it touched. A step costs O(ids), never O(rows): no table-sized buffer
    is reduced, cleared or scanned.
    The result equals the unsharded table's update up to float rounding (tests/modular/fused/
    test_fused.py, atol 1e-5). Several lookups before one backward are merged into one batch,
    so their gradients add up before one update, as in the emulation.
    All of this is the default, `fuse_optimizer(..., column_wise_statistic="exact")`. With
    "per_shard" each piece keeps the statistic of its own columns (TorchRec's approximation) and
    runs fbgemm's plain fused kernel, with none of the above (Note [fused tables] in
    modular/fused/choice.py). The planner prices the two passes unless it is told "per_shard" too
    (`planners.plan(..., column_wise_statistic=...)`, planners/cost.py).
    """

    def __init__(
        self,
        group: KernelGroup,
        sizes: list[tuple[int, int]],
        device: torch.device,
        config,
        forms: tuple[Optional[RowForm], ...],
    ) -> None:
        """`forms[t]`: how kernel table t reports its statistics (`RowForm.IDS` or
        `RowForm.ROWS`), or None for a table that is not column-wise (none needed)."""
        super().__init__(group, sizes, device, config)
        if len(forms) != len(sizes):
            raise ValueError(f"{len(forms)} statistics forms for {len(sizes)} kernel tables")
        self._forms = forms
        self._zero_lr = torch.tensor(0.0, device=device)
        self._scratch_flat: Optional[torch.Tensor] = None  # pass 1's state, made on first use
        self._scratch: list[torch.Tensor] = []  # its view per kernel table
        self._batch: Optional[Lookup] = None
        # Each kernel table's routes (a table read by two features has two).
        self._routes_of = [
            [r for r, t in enumerate(group.feature_table_map) if t == table]
            for table in range(len(sizes))
        ]
        # Each route's first row in the flat state (fbgemm's row-wise state: one float per row,
        # the kernel's tables one after another).
        first_row = [0]
        for rows, _ in sizes[:-1]:
            first_row.append(first_row[-1] + rows)
        self._route_first_row = torch.tensor(
            [first_row[t] for t in group.feature_table_map], dtype=torch.int64, device=device
        )
        self.forms = forms
        # Pass 1 through a pooling kernel where the routes have one width (Note [row statistics
        # from a pooling kernel]); else fbgemm's backward into the scratch state.
        self._pooled_pass = (
            RowGradSquares(group, sizes, device) if RowGradSquares.supports(group) else None
        )

    # -- per id, all tables at once (modular/fused/row_means.py) ------------------------------

    def id_stats(self) -> Optional[tuple[Lookup, torch.Tensor, torch.Tensor]]:
        """Pass 1 over the pending lookups for a group whose tables all report per id: the
        batch, each id's row as a key into the flat state (table offset + row), and this shard's
        mean(g**2) over its columns at that row, ids in batch order; None if nothing is pending."""
        batch = self._batch = self.take_batch()
        if batch is None:
            return None
        if self._pooled_pass is not None:
            got = self._pooled_pass(batch)
            per_id = got.s.new_empty(batch.indices.numel())
            per_id[got.order] = got.s[got.inverse]
            return batch, got.id_keys, per_id
        if self._scratch_flat is None:
            self._scratch_flat = torch.zeros_like(self.tbe.momentum1_host.detach())
            self._scratch = list(self._scratch_flat.split([rows for rows, _ in self.sizes]))
        self.run_backward(batch, state=self._scratch_flat, lr=self._zero_lr)
        key_of_id = self._keys(batch)
        per_id = self._scratch_flat.index_select(0, key_of_id)
        self._scratch_flat.index_fill_(0, key_of_id, 0.0)
        return batch, key_of_id, per_id

    def _keys(self, batch: Lookup) -> torch.Tensor:
        routes = len(self.group.routes)
        bags = (batch.offsets.numel() - 1) // routes
        per_route = batch.offsets[::bags].diff() if bags else batch.offsets.new_zeros(routes)
        first = self._route_first_row.repeat_interleave(per_route.long(), output_size=batch.indices.numel())
        return first + batch.indices.long()

    @torch.no_grad()
    def update_ids(self, key_of_id: torch.Tensor, delta: torch.Tensor) -> None:
        """Pass 2 for `id_stats`: the state at each id's key becomes state + delta (an id's row
        repeated carries the same delta, so whichever copy lands is right), then the update."""
        state = self.tbe.momentum1_host.detach()
        state.index_copy_(0, key_of_id, state.index_select(0, key_of_id).add_(delta))
        batch, self._batch = self._batch, None
        if batch is not None:
            self.run_backward(batch)

    # -- per kernel table (the general form) ------------------------------------------------

    def row_stats(self) -> Optional[list[Optional[tuple[torch.Tensor, torch.Tensor]]]]:
        """Pass 1 over the pending lookups: per kernel table, its rows (int64: one per id, or
        sorted and unique, as its form says) and this shard's mean(g**2) over its columns on
        each; None for tables without a form, or in place of the list if nothing is pending."""
        self._batch = self.take_batch()
        if self._batch is None:
            return None
        if self._pooled_pass is not None:
            return self._pooled_row_stats(self._batch)
        if self._scratch_flat is None:  # zero once; afterwards only touched rows are cleared
            self._scratch_flat = torch.zeros_like(self.tbe.momentum1_host.detach())
            self._scratch = list(self._scratch_flat.split([rows for rows, _ in self.sizes]))
        self.run_backward(self._batch, state=self._scratch_flat, lr=self._zero_lr)
        out: list[Optional[tuple[torch.Tensor, torch.Tensor]]] = []
        for form, ids, scratch in zip(self._forms, self._table_ids(self._batch), self._scratch):
            if form is RowForm.ROWS:
                rows = torch.sort(ids, stable=True).values.unique_consecutive().long()
            else:
                rows = ids.long()
            out.append(None if form is None else (rows, scratch.index_select(0, rows)))
            scratch.index_fill_(0, rows, 0.0)
        return out

    def _pooled_row_stats(self, batch: Lookup) -> list[Optional[tuple[torch.Tensor, torch.Tensor]]]:
        """`row_stats` from the pooling kernel: every touched row's s at once, then each kernel
        table's share in its form (its ids are one slice of the batch, its keys one run)."""
        pas = self._pooled_pass
        keys, s, inverse, order, _ = pas(batch)
        per_id = s.new_empty(batch.indices.numel())
        per_id[order] = s[inverse]
        cuts = batch.route_slices(len(self.group.routes))
        key_cuts = torch.searchsorted(keys, pas.first_row.to(keys.dtype)).tolist() + [keys.numel()]
        out: list[Optional[tuple[torch.Tensor, torch.Tensor]]] = []
        for t, (form, mine) in enumerate(zip(self._forms, self._routes_of)):
            if form is None or not mine:
                out.append(None)
            elif form is RowForm.ROWS:
                lo, hi = key_cuts[t], key_cuts[t + 1]
                out.append((keys[lo:hi].long() - pas.first_row[t], s[lo:hi]))
            else:
                ids = slice(cuts[mine[0]].start, cuts[mine[-1]].stop)
                out.append((batch.indices[ids].long(), per_id[ids]))
        return out

    def _table_ids(self, batch: Lookup) -> list[torch.Tensor]:
        """Each kernel table's ids in `batch`, route after route."""
        cuts = batch.route_slices(len(self.group.routes))
        out = []
        for mine in self._routes_of:
            pieces = [batch.indices[cuts[r]] for r in mine]
            out.append(pieces[0] if len(pieces) == 1 else torch.cat(pieces))
        return out

    @torch.no_grad()
    def update(self, adjust: list[Optional[tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """Pass 2: sets the state of kernel table t to state + delta on `adjust[t] = (rows,
        delta)` (the whole row's mean minus this shard's; rows as `row_stats` gave them, a row
        repeated with the same delta), then the real update."""
        name = self.config.optimizer.state_name()
        for t, change in enumerate(adjust):
            if change is not None:
                rows, delta = change
                state = self.states[t][name]
                state.index_copy_(0, rows, state.index_select(0, rows).add_(delta))
        batch, self._batch = self._batch, None
        if batch is not None:
            self.run_backward(batch)


class GatheredFusedKernel(DeferredFusedKernel):
    """fbgemm's fused optimizer replayed over a batch gathered from the table's other holders:
    a data-parallel copy (every rank's batch of the shard group), a shard's copy in exact 2D
    replica groups (every group's batch: Note [exact replicas] in
    modular/kernels/exact_replicas.py), or both.

    # Note [fused data-parallel copies]
    Every data-parallel copy must apply the same update: the mean gradient over ranks. Rather
    than gather touched rows and their gradients (rows x dim floats from every rank), the owning
    module gathers each rank's lookup batch, its ids and the pooled outputs' gradient (divided by
    the world size), and every rank runs fbgemm's fused backward on the global batch, ranks in
    order: the identical update everywhere, from a fraction of the bytes (ids and bags x dim
    floats), with fbgemm summing duplicate rows. CPU; other devices take the torch emulation.
    """
