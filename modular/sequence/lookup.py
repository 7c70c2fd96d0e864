"""Looking sequences up through the EBC's kernels.

# Note [sequence lookups]
A sequence lookup returns each id's row. An EmbeddingCollection's tables are `Pooling.NONE` to the
layout, and each kernel group (modular/tables/layout.py `kernel_groups`) takes them one of two ways:

- fbgemm's sequence kernel, PoolingMode.NONE (`kernel.nobag`): `FusedKernel`, the plain fused
  split TBE, on CUDA (`SEQUENCE_KERNEL_DEVICES` in modular/fused/fbgemm.py; on CPU it is the
  slower form, below, and tests switch it on there to hold it to the same parity). Each route is one bag of all its ids (offsets: the routes' id counts), and the
  kernel returns (ids, width) rows, no padding; its fused backward sums the rows an id repeats,
  as the unsharded EC's gradient does. fbgemm's NONE kernels take tables of one width only
  (fbgemm-gpu 1.8.0 asserts "Mixed dimension tables only supported for pooling tables"), so
  `kernel_groups` cuts sequence groups by width (column pieces of unequal widths; torchrec's EC
  gives every table the same dim, so this rarely costs a kernel).
- each id a bag of one in a SUM kernel, everywhere else: the fused kernel on CPU; fbgemm-gpu-cpu 1.8.0's dense TBE
  (`DenseKernel`, and `EmulatedFusedKernel`'s forward) pools even with PoolingMode.NONE (it
  returns (bags per route, T * width), each bag summed), and the deferred fused kernels
  (`RowStatsFusedKernel`, `GatheredFusedKernel`, modular/fused/deferred.py) replay fbgemm's
  SUM backward ops, whose gradient is per bag. A TBE batch holds the same number of bags per route, so a kernel over
  routes of n_1, ..., n_T ids takes N = max(n_t) bags per route, route t's first n_t of one id
  each and the rest empty, and returns (N, sum of the routes' widths): route t's rows are the
  first n_t rows of its columns. The empty bags cost rows of output and gradient, not lookups.
  Data-parallel copies gather every rank's bags, which needs equal shapes on every rank: their
  N is the maximum over ranks (one small all-reduce a step, only where a module has such copies).

Both give the same rows and the same update up to the order fbgemm adds a repeated id's
gradients in (tests/modular/sequence/test_sequence_fused.py, test_sequence_kernels.py). On CPU the NONE
kernel is the slower one: fbgemm-gpu-cpu 1.8.0's nobag backward took 2.3-6.5x the SUM backward on
bags of one (20,480 ids, 4 tables of 64 columns, one thread, benchmarks/sequence_kernels.py:
exact SGD 20.2 against 3.1 ms, row-wise Adagrad 22.1 against 8.5 ms), even when uneven routes pad
the bags; the fused table-wise EC step paid it (docs/benchmarks.md), so CPU keeps bags of one.
`FusedKernel.nobag` is the one place that picks the form.
"""

from __future__ import annotations

from typing import Optional

import torch

from modular.kernels.base import Kernel

__all__ = ["lookup_kernels"]


def lookup_kernels(
    kernels: list[Kernel], values: torch.Tensor, counts: list[int], *, bags: Optional[int] = None
) -> list[torch.Tensor]:
    """Each kernel's output for its routes' ids: a `nobag` kernel's (ids, width) rows, route
    after route; a bags-of-one kernel's (bags per route, its routes' widths side by side), route
    t's rows first in its columns (`RowGather` in modular/sequence/output.py puts them in
    place). `values` holds the ids route by route, `counts` how many each route has; the
    kernels take consecutive routes. `bags`: the bags per route every bag-of-one kernel takes
    (data-parallel copies: agreed over ranks), else each kernel's longest route (Note [sequence
    lookups])."""
    out: list[torch.Tensor] = []
    route, start = 0, 0
    for kernel in kernels:
        n = counts[route : route + len(kernel.group.routes)]
        total = sum(n)
        ids = values[start : start + total]
        out.append(_rows(kernel, ids, n) if kernel.nobag else _bags_of_one(kernel, ids, n, bags))
        route += len(n)
        start += total
    return out


def _rows(kernel: Kernel, ids: torch.Tensor, n: list[int]) -> torch.Tensor:
    """fbgemm's PoolingMode.NONE: one bag per route, one row per id: (ids, width)."""
    lengths = torch.tensor(n, device=ids.device, dtype=ids.dtype)
    offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths)
    return kernel(ids, offsets, None)


def _bags_of_one(kernel: Kernel, ids: torch.Tensor, n: list[int], bags: Optional[int]) -> torch.Tensor:
    """A SUM kernel over bags of one id, each route padded to `bags` (or the longest route):
    (bags per route, sum of widths)."""
    per_route = max(max(n), 1) if bags is None else bags
    lengths = torch.arange(per_route, device=ids.device).unsqueeze(0) < torch.tensor(
        n, device=ids.device
    ).unsqueeze(1)
    offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths.reshape(-1).to(ids.dtype))
    return kernel(ids, offsets, None)
