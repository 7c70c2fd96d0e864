"""How many all-to-alls the first training step of a sharded EBC costs: a regression test for the
collectives a step waits on (docs/benchmarks.md). Data-parallel-only modules keep only the small
agreement all-to-all (a bad batch must still raise on every rank). Later steps send the ids with
the agreement's header, one all-to-all fewer: tests/modular/routing/test_ids_exchange.py."""

from __future__ import annotations

import copy

import pytest
import torch.distributed as dist

import modular
from tests.dist import run_on_ranks
from tests.modular.ebc_cases import make_ebc, plan_for, rank_batches


def _count_all_to_alls(case: str, weighted: bool) -> tuple[int, int]:
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = make_ebc(weighted)
    ebc = modular.shard(copy.deepcopy(ref), plan_for(case, ref, world))
    return _count_all_to_alls_of(ebc, rank_batches(ref, world, 1)[rank])


def _count_all_to_alls_of(ebc, batch) -> tuple[int, int]:
    """All-to-alls in the forward and the backward of one step."""
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
        ("data_parallel", False, (1, 0)),  # agreement only; data-parallel copies sync by all-gathers
        ("table_wise", False, (3, 1)),  # headers, ids, pooled; pooled gradients
        ("mixed", False, (3, 1)),
        ("mixed", True, (3, 1)),  # per-sample weights travel with the ids
    ],
)
def test_all_to_alls_per_step(case: str, weighted: bool, expected: tuple[int, int]) -> None:
    assert run_on_ranks(2, _count_all_to_alls, case, weighted, timeout=100) == [expected, expected]



def _alone(case: str) -> tuple[tuple[int, int], float]:
    """All-to-alls of one step in a world of one, and its output's distance from the EBC's."""
    ref = make_ebc(True)
    ebc = modular.shard(copy.deepcopy(ref), plan_for(case, ref, 1))
    batch = rank_batches(ref, 1, 1)[0]
    counts = _count_all_to_alls_of(ebc, batch)
    return counts, float((ebc(batch).values() - ref(batch).values()).abs().max())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["table_wise", "mixed", "data_parallel"])
def test_a_world_of_one_sends_nothing(case: str) -> None:
    # Each all-to-all would copy a tensor onto itself (on a GPU, a NCCL launch each).
    [(counts, error)] = run_on_ranks(1, _alone, case, timeout=100)
    assert counts == (0, 0)
    assert error <= 1e-5
