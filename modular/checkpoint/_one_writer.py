"""Checkpoints of 2D-sharded models (docs/design.md, "2D sparse parallelism"): which rank writes a
table's copies, and which ranks send it to `export`'s destination.

# Note [one replica group writes]
Under `shard(..., mesh=mesh)` every replica group holds every planned table, sharded alike, so each
shard (and the fused optimizer's state laid out like it) is presented to DCP by R ranks at the same
key and offsets. DCP's own dedup (`dedup_save_plans`) would keep one of them, but it picks each
chunk's writer by load balance, so chunks of one table can come from different replica groups.
Under replica_sync="exact" the copies are bit-identical and that would not show; under
"periodic" between two `sync_replicas` calls they differ, and the checkpoint would be a patchwork
of replica groups, a model no replica ever held. So `save` leaves the copies of replica groups
other than the first (`Replicas.index > 0`) out of the state it hands DCP: replica group 0 writes
every table, weight and optimizer state, and what a checkpoint holds is exactly its model (the
hyperparameters and every entry outside the 2D collections are written as before). Loading needs
nothing of it: DCP stores global shapes and chunks, so every rank, in any replica group, 1D or 2D,
reads the slices its own shards need.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from modular.checkpoint._apply import _WRAPPERS
from modular.checkpoint._entries import MODEL
from modular.sharding import sharded_modules

__all__ = ["drop_replica_copies", "state_prefix"]


def state_prefix(model: nn.Module, name: str) -> str:
    """The prefix of module `name`'s keys in `get_model_state_dict(model)` ("" for the model
    itself, else ending in "."), which leaves out the child a wrapper adds (DDP's `module`,
    torch.compile's `_orig_mod`)."""
    module, kept = model, []
    for part in name.split(".") if name else []:
        if not any(isinstance(module, cls) and part == child for cls, child in _WRAPPERS):
            kept.append(part)
        module = getattr(module, part)
    return "".join(f"{p}." for p in kept)


def drop_replica_copies(model: nn.Module, state: dict[str, Any], optim_prefixes: list[str]) -> dict[str, Any]:
    """`state` (Note [checkpoint keys]) without the entries of 2D collections this rank holds as a
    copy in a replica group other than the first (Note [one replica group writes])."""
    copies = [
        state_prefix(model, name)
        for name, m in sharded_modules(model)
        if not m.is_local and m.replicas is not None and m.replicas.index > 0
    ]
    if not copies:
        return state
    starts = tuple(
        start + p for p in copies for start in (MODEL, *(f"{o}state." for o in optim_prefixes))
    )
    return {k: v for k, v in state.items() if not k.startswith(starts)}
