"""Issue 51 on a GPU machine: `python -m planners calibrate --device cuda [--backend nccl|gloo]`
(Note [calibrating a GPU machine] in modular/measure_device.py). Here, without a GPU: the choice
of backend and its errors (before any rank starts), the CLI's flags, and that the device, the
backend and the notes reach the topology file and what the CLI prints. The measuring on CUDA
runs in scripts/gpu/run.sh's `calibrate` part and tests/gpu/test_cuda_calibrate.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import planners
from modular.measure_device import check
from planners.__main__ import main
from planners.calibration import Calibration, KernelRate

RATE = KernelRate(per_id=10e-9, per_id_byte=0.2e-9, per_bag_column=1e-9)


def _calibration(**changes) -> Calibration:
    fields = dict(kernels={f: RATE for f in ("fused", "emulated", "dense")}, all_to_all_latency=50e-6,
                  all_to_all_bandwidth=20e9, all_reduce_latency=60e-6, all_reduce_bandwidth=20e9,
                  stream_bandwidth=2e12, step_fixed=1e-3, kernel_fixed=1e-4, world_size=1,
                  threads_per_rank=1, backend="nccl", device="cuda", host="gpu-host",
                  measured_at=__import__("time").time() - 3600)  # fmt: skip
    return Calibration(**{**fields, **changes})


@pytest.mark.parametrize("device,backend,world,gpus,want", [
    ("cpu", None, 2, 0, "gloo"), ("cpu", "gloo", 3, 0, "gloo"),
    ("cuda", None, 1, 1, "nccl"), ("cuda", None, 2, 2, "nccl"), ("cuda", None, 2, 1, "gloo"),
    ("cuda", "gloo", 2, 8, "gloo"), ("cuda", "nccl", 2, 2, "nccl"),
])  # fmt: skip
def test_the_backend_is_nccl_with_a_gpu_per_rank_else_gloo(device, backend, world, gpus, want) -> None:
    assert check(device, backend, world, gpus=gpus) == want


@pytest.mark.parametrize("device,backend,world,gpus,words", [
    ("cuda", "nccl", 2, 1, ["--backend nccl --world-size 2", "1 CUDA device(s)", "one per rank",
                            "use --backend gloo", "--world-size 1"]),
    ("cuda", None, 2, 0, ["--device cuda", "no CUDA device", "--device cpu"]),
    ("cpu", "nccl", 2, 0, ["--device cpu runs gloo"]),
    ("tpu", None, 2, 0, ["must be cpu or cuda"]),
])  # fmt: skip
def test_a_backend_the_machine_cannot_run_says_why_and_what_to_do(device, backend, world, gpus, words) -> None:
    with pytest.raises(ValueError) as e:
        check(device, backend, world, gpus=gpus)
    assert all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has a CUDA device")
def test_calibrate_on_cuda_without_one_fails_before_any_rank(tmp_path: Path, capsys) -> None:
    out = tmp_path / "g.json"
    from modular.measure import calibrate

    with pytest.raises(ValueError, match="no CUDA device"):
        calibrate(1, device="cuda", say=lambda line: pytest.fail(f"a rank started: {line}"))
    assert main(["calibrate", "--out", str(out), "--device", "cuda", "--world-size", "1"]) == 2
    err = capsys.readouterr().err
    assert "calibrate failed (exit 2)" in err and "torch sees no CUDA device here" in err
    assert not out.exists()


def test_the_cli_refuses_what_calibrate_cannot_measure(tmp_path: Path, capsys) -> None:
    out = str(tmp_path / "c.json")
    assert main(["calibrate", "--out", out, "--backend", "nccl"]) == 2
    assert "--backend nccl needs --device cuda" in capsys.readouterr().err
    assert main(["calibrate", "--out", out, "--world-size", "1"]) == 2  # CPU: a peer to measure
    assert "--world-size >= 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["calibrate", "--out", out, "--device", "cuda", "--backend", "mpi"])
    assert "invalid choice: 'mpi'" in capsys.readouterr().err


def test_device_backend_and_notes_reach_the_file_and_what_the_cli_prints(tmp_path: Path, capsys) -> None:
    path = tmp_path / "g.json"
    notes = ("2 rank(s) on 1 x NVIDIA H200 over gloo", "collectives over gloo ...")
    _calibration(backend="gloo", world_size=2, notes=notes).save(path)
    assert json.loads(path.read_text())["notes"] == list(notes)
    cal = planners.Topology.from_file(str(path)).calibration
    assert cal is not None and (cal.device, cal.backend, cal.notes) == ("cuda", "gloo", notes)
    line = cal.describe()
    assert "measured on gpu-host, cuda over gloo, world 2" in line and "2 rank(s) on 1 x NVIDIA H200" in line
    tables = tmp_path / "t.yaml"
    tables.write_text("- {name: a, num_embeddings: 1000, embedding_dim: 16, pooling_factor: 3}\n")
    assert main(["plan", str(tables), "--world-size", "2", "--batch-size", "64", "--topology", str(path)]) == 0
    assert "cuda over gloo, world 2" in capsys.readouterr().out
    cpu = tmp_path / "c.json"  # a CPU file's fields stay as they were: no notes
    _calibration(backend="gloo", device="cpu").save(cpu)
    assert "notes" not in json.loads(cpu.read_text())
    assert "measured on gpu-host, gloo, world 1" in Calibration.load(cpu).describe()
