"""How many all-to-alls one training step of a sharded EBC costs: a regression test for the
collectives a step waits on (docs/benchmarks.md). Data-parallel-only modules keep only the small
agreement all-to-all (a bad batch must still raise on every rank)."""

from __future__ import annotations

import copy

import pytest
import torch.distributed as dist

import modular
from tests.dist import run_on_ranks
from tests.modular.cases import make_ebc, plan_for, rank_batches


def _count_all_to_alls(case: str, weighted: bool) -> tuple[int, int]:
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = make_ebc(weighted)
    ebc = modular.shard(copy.deepcopy(ref), plan_for(case, ref, world))
    batch = rank_batches(ref, world, 1)[rank]
    calls = {"n": 0}
    original = dist.all_to_all_single

    def counting(*args, **kwargs):
        calls["n"] += 1
        return original(*args, **kwargs)

    dist.all_to_all_single = counting
    try:
        out = ebc(batch).values()
        forward = calls["n"]
        out.sum().backward()
    finally:
        dist.all_to_all_single = original
    return forward, calls["n"] - forward


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "case, weighted, expected",
    [
        ("data_parallel", False, (1, 0)),  # agreement only; replicas sync by all-gathers
        ("table_wise", False, (3, 1)),  # agreement, ids, pooled; pooled gradients
        ("mixed", False, (3, 1)),
        ("mixed", True, (4, 1)),  # + per-sample weights
    ],
)
def test_all_to_alls_per_step(case: str, weighted: bool, expected: tuple[int, int]) -> None:
    assert run_on_ranks(2, _count_all_to_alls, case, weighted, timeout=100) == [expected, expected]
