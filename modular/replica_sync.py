"""`modular.sync_replicas`: the replica groups of a 2D-sharded model made equal again.

Under `shard(..., mesh=mesh, replica_sync="periodic")` (TorchRec's DMPCollection semantics) no
step moves anything across replica groups: each group trains exactly as a 1D job on its own
ranks' batches would (gradients averaged over its shard group, Note [grad scaling across ranks]),
and its copies drift apart. `sync_replicas`, called on every rank every N steps, averages every
table shard (and the fused optimizer's state) over the replica groups. Under "exact" (Note
[exact replicas] in modular/kernels/exact_replicas.py) the copies never differ, so the call instead
checks that they do not, and raises on every rank naming the module if one diverged, rather than
averaging the difference away.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from torch import nn

from modular.comm import all_gather_bytes, all_reduce
from modular.errors import ShardingError
from modular.profiling import REPLICA_SYNC, labelled
from modular.sharding import sharded_modules
from modular.tables.replicas import Replicas

__all__ = ["sync_replicas"]


@labelled(REPLICA_SYNC)  # Note [profiler labels] in modular/profiling.py
@torch.no_grad()
def sync_replicas(model: nn.Module, *, optimizer_state: bool = True) -> nn.Module:
    """Averages every 2D-sharded collection's shards over its replica groups, in place, and
    returns `model`. Call it on every rank, between steps:

        if step % 100 == 0:
            modular.sync_replicas(model)

    `optimizer_state`: average the fused optimizer's state too (momentum, Adagrad's sums).
    Collections sharded with replica_sync="exact" are checked instead: a shard that differs from
    its copies raises `ShardingError` on every rank. 1D collections are left alone.
    """
    diverged: list[str] = []
    for fqn, m in sharded_modules(model):
        replicas = m.replicas
        if replicas is None or replicas.size == 1:
            continue
        tensors = list(m.local_shard_views().values())
        if optimizer_state and m.fused_tables is not None:
            tensors += [t for states in m.fused_tables.states().values() for t in states.values()]
        if replicas.exact:
            if not _agree(tensors, replicas):
                diverged.append(fqn)
            continue
        _average(tensors, replicas, fqn)
    flag = torch.tensor([float(len(diverged))])
    # every rank hears of a divergence anywhere; a dead peer: CollectiveError (Note [a failed peer])
    all_reduce(flag, group=None, op=dist.ReduceOp.MAX,
               what="sync_replicas' all-reduce of the diverged-replica flag")  # fmt: skip
    if flag.item() > 0:
        where = f"modules {diverged} on rank {dist.get_rank()}" if diverged else "another rank"
        raise ShardingError(
            f"a replica diverged from its copies in the other replica groups ({where}) under "
            "replica_sync='exact', which keeps them bit-identical; something changed one copy "
            "outside a training step (a write into one rank's shards, a different optimizer "
            "config or learning rate per rank). Reload from a checkpoint"
        )
    return model


def _agree(tensors: list[torch.Tensor], replicas: Replicas) -> bool:
    digest = hashlib.sha256()
    for t in tensors:
        digest.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    mine = digest.digest()
    return len(set(all_gather_bytes(mine, width=len(mine), group=replicas.group))) == 1


def _average(tensors: list[torch.Tensor], replicas: Replicas, fqn: str) -> None:
    """One all-reduce per dtype over the replica group, then each tensor set to the mean."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for dtype, group in by_dtype.items():
        flat = torch.cat([t.detach().reshape(-1).float() for t in group])
        all_reduce(flat, group=replicas.group, what=f"the replica average of module {fqn!r}")
        flat.div_(replicas.size)
        for t, piece in zip(group, flat.split([t.numel() for t in group])):
            t.detach().copy_(piece.view(t.shape).to(dtype))
