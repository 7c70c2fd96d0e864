"""Managed-collision tables under a 2D mesh (Note [managed collisions in 2D] in
modular/managed_collisions.py): the collision state is the unsharded module's on the global batch
of all four ranks, not one per replica group, step by step; under replica_sync="exact" the
outputs and trained tables too."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import modular
from planners.types import ShardingPlan
from tests.dist import run_on_ranks
from tests.modular.ebc_cases import global_batch, placements_for
from tests.modular.mc.beside_reference import assert_remapped_slice, assert_same_collision_state, step_batches
from tests.modular.mc.test_split_state import _batch, _model

SPECS = {"t_a": ("distance_lfu", 1, 40), "t_b": ("lru", 2, 24)}
LR, STEPS = 0.5, 6


def _train(sync: str) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model, ref = _model(SPECS), _model(SPECS)
    plan = ShardingPlan(world_size=2, modules={
        "mc._embedding_module": placements_for("row_wise", model.mc._embedding_module, 2)})  # fmt: skip
    modular.shard(model, plan, mesh=mesh, replica_sync=sync)
    opt = torch.optim.SGD(list(modular.local_parameters(model)), lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for step in range(STEPS):
        batches, size, before = step_batches(_batch, step, world, rank)
        pooled, remapped = model.mc(batches[rank])
        ref_pooled, ref_remapped = ref.mc(global_batch(batches))
        label = f"{sync} rank {rank} step {step}"
        assert_remapped_slice(remapped, ref_remapped, before, label)  # remapped as the global batch's
        if sync == "exact":
            torch.testing.assert_close(pooled.values(), ref_pooled.values()[before : before + size[rank]],
                                       rtol=1e-4, atol=1e-5, msg=lambda m: f"{label}: outputs: {m}")  # fmt: skip
        probe = torch.randn(sum(size), pooled.values().shape[1], generator=torch.Generator().manual_seed(step))
        (pooled.values() * probe[before : before + size[rank]]).sum().backward()
        ((ref_pooled.values() * probe).sum() / world).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        assert_same_collision_state(model, ref, label)
    exported = modular.checkpoint.export(model)  # each table once, from rank 0's replica group
    if sync == "exact" and exported is not None:
        want = ref.state_dict()
        for key, value in exported.items():
            torch.testing.assert_close(value, want[key], rtol=1e-4, atol=1e-5, msg=lambda m: f"{sync}: {key}: {m}")


@pytest.mark.parametrize("sync", ["exact", "periodic"])
def test_the_collision_state_is_the_global_batchs_across_replica_groups(sync) -> None:
    run_on_ranks(4, _train, sync, timeout=180)
