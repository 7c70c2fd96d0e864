"""Each table's sparse gradient from a lookup's pooled gradient: the rows it touched and, per
row, its ids' gradients summed (Note [emulated fused kernels] in modular/kernels/emulated.py).

A touched row's gradient is the sum, over the ids that looked it up, of their bag's output
gradient (times the id's weight, and 1/length in a MEAN bag). That is a pooling: the ids sorted
by row (stably, so each row's ids keep their order) are bags, one per touched row, over the rows
of the pooled gradient, and one `embedding_bag` sums them, without a (ids, cols) tensor of
per-id gradients. The sums come in the order an `index_add_` over the ids would add them, so they
are those bit for bit. Measured on one CPU thread, 40,960 ids of one table of 64 columns: 0.7 ms
against 2.5 ms for gathering per-id gradients and `index_add_`ing them.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from modular.tables.layout import KernelGroup, Pooling

__all__ = ["summed_row_grads"]


def summed_row_grads(
    group: KernelGroup,
    tables: int,
    route_cols: list[int],
    grad_out: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    weights: Optional[torch.Tensor],
) -> list[Optional[tuple[torch.Tensor, torch.Tensor]]]:
    """Per kernel table (of `tables`), its touched rows (int64, ascending) and their summed
    gradients, or None where no id looked it up; `route_cols[f]`: route f's first column in
    `grad_out` (the pooled outputs' gradient, bags of every route one after another)."""
    routes = len(group.routes)
    bags = offsets.numel() - 1
    per_route = bags // routes
    n = indices.numel()
    lengths = offsets[1:] - offsets[:-1]
    bag_of_id = torch.repeat_interleave(
        torch.arange(bags, device=offsets.device), lengths, output_size=n
    )
    scale = None if weights is None else weights.float()
    if group.pooling is Pooling.MEAN:
        inverse = 1.0 / lengths.clamp(min=1).to(grad_out.dtype)
        per_id = torch.repeat_interleave(inverse, lengths, output_size=n)
        scale = per_id if scale is None else scale * per_id
    bounds = offsets[::per_route].tolist()  # where each route's ids start: one host read
    out: list[Optional[tuple[torch.Tensor, torch.Tensor]]] = []
    for t in range(tables):
        mine = [
            f for f, table in enumerate(group.feature_table_map)
            if table == t and bounds[f] < bounds[f + 1]
        ]  # fmt: skip
        if not mine:
            out.append(None)
            continue
        dim = group.routes[mine[0]].shard.num_cols
        # Each route's rows of the pooled gradient, one after another; an id's bag among them.
        sources, ids, bag, scales = [], [], [], []
        for j, f in enumerate(mine):
            lo, hi = bounds[f], bounds[f + 1]
            sources.append(grad_out.narrow(1, route_cols[f], dim))
            ids.append(indices[lo:hi])
            bag.append(bag_of_id[lo:hi] + (j - f) * per_route)
            if scale is not None:
                scales.append(scale[lo:hi])
        source = sources[0] if len(mine) == 1 else torch.cat(sources)
        by_row, order = (ids[0] if len(mine) == 1 else torch.cat(ids)).sort(stable=True)
        rows, counts = torch.unique_consecutive(by_row, return_counts=True)
        bag_offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(counts)
        bag_ids = (bag[0] if len(mine) == 1 else torch.cat(bag)).index_select(0, order)
        weight = None
        if scale is not None:
            weight = (scales[0] if len(mine) == 1 else torch.cat(scales)).index_select(0, order)
        summed = F.embedding_bag(
            bag_ids, source.contiguous(), bag_offsets, mode="sum", per_sample_weights=weight,
            include_last_offset=True,
        )  # fmt: skip
        out.append((rows.long(), summed))
    return out
