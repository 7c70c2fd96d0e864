"""Tests of the multi-process harness itself (tests/dist.py)."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.dist import RankError, expect_errors_on_all_ranks, run_on_ranks, spawn_ranks


# Rank bodies: module-level so that the ranks can unpickle them by reference.


def _rank_sum() -> tuple[int, int, float, int]:
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    return dist.get_rank(), dist.get_world_size(), total.item(), os.getpid()


def _scaled(values: torch.Tensor, *, factor: float) -> torch.Tensor:
    return values * factor * (dist.get_rank() + 1)


def _fail_on_rank_1() -> int:
    if dist.get_rank() == 1:
        raise ValueError("table 'ads_id' has no shard on rank 1")
    return dist.get_rank()


def _fail_on_every_rank() -> None:
    raise ValueError(f"feature 'user_id' is missing on rank {dist.get_rank()}")


def _rank_0_waits_alone() -> int:
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))
    return dist.get_rank()


def _rank_1_fails_while_rank_0_waits() -> None:
    if dist.get_rank() == 1:
        raise KeyError("rank 1 gave up")
    dist.all_reduce(torch.ones(1))


def _rank_1_exits() -> None:
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()


def _print_and_return_rank() -> int:
    print(f"hello from rank {dist.get_rank()}")
    return dist.get_rank()


def _return_lambda() -> Any:
    return lambda: None


def _subgroup_count_after_new_group() -> int:
    dist.new_group(ranks=[0, 1])
    return len(dist.distributed_c10d._world.pg_map)


def _env_and_preload(name: str) -> tuple[str | None, int, bool]:
    return os.environ.get(name), dist.get_world_size(), "torchrec" in sys.modules


def _sleep_on_rank_0(seconds: float) -> int:
    if dist.get_rank() == 0:
        time.sleep(seconds)
    return dist.get_rank()


# Pooled ranks


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_results_are_ordered_by_rank(world_size: int) -> None:
    results = run_on_ranks(world_size, _rank_sum)
    expected_sum = float(sum(range(world_size)))
    assert [r[:3] for r in results] == [(rank, world_size, expected_sum) for rank in range(world_size)]
    pids = {r[3] for r in results}
    assert len(pids) == world_size and os.getpid() not in pids
    assert run_on_ranks(world_size, _rank_sum) == results  # same pool, same processes


def test_args_kwargs_and_tensors_round_trip() -> None:
    results = run_on_ranks(3, _scaled, torch.arange(4.0), factor=0.5)
    for rank, result in enumerate(results):
        torch.testing.assert_close(result, torch.arange(4.0) * 0.5 * (rank + 1))


def test_error_on_one_rank_names_it_and_pool_survives() -> None:
    before = run_on_ranks(2, _rank_sum)
    with pytest.raises(RankError, match=r"failed on ranks \[1\][\s\S]*rank 1: ValueError: table 'ads_id' has no shard on rank 1") as info:
        run_on_ranks(2, _fail_on_rank_1)
    assert list(info.value.errors) == [1]
    exc_type, message, tb = info.value.errors[1]
    assert (exc_type, message) == ("ValueError", "table 'ads_id' has no shard on rank 1")
    assert "_fail_on_rank_1" in tb
    assert run_on_ranks(2, _rank_sum) == before  # healthy, so the same processes serve the next call


def test_expect_errors_on_all_ranks() -> None:
    assert expect_errors_on_all_ranks(3, _fail_on_every_rank) == [f"feature 'user_id' is missing on rank {rank}" for rank in range(3)]
    with pytest.raises(AssertionError, match=r"ranks \[0\] did not"):
        expect_errors_on_all_ranks(2, _fail_on_rank_1)


def test_hang_times_out_with_stack_and_next_call_gets_fresh_pool() -> None:
    before = run_on_ranks(2, _rank_sum)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"_rank_0_waits_alone\) timed out after 2 s: ranks \[0\] had not answered \(ranks \[1\] had\)") as info:
        run_on_ranks(2, _rank_0_waits_alone, timeout=2.0)
    assert time.monotonic() - start < 8.0
    assert "in _rank_0_waits_alone" in str(info.value)  # rank 0's dumped stack shows where it hung
    after = run_on_ranks(2, _rank_sum)
    assert [r[:3] for r in after] == [r[:3] for r in before]
    assert {r[3] for r in after}.isdisjoint(r[3] for r in before)


def test_error_while_peer_waits_fails_fast() -> None:
    start = time.monotonic()
    with pytest.raises(RankError, match=r"failed on ranks \[1\]; ranks \[0\] were still running") as info:
        run_on_ranks(2, _rank_1_fails_while_rank_0_waits, timeout=60.0)
    assert time.monotonic() - start < 10.0  # the settle time, not the 60 s timeout
    assert info.value.errors[1][:2] == ("KeyError", "'rank 1 gave up'")
    assert [r[:3] for r in run_on_ranks(2, _rank_sum)] == [(0, 2, 1.0), (1, 2, 1.0)]


def test_dead_rank_is_reported_promptly_with_exit_code() -> None:
    start = time.monotonic()
    with pytest.raises(RankError, match=r"rank 1: RankDied: rank 1 exited with exit code 3"):
        run_on_ranks(2, _rank_1_exits)
    assert time.monotonic() - start < 10.0  # not the 60 s collective timeout
    assert [r[:3] for r in run_on_ranks(2, _rank_sum)] == [(0, 2, 1.0), (1, 2, 1.0)]


def test_rank_output_is_replayed_on_the_test_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_on_ranks(2, _print_and_return_rank) == [0, 1]
    out = capsys.readouterr().out
    assert "----- rank 1 output -----\nhello from rank 1\n" in out
    assert "hello from rank 0" in out


def test_unpicklable_result_is_a_rank_error() -> None:
    with pytest.raises(RankError, match=r"rank 0: .*cannot pickle the return value of tests\.test_dist_harness\._return_lambda"):
        run_on_ranks(1, _return_lambda)
    assert run_on_ranks(1, _rank_sum)[0][:3] == (0, 1, 0.0)


def test_process_groups_made_by_a_call_do_not_leak_into_the_next() -> None:
    first = run_on_ranks(2, _subgroup_count_after_new_group)
    assert run_on_ranks(2, _subgroup_count_after_new_group) == first == [2, 2]  # WORLD + one subgroup


# Fresh ranks


def test_spawn_ranks_applies_env_in_preloaded_forks() -> None:
    outcomes = spawn_ranks(2, _env_and_preload, "MODULAR_TEST_MARKER", env={"MODULAR_TEST_MARKER": "on"}, timeout=60.0)
    assert [(o.rank, o.result, o.error, o.exitcode, o.timed_out) for o in outcomes] == [
        (0, ("on", 2, True), None, 0, False),
        (1, ("on", 2, True), None, 0, False),
    ]


def test_spawn_ranks_fresh_interpreter_does_not_preload() -> None:
    (outcome,) = spawn_ranks(1, _env_and_preload, "MODULAR_TEST_MARKER", env={"MODULAR_TEST_MARKER": "fresh"}, fresh_interpreter=True, timeout=60.0)
    assert (outcome.result, outcome.exitcode) == (("fresh", 1, False), 0)


def test_spawn_ranks_reports_death_and_peer_error() -> None:
    outcomes = spawn_ranks(2, _rank_1_exits, timeout=30.0)
    assert (outcomes[1].exitcode, outcomes[1].error) == (3, None)
    assert outcomes[0].error is not None and outcomes[0].exitcode == 0 and not outcomes[0].timed_out


def test_spawn_ranks_kills_ranks_at_timeout() -> None:
    start = time.monotonic()
    outcomes = spawn_ranks(2, _sleep_on_rank_0, 600.0, timeout=3.0)
    assert time.monotonic() - start < 6.0
    assert [(o.result, o.exitcode, o.timed_out) for o in outcomes] == [(None, -9, True), (1, 0, False)]
    assert "in _sleep_on_rank_0" in outcomes[0].output  # its stack at the timeout
