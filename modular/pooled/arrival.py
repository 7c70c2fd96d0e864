"""Where the pooled columns that reach a rank go in its output: one gather (or one add) of blocks.

# Note [arrival blocks]
Output dist leaves one flat buffer per rank: from each source rank, in rank order, a (batch, d_r)
block of the columns that rank pooled for this rank's samples, then this rank's own data-parallel
columns (batch, d_local). `Layout.output_columns` says where each arriving column goes. Column by
column that is a gather of batch x output_dim floats through a column index (plus, first, a
concatenation of the sources): measured 0.2 ms forward and 0.3 ms backward per step at the
benchmark's size, more than the kernels' own bookkeeping. But columns arrive in runs (a route's
columns are consecutive, and so are its output's), so the map is taken over blocks of `width`
columns, the largest width that divides every run's start and length: for each sample, each
arriving block has one output block. The flat buffer viewed as (blocks, width) then goes through
one `index_select` (each output block arrives once: table-wise, column-wise, data-parallel) or one
`index_add` into zeros (row-wise partial sums), and backward is one `index_select` through the
same map, never a scatter. Measured 0.05 ms each way. The indices depend on the batch size and
are kept for the sizes seen. Both directions write into kept buffers (Note [kept receive buffers]
in modular/comm.py): a fresh (batch, output_dim) tensor each step is fresh pages on CPU, and the
backward's cost 2.7 ms a step at the benchmark's size, against 0.3 ms for the same gather into a
reused buffer (tw/fused, 2 loaded ranks, torch.profiler).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from modular.comm import KeptBuffers


class Arrival:
    """The block map of one sharded module (Note [arrival blocks])."""

    def __init__(
        self, widths: list[int], columns: list[int], output_dim: int, device: torch.device
    ) -> None:
        """`widths`: columns from each source (ranks in order, then local); `columns`: for each
        arriving column, in that order, its output column."""
        if sum(widths) != len(columns):
            raise ValueError(f"{len(columns)} columns for sources of widths {widths}")
        width = output_dim
        start = 0
        for w in widths:
            width = math.gcd(width, w)
            for p in range(w):
                c = columns[start + p]
                if p == 0 or c != columns[start + p - 1] + 1:  # a run starts here
                    width = math.gcd(math.gcd(width, p), c)
            start += w
        self.width = max(width, 1)
        self.output_dim = output_dim
        self._device = device
        g = self.width
        self._blocks_per_source = [w // g for w in widths]
        # For each arriving block, its output block within one sample.
        self._targets = [columns[i] // g for i in range(0, len(columns), g)]
        self.is_permutation = sorted(self._targets) == list(range(output_dim // g))
        self._maps: dict[int, tuple[torch.Tensor, Optional[torch.Tensor], bool]] = {}
        self.buffers = KeptBuffers()

    def arrange(self, flat: torch.Tensor, batch: int) -> torch.Tensor:
        """The (batch, output_dim) output from the flat arrival buffer (differentiable)."""
        if self.output_dim == 0:
            return flat.new_zeros(batch, 0)
        dst, src, identity = self._map(batch)
        if identity:
            return flat.view(batch, self.output_dim)
        return _Arrange.apply(flat, dst, src, batch, self)

    def _map(self, batch: int) -> tuple[torch.Tensor, Optional[torch.Tensor], bool]:
        got = self._maps.get(batch)
        if got is None:
            got = self._maps[batch] = self._build(batch)
        return got

    def _build(self, batch: int) -> tuple[torch.Tensor, Optional[torch.Tensor], bool]:
        """dst[i]: the output block (sample-major) of arriving block i; src, its inverse, when
        the map is a permutation; and whether it is the identity."""
        as_long = dict(dtype=torch.int64, device=self._device)
        per_sample = self.output_dim // self.width
        samples = torch.arange(batch, **as_long).view(batch, 1) * per_sample
        pieces, first = [], 0
        for k in self._blocks_per_source:
            if k:
                targets = torch.tensor(self._targets[first : first + k], **as_long)
                pieces.append((samples + targets.view(1, k)).reshape(-1))
            first += k
        dst = torch.cat(pieces)
        identity = self.is_permutation and torch.equal(dst, torch.arange(dst.numel(), **as_long))
        src = None
        if self.is_permutation:
            src = torch.empty_like(dst)
            src[dst] = torch.arange(dst.numel(), **as_long)
        return dst, src, identity


class _Arrange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, flat, dst, src, batch: int, arrival: Arrival):  # type: ignore[override]
        ctx.save_for_backward(dst)
        ctx.width = g = arrival.width
        ctx.buffers = arrival.buffers
        blocks = flat.view(-1, g)
        if src is not None:
            out = arrival.buffers.empty("arranged", flat.numel(), flat).view(-1, g)
            torch.index_select(blocks, 0, src, out=out)
        else:
            out = blocks.new_zeros(batch * arrival.output_dim // g, g).index_add_(0, dst, blocks)
        return out.view(batch, arrival.output_dim)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (dst,) = ctx.saved_tensors
        grad = grad.contiguous()
        out = ctx.buffers.empty("arranged grad", dst.numel() * ctx.width, grad)
        torch.index_select(grad.view(-1, ctx.width), 0, dst, out=out.view(-1, ctx.width))
        return out, None, None, None, None
