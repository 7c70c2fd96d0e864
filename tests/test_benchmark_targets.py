"""benchmarks/step_time.py's pure helpers: which cases meet issue 7's ratios, per-thread CPU (no
ranks), the floor's bytes and the devices' peaks (benchmarks/_bandwidth.py); and its one-at-a-time
loop for CUDA on 2 CPU ranks, with torch.cuda's allocator calls stubbed."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from benchmarks import _bandwidth

_PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "step_time.py"
_spec = importlib.util.spec_from_file_location("step_time", _PATH)
step_time = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("step_time", step_time)  # its dataclasses look their module up
_omp = os.environ.get("OMP_NUM_THREADS")
_spec.loader.exec_module(step_time)  # sets OMP_NUM_THREADS for the ranks it would start
if _omp is None:
    os.environ.pop("OMP_NUM_THREADS", None)


def _times(**ms: float) -> dict:
    return {"times": {name: [v / 1e3] * 3 for name, v in ms.items()}, "notes": {}}


def test_target_lines_name_the_cases_that_miss() -> None:
    results = {
        ("tw", "fused"): _times(ours=16, prefetch=14, torchrec=20, floor=9.5, dense=0.5),
        ("cw", "fused"): _times(ours=40, prefetch=38, torchrec=25, floor=14, dense=1),
    }
    lines = step_time._target_lines(SimpleNamespace(world_size=2), results)
    assert lines == [
        "target ours / TorchRec <= 0.8: met by 1 of 2; not by cw/fused 1.60",
        "target ours + prefetch / TorchRec <= 0.8: met by 1 of 2; not by cw/fused 1.52",
        "target ours / (floor + dense) <= 1.5: met by 0 of 2; not by tw/fused 1.60, cw/fused 2.67",
        "target ours + prefetch / (floor + dense) <= 1.5: met by 1 of 2; not by cw/fused 2.53",
    ]


def test_without_torchrec_or_on_other_world_sizes_only_what_applies() -> None:
    results = {("rw", "dense"): _times(ours=40, prefetch=40, floor=60, dense=0.5)}
    assert step_time._target_lines(SimpleNamespace(world_size=3), results) == []
    assert step_time._target_lines(SimpleNamespace(world_size=2), results) == [
        "target ours / (floor + dense) <= 1.5: met by 1 of 1",
        "target ours + prefetch / (floor + dense) <= 1.5: met by 1 of 1",
    ]


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="Linux's per-thread schedstat")
def test_thread_cpu_charges_a_busy_thread_and_names_it() -> None:
    me = threading.get_native_id()
    before = step_time._thread_cpu()
    start = time.thread_time()
    while time.thread_time() - start < 0.03:  # 30 ms of this thread's own CPU
        pass
    after = step_time._thread_cpu()
    used_ms = (after[me][1] - before[me][1]) / 1e6
    assert 25 <= used_ms < 1000, used_ms
    assert after[me][0]  # the thread's name (/proc comm), which --cpu groups threads by


def test_fused_floor_bytes_counts_every_read_and_write_of_the_formula() -> None:
    # Two tables: 10 ids (4 distinct) 8 wide, and 6 ids (6 distinct) 4 wide, over 3 bags each.
    got = _bandwidth.fused_floor_bytes(ids=[10, 6], unique=[4, 6], dims=[8, 4], bags=3)
    first = 10 * 8 * 4 + 3 * 8 * 4 + 3 * 8 * 4 + 2 * 4 * 8 * 4 + 2 * 4 * 4 + 2 * (10 + 3) * 4
    second = 6 * 4 * 4 + 3 * 4 * 4 + 3 * 4 * 4 + 2 * 6 * 4 * 4 + 2 * 6 * 4 + 2 * (6 + 3) * 4
    assert got == first + second == 904 + 504
    # FP16 rows halve what the rows move, and only that.
    half = _bandwidth.fused_floor_bytes(ids=[10], unique=[4], dims=[8], bags=3, weight_bytes=2)
    assert first - half == (10 * 8 + 2 * 4 * 8) * 2


def test_fused_floor_bytes_refuses_counts_that_cannot_be() -> None:
    with pytest.raises(ValueError, match="4 distinct rows among only 3 ids"):
        _bandwidth.fused_floor_bytes(ids=[3], unique=[4], dims=[8], bags=1)
    with pytest.raises(ValueError, match="2 id counts, 1 distinct-row counts, 2 widths"):
        _bandwidth.fused_floor_bytes(ids=[3, 3], unique=[1], dims=[8, 8], bags=1)


def test_ids_per_table_splits_a_tbe_batch_by_table_and_counts_distinct_rows() -> None:
    import torch

    # 2 tables x 2 bags: table 0's bags [5, 5] and [7]; table 1's bags [] and [1, 2, 1].
    values = torch.tensor([5, 5, 7, 1, 2, 1], dtype=torch.int32)
    offsets = torch.tensor([0, 2, 3, 3, 6], dtype=torch.int32)
    assert _bandwidth.ids_per_table(values, offsets, 2) == ([3, 3], [2, 2])
    received = [(values, offsets, None)]
    assert _bandwidth.floor_bytes_per_step(received, [(10, 4), (10, 8)]) == (
        _bandwidth.fused_floor_bytes(ids=[3, 3], unique=[2, 2], dims=[4, 8], bags=2)
    )


def test_peak_bandwidth_knows_the_lent_machines_and_nothing_else() -> None:
    assert _bandwidth.peak_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert _bandwidth.peak_bandwidth("NVIDIA H100 PCIe") == 2.0e12
    assert _bandwidth.peak_bandwidth("NVIDIA H200") == 4.8e12
    assert _bandwidth.peak_bandwidth("NVIDIA A100-SXM4-80GB") == 2.0e12
    assert _bandwidth.peak_bandwidth("NVIDIA A100-SXM4-40GB") is None  # not in the table
    assert _bandwidth.peak_bandwidth("NVIDIA A100 80GB PCIe") == 2.0e12
    assert _bandwidth.peak_bandwidth("NVIDIA GeForce RTX 4090") is None
    line = _bandwidth.bandwidth_line("rw/fused", 6.7e9, 4e-3, "NVIDIA H100 80GB HBM3")
    assert line == (
        "rw/fused: floor moved at least 6.7 GB per step (per rank) in 4.00 ms: 1.675 TB/s; "
        "peak of NVIDIA H100 80GB HBM3: 3.35 TB/s (50% of it)"
    )
    assert _bandwidth.bandwidth_line("rw/fused", 1e9, 1.0, None).endswith("peak of this CPU: unknown")


def test_summary_and_targets_leave_out_a_contender_that_did_not_run(capsys) -> None:
    results = {("dp", "dense"): _times(ours=30, prefetch=28, floor=10)}  # dense part failed
    results[("dp", "dense")]["notes"]["dense"] = "OutOfMemoryError: CUDA out of memory"
    cfg = SimpleNamespace(
        world_size=2, device="cpu", cores=(0, 1), pin=False, tables=2, rows=10, dim=4, batch=2,
        pooling=1, weighted=False, steps=3, blocks=1, cw_statistic="exact",
    )  # fmt: skip
    step_time._print_summary(cfg, results)
    out = capsys.readouterr().out
    assert "| data_parallel | dense | 30.0 | 28.0 | n/a | n/a |" in out
    assert "dense not run: OutOfMemoryError: CUDA out of memory" in out
    assert "target" not in out  # no ratio to the floor + dense part without the dense part


def _contenders_one_at_a_time() -> tuple[dict, dict, list[str]]:
    import torch
    import torch.distributed as dist
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    rank = dist.get_rank()
    kjt = KeyedJaggedTensor(keys=["f0"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 1]))

    def fails_to_build_on_rank_1():
        if rank == 1:
            raise MemoryError("no room for b")
        return lambda _kjt: None

    def fails_to_run_on_rank_0():
        def step(_kjt):
            if rank == 0:
                raise RuntimeError("c broke\nsecond line")
        return step

    builders = {
        "a": lambda: (lambda _kjt: None),
        "b": fails_to_build_on_rank_1,
        "c": fails_to_run_on_rank_0,
        "d": lambda: (lambda _kjt: None),
    }
    cfg = SimpleNamespace(device="cpu", steps=3, blocks=1, warmup=1, profile=None, cpu=False)
    freed = []
    cuda = {n: getattr(torch.cuda, n) for n in ("empty_cache", "reset_peak_memory_stats", "max_memory_allocated")}
    # The CPU stands in for the GPU: what the loop asks of the allocator is recorded instead.
    torch.cuda.empty_cache = lambda: freed.append("empty_cache")
    torch.cuda.reset_peak_memory_stats = lambda: freed.append("reset")
    torch.cuda.max_memory_allocated = lambda: 7
    try:
        notes: dict = {}
        times, peak = step_time._one_at_a_time(cfg, rank, "tw", "fused", builders, [kjt], notes)
    finally:
        for n, f in cuda.items():
            setattr(torch.cuda, n, f)
    return {k: len(v) for k, v in times.items()}, notes, peak, freed


def test_on_a_gpu_a_contender_that_fails_on_one_rank_is_skipped_on_all_and_the_rest_run() -> None:
    from tests.dist import run_on_ranks

    (times0, notes0, peak0, freed0), (times1, notes1, _, _) = run_on_ranks(2, _contenders_one_at_a_time)
    assert times0 == times1 == {"a": 3, "d": 3}
    assert notes0 == {"b": "failed on another rank", "c": "RuntimeError: c broke"}
    assert notes1 == {"b": "MemoryError: no room for b", "c": "failed on another rank"}
    assert peak0 == {"a": 7, "b": 7, "c": 7, "d": 7}  # failed ones too: how far they got
    assert freed0 == ["empty_cache", "reset"] * 4 + ["empty_cache"]  # before each, and after all


def test_planner_time_repeat_reports_how_far_single_rounds_stray(capsys) -> None:
    """benchmarks/planner_time.py --repeat: a configuration measured in rounds is judged on its
    median, and the report counts the rounds that stray beyond 20% of it, round by round
    against the predictions, and names the widest."""
    from benchmarks import planner_time

    cases = planner_time.random_cases(2, seed=3)
    steady, noisy = cases[0].name, cases[1].name
    rounds = {steady: [0.010, 0.010, 0.011], noisy: [0.004, 0.009, 0.004]}
    predictions = {steady: 0.010, noisy: 0.004}
    original = planner_time.predicted
    planner_time.predicted = lambda case, topology: predictions[case.name]
    try:
        planner_time.repeatable(cases, rounds, topology=None)
    finally:
        planner_time.predicted = original
    out = capsys.readouterr().out
    assert "rounds within +-20% of their configuration's median: 5 of 6" in out
    assert "round 1 alone, against the first file's predictions: 2 of 2 within +-20%" in out
    assert "round 2 alone, against the first file's predictions: 1 of 2 within +-20%" in out
    assert f"widest: {noisy} x2.25 (4.0, 9.0, 4.0 ms)" in out
