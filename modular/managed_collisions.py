"""torchrec's managed-collision modules under a plan (issue 46).

Note [managed collisions over the global batch]
torchrec's `ManagedCollisionEmbeddingBagCollection` / `ManagedCollisionEmbeddingCollection` remap
raw ids into `zch_size` slots with a `ManagedCollisionCollection` (its MCH modules keep the
sorted raw ids, counts and access times, and evict every `eviction_interval` calls), then look
the slots up in an inner EBC/EC (`_embedding_module`). Sharding only the inner collection is
silently wrong: each rank's collision module would remap its own rank's batch, so after a few
steps one raw id maps to different rows on different ranks.

So when a plan shards an MC module's inner collection, `shard` also makes its collision
collection remap the *global* batch: each call all-gathers every rank's raw ids (the ranks'
batches in rank order, as the unsharded reference sees them), runs torchrec's own remap on them,
identically on every rank, and keeps this rank's slice of the remapped ids for the sharded
inner collection. Every rank's collision state therefore stays equal to the unsharded module's
fed the global batch, step by step: its remapped ids, its evictions (whose rows, like the
unsharded module's, keep their values), the outputs, the gradients and the trained weights, on
every plan of the table and at any world size, since nothing in it depends on either. The state
keeps torchrec's keys (the collection's class gains only this forward), so checkpoints,
`export` and `load_unsharded` see the unsharded module's. (torchrec keeps the eviction history
in non-persistent buffers sized at the first training call, so a resumed run continues as
torchrec's module resumed from its state_dict, not as one that never stopped.)

What it costs: the collision state is replicated, not split across ranks (every rank holds all
of it, and every rank remaps the global batch: its work and the gather's bytes grow with the
world size). So this is the fallback, for collision modules that modular cannot split exactly
(not torchrec's MCH module, a threshold filter); torchrec's MCH modules get their state split
(Note [sharded managed collisions] in modular/mc/sharded_mch.py). Both paths check ids with the
split path's `check_ids` (one small gather first), so a bad id (negative, or past the table's
`input_hash_size`) raises the same `InputError` everywhere before any state changes. A plan naming the collision collection
itself is refused: it holds no table.

Note [managed collisions in 2D]
Under `shard(..., mesh=mesh)` the inner collection's tables live in each replica group (the
mesh's "shard" dim), but the collision collection remaps over every rank of the mesh (the whole
job): the global batch is every rank's, and a raw id must map to the same slot in every replica
group, or the replicas' rows of one slot would be trained by different ids. Remapping over a
replica group alone kept one collision state per group, each fed its own group's batches: it
trained silently wrong (under replica_sync="exact" too). So the split state is dealt over all W
ranks (Note [slots dealt round]), and each rank's remapped ids go to its own replica group's
tables. Under replica_sync="periodic" the tables differ between syncs, as they do without
collisions; the remap does not.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from modular.errors import InputError, ShardingError
from modular.mc.devices import all_gather
from modular.mc.split import EAGER_REASON, check_ids, split_collisions, why_not_split, with_forward
from modular.routing.variable_batch import strides_of

logger = logging.getLogger(__name__)

__all__ = ["check_not_managed", "managed_owner", "remap_globally"]



def _owner(model: nn.Module, fqn: str) -> tuple[str, Optional[nn.Module], str]:
    parent, _, name = fqn.rpartition(".")
    try:
        owner = model.get_submodule(parent) if fqn else None
    except AttributeError:
        owner = None
    return parent, owner, name


def managed_owner(model: nn.Module, fqn: str) -> Optional[tuple[str, nn.Module]]:
    """(FQN, module) of the managed-collision module whose inner collection is `fqn`, if any."""
    parent, owner, name = _owner(model, fqn)
    if owner is not None and hasattr(owner, "_managed_collision_collection") and name == "_embedding_module":
        return parent, owner
    return None


def check_not_managed(model: nn.Module, fqn: str) -> None:
    """Raises ShardingError when the plan's module `fqn` is a managed-collision module's collision
    collection (Note [managed collisions over the global batch])."""
    parent, owner, name = _owner(model, fqn)
    if owner is None or not hasattr(owner, "_managed_collision_collection"):
        return
    if name != "_managed_collision_collection":
        return
    tables = f"{parent}._embedding_module" if parent else "_embedding_module"
    raise ShardingError(
        f"the plan names module {fqn!r}, the collision collection of the "
        f"{type(owner).__name__} {parent!r}: it holds no table. Plan the tables of its inner "
        f"collection {tables!r} (planners.plan(model, ...) does); modular then remaps the "
        f"global batch with {fqn!r} on every rank, so a raw id maps to the same row everywhere"
    )


def remap_globally(owner: nn.Module, group: Optional[ProcessGroup], path: str = "") -> None:
    """Makes `owner`'s collision collection remap as torchrec's module on the global batch: with
    its state split across ranks where it can (Note [sharded managed collisions]), else
    replicated (Note [managed collisions over the global batch]); its keys stay torchrec's.
    `path`: the owner's FQN in the model, for errors."""
    mcc = owner._managed_collision_collection
    mcc._modular_path = path
    reason = why_not_split(mcc)
    if reason is None and not getattr(type(mcc), "_modular_global", False):
        split_collisions(mcc, group)
        return
    logger.info("managed collisions of %s: state replicated on every rank, not split: %s",
                type(owner).__name__, reason)
    with_forward(mcc, _global_forward, "_modular_global")
    mcc._modular_group = group


@torch.compiler.disable(reason=EAGER_REASON)
def _global_forward(self, features: KeyedJaggedTensor, mutate_miss_lengths: bool = True) -> KeyedJaggedTensor:
    group = self._modular_group
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    check_ids(self, features, group)  # the split path's check: the same error on every rank
    # torchrec's remap runs where its state lives (Note [collision state on a GPU rank]); the
    # remapped ids go back on the input's device
    state = next(self.buffers(), features.values()).device
    state = features.device() if state.type == "meta" else state
    whole, bags = _gather(features, group, world, state)
    remapped = super(type(self), self).forward(whole, mutate_miss_lengths=mutate_miss_lengths)
    out = _slice(remapped, bags, rank, features)
    return out if out.device() == features.device() else out.to(features.device())


def _gather(kjt: KeyedJaggedTensor, group, world: int, device: torch.device) -> tuple[KeyedJaggedTensor, list[torch.Tensor]]:
    """Every rank's batch, concatenated feature by feature in rank order, as torchrec's unsharded
    module takes the global batch, on `device`; and each rank's bags per feature. Where any rank's batch has a
    batch size per feature (VBE) the global batch is a VBE one: each feature's strides one per
    rank, the inverse indices shifted past the earlier ranks' bags (Note [managed collisions of
    a variable batch] in modular/mc/split.py)."""
    keys = kjt.keys()
    n_keys = len(keys)
    variable = kjt.variable_stride_per_key()
    weights = kjt.weights_or_none()
    strides = strides_of(kjt)
    inverse = kjt.inverse_indices()[1].long() if variable else None
    batch = inverse.shape[1] if variable else kjt.stride()
    lengths = kjt.lengths().long()
    values = kjt.values().long()
    head = torch.tensor([batch, values.numel(), int(variable), int(weights is not None), *strides], dtype=torch.int64)
    meta = all_gather(head, group=group, world=world, what="a gather of managed-collision batch sizes").tolist()
    if len({m[3] for m in meta}) > 1:
        raise InputError(f"managed-collision features {list(keys)}: some ranks pass per-sample "
                         "weights and others do not; pass them on every rank or on none")
    any_variable = any(m[2] for m in meta)

    def size(m: list[int]) -> int:  # lengths, values, weights' bits, inverse indices
        return sum(m[4:]) + m[1] * (2 if m[3] else 1) + (n_keys * m[0] if m[2] else 0)

    longest = max(1, *(size(m) for m in meta))  # gloo: non-empty
    mine = [lengths, values]
    if weights is not None:
        mine.append(weights.float().view(torch.int32).long())
    if inverse is not None:
        mine.append(inverse.reshape(-1))
    payload = torch.cat(mine)
    payload = torch.cat([payload, payload.new_zeros(longest - payload.numel())])
    payloads = all_gather(payload, group=group, world=world, what="a gather of managed-collision raw ids")
    per_key_lengths: list[list[torch.Tensor]] = [[] for _ in keys]
    per_key_values: list[list[torch.Tensor]] = [[] for _ in keys]
    per_key_weights: list[list[torch.Tensor]] = [[] for _ in keys]
    inverses, bags, before = [], [], torch.zeros(n_keys, dtype=torch.int64)
    for m, p in zip(meta, payloads):
        b, n, var, has_weights, rank_strides = m[0], m[1], m[2], m[3], torch.tensor(m[4:], dtype=torch.int64)
        at = int(rank_strides.sum())
        lens = p[:at].split(m[4:])
        vals = p[at: at + n]
        wts = p[at + n: at + 2 * n].int().view(torch.float32) if has_weights else None
        at += n * (2 if has_weights else 1)
        inv = p[at: at + n_keys * b].view(n_keys, b) if var else torch.arange(b).expand(n_keys, b)
        inverses.append(inv + before.view(-1, 1))
        before += rank_strides
        bags.append(rank_strides)
        ends = torch.stack([x.sum() for x in lens]).cumsum(0).tolist() if n_keys else []
        for k in range(n_keys):
            start = ends[k - 1] if k else 0
            per_key_lengths[k].append(lens[k])
            per_key_values[k].append(vals[start: ends[k]])
            if wts is not None:
                per_key_weights[k].append(wts[start: ends[k]])
    shape = dict(stride_per_key_per_rank=torch.stack(bags).T.tolist(), inverse_indices=(keys, torch.cat(inverses, 1))
                 ) if any_variable else dict(stride=sum(m[0] for m in meta))  # fmt: skip
    whole = KeyedJaggedTensor(
        keys=keys,
        values=torch.cat([v for vs in per_key_values for v in vs]).to(kjt.values().dtype),
        lengths=torch.cat([v for vs in per_key_lengths for v in vs]).to(kjt.lengths().dtype),
        weights=torch.cat([v for vs in per_key_weights for v in vs]) if weights is not None else None,
        **shape,
    )  # fmt: skip
    return (whole if whole.device() == device else whole.to(device)), bags  # built on the host


def _slice(kjt: KeyedJaggedTensor, bags: list[torch.Tensor], rank: int, like: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """This rank's bags of the global batch's remapped features, in the form of its own batch
    `like` (its strides and inverse indices where it is a VBE batch)."""
    bags_ = torch.stack(bags)  # (world, features)
    before, mine = bags_[:rank].sum(0).tolist(), bags_[rank].tolist()
    weights = kjt.weights_or_none()
    lengths = kjt.lengths().split(bags_.sum(0).tolist())
    key_ends = torch.stack([x.sum() for x in lengths]).cumsum(0).tolist() if lengths else []
    out_lengths, out_values, out_weights = [], [], []
    for k in range(len(kjt.keys())):
        key_start = key_ends[k - 1] if k else 0
        start = key_start + int(lengths[k][: before[k]].sum())
        count = int(lengths[k][before[k]: before[k] + mine[k]].sum())
        out_lengths.append(lengths[k][before[k]: before[k] + mine[k]])
        out_values.append(kjt.values()[start: start + count])
        if weights is not None:
            out_weights.append(weights[start: start + count])
    shape = dict(stride_per_key_per_rank=like.stride_per_key_per_rank(), inverse_indices=like.inverse_indices()
                 ) if like.variable_stride_per_key() else dict(stride=like.stride())  # fmt: skip
    return KeyedJaggedTensor(
        keys=kjt.keys(), values=torch.cat(out_values), lengths=torch.cat(out_lengths),
        weights=torch.cat(out_weights) if weights is not None else None, **shape,
    )  # fmt: skip
