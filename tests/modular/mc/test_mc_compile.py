"""A compiled module that holds a managed-collision EBC (`modular.apply_compile` on a tower around
it): the collision collection runs eagerly, one deliberate graph break per call (Note [compiling a
sharded model] in modular/compose/compile.py), and the model trains as torchrec's unsharded one
on the global batch. Compiled into, it crashed inside inductor."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import modular
from tests.dist import run_on_ranks
from tests.modular.compare import assert_weights_match
from tests.modular.ebc_cases import global_batch
from tests.modular.mc.beside_reference import (
    assert_remapped_slice, assert_same_collision_state, shard_mc, step_batches,
)  # fmt: skip
from tests.modular.mc.test_split_state import _batch, _model

SPECS = {"t_a": ("distance_lfu", 1, 40), "t_b": ("lru", 2, 24)}
LR, STEPS = 0.3, 4


class Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _model(SPECS)
        self.mlp = nn.Linear(3 * 4, 1)

    def forward(self, kjt):
        pooled, remapped = self.inner.mc(kjt)
        return self.mlp(pooled.values()).view(-1), remapped


class Root(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tower = Tower()

    def forward(self, kjt):
        return self.tower(kjt)


def _train() -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    model, ref = Root(), Root()
    shard_mc(model.tower.inner, "row_wise")
    modular.apply_compile(model, modules={Tower})
    opt = torch.optim.SGD(list(modular.local_parameters(model)), lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for step in range(STEPS):
        batches, size, before = step_batches(_batch, step, world, rank)
        out, remapped = model(batches[rank])
        ref_out, ref_remapped = ref(global_batch(batches))
        label = f"rank {rank} step {step}"
        torch.testing.assert_close(out, ref_out[before : before + size[rank]], rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{label}: outputs: {m}")  # fmt: skip
        assert_remapped_slice(remapped, ref_remapped, before, label)
        target = torch.randn(sum(size), generator=torch.Generator().manual_seed(step))
        (((out - target[before : before + size[rank]]) ** 2).sum() / sum(size) * world).backward()
        (((ref_out - target) ** 2).sum() / sum(size)).backward()
        # the dense part is replicated, not DDP'd: average its gradients as DDP would
        for p in model.tower.mlp.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        assert_same_collision_state(model.tower.inner, ref.tower.inner, label)
    assert_weights_match(model, ref, f"rank {rank}: trained")


def test_a_compiled_tower_around_an_mc_ebc_trains_as_the_unsharded_model() -> None:
    run_on_ranks(2, _train, timeout=240)
