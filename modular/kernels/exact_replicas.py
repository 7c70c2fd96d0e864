"""A shard's copies across the replica groups of a 2D layout, kept exact (modular/tables/replicas.py).

# Note [exact replicas]
Under `shard(..., mesh=mesh, replica_sync="exact")` every shard has one copy per replica group,
and each copy's kernel sees only its own group's batch (the ids input dist routed within the shard
group, the pooled gradients output dist sent back there, divided by the shard group's size G).
A copy across replica groups is then what a data-parallel copy is inside one group, and is made
exact the same way (Note [dense data-parallel copies], Note [fused data-parallel copies]): before
the update, each copy
gathers the other copies' lookup batches over the replica group (their ids, bag lengths and
pooled gradients, the gradients divided by the replica count R) and replays the merged batch,
replica groups in order, through the kernel's own backward. So every copy applies one update, from
the global batch, with the gradient of the mean over all G x R ranks' losses (Note [grad scaling
across ranks]): bit-identical replicas whose training equals the unsharded model's. A fused
module's deferred kernels gather first thing at the end of backward, all of them together
(`gather_across_replicas` in modular/fused/deferred.py; so the column pieces' row statistics
of Note [row statistics across column shards] are the global batch's too), dense kernels at the
start of their own backward, and the torch emulation gathers its touched rows' gradients instead
(`take_every_pending`, all of a module's emulated kernels together), as its data-parallel
copies do. A data-parallel table is a copy in every
rank: gathered over the replica group first, then over the shard group, it replays all G x R
ranks' batches.
Each gather is two all-gathers over the replica group, whatever it holds: every batch's counts
(3 int64 per kernel), then every part of every batch as bytes in one buffer (Note [one gather per
batch] in modular/kernels/lookups.py). A step then costs a fused module 2 replica-axis
collectives (4 where it holds both deferred and emulated kernels), an unfused one 2 per kernel
(they gather inside autograd's backward, one kernel at a time); it was 4-5 per kernel (counts,
lengths, ids, weights, gradients; 3 for the emulation), which on a latency-bound link dominate
(benchmarks/step_2d.py counts them; docs/benchmarks.md, "step_2d.py").
A fused kernel that would update inside fbgemm's backward becomes a deferred one (CPU; other
devices take the torch emulation, as for data-parallel copies); a dense kernel off CPU
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
from modular.profiling import REPLICA_SYNC, labelled
from modular.tables.replicas import Replicas

__all__ = ["gather_replicas", "gather_every_replica", "all_reduce_replicas"]


def gather_replicas(mine: Lookup, routes: int, replicas: Replicas) -> Lookup:
    """Every replica group's lookup batch for this shard (Note [exact replicas]), merged in
    replica order, gradients divided by the replica count: `gather_every_replica` of one."""
    return gather_every_replica([mine], [routes], replicas)[0]


@labelled(REPLICA_SYNC)  # Note [profiler labels] in modular/profiling.py
def gather_every_replica(
    batches: list[Lookup], routes: list[int], replicas: Replicas
) -> list[Lookup]:
    """`gather_replicas` for several kernels' batches (`routes[k]` routes each) in the same two
    all-gathers: replica groups may have different batch sizes, so each rank first shares every
    batch's bag, id and gradient row counts (one small all-gather), then their lengths, ids
    (weights) and pooled gradients in one more, padded to the longest (Note [one gather per
    batch] in modular/kernels/lookups.py). The same result, bit for bit, on every replica."""
    group, world = replicas.group, replicas.size
    counts, pieces, widths = [], [], []
    for mine in batches:
        lengths = (mine.offsets[1:] - mine.offsets[:-1]).to(mine.indices.dtype)
        counts += [lengths.numel(), mine.indices.numel(), mine.grad_out.shape[0]]
        pieces += [lengths, mine.indices, mine.grad_out.reshape(-1)]
        if mine.weights is not None:
            pieces.append(mine.weights.float())
        widths.append(4 if mine.weights is not None else 3)
    device = batches[0].indices.device
    mine_counts = torch.tensor(counts, dtype=torch.int64, device=device)
    every = all_gather(mine_counts, group=group, world=world, what="a replica's lookup counts").tolist()
    sizes = []  # per rank, each piece's length
    for per_rank in every:
        sizes.append([])
        for k, (mine, width) in enumerate(zip(batches, widths)):
            bags, n, rows = per_rank[3 * k : 3 * k + 3]
            sizes[-1] += [bags, n, rows * mine.grad_out.shape[1]] + [n] * (width - 3)
    got = all_gather_packed(pieces, sizes, group, world, what="the replicas' lookup batches")
    out, first = [], 0
    for k, (mine, width) in enumerate(zip(batches, widths)):
        entries = []
        for r in range(world):
            lengths, ids, grads, *weights = got[r][first : first + width]
            offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths)
            entries.append(
                Lookup(
                    grads.view(every[r][3 * k + 2], mine.grad_out.shape[1]).div_(world),
                    ids,
                    offsets.to(mine.indices.dtype),
                    weights[0] if weights else None,
                )
            )
        out.append(merge_lookups(entries, routes[k]))
        first += width
    return out


@labelled(REPLICA_SYNC)
def all_reduce_replicas(grad: torch.Tensor, replicas: Replicas) -> None:
    """A dense kernel's gradient off CPU: the mean over the replica groups, in place."""
    all_reduce(grad, group=replicas.group, what="the gradient all-reduce across replica groups")
    grad.div_(replicas.size)
