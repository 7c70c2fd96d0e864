"""CUDA: `python -m planners calibrate --device cuda` measures a GPU job's ranks (issue 51, Note
[calibrating a GPU machine] in modular/measure_device.py).

Skipped where torch sees no CUDA device (CI); scripts/gpu/run.sh's `calibrate` part runs the CLI
at world 1 over NCCL and world 2 over gloo. Here: one quick calibration at world 1 over NCCL,
~1 min (an estimate: never run). Its streaming copy must be the GPU's memory, timed to the
copy's end: an HBM copy of 64 MiB timed without `torch.cuda.synchronize()` would read as a
launch (tens of TB/s), and one on the host as a CPU's (tens of GB/s).
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.timeout(400)
def test_a_quick_calibration_on_one_gpu_over_nccl_measures_the_gpu() -> None:
    from modular.measure import calibrate

    lines: list[str] = []
    cal = calibrate(1, quick=True, device="cuda", say=lines.append)
    assert (cal.device, cal.backend, cal.world_size) == ("cuda", "nccl", 1), cal
    assert any("world 1" in note for note in cal.notes) and "cuda" in cal.versions
    assert 1e11 < cal.stream_bandwidth < 8e12, f"stream copy {cal.stream_bandwidth / 1e9:.0f} GB/s"
    assert all(math.isfinite(getattr(r, p)) for r in cal.kernels.values() for p in r.PARTS)
    assert any(l.startswith("calibrate: world 1, 1 thread(s) per rank, cuda, nccl") for l in lines), lines
    assert "cuda over nccl, world 1" in cal.describe()
