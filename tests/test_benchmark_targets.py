"""benchmarks/step_time.py's pure helpers: which cases meet issue 7's ratios, per-thread CPU (no ranks)."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys
import threading
import time
from types import SimpleNamespace

import pytest

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
