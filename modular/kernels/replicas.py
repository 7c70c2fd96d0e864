"""A shard's copies across the replica groups of a 2D layout, kept exact (modular/tables/replicas.py).

# Note [exact replicas]
Under `shard(..., mesh=mesh, replica_sync="exact")` every shard has one copy per replica group,
and each copy's kernel sees only its own group's batch (the ids input dist routed within the shard
group, the pooled gradients output dist sent back there, divided by the shard group's size G).
A copy across replica groups is then what a data-parallel replica is inside one group, and is made
exact the same way (Note [dense replicas], Note [fused replicas]): before the update, each copy
gathers the other copies' lookup batches over the replica group (their ids, bag lengths and
pooled gradients, the gradients divided by the replica count R) and replays the merged batch,
replica groups in order, through the kernel's own backward. So every copy applies one update, from
the global batch, with the gradient of the mean over all G x R ranks' losses (Note [grad scaling
across ranks]): bit-identical replicas whose training equals the unsharded model's. Deferred
kernels gather in `take_batch` (so the column pieces' row statistics of Note [row statistics
across column shards] are the global batch's too), dense kernels at the start of their backward,
and the torch emulation gathers its touched rows' gradients instead (`all_gather_mean`), as its
data-parallel replicas do. A data-parallel table is a copy in every rank: gathered over the
replica group first, then over the shard group, it replays all G x R ranks' batches.
A fused kernel that would update inside fbgemm's backward becomes a deferred one (CPU; other
devices take the torch emulation, as for data-parallel replicas); a dense kernel off CPU
all-reduces its gradient over the replica group instead.

The alternative, all-reducing each copy's row-sparse gradient, needs the union of the touched
rows first (a gather of row ids), then an all-reduce of rows x dim floats over that union. For a
lookup of n ids over b bags per route in r routes of total width D, the replay moves per rank
(R - 1) x (4n + 4rb + 4bD) bytes (ids, lengths, pooled gradients), against the row-sparse one's
~2 (R - 1)/R x 4uD for u touched rows in the union (a ring all-reduce) plus the rows' own gather;
the pooled gradient is b x D against u x D, and with pooling factor p >= 1 a bag touches up to p
rows, so u >= b whenever a table is not so hot that the whole batch touches fewer rows than it
has bags. benchmarks/replica_bytes.py counts both from real batches: a 100,000 x 64 table, 1,024
bags per replica, R = 2, received per rank per step: one id per bag 264 KiB (replay) against
516 KiB (row-sparse) for uniform ids and 264 against 260 for power-law ones (1.05), the one
case near even; 4 ids per bag 276 against 1,999 / 820; 20 ids per bag 340 against 8,538 /
2,768. The replay's bytes grow with ids by 4 bytes each, the row-sparse one's by 4 x dim per
new row. More replicas do not change the picture but for one case: at R = 4 and R = 8 (`--replicas`)
one power-law id per bag is the row-sparse one's (689 against 792 KiB, 1,431 against 1,848), a hot
table read once per bag whose union grows slower than the batch; every case with 4 or more ids per
bag stays 2.5-15x in the replay's favour. The replay also needs no unique/coalesce pass before the collective, keeps fbgemm's own fused update
(one kernel call on the merged batch, duplicates summed by fbgemm), and is bit-identical on
every replica by construction (the all-reduce's sum order is the backend's).
"""

from __future__ import annotations

import torch

from modular.comm import all_gather, all_reduce
from modular.kernels.lookups import Lookup, all_gather_packed, merge_lookups
from modular.tables.replicas import Replicas

__all__ = ["gather_replicas", "all_reduce_replicas"]


def gather_replicas(mine: Lookup, routes: int, replicas: Replicas) -> Lookup:
    """Every replica group's lookup batch for this shard (Note [exact replicas]), merged in
    replica order, gradients divided by the replica count. Replica groups may have different
    batch sizes, so each rank first shares its bag, id and gradient row counts (one small
    all-gather), then its lengths, ids (weights) and pooled gradients in one more, padded to the
    longest (Note [one gather per batch] in modular/kernels/lookups.py). The same result, bit
    for bit, on every replica."""
    group, world = replicas.group, replicas.size
    ids, device = mine.indices, mine.indices.device
    rows, cols = mine.grad_out.shape
    lengths = (mine.offsets[1:] - mine.offsets[:-1]).to(ids.dtype)
    counts = torch.tensor([lengths.numel(), ids.numel(), rows], dtype=torch.int64, device=device)
    every = all_gather(counts, group=group, world=world, what="a replica's lookup counts").tolist()
    pieces = [lengths, ids, mine.grad_out.reshape(-1)]
    if mine.weights is not None:
        pieces.append(mine.weights.float())
    sizes = [[bags, n, n_rows * cols] + [n] * (len(pieces) - 3) for bags, n, n_rows in every]
    got = all_gather_packed(pieces, sizes, group, world, what="a replica's lookup batch")
    entries = []
    for (all_lengths, all_ids, grads, *weights), (_, _, n_rows) in zip(got, every):
        offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(all_lengths)
        entries.append(
            Lookup(
                grads.view(n_rows, cols).div_(world),
                all_ids,
                offsets.to(ids.dtype),
                weights[0] if weights else None,
            )
        )
    return merge_lookups(entries, routes)


def all_reduce_replicas(grad: torch.Tensor, replicas: Replicas) -> None:
    """A dense kernel's gradient off CPU: the mean over the replica groups, in place."""
    all_reduce(grad, group=replicas.group, what="the gradient all-reduce across replica groups")
    grad.div_(replicas.size)
