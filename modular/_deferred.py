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
         zeroed scratch state: each touched row gets s = mean over this shard's columns of g**2
         (the weights are left as they are: w -= 0 * ...);
      2. the owning module all-reduces cols * s per column-wise table, which gives every shard
         the whole row's mean m, adds m - s to the row's state, and runs the same backward with
         the real learning rate: fbgemm adds s back, so the state grows by m and the update
         divides by the exact statistic.
    The result equals the unsharded table's update up to float rounding (tests/modular/
    test_fused.py, atol 1e-5). Two fbgemm passes and one all-reduce of one float per row replace
    a gradient scattered in torch (docs/benchmarks.md). Several lookups before one backward are
    merged into one batch, so their gradients add up before one update, as in the emulation.
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

    def row_stats(self) -> Optional[list[torch.Tensor]]:
        """Pass 1 over the pending lookups: per kernel table, mean(g**2) over its columns for
        each row (zero where untouched); None if nothing is pending."""
        self._batch = self.take_batch()
        if self._batch is None:
            return None
        # Kept across steps: a fresh buffer this size is fresh pages to fault in (Note [dense
        # gradient buffer] in modular/_kernels.py); the caller is done with last step's statistics.
        if self._scratch is None:
            self._scratch = torch.zeros_like(self.tbe.momentum1_host.detach())
        else:
            self._scratch.zero_()
        self.run_backward(self._batch, state=self._scratch, lr=self._zero_lr)
        return [
            self._scratch[off : off + rows]
            for off, (rows, _) in zip(self._stats_offsets, self.sizes)
        ]

    @torch.no_grad()
    def update(self, adjust: list[Optional[torch.Tensor]]) -> None:
        """Pass 2: adds `adjust[t]` (the whole row's mean minus this shard's) to the state of
        kernel table t, then the real update."""
        name = self.config.optimizer.state_name()
        for t, delta in enumerate(adjust):
            if delta is not None:
                self.states[t][name].add_(delta)
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
