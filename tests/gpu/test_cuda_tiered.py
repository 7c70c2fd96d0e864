"""CUDA: tiered tables, a cache on the GPU over pinned host memory (Note [tiered tables]), train
like the same tables resident on the GPU.

Skipped where torch sees no CUDA device. Written in a session without one (issue 47) and not yet
run on a GPU: the CUDA tier is off unless MODULAR_CUDA_TIERS=1 (modular/tiered/tier_plan.py),
which this file sets; `bash scripts/gpu/run.sh tiered` runs it. `MODULAR_GPU_TEST_DEVICE=cpu`
runs the same bodies on CPU gloo ranks (the tier's files under a temporary directory).

Each world size runs in fresh spawned ranks (tests/gpu/test_cuda.py's `run_spawned`: NCCL with
one GPU per rank where there are enough GPUs, else gloo on GPU 0). Per case, two models of one
seed and plan, one tiered with small caches, train side by side on the same Zipf batches
(tests/modular/tiered/test_tiered_training.py's tables and plans), prefetched or not: outputs
every step, then weights and fused state through `state_dict()`, within ATOL (fbgemm's CUDA
backward sorts a step's ids, which renumbering to slots reorders), and prefetched steps miss
nothing.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

import modular
from planners.types import ShardingPlan
from tests.gpu.test_cuda import DEVICE_KIND, run_spawned
from tests.modular.tiered.test_tiered_training import Case, _locals, batch, make_ebc, placements

pytestmark = pytest.mark.skipif(
    DEVICE_KIND == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device"
)
os.environ["MODULAR_CUDA_TIERS"] = "1"  # the spawned ranks inherit it
ATOL, STEPS = 1e-5, 6
CASES = [
    Case("rw", "exact_rowwise_adagrad", 0.05, prefetch=True),
    Case("tw", "exact_adagrad", 0.02, "lfu"),
    Case("twrw", "exact_sgd", 0.1),
    Case("cw", "exact_rowwise_adagrad", 0.05, statistic="per_shard", prefetch=True),
    Case("rw", "adam", 0.05),
]


def _build(case: Case, device: torch.device, tiered: bool, tier_dir: str):
    world = dist.get_world_size()
    ebc = make_ebc()
    extra = {"column_wise_statistic": case.statistic} if case.statistic != "exact" else {}
    opt = modular.fuse_optimizer(ebc, case.optimizer, lr=0.05, eps=1e-3, **extra)
    places = placements(case.plan, world)
    if tiered:
        places = {n: dataclasses.replace(p, cache_load_factor=case.factor, cache_policy=case.policy)
                  for n, p in places.items()}  # fmt: skip
    plan = ShardingPlan(world_size=world, modules={"": places})
    return modular.shard(ebc, plan, device=device, tier_dir=tier_dir if tiered else None), opt


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> float:
    torch.testing.assert_close(a.float().cpu(), b.float().cpu(), atol=ATOL, rtol=0, msg=lambda m: f"{what}: {m}")
    return float((a.float().cpu() - b.float().cpu()).abs().max()) if a.numel() else 0.0


def _cases(device: torch.device) -> dict:
    rank, worst = dist.get_rank(), {}
    with tempfile.TemporaryDirectory() as tier_dir:
        for case in CASES:
            resident, ropt = _build(case, device, False, tier_dir)
            tiered, topt = _build(case, device, True, tier_dir)
            batches = [batch(step, rank).to(device) for step in range(STEPS)]
            if case.prefetch:
                modular.prefetch(tiered, batches[0])
            err, misses = 0.0, []
            for step in range(STEPS):
                if case.prefetch and step + 1 < STEPS:
                    modular.prefetch(tiered, batches[step + 1])
                a = resident(batch(step, rank).to(device)).values()
                b = tiered(batches[step]).values()
                misses.append(sum(s["misses"] for s in modular.tier_stats(tiered).values()))
                err = max(err, _close(a, b, f"{case} step {step} output"))
                target = torch.randn(a.shape, generator=torch.Generator().manual_seed(step)).to(device)
                (a * target).sum().backward()
                (b * target).sum().backward()
                ropt.step()
                topt.step()
            for (name, x), (_, y) in zip(resident.state_dict().items(), tiered.state_dict().items()):
                for u, v in zip(_locals(x), _locals(y)):
                    err = max(err, _close(u, v, f"{case} {name}"))
            rstate, tstate = ropt.state_dict()["state"], topt.state_dict()["state"]
            for name in rstate:
                for key in rstate[name]:
                    for u, v in zip(_locals(rstate[name][key]), _locals(tstate[name][key])):
                        err = max(err, _close(u, v, f"{case} {name} {key}"))
            if case.prefetch:
                assert sum(misses) == 0, (case, misses)
            worst[repr(case)] = err
            del resident, tiered, ropt, topt
            gc.collect()
    return worst


@pytest.mark.parametrize("world", [1, 2])
def test_tiered_tables_on_the_device_train_like_resident_ones(world: int) -> None:
    results = run_spawned(world, _cases)
    print({w: r for w, r in enumerate(results)})  # the largest differences, for docs/gpu.md
