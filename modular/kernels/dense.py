"""fbgemm's dense TBE for a kernel group: gradients for any torch optimizer.

# Note [dense gradient buffer]
A dense kernel's gradient is as large as its weights, and on CPU a fresh tensor that large is a
fresh mmap: the kernel pays a page fault per 4 KiB on first touch, every step (measured: a new
zeroed 100 MiB buffer 43 ms, zeroing the same buffer again 3 ms; fbgemm's dense TBE backward
allocates one per call, so it spent 44 ms of a 61 ms step there). So a dense kernel keeps its
flat gradient across steps, as `zero_grad(set_to_none=False)` would: `.grad = None` (what
`optimizer.zero_grad()` does) hides it, and the next backward zeroes it and accumulates into it.
On CPU the accumulation is fbgemm's exact-SGD backward with a learning rate of -1 run on the
gradient buffer instead of the weights (`w -= lr * g` with lr = -1 is `buf += g`, per touched row,
with fbgemm's own sort and sums: bit-identical to its dense gradient for SUM). MEAN bags go in as
SUM with 1/length folded into per-id weights, because fbgemm's weighted CPU backward leaves the
1/length out. Other devices keep fbgemm's dense TBE backward (their caching allocators make a new
buffer cheap). A reference to last step's `.grad` taken before `zero_grad()` therefore sees this
step's gradient, as with set_to_none=False.

# Note [dense data-parallel copies]
A data-parallel table's gradient must be the mean over ranks of their batches' gradients, the same
on every rank. DDP all-reduces the whole (rows, dim) gradient; but a step touches only the rows
its ids name, so on CPU a data-parallel copy first all-gathers every rank's bag lengths (one small
collective), and when the global batch's ids x dim is at most the buffer's size (`replay_pays`)
it gathers the ids and the pooled outputs' gradients divided by the world size and runs the same
fbgemm backward on the global batch, ranks in order: the same sum, from bags x dim floats and ids
instead of a table's worth, and the same bits on every rank. Otherwise (more ids than the table
has rows) it accumulates its own batch and all-reduces the buffer. The choice rests on the
gathered lengths, so every rank makes the same one. Measured in docs/benchmarks.md; the fused
twin is Note [fused data-parallel copies] in modular/fused/deferred.py.
"""

from __future__ import annotations

from typing import Optional

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from torch.distributed import ProcessGroup

from modular.comm import all_reduce
from modular.kernels.base import (
    KernelLookup,
    dense_tbe,
    lookup_without_weight_grads,
    no_weight_grads,
    sum_weights,
)
from modular.kernels.lookups import Lookup, gather_batch, gather_lengths
from modular.kernels.exact_replicas import all_reduce_replicas, gather_replicas
from modular.kernels.views import GradBuffer, ShardView
from modular.profiling import LOOKUP_BACKWARD, label_backward
from modular.tables.layout import KernelGroup
from modular.tables.replicas import Replicas

__all__ = ["DenseKernel", "replay_pays"]


class DenseKernel:
    """fbgemm's dense TBE for one kernel group: autograd gives the flat buffer a dense gradient.

    Not an nn.Module on purpose: its flat buffer must not appear in the owning module's
    `named_parameters()`, which lists the tables under their unsharded names instead.
    """

    nobag = False  # the dense CPU TBE pools even in PoolingMode.NONE (Note [sequence lookups])

    def __init__(
        self,
        group: KernelGroup,
        sizes: list[tuple[int, int]],
        device: torch.device,
    ) -> None:
        self.group = group
        self.sizes = sizes
        self.tbe = dense_tbe(group, sizes, device)
        self.grads = GradBuffer(self.tbe.weights)
        offsets, start = [], 0
        for rows, cols in sizes:
            offsets.append(start)
            start += rows * cols
        self.views = [
            ShardView(self.grads, off, rows, cols) for off, (rows, cols) in zip(offsets, sizes)
        ]
        self._on_cpu = device.type == "cpu"
        self._no_weight_grads = no_weight_grads(group, device)
        self._copies: Optional[tuple[Optional[ProcessGroup], int]] = None  # data-parallel
        self.replay_ratio = 1.0  # Note [dense data-parallel copies]; tests force either way: 0, inf
        self._across: Optional[Replicas] = None  # Note [exact replicas]
        if self._on_cpu:
            self._placements = torch.full(
                (len(sizes),), EmbeddingLocation.HOST.value, dtype=torch.int32
            )
            self._minus_one = torch.tensor(-1.0)

    @property
    def flat_weight(self) -> torch.nn.Parameter:
        return self.tbe.weights

    def data_parallel_over(self, group: Optional[ProcessGroup], world: int) -> None:
        """Makes this kernel a data-parallel copy on `world` ranks: each backward leaves the
        mean over ranks of their batches' gradients in the buffer (Note [dense data-parallel
        copies])."""
        if self._on_cpu:
            self._copies = (group, world)
            if self.tbe.weights.dtype is not torch.float32:
                # An FP16 buffer all-reduced would round once per rank's partial sum; the replay
                # sums every rank's rows in FP32 and rounds once (Note [low-precision tables]).
                self.replay_ratio = float("inf")
            return

        def all_reduce_mean(flat: torch.Tensor) -> None:
            _all_reduce_mean(flat.grad, group, world)

        self.flat_weight.register_post_accumulate_grad_hook(all_reduce_mean)

    def replicate_across(self, replicas: Replicas) -> None:
        """Makes each backward's gradient every replica group's batch's (Note [exact replicas]
        in modular/kernels/exact_replicas.py): replayed on CPU, all-reduced elsewhere."""
        if self._on_cpu:
            self._across = replicas
            return
        self.flat_weight.register_post_accumulate_grad_hook(
            lambda flat: all_reduce_replicas(flat.grad, replicas)
        )

    def __call__(
        self, indices: torch.Tensor, offsets: torch.Tensor, weights: Optional[torch.Tensor]
    ) -> torch.Tensor:
        if not self._on_cpu:
            no_grads = self._no_weight_grads
            out = lookup_without_weight_grads(self.tbe, indices, offsets, weights, no_grads)
            return label_backward(out, LOOKUP_BACKWARD)  # fbgemm's own backward off CPU
        return KernelLookup.apply(self.tbe.weights, self, indices, offsets, weights)

    def backward(self, batch: Lookup) -> None:
        """Adds this lookup's gradient into the kept buffer (Note [dense gradient buffer]); for a
        data-parallel copy, the mean over ranks (Note [dense data-parallel copies])."""
        reduce = False
        if self._across is not None:  # first every replica group's batch (Note [exact replicas])
            batch = gather_replicas(batch, len(self.group.routes), self._across)
        if self._copies is not None:
            group, world = self._copies
            lengths = gather_lengths(batch, group, world)
            ids = int(lengths.sum())
            if replay_pays(ids, self.tbe.max_D, self.tbe.weights.numel(), self.replay_ratio):
                batch = gather_batch(batch, lengths, len(self.group.routes), group, world)
            else:
                reduce = True
        per_id = sum_weights(self.group.pooling, batch.offsets, batch.weights)
        tbe = self.tbe
        grad = self.grads.acquire()
        torch.ops.fbgemm.split_embedding_backward_codegen_sgd_cpu(
            batch.grad_out,
            grad,
            self._placements,
            tbe.weights_offsets,
            tbe.D_offsets,
            tbe.max_D,
            tbe.hash_size_cumsum,
            tbe.total_hash_size_bits,
            batch.indices,
            batch.offsets,
            int(PoolingMode.SUM),
            per_id,
            False,  # stochastic rounding
            self._minus_one,  # learning rate: w -= lr * g is buf += g
            0,  # output dtype: fp32
        )
        if reduce:
            _all_reduce_mean(grad, *self._copies)


def replay_pays(global_ids: int, dim: int, numel: int, ratio: float = 1.0) -> bool:
    """Whether a dense data-parallel copy replays the global batch rather than all-reducing its
    gradient (Note [dense data-parallel copies]): when the replay's scatter, ids x dim adds, is
    at most `ratio` times the buffer's size."""
    return global_ids * dim <= ratio * numel


def _all_reduce_mean(grad: torch.Tensor, group: Optional[ProcessGroup], world: int) -> None:
    # Note [grad scaling across ranks] (modular/comm.py): the mean over ranks, like DDP.
    all_reduce(grad, group=group, what="the gradient all-reduce of a data-parallel table")
    grad.div_(world)
