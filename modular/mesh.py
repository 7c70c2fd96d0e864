"""The mesh `modular.shard` is given: which group shards the tables, and the replica axis beside it.

A 2D `DeviceMesh` with dims ("replicate", "shard"), FSDP2's HSDP layout, shards every planned
table within each "shard" group by the plan (`plan.world_size == mesh["shard"].size()`) and keeps
one copy of that layout per "replicate" group (`Replicas`, modular/tables/replicas.py). A 1D mesh
is one process group, today's `process_group=`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from modular.errors import ShardingError
from modular.tables.replicas import Replicas, ReplicaSync

__all__ = ["MESH_DIMS", "MeshGroups", "resolve_mesh"]

MESH_DIMS = ("replicate", "shard")


@dataclass(frozen=True)
class MeshGroups:
    """Where `shard` runs: the tables' (shard) group, the replica axis (2D only), the group whose
    ranks agree on the plan and the mesh (Note [agreeing on the plan]), and the mesh as every
    rank must describe it (None when no 2D mesh was given)."""

    shard_group: Optional[ProcessGroup]
    replicas: Optional[Replicas]
    agreement_group: Optional[ProcessGroup]
    described: Optional[dict]

    def shard_size_message(self, plan_world: int, world: int) -> str:
        """Why a plan for `plan_world` ranks does not fit a shard group of `world`, and the fix."""
        if self.replicas is None:
            return (
                f"the plan is for {plan_world} ranks but the process group has {world}; "
                f"make a plan for world_size={world}"
            )
        shape = tuple(self.described["shape"])
        return (
            f"the plan is for {plan_world} ranks but mesh['shard'] has {world} (a mesh of shape "
            f"{shape} over {MESH_DIMS}: {self.replicas.size} replica groups of {world} ranks); "
            f"make a plan for world_size={world}, or a mesh whose 'shard' dim has {plan_world} "
            "ranks"
        )


def resolve_mesh(
    mesh: Optional[DeviceMesh],
    process_group: Optional[ProcessGroup],
    replica_sync: ReplicaSync,
) -> tuple[MeshGroups, Optional[ShardingError]]:
    """The groups `shard` runs on, and the problem with `mesh` if it has one (raised on every
    rank by the plan's agreement, which then runs over every rank)."""
    plain = MeshGroups(process_group, None, process_group, None)
    if mesh is None:
        return plain, None
    if not isinstance(mesh, DeviceMesh):
        return _broken(f"mesh must be a torch DeviceMesh, got {type(mesh).__name__}")
    if process_group is not None:
        return _broken(
            "modular.shard takes a mesh or a process_group, not both: the mesh's 'shard' dim is "
            "the tables' group"
        )
    if mesh.ndim == 1:
        group = mesh.get_group()
        return MeshGroups(group, None, group, None), None
    names = tuple(mesh.mesh_dim_names or ())
    described = {
        "shape": list(mesh.mesh.shape), "names": list(names), "ranks": mesh.mesh.tolist(),
        "sync": replica_sync.value,
    }  # fmt: skip
    if mesh.ndim != 2 or names != MESH_DIMS:
        return _broken(
            f"modular.shard takes a 1D mesh or a 2D mesh with dims {MESH_DIMS} (FSDP2's HSDP "
            f"layout), got a {mesh.ndim}D mesh of shape {tuple(mesh.mesh.shape)} with dims "
            f"{names or None}; build it with init_device_mesh(device, (replicas, shard_size), "
            f"mesh_dim_names={MESH_DIMS})",
            described,
        )
    if mesh.size() != dist.get_world_size():
        return _broken(
            f"the 2D mesh spans {mesh.size()} ranks but the job has {dist.get_world_size()}; "
            "modular.shard takes a 2D mesh over every rank",
            described,
        )
    replicas = Replicas(
        group=mesh.get_group("replicate"), size=mesh.size(0),
        index=mesh.get_local_rank("replicate"), sync=replica_sync, mesh=mesh,
    )  # fmt: skip
    return MeshGroups(mesh.get_group("shard"), replicas, None, described), None


def _broken(message: str, described: Optional[dict] = None) -> tuple[MeshGroups, ShardingError]:
    """A mesh `shard` cannot use: agreed on (and raised) over every rank."""
    return MeshGroups(None, None, None, described or {"broken": True}), ShardingError(message)
