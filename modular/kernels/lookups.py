"""One kernel's lookup batch as data: merged over several lookups, or gathered from every rank.

A data-parallel replica's gradient is the mean over ranks of each rank's batch. The kernels that
hold replicas gather those batches (ids, bag lengths, pooled outputs' gradients) and replay the
global one through fbgemm's backward, instead of reducing a table-sized gradient: Note [fused
replicas] in modular/kernels/deferred.py, Note [dense replicas] in modular/kernels/dense.py.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch.distributed import ProcessGroup

from modular.comm import all_gather, all_gather_padded
from modular.routing.router import INT32_MAX


class Lookup(NamedTuple):
    """One TBE batch and its pooled outputs' gradient."""

    grad_out: torch.Tensor  # (bags per route, total columns)
    indices: torch.Tensor
    offsets: torch.Tensor  # routes * bags + 1, the indices' dtype
    weights: Optional[torch.Tensor]

    @classmethod
    def of(cls, grad_out, indices, offsets, weights) -> Lookup:
        """What a kernel's backward receives, as fbgemm's backward ops take it: a contiguous
        gradient and offsets of the ids' dtype."""
        return cls(grad_out.contiguous(), indices, offsets.to(indices.dtype), weights)

    def route_slices(self, routes: int) -> list[slice]:
        """Where each of the batch's `routes` routes (equal bag counts, route-major) has its ids
        in `indices` (and `weights`): one read of the offsets."""
        bags = (self.offsets.numel() - 1) // routes
        bounds = self.offsets[::bags].tolist() if bags else [0] * (routes + 1)
        return [slice(bounds[r], bounds[r + 1]) for r in range(routes)]


def batch_offsets(lengths: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A TBE batch's ids and its bags' offsets, in one dtype: the ids' (int32 mostly), or int64
    for both once the batch holds more than INT32_MAX ids (Note [ids on the wire])."""
    if indices.numel() > INT32_MAX:
        indices, lengths = indices.long(), lengths.long()
    offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths)
    return indices, offsets.to(indices.dtype)


def merge_lookups(pending: list[Lookup], routes: int) -> Lookup:
    """One TBE batch holding several lookups' bags: feature by feature, the first lookup's bags,
    then the next's (TBE batches are feature-major), with their output gradients stacked."""
    weighted = pending[0].weights is not None
    ids, weights, lengths = [], [], []
    for p in pending:
        cuts = p.route_slices(routes)
        bags = (p.offsets.numel() - 1) // routes
        lengths.append((p.offsets[1:] - p.offsets[:-1]).view(routes, bags))
        ids.append([p.indices[c] for c in cuts])
        if weighted:
            weights.append([p.weights[c] for c in cuts])
    indices = torch.cat([seg[f] for f in range(routes) for seg in ids])
    merged_weights = (
        torch.cat([seg[f] for f in range(routes) for seg in weights]) if weighted else None
    )
    indices, offsets = batch_offsets(torch.cat(lengths, dim=1).reshape(-1), indices)
    grad_out = torch.cat([p.grad_out for p in pending], dim=0)
    return Lookup(grad_out, indices, offsets, merged_weights)


def gather_lengths(mine: Lookup, group: Optional[ProcessGroup], world: int) -> torch.Tensor:
    """Every rank's bag lengths, (world, bags): one all-gather of equal shapes (input dist agreed
    on the batch size). Their sum is the global batch's id count, the same on every rank."""
    lengths = (mine.offsets[1:] - mine.offsets[:-1]).contiguous()
    return all_gather(lengths, group=group, world=world, what="the bag lengths of a replica")


def gather_batch(
    mine: Lookup,
    all_lengths: torch.Tensor,
    routes: int,
    group: Optional[ProcessGroup],
    world: int,
) -> Lookup:
    """Every rank's lookup batch merged in rank order, gradients divided by the world size (the
    mean over ranks, Note [grad scaling across ranks]): the pooled gradients (equal shapes), then
    the ids (and weights) padded to the longest. The same result, bit for bit, on every rank."""
    device, id_type = mine.indices.device, mine.indices.dtype
    all_grads = all_gather(
        mine.grad_out.contiguous(), group=group, world=world,
        what="the pooled-output gradients of a replica",
    )  # fmt: skip
    counts = all_lengths.sum(1).tolist()
    longest = max(counts)
    ids = all_gather_padded([mine.indices], longest, group, world, id_type, device)
    weights = None
    if mine.weights is not None:
        weights = all_gather_padded(
            [mine.weights.float()], longest, group, world, torch.float32, device
        )
    entries = []
    for r in range(world):
        offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(all_lengths[r])
        entries.append(
            Lookup(
                all_grads[r].div_(world),
                ids[r, : counts[r]],
                offsets.to(id_type),
                None if weights is None else weights[r, : counts[r]],
            )
        )
    return merge_lookups(entries, routes)
