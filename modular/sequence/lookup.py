"""Looking sequences up through the EBC's kernels.

# Note [sequence lookups as bags of one]
A sequence lookup returns each id's row. That is a SUM lookup in which every id is a bag of its
own, so the kernels of modular/kernels/ (dense, fused, emulated, deferred, replicas) serve
EmbeddingCollections unchanged, with their fused updates, their row statistics and their
gradients, and fbgemm's backward sums the rows an id repeats exactly as it does for bags. A TBE
batch holds the same number of bags per feature (here: per route), so a kernel over routes of
n_1, ..., n_T ids takes N = max(n_t) bags per route, route t's first n_t of one id each and the
rest empty, and returns (N, sum of the routes' widths): route t's rows are the first n_t rows of
its columns. The empty bags cost rows of output and gradient, not lookups; a route per kernel
would cost none, but a table read by two features must stay in one kernel (its weights are one
buffer). fbgemm's own PoolingMode.NONE returns (ids, width) with no padding, but its CPU dense
TBE pools anyway (fbgemm-gpu-cpu 1.8.0: NONE gives (1, T * width)), and the fused kernels'
deferred and replica paths replay fbgemm's SUM backward ops, so one form serves them all. Data-
parallel replicas gather every rank's bags, which needs equal shapes on every rank: their N is
the maximum over ranks (one small all-reduce a step, only where a module has replicas).
"""

from __future__ import annotations

from typing import Optional

import torch

from modular.kernels.base import Kernel

__all__ = ["lookup_routes"]


def lookup_routes(
    kernels: list[Kernel], values: torch.Tensor, counts: list[int], *, bags: Optional[int] = None
) -> list[torch.Tensor]:
    """Each route's rows, (ids of the route, its width), in route order: `values` holds the ids
    route by route, `counts` how many each route has; the kernels take consecutive routes.
    `bags`: the bags per route every kernel takes (replicas: agreed over ranks), else each
    kernel's longest route."""
    out: list[torch.Tensor] = []
    route, start = 0, 0
    for kernel in kernels:
        group = kernel.group.routes
        n = counts[route : route + len(group)]
        total = sum(n)
        per_route = max(max(n), 1) if bags is None else bags
        ids = values[start : start + total]
        lengths = torch.arange(per_route, device=ids.device).unsqueeze(0) < torch.tensor(
            n, device=ids.device
        ).unsqueeze(1)
        offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(
            lengths.reshape(-1).to(ids.dtype)
        )
        rows = kernel(ids, offsets, None)  # (per_route, sum of widths)
        col = 0
        for r, count in zip(group, n):
            width = r.shard.num_cols
            out.append(rows[:count, col : col + width])
            col += width
        route += len(group)
        start += total
    return out
