"""One kernel's lookup batch as data: merged over several lookups, or gathered from every rank.

A data-parallel copy's gradient is the mean over ranks of each rank's batch. The kernels that
hold data-parallel copies gather those batches (ids, bag lengths, pooled outputs' gradients) and
replay the global one through fbgemm's backward, instead of reducing a table-sized gradient: Note
[fused data-parallel copies] in modular/fused/deferred.py, Note [dense data-parallel copies] in
modular/kernels/dense.py; every part of a batch in one all-gather after its counts (Note [one
gather per batch]).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch.distributed import ProcessGroup

from modular.comm import KeptBuffers, all_gather

# The most ids an fbgemm batch indexes with int32 offsets; past it, ids and offsets are int64
# (Note [ids on the wire] in modular/routing/router.py), and so is a wire that carries them.
INT32_MAX = 2**31 - 1


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
    return all_gather(lengths, group=group, world=world,
                      what="the bag lengths of a data-parallel table")  # fmt: skip


def gather_batch(
    mine: Lookup,
    all_lengths: torch.Tensor,
    routes: int,
    group: Optional[ProcessGroup],
    world: int,
) -> Lookup:
    """Every rank's lookup batch merged in rank order, gradients divided by the world size (the
    mean over ranks, Note [grad scaling across ranks]): the pooled gradients (equal shapes) and
    the ids (and weights), in one gather (Note [one gather per batch]). The same result, bit for
    bit, on every rank."""
    counts = all_lengths.sum(1).tolist()
    pieces = [mine.grad_out.reshape(-1), mine.indices]
    if mine.weights is not None:
        pieces.append(mine.weights.float())
    every = [[pieces[0].numel(), n] + ([n] if mine.weights is not None else []) for n in counts]
    got = all_gather_packed(pieces, every, group, world,
                            what="the lookup batches of a data-parallel table")  # fmt: skip
    entries = []
    for r, (grads, ids, *weights) in enumerate(got):
        offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(all_lengths[r])
        entries.append(
            Lookup(
                grads.view(mine.grad_out.shape).div_(world),
                ids,
                offsets.to(mine.indices.dtype),
                weights[0] if weights else None,
            )
        )
    return merge_lookups(entries, routes)


def all_gather_packed(
    pieces: list[torch.Tensor],
    every: list[list[int]],
    group: Optional[ProcessGroup],
    world: int,
    *,
    what: str,
    kept: Optional[KeptBuffers] = None,
) -> list[list[torch.Tensor]]:
    """Every rank's 1-D `pieces`, each of its own dtype, in one all-gather instead of one per
    piece (Note [one gather per batch]): `every[r][i]` is rank r's length of piece i, which the
    ranks already agree on (an earlier gather of counts), and every rank's piece i has the same
    dtype. Returns `got[r][i]`, rank r's piece i, a view of the gathered buffer; with `kept`, the
    buffers are kept across calls (Note [kept receive buffers]).

    # Note [one gather per batch]
    A collective over gloo or NCCL costs a round of latency whatever its size, and a kernel's
    batch (bag lengths, ids, per-sample weights, pooled gradients; or touched rows and their
    gradients) was one all-gather per part. Here they travel as bytes in one buffer per rank:
    pieces with larger elements first (sizes are powers of two, so each piece starts aligned
    for its dtype and is read back as a view, no copy), the buffer padded to the longest
    rank's, rounded up to the widest element. Bytes are copied, never converted: what arrives
    is bit for bit what the per-part gathers delivered. A rank receives the longest rank's
    total rather than the sum of each part's longest: the same where ranks' batches are alike
    (but for the rounding), less where they differ (row-wise shards, replica groups of
    different batch sizes)."""
    sizes = [p.element_size() for p in pieces]
    order = sorted(range(len(pieces)), key=lambda i: -sizes[i])

    def layout(lengths: list[int]) -> tuple[list[int], int]:
        """Each piece's byte offset in a rank's buffer, and the bytes used."""
        start, at = [0] * len(pieces), 0
        for i in order:
            start[i], at = at, at + lengths[i] * sizes[i]
        return start, at

    laid = [layout(lengths) for lengths in every]
    starts = [start for start, _ in laid]
    align = max(sizes)  # each rank's buffer starts aligned for the widest dtype
    size = max(align, -(-max(used for _, used in laid) // align) * align)
    device = pieces[0].device
    like = torch.empty(0, dtype=torch.uint8, device=device)
    mine = torch.empty(size, dtype=torch.uint8, device=device) if kept is None else kept.empty(
        "packed", size, like)
    start, used = layout([p.numel() for p in pieces])
    for i, p in enumerate(pieces):
        mine[start[i] : start[i] + p.numel() * sizes[i]] = p.contiguous().view(-1).view(torch.uint8)
    mine[used:].zero_()
    out = None if kept is None else kept.empty("gathered packed", world * size, like)
    got = all_gather(mine, group=group, world=world, what=what, out=out)
    return [
        [
            got[r, start : start + n * sizes[i]].view(pieces[i].dtype)
            for i, (start, n) in enumerate(zip(starts[r], every[r]))
        ]
        for r in range(world)
    ]
