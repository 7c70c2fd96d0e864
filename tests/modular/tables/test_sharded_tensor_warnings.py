"""Note [ShardedTensor warnings]: modular's own work on ShardedTensor tables prints no
deprecation warning; a user's own op on one still does."""

from __future__ import annotations

import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor

import modular
from planners.types import ShardingPlan
from tests.dist import run_on_ranks
from tests.modular import checkpoint_cases as H

DEPRECATED = "Please use DTensor instead"


def _lifecycle(path: str) -> tuple[list[str], int]:
    """Everything a training script does with ShardedTensor tables, under a recorder that sees
    every warning; returns the deprecation warnings modular let through, and how many the
    user's own `.detach()` on a table raised."""
    world = dist.get_world_size()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = H.sharded_checkpoint_model("A", seed=1)
        dense = torch.optim.Adagrad(modular.local_parameters(model), lr=0.1)
        H.train_checkpoint_model(model, dense, range(2))
        modular.clip_grad_norm_(model, 1.0)
        modular.checkpoint.save(path, model, dense)
        model.load_state_dict(model.state_dict())
        other = H.sharded_checkpoint_model("B", seed=2)
        other_dense = torch.optim.Adagrad(modular.local_parameters(other), lr=0.1)
        H.train_checkpoint_model(other, other_dense, range(1))
        modular.checkpoint.load(path, other, other_dense)
        modular.checkpoint.export(other)
        modular.checkpoint.load_unsharded(other, H.build_checkpoint_model(3).state_dict())
        with modular.unshard(other, rank0_only=True):
            pass
        fused = H.build_checkpoint_model(4)
        tables = modular.fuse_optimizer(fused, "exact_rowwise_adagrad", lr=0.1)
        plan = ShardingPlan(world_size=world, modules={"ebc": H.checkpoint_placements("C", world)})
        fused = modular.shard(fused, plan)
        dense = torch.optim.Adam(modular.local_parameters(fused), lr=0.01)
        both = modular.CombinedOptimizer({"tables": tables, "dense": dense})
        H.train_checkpoint_model(fused, both, range(2))
        both.load_state_dict(both.state_dict())
        modular.checkpoint.save(path + "_fused", fused, both)
        modular.checkpoint.load(path + "_fused", fused, both)
        ours = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if DEPRECATED in str(w.message)]
        caught.clear()
        sharded = [p for p in model.parameters() if isinstance(p, ShardedTensor)]
        sharded[0].detach()  # the user's own op
        theirs = sum(DEPRECATED in str(w.message) for w in caught)
    return ours, theirs


@pytest.mark.timeout(120)
def test_no_sharded_tensor_warning_from_modular_but_the_users_own_ops_warn() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        results = run_on_ranks(3, _lifecycle, f"{tmp}/ckpt", timeout=100)
    for rank, (ours, theirs) in enumerate(results):
        assert ours == [], f"rank {rank}: {len(ours)} warnings from modular:\n" + "\n".join(ours)
        assert theirs == 1, f"rank {rank}: the user's own ShardedTensor op warned {theirs} times"
