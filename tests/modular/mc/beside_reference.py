"""Training a sharded managed-collision model beside torchrec's unsharded one on the global
batch (tests/modular/test_managed_collisions.py, tests/modular/mc/test_split_checkpoint.py)."""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import modular
from planners.types import ShardingPlan
from tests.modular.ebc_cases import global_batch, placements_for


def step_batches(batch_of: Callable[[int, int], KeyedJaggedTensor], step: int, world: int,
                 rank: int) -> tuple[list[KeyedJaggedTensor], list[int], int]:  # fmt: skip
    """Every rank's batch of `step` (`batch_of(step, r)`), their sample counts, and how many
    samples the ranks before `rank` hold (where its slice of the global batch starts)."""
    batches = [batch_of(step, r) for r in range(world)]
    sizes = [b.stride() for b in batches]
    return batches, sizes, sum(sizes[:rank])


def train_beside_reference(
    model: Optional[nn.Module], ref: nn.Module, opt, ref_opt, *, batch_of: Callable[[int, int], KeyedJaggedTensor],
    width: int, world: int, rank: int, steps: range,
) -> None:  # fmt: skip
    """`steps` of `model.mc` on this rank's batch (`batch_of(step, rank)`; None: the reference
    alone) and of `ref.mc` on every rank's batch in rank order, each loss the pooled outputs
    times one seeded probe of `width` columns (the reference's mean over ranks), then each
    optimizer's step (`opt` None: the model's tables are fused)."""
    for step in steps:
        batches, strides, before = step_batches(batch_of, step, world, rank)
        probe = torch.randn(sum(strides), width, generator=torch.Generator().manual_seed(step))
        if model is not None:
            pooled, _ = model.mc(batches[rank])
            (pooled.values() * probe[before: before + strides[rank]]).sum().backward()
            if opt is not None:
                opt.step()
                opt.zero_grad()
        ref_pooled, _ = ref.mc(global_batch(batches))
        ((ref_pooled.values() * probe).sum() / world).backward()
        ref_opt.step()
        ref_opt.zero_grad()


def assert_same_collision_state(model: nn.Module, ref: nn.Module, label: str) -> None:
    """`model.mc`'s collision state_dict holds `ref.mc`'s keys and values exactly."""
    mine, theirs = model.mc._managed_collision_collection.state_dict(), ref.mc._managed_collision_collection.state_dict()
    assert mine.keys() == theirs.keys(), label
    differ = [k for k in theirs if not torch.equal(mine[k], theirs[k])]
    assert not differ, f"{label}: collision state differs in {differ}"


def shard_mc(model: nn.Module, kind: str) -> nn.Module:
    """`model` with its MC-EBC's inner collection sharded `kind` (ebc_cases' placements) over
    the world."""
    world = dist.get_world_size()
    modular.shard(model, ShardingPlan(world_size=world, modules={
        "mc._embedding_module": placements_for(kind, model.mc._embedding_module, world)}))  # fmt: skip
    return model


def assert_remapped_slice(remapped, ref_remapped, before: int, label: str) -> None:
    """This rank's remapped ids (a KJT) are its slice of the global batch's (`ref_remapped`),
    whose first `before` samples are the earlier ranks'."""
    for key in remapped.keys():
        start = int(ref_remapped[key].lengths()[:before].sum())
        n = int(remapped[key].lengths().sum())
        assert torch.equal(remapped[key].values(), ref_remapped[key].values()[start : start + n]), f"{label}: {key}"
