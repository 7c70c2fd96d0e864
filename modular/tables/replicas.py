"""The replica axis of a 2D layout: tables sharded within a group of ranks and replicated across
groups (`modular.shard(model, plan, mesh=mesh)` with dims ("replicate", "shard")).

A `RankLayout` holds the shard group (`group`, `world`, `rank`: where the plan's ranks live) and,
beside it, a `Replicas` record for the other axis, the way FSDP2 keeps `HSDPMeshInfo`'s replicate
dim beside `FSDPMeshInfo`'s shard dim. Nothing in input or output dist reads it: ids and pooled
columns move inside the shard group only. The kernels read it to make each shard's copies agree
(Note [exact replicas] in modular/kernels/exact_replicas.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

import torch
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from modular.comm import broadcast

__all__ = ["ReplicaSync", "Replicas", "copy_from_first_replica"]


class ReplicaSync(enum.Enum):
    """How a shard's copies in the replica groups stay equal (`shard(..., replica_sync=)`)."""

    # Every step, every replica applies the update of the global batch (every group's samples):
    # training equals the unsharded model's, and replicas stay bit-identical.
    EXACT = "exact"
    # No per-step traffic across groups; `modular.sync_replicas` averages them (TorchRec's
    # DMPCollection semantics).
    PERIODIC = "periodic"

    @classmethod
    def parse(cls, value) -> ReplicaSync:
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            raise ValueError(
                f"replica_sync must be one of {[m.value for m in cls]}, got {value!r}"
            ) from None


@dataclass(frozen=True)
class Replicas:
    """This rank's replica axis: the group of ranks holding the same shards as this one (one per
    replica group, in replica order), its size and this rank's index in it, and the 2D mesh
    ("replicate", "shard") that DTensor tables span (Note [table tensor types])."""

    group: Optional[ProcessGroup]
    size: int
    index: int
    sync: ReplicaSync = ReplicaSync.EXACT
    mesh: Optional[DeviceMesh] = None

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.size:
            raise ValueError(f"replica index {self.index} is not in [0, {self.size})")

    @property
    def exact(self) -> bool:
        """Whether every step's update is made the same on every replica (and there are some)."""
        return self.size > 1 and self.sync is ReplicaSync.EXACT


@torch.no_grad()
def copy_from_first_replica(tensors: list[torch.Tensor], replicas: Replicas) -> None:
    """Broadcasts `tensors` (this rank's shards) from the first replica group to the others, so
    every copy starts bit-identical whatever each rank's unsharded model held."""
    for t in tensors:  # a dead peer: CollectiveError (Note [a failed peer])
        broadcast(t.data, src=0, group=replicas.group,
                  what="the broadcast of the first replica group's shards")  # fmt: skip
