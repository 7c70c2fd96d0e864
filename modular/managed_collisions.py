"""torchrec's managed-collision modules meet a plan (issue 46).

Note [managed collisions are not sharded yet]
torchrec's `ManagedCollisionEmbeddingBagCollection` / `ManagedCollisionEmbeddingCollection` remap
raw ids into `zch_size` slots with a `ManagedCollisionCollection` (its MCH modules keep the
sorted raw ids, counts and access times), then look the slots up in an inner EBC/EC
(`_embedding_module`). Sharding only the inner collection is silently wrong: each rank's
collision module would remap its own rank's batch, so after a few steps one raw id maps to
different rows on different ranks, and training goes on. Until the collision state itself is
sharded (one remap of the global batch, the same on every rank), `shard` refuses a plan that
names the inner collection or the collision collection, on every rank (the check reads only the
model and the plan, which every rank holds alike), naming both modules and what to do. The
planner plans the inner collection's tables (`zch_size` rows each) under the inner
collection's FQN, and skips the collision collection, which holds no table.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from modular.errors import ShardingError

__all__ = ["check_not_managed"]


def _owner(model: nn.Module, fqn: str) -> tuple[str, Optional[nn.Module], str]:
    parent, _, name = fqn.rpartition(".")
    try:
        owner = model.get_submodule(parent) if fqn else None
    except AttributeError:
        owner = None
    return parent, owner, name


def check_not_managed(model: nn.Module, fqn: str) -> None:
    """Raises ShardingError when the plan's module `fqn` belongs to a managed-collision module
    (Note [managed collisions are not sharded yet])."""
    parent, owner, name = _owner(model, fqn)
    if owner is None or not hasattr(owner, "_managed_collision_collection"):
        return
    if name not in ("_embedding_module", "_managed_collision_collection"):
        return
    kind = type(owner).__name__
    tables = f"{parent}._embedding_module" if parent else "_embedding_module"
    remap = f"{parent}._managed_collision_collection" if parent else "_managed_collision_collection"
    raise ShardingError(
        f"the plan names module {fqn!r}, part of the {kind} {parent!r}: its tables "
        f"({tables!r}) are looked up with ids that its collision module ({remap!r}) remaps. "
        "modular does not shard managed-collision modules yet, and sharding the tables alone "
        "would be silently wrong: each rank's collision module would remap only its own batch, "
        "so one raw id would map to different rows on different ranks (an unsharded copy per "
        "rank under DDP diverges the same way). For now hash the raw ids into a plain "
        "EmbeddingBagCollection (ids % num_embeddings) and shard that, or train this module "
        "in one process (docs/troubleshooting.md, 'Managed-collision modules')"
    )
