"""Installs the split collision state in a managed-collision module's collection, and checks a
batch's raw ids on every rank before any state changes (Note [sharded managed collisions] in
modular/mc/sharded_mch.py).

Note [managed collisions of a variable batch]
A VBE KeyedJaggedTensor (`stride_per_key_per_rank`, `inverse_indices`: a feature with fewer bags
than samples) is remapped as torchrec's unsharded module remaps the global VBE batch: each
feature's bags of every rank in rank order, its strides one per rank, the inverse indices shifted
past the earlier ranks' bags. torchrec's collection takes such a batch as it is (it remaps value
by value and hands the strides and inverse indices on), and the split state reads a batch only
as each rank's ids per feature, in that order (the history, its cut, the counts, the remap), so
nothing in it depends on the bags; the inner EBC then pools the rank's bags and expands them
(Note [variable batch per feature] in modular/routing/variable_batch.py). A rank may pass a VBE
batch beside plain ones. An EmbeddingCollection sharded by modular takes no VBE batch, so the
collection of an MC-EC refuses one in its id check, on every rank and before any state changes
(else the inner EC would refuse it after the remap had recorded and evicted). The replicated
path (Note [managed collisions over the global batch]) gathers the ranks' batches into that
global VBE batch and runs torchrec's remap on it.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.mc_modules import ManagedCollisionCollection, MCHManagedCollisionModule
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from modular.mc.devices import all_gather
from modular.errors import InputError
from modular.mc.eviction import scoring_for
from modular.mc.sharded_mch import ShardedMCHModule
from modular.routing.variable_batch import strides_of

__all__ = ["check_ids", "split_collisions", "why_not_split", "with_forward"]

_SUBCLASSES: dict[tuple[type, str], type] = {}
_VBE_FOR_EC = -2  # the bound of a check's row that refuses a VBE batch for an EC's collisions


def why_not_split(mcc: nn.Module) -> Optional[str]:
    """None when every collision module of `mcc` can be split exactly; else the reason (the
    collection then remaps the global batch on every rank, replicated)."""
    for table, module in mcc._managed_collision_modules.items():
        if type(module) is not MCHManagedCollisionModule:
            return f"table {table!r}'s collision module is a {type(module).__name__}, not torchrec's MCHManagedCollisionModule"
        scoring, reason = scoring_for(module._eviction_policy)
        if scoring is None:
            return f"table {table!r}: {reason}"
        if module._output_global_offset != 0 or module._buckets != 1:
            return f"table {table!r}'s collision module is already a shard of a table (output offset or buckets)"
    return None


def split_collisions(mcc: nn.Module, group: Optional[ProcessGroup]) -> None:
    """Replaces each MCH module of `mcc` with a ShardedMCHModule holding this rank's share of its
    state (FQNs and state_dict keys unchanged), and makes `mcc` check ids on every rank first."""
    for table in list(mcc._managed_collision_modules):
        module = mcc._managed_collision_modules[table]
        scoring, _ = scoring_for(module._eviction_policy)
        sharded = ShardedMCHModule(module, scoring, group)
        sharded._table = table  # how errors name it (torchrec's `_name` may be None)
        sharded.train(module.training)
        mcc._managed_collision_modules[table] = sharded
    with_forward(mcc, _checked_forward, "_modular_split")
    mcc._modular_group = group


def with_forward(module: nn.Module, forward, marker: str) -> None:
    """Gives `module` a subclass of its class whose `forward` is `forward`, marked by the class
    attribute `marker` (once: a module already marked keeps its class). The subclass keeps the
    class's name and module, so state_dict keys and reprs stay torchrec's; one per (class,
    marker), made on first use."""
    cls = type(module)
    if getattr(cls, marker, False):
        return
    if (cls, marker) not in _SUBCLASSES:
        _SUBCLASSES[cls, marker] = type(cls.__name__, (cls,), {
            "forward": forward, marker: True, "__module__": cls.__module__,
        })  # fmt: skip
    module.__class__ = _SUBCLASSES[cls, marker]


# Why a compiled model runs a managed-collision collection eagerly (Note [compiling a sharded model]
# in modular/compose/compile.py: the same deliberate graph break as a sharded collection's).
EAGER_REASON = (
    "a managed-collision collection under modular remaps eagerly (host reads of the batch, "
    "collectives, its collision state's sorts and searches), one deliberate graph break per call; "
    "under fullgraph=True compile the dense modules instead (modular.apply_compile)"
)


@torch.compiler.disable(reason=EAGER_REASON)
def _checked_forward(self, features: KeyedJaggedTensor, mutate_miss_lengths: bool = True) -> KeyedJaggedTensor:
    keys = features.keys()
    first = _first_bad(self, features)
    clean = int(first[0]) == len(keys)
    by_key = dict(zip(keys, features.values().split(features.length_per_key())))
    pieces = {}  # each evicting table's unique ids, folded into the check (Note [sharded managed collisions])
    for table, module in self._managed_collision_modules.items():
        values = torch.cat([by_key[f] for f in self._table_to_features[table]])
        piece = module.fold_piece(values if clean else values[:0])  # a rank with a bad id sends filler
        if piece is not None:
            pieces[table] = piece
    lengths, got = _gather_checked(self, features, first, self._modular_group, list(pieces.values()))
    for table, module in self._managed_collision_modules.items():
        # each table's id counts per rank, in the order torchrec hands it its features
        module._lengths = lengths[:, [keys.index(f) for f in self._table_to_features[table]]]
    for table, rows in zip(pieces, got):
        self._managed_collision_modules[table].take_folded(rows)
    return ManagedCollisionCollection.forward(self, features, mutate_miss_lengths=mutate_miss_lengths)


def check_ids(mcc: nn.Module, features: KeyedJaggedTensor, group: Optional[ProcessGroup]) -> torch.Tensor:
    """Raises InputError on every rank, the same, when any rank's batch holds an id that is
    negative or past its table's `input_hash_size`: one small all_gather, before any state
    changes. The id named is the first bad one of the global batch (feature by feature, ranks in
    order), as the unsharded module fed the global batch would see it. Returns every rank's id
    count per feature, (world, features), gathered with the check."""
    return _gather_checked(mcc, features, _first_bad(mcc, features), group, [])[0]


def _first_bad(mcc: nn.Module, features: KeyedJaggedTensor) -> torch.Tensor:
    """(feature index, id, bound) of this rank's first bad id; (features, 0, 0) when none. A VBE
    batch for an EC's collisions is bad at its first feature of its own bag count: (feature
    index, that count, _VBE_FOR_EC) (Note [managed collisions of a variable batch])."""
    keys = features.keys()
    tables = mcc._feature_to_table
    if features.variable_stride_per_key() and all(isinstance(c, EmbeddingConfig) for c in mcc._embedding_configs):
        strides = strides_of(features)
        inverse = features.inverse_indices_or_none()
        batch = inverse[1].shape[1] if inverse is not None else max(strides)
        k = next((k for k, s in enumerate(strides) if s != batch), 0)
        return torch.tensor([k, strides[k], _VBE_FOR_EC], dtype=torch.int64)
    for k, (key, values) in enumerate(zip(keys, features.values().split(features.length_per_key()))):
        module = mcc._managed_collision_modules[tables[key]] if key in tables else None
        bound = getattr(module, "_input_hash_size", None)
        if values.numel() == 0:
            continue
        bad = values < 0
        if bound is not None:
            bad |= values >= bound
        if bool(bad.any()):
            return torch.tensor([k, int(values[bad][0]), -1 if bound is None else bound], dtype=torch.int64)
    return torch.tensor([len(keys), 0, 0], dtype=torch.int64)


def _gather_checked(mcc: nn.Module, features: KeyedJaggedTensor, first: torch.Tensor, group: Optional[ProcessGroup],
                    pieces: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:  # fmt: skip
    """One all_gather of every rank's check (`first`), id counts per feature and `pieces` (the
    same sizes on every rank); raises check_ids's InputError before anything is used. Returns
    the counts (world, features) and each piece gathered, (world, its size)."""
    keys = features.keys()
    tables = mcc._feature_to_table
    world = dist.get_world_size(group)
    per_key = torch.tensor(features.length_per_key(), dtype=torch.int64)
    found = all_gather(torch.cat([first, per_key, *pieces]), group=group, world=world,
                       what="a check of managed-collision ids")  # fmt: skip
    k = int(found[:, 0].min())
    if k == len(keys):
        ends = (3 + len(keys) + torch.tensor([p.numel() for p in pieces], dtype=torch.int64).cumsum(0)).tolist()
        return found[:, 3 : 3 + len(keys)], [found[:, e - p.numel() : e] for p, e in zip(pieces, ends)]
    rank = int((found[:, 0] == k).nonzero()[0, 0])
    value, bound = int(found[rank, 1]), int(found[rank, 2])
    if bound == _VBE_FOR_EC:
        raise InputError(
            f"managed-collision feature {keys[k]!r}: rank {rank}'s batch has a batch size per "
            f"feature (a VBE KeyedJaggedTensor, {value} bags of {keys[k]!r}), but the "
            f"ManagedCollisionEmbeddingCollection {getattr(mcc, '_modular_path', '')!r} (tables "
            f"{sorted(mcc._managed_collision_modules)}) feeds an EmbeddingCollection, which takes no "
            "variable batch sharded; expand the batch "
            "to one bag per sample for it. Nothing was remapped or recorded"
        )
    raise InputError(
        f"managed-collision feature {keys[k]!r}: rank {rank}'s batch has id {value}, outside "
        f"[0, input_hash_size={None if bound < 0 else bound}) of table {tables.get(keys[k], keys[k])!r}; "
        "hash raw ids into that range before the model"
    )
