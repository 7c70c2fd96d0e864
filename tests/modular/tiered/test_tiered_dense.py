"""A DLRM with tiered tables under DDP and FSDP2 on its dense part (Note [tiered tables]): the
same losses, dense weights and tables bit for bit as the same model with every table resident,
at worlds 2 and 3, the row-wise and table-wise tables tiered with caches of 30%, prefetched."""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch
import torch.distributed as dist

import modular
from planners.types import ShardingPlan
from tests.dist import run_on_ranks
from tests.modular.dlrm_cases import DLRM_STEPS, MLP, build_dlrm, dlrm_batch, loss_of, mixed_plan

WRAPS = {
    "fsdp": lambda m: modular.apply_fully_shard(m, modules={MLP}),
    "ddp": modular.apply_ddp,
}


def _tiered(plan: ShardingPlan) -> ShardingPlan:
    places = {
        n: dataclasses.replace(p, cache_load_factor=0.3) if n in ("t_user", "t_item") else p
        for n, p in plan.modules["sparse"].items()
    }  # fmt: skip
    return ShardingPlan(world_size=plan.world_size, modules={"sparse": places})


def _run(wrap: str, tier_dir: str) -> int:
    world, rank = dist.get_world_size(), dist.get_rank()
    models = []
    for tier in (None, tier_dir):
        plan = _tiered(mixed_plan(world)) if tier else mixed_plan(world)
        setup = build_dlrm(plan, WRAPS[wrap], before_shard=_fuse, tier_dir=tier)
        dense = torch.optim.SGD(modular.local_parameters(setup.model), lr=0.1)
        models.append((setup, dense))
    batches = [dlrm_batch(step, rank) for step in range(DLRM_STEPS)]
    tiered_model = models[1][0].model
    modular.prefetch(tiered_model, batches[0].sparse)
    for step in range(DLRM_STEPS):
        if step + 1 < DLRM_STEPS:
            modular.prefetch(tiered_model, batches[step + 1].sparse)
        losses = []
        for i, (setup, dense) in enumerate(models):
            batch = batches[step] if i == 1 else dlrm_batch(step, rank)
            loss = loss_of(setup.forward, batch)
            loss.backward()
            dense.step()
            dense.zero_grad()
            losses.append(loss.detach())
        assert torch.equal(*losses), f"{wrap} step {step}: losses differ"
    stats = modular.tier_stats(tiered_model)
    # caches of a few rows: a prefetch that does not fit beside its step is left to the step
    assert stats and all(s["rows_fetched"] > 0 for s in stats.values()), stats
    ours, theirs = (modular.checkpoint.export(s.model) for s, _ in models)
    if ours is not None:
        for name in theirs:
            assert torch.equal(ours[name], theirs[name]), f"{wrap}: {name} differs"
    del models, tiered_model
    gc.collect()
    return len(stats)


def _fuse(model) -> None:
    modular.fuse_optimizer(model, "exact_adagrad", lr=0.1, eps=1e-3)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("wrap", sorted(WRAPS))
def test_tiered_dlrm_under_ddp_and_fsdp_equals_resident(world, wrap, tmp_path):
    counted = run_on_ranks(world, _run, wrap, str(tmp_path), timeout=180)
    assert max(counted) >= 1
