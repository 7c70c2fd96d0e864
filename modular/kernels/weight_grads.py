"""The gradient of per-sample weights that require grad, beside any kernel's lookup (Note [learned
per-sample weights] in modular/routing/learned_weights.py).

Every kernel looks up detached weights: its backward trains the tables only (fbgemm's TBE is told
that no weight needs a gradient, Note [no gradient for per-sample weights] in
modular/kernels/base.py, and a fused kernel's backward updates its rows). `WeightGrads` sits on
the kernels' pooled output: its backward runs before theirs (their output is its input), so it
reads each id's row as the forward did, before any fused update, and gives weight i of a bag
<grad of its bag's output, row of id i> (over its route's columns), the derivative of what the
kernel pooled, whichever kernel that is, on any device. Weighted tables pool by SUM only (`shard`
refuses a MEAN one, as torchrec's unsharded EBC does). Its backward loops over the kernels'
routes in Python (a few torch ops each, no host read but one): only a step whose weights learn
pays it, and position-weighted features are few. fbgemm's CPU op for it
(`split_embedding_codegen_grad_indice_weights_cpu`, one call per kernel) would remove the loop on
CPU at the price of one path per device and kernel storage.
"""

from __future__ import annotations

import torch

__all__ = ["pool_with_weight_grads"]


class WeightGrads(torch.autograd.Function):
    """`pooled` unchanged; backward: the gradient of `weights` (one per id of `values`)."""

    @staticmethod
    def forward(ctx, weights, pooled, kernels, values, offsets, bags):  # type: ignore[override]
        ctx.save_for_backward(values, offsets)
        ctx.kernels, ctx.bags = kernels, bags
        return pooled.view_as(pooled)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        values, offsets = ctx.saved_tensors
        return _weight_grads(ctx.kernels, values, offsets, ctx.bags, grad), grad, None, None, None, None


def _weight_grads(
    kernels: list, values: torch.Tensor, offsets: torch.Tensor, bags: int, grad: torch.Tensor
) -> torch.Tensor:
    """Each id's <its bag's output gradient, its row>, route by route: route r of the kernels (in
    order) holds bags [r * bags, (r + 1) * bags), pooled into its columns of `grad`."""
    out = torch.zeros(values.numel(), dtype=torch.float32, device=values.device)
    routes = [(k, i) for k in kernels for i in range(len(k.group.routes))]
    if not routes or values.numel() == 0:
        return out
    ends = torch.arange(len(routes) + 1, device=offsets.device) * bags
    cuts = offsets[ends].tolist()  # one read: where each route's ids start
    lengths = (offsets[1:] - offsets[:-1]).long()
    bag_of = torch.repeat_interleave(
        torch.arange(lengths.numel(), device=values.device), lengths, output_size=values.numel()
    )
    col = 0
    for r, (kernel, i) in enumerate(routes):
        route = kernel.group.routes[i]
        width = route.shard.num_cols
        lo, hi = cuts[r], cuts[r + 1]
        if hi > lo:
            t = kernel.group.feature_table_map[i]
            if hasattr(kernel, "cached_rows"):  # a tier's rows are in its cache (Note [tiered tables])
                rows = kernel.cached_rows(t, values[lo:hi]).float()
            else:
                rows = torch.Tensor.detach(kernel.views[t]).index_select(0, values[lo:hi].long()).float()
            bag = bag_of[lo:hi]
            g = grad[bag - r * bags, col:col + width]
            out[lo:hi] = (rows * g).sum(1)
        col += width
    return out


def pool_with_weight_grads(
    pool, kernels: list, values: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor,
    bags: int,
) -> torch.Tensor:
    """`pool(kernels, values, offsets, weights.detach(), bags)` whose backward also gives
    `weights` their gradient; with no kernel (a rank that holds no route), an empty (bags, 0)
    output that still carries the weights' backward, which the ranks that sent them wait for."""
    if kernels:
        pooled = pool(kernels, values, offsets, weights.detach(), bags)
    else:
        pooled = torch.zeros(bags, 0, device=weights.device)
    return WeightGrads.apply(weights, pooled, kernels, values, offsets, bags)
