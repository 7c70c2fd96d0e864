"""Fused kernels whose update waits for the end of backward: fbgemm's CPU backward ops run by
the owning module once its collectives have completed the batch (column-wise row statistics,
data-parallel replicas). See Note [row statistics across column shards] and Note [fused
replicas] below, and Note [fused tables] in modular/optim.py.
"""

from __future__ import annotations

from typing import Optional

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode

from modular._kernels import FusedKernel, KernelLookup, sum_weights
from modular._input import INT32_MAX
from modular._lookups import Lookup, merge_lookups
from modular._layout import KernelGroup


class DeferredFusedKernel(FusedKernel):
    """fbgemm's fused kernel (CPU) whose update runs at the end of backward, on a batch the
    owning module may first complete with other ranks' data (subclasses say how)."""

    def __init__(
        self, group: KernelGroup, sizes: list[tuple[int, int]], device: torch.device, config
    ) -> None:
        super().__init__(group, sizes, device, config)
        self.pending: list[Lookup] = []
        self._placeholder = torch.zeros(0, device=device, requires_grad=True)
        self._ones = torch.ones(0, device=device)

    def __call__(
        self, indices: torch.Tensor, offsets: torch.Tensor, weights: Optional[torch.Tensor]
    ) -> torch.Tensor:
        self._sync_lr()
        return KernelLookup.apply(self._placeholder, self, indices, offsets, weights)

    def backward(
        self,
        grad_out: torch.Tensor,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        weights: Optional[torch.Tensor],
    ) -> None:
        """Records what the update at the end of backward needs (the owning module runs it after
        its collectives)."""
        self.pending.append(Lookup.of(grad_out, indices, offsets, weights))

    def take_batch(self) -> Optional[Lookup]:
        """The lookups since the last update as one batch (several are merged, so their
        gradients add up before one update); None if there were none."""
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
        tbe, kind = self.tbe, self.config.optimizer.value
        weights, self._ones = sum_weights(
            self.group.pooling, batch.offsets, batch.weights, self._ones
        )
        lr = tbe.learning_rate_tensor if lr is None else lr
        common = (
            batch.grad_out, tbe.weights_host, tbe.weights_placements, tbe.weights_offsets,
            tbe.D_offsets, tbe.max_D, tbe.hash_size_cumsum, tbe.total_hash_size_bits,
            batch.indices, batch.offsets, int(PoolingMode.SUM), weights,
            False,  # stochastic rounding
        )  # fmt: skip
        with torch.no_grad():
            if kind == "exact_sgd":
                torch.ops.fbgemm.split_embedding_backward_codegen_sgd_cpu(*common, lr, 0)
                return
            momentum = (
                (tbe.momentum1_host if state is None else state).detach(),
                tbe.momentum1_placements,
                tbe.momentum1_offsets,
            )
            if kind == "exact_adagrad":
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
      1. at the end of backward, fbgemm's row-wise Adagrad backward with learning rate 0 into a
         scratch state that is zero: each touched row gets s = mean over this shard's columns
         of g**2 (the weights are left as they are: w -= 0 * ...);
      2. the owning module sums cols * s over the table's column shards, which gives every shard
         the whole row's mean m, adds m - s to the row's state, and runs the same backward with
         the real learning rate: fbgemm adds s back, so the state grows by m and the update
         divides by the exact statistic.
    Every column shard of a table looks up the same ids (each id is routed to all of them), so
    every holder finds the same touched rows, sorted: the statistics travel as one float per
    touched row, only between the ranks that hold shards of the table (one all-to-all for all
    column-wise tables), and pass 1's scratch is cleared on those rows only. A step costs
    O(ids), never O(rows): no table-sized buffer is reduced or cleared.
    The result equals the unsharded table's update up to float rounding (tests/modular/
    test_fused.py, atol 1e-5). Several lookups before one backward are merged into one batch,
    so their gradients add up before one update, as in the emulation.
    """

    def __init__(
        self, group: KernelGroup, sizes: list[tuple[int, int]], device: torch.device, config
    ) -> None:
        super().__init__(group, sizes, device, config)
        self._zero_lr = torch.tensor(0.0, device=device)
        self._scratch: Optional[torch.Tensor] = None
        self._batch: Optional[Lookup] = None
        rows = [r for r, _ in sizes]  # row-wise state: one value per row, tables back to back
        self._stats_offsets = [sum(rows[:t]) for t in range(len(rows))]
        # Touched rows are found in the stacked numbering, as int32 keys when they fit: a stable
        # sort (a radix sort on CPU) of 327,680 int32 ids takes 2.3 ms, against 4.3 for
        # torch.unique and 3-4x that for int64 keys.
        self._key_type = torch.int32 if sum(rows) <= INT32_MAX else torch.int64
        self._route_offsets = torch.tensor(
            [self._stats_offsets[t] for t in group.feature_table_map], dtype=self._key_type,
            device=device,
        )  # fmt: skip
        self._table_starts = torch.tensor(self._stats_offsets[1:], dtype=torch.int64, device=device)

    def row_stats(self) -> Optional[list[tuple[torch.Tensor, torch.Tensor]]]:
        """Pass 1 over the pending lookups: per kernel table, its touched rows (sorted, int64)
        and this shard's mean(g**2) over its columns on each; None if nothing is pending."""
        self._batch = self.take_batch()
        if self._batch is None:
            return None
        if self._scratch is None:  # zero once; afterwards only touched rows are cleared
            self._scratch = torch.zeros_like(self.tbe.momentum1_host.detach())
        self.run_backward(self._batch, state=self._scratch, lr=self._zero_lr)
        touched = self._touched_rows(self._batch)  # in the scratch's (stacked tables) rows
        stats = self._scratch.index_select(0, touched)
        self._scratch.index_fill_(0, touched, 0.0)
        counts = torch.diff(
            torch.searchsorted(touched, self._table_starts), prepend=touched.new_zeros(1),
            append=touched.new_full((1,), touched.numel()),
        ).tolist()  # fmt: skip
        return [
            (rows - offset, s)
            for rows, s, offset in zip(
                touched.split(counts), stats.split(counts), self._stats_offsets
            )
        ]

    def _touched_rows(self, batch: Lookup) -> torch.Tensor:
        """The distinct rows `batch` looks up, sorted, numbered like the stacked state."""
        routes = len(self.group.routes)
        per_route = (batch.offsets.numel() - 1) // routes
        ids_per_route = torch.diff(batch.offsets[::per_route]) if per_route else None
        if ids_per_route is None or batch.indices.numel() == 0:
            return torch.zeros(0, dtype=torch.int64, device=batch.indices.device)
        shift = torch.repeat_interleave(
            self._route_offsets, ids_per_route.long(), output_size=batch.indices.numel()
        )
        ids = batch.indices.to(self._key_type) + shift
        return torch.sort(ids, stable=True).values.unique_consecutive().long()

    @torch.no_grad()
    def update(self, adjust: list[Optional[tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """Pass 2: adds `adjust[t] = (rows, delta)` (the whole row's mean minus this shard's) to
        the state of kernel table t, then the real update."""
        name = self.config.optimizer.state_name()
        for t, change in enumerate(adjust):
            if change is not None:
                rows, delta = change
                self.states[t][name].index_add_(0, rows, delta)
        batch, self._batch = self._batch, None
        if batch is not None:
            self.run_backward(batch)


class ReplicaFusedKernel(DeferredFusedKernel):
    """A data-parallel replica under fbgemm's fused optimizer.

    # Note [fused replicas]
    Every replica must apply the same update: the mean gradient over ranks. Rather than gather
    touched rows and their gradients (rows x dim floats from every rank), the owning module
    gathers each rank's lookup batch, its ids and the pooled outputs' gradient (divided by the
    world size), and every rank runs fbgemm's fused backward on the global batch, ranks in
    order: the identical update everywhere, from a fraction of the bytes (ids and bags x dim
    floats), with fbgemm summing duplicate rows. CPU; other devices take the torch emulation.
    """
