"""Pass 1 of the exact column-wise row statistic from a forward kernel instead of fbgemm's backward.

# Note [row statistics from a pooling kernel]
Pass 1 of Note [row statistics across column shards] (modular/fused/deferred.py) needs, for
every row a step touched, s = mean over this shard's columns of g**2, g the row's gradient: the
sum, over the ids naming the row, of the pooled gradient of the id's bag (times the id's weight,
or 1/length for MEAN). That sum is a pooling: with the pooled gradients as the rows of a table
(bag b of route r at row r * bags + b, which is where route-major pooled outputs put it when every
route has the same width) and, for each touched row, the bags of its ids as one bag, fbgemm's
forward TBE returns every touched row's gradient in one call. So pass 1 is one stable sort of the
ids' rows (table offset + row), one unique, and one forward kernel of width `cols` over the ids,
instead of fbgemm's row-wise Adagrad backward with a learning rate of 0 (the backward sorts too,
then reads and writes every touched row's weights and state). The kernel's output is taken in
pieces of CHUNK floats, each reduced to its rows' norms at once: one (touched rows, width) output
would be a fresh mmap every step, whose page faults cost more than the pooling (measured: 69 ms
in one piece, 19-30 ms in pieces, against 101 ms for the backward pass 1, on 327,680 ids of 32
columns over 8 tables of 100,000 rows, one core, fbgemm-gpu-cpu 1.8.0; docs/benchmarks.md
"Column-wise fused tables").
The sums add in a different order than fbgemm's backward does, so s differs from the backward's
own s' in the last bits; pass 2 sets the state to state + m - s and fbgemm adds s', so the state
grows by m + (s' - s): a relative error of the order of float rounding (tests/modular/fused/test_fused.py
and test_fused_column_statistic.py hold the result to the unsharded table at 1e-5).
Kernels whose routes have different widths (column pieces of tables of different dims in one
group) keep the backward pass 1.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from modular.kernels.base import sum_weights
from modular.kernels.lookups import Lookup
from modular.tables.layout import KernelGroup

__all__ = ["RowGradSquares", "RowSquares"]

CHUNK = 1 << 20  # floats of pooled gradients at a time (4 MiB)


class RowSquares(NamedTuple):
    """Pass 1's result for one batch."""

    keys: torch.Tensor  # the touched rows, sorted and unique, as table offset + row
    s: torch.Tensor  # each touched row's mean over the shard's columns of g**2
    inverse: torch.Tensor  # for the ids in key order, which touched row each is
    order: torch.Tensor  # the ids in key order (a stable sort)
    id_keys: torch.Tensor  # each id's key, in batch order (int64)


class RowGradSquares:
    """For one kernel group whose routes have one width: each touched row's mean of g**2."""

    def __init__(self, group: KernelGroup, sizes: list[tuple[int, int]], device: torch.device) -> None:
        widths = {r.shard.num_cols for r in group.routes}
        if len(widths) != 1:
            raise ValueError(f"routes of widths {sorted(widths)}: one width is needed")
        (self.width,) = widths
        self.group = group
        self.routes = len(group.routes)
        as_long = dict(dtype=torch.int64, device=device)
        first_row = [0]
        for rows, _ in sizes[:-1]:
            first_row.append(first_row[-1] + rows)
        # Each kernel table's rows start here in one key space (table offset + row).
        self.first_row = torch.tensor(first_row, **as_long)
        self.route_first_row = self.first_row[torch.tensor(group.feature_table_map, **as_long)]
        # Keys sort as int32 where they fit: torch's stable sort of 327,680 keys took 2.9 ms as
        # int32 against 7.4 ms as int64 (one core of the benchmark's machine).
        self._key_type = torch.int32 if sum(rows for rows, _ in sizes) < 2**31 else torch.int64
        self._route_first_key = self.route_first_row.to(self._key_type)
        self._d_offsets = torch.tensor([0, self.width], dtype=torch.int32, device=device)
        self._zero = torch.zeros(1, **as_long)

    @staticmethod
    def supports(group: KernelGroup) -> bool:
        return len({r.shard.num_cols for r in group.routes}) == 1

    @torch.no_grad()
    def __call__(self, batch: Lookup) -> RowSquares:
        """Every touched row of `batch` with its s (`RowSquares`)."""
        indices, offsets = batch.indices, batch.offsets
        n = indices.numel()
        bags = (offsets.numel() - 1) // self.routes
        lengths = (offsets[1:] - offsets[:-1]).long()
        bag = torch.repeat_interleave(
            torch.arange(lengths.numel(), device=indices.device), lengths, output_size=n
        )
        key = self._route_first_key.repeat_interleave(
            lengths.view(self.routes, bags).sum(1), output_size=n
        ) + indices.to(self._key_type)
        sorted_keys, order = torch.sort(key, stable=True)
        keys, inverse, counts = torch.unique_consecutive(
            sorted_keys, return_inverse=True, return_counts=True
        )
        # The pooled gradients route by route: (routes * bags, width), row r * bags + b.
        grad = batch.grad_out.float().view(bags, self.routes, self.width).transpose(0, 1)
        grad = grad.contiguous().view(-1)
        weights = sum_weights(self.group.pooling, offsets, batch.weights)
        sources = bag[order]
        if weights is not None:
            weights = weights[order].contiguous()
        bounds = torch.ops.fbgemm.asynchronous_complete_cumsum(counts)
        rows = torch.tensor([0, self.routes * bags], dtype=torch.int64, device=grad.device)
        s = torch.empty(keys.numel(), device=grad.device)
        # In pieces of about CHUNK floats: one (touched rows, width) output at once would be a
        # fresh mmap (page faults on every 4 KiB, Note [dense gradient buffer]), pieces this size
        # come from the heap; 4 pieces at the benchmark's size, not one per table.
        step = max(1, CHUNK // self.width)
        for lo in range(0, keys.numel(), step):
            hi = min(lo + step, keys.numel())
            first, last = bounds[lo], bounds[hi]
            pooled = torch.ops.fbgemm.split_embedding_codegen_forward_cpu(
                grad,
                self._zero,
                self._d_offsets,
                self.width,
                rows,
                sources[first:last],
                bounds[lo : hi + 1] - first,
                0,  # SUM
                None if weights is None else weights[first:last],
                0,  # FP32 out
            )
            torch.linalg.vector_norm(pooled, dim=1, out=s[lo:hi])
        s.square_().div_(self.width)
        return RowSquares(keys, s, inverse, order, key.long())
