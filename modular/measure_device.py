"""Where `python -m modular.measure` measures: the device and backend of its ranks (Note
[calibrated prices] in planners/calibration.py, "On CUDA" below).

Note [calibrating a GPU machine]
`calibrate --device cuda` measures what a CUDA job runs: each rank on GPU `rank % GPUs`, its
tables, batches and steps there, every timed step ended with `torch.cuda.synchronize()` (a
step's time includes the GPU's work, not only the launches), its collectives over the chosen
backend with tensors on the backend's device (`collective_device` in modular/comm.py: the GPU
under NCCL, host memory under gloo, as modular's own collectives move them). The backend is
NCCL when there are at least as many GPUs as ranks, else gloo with the ranks sharing the GPUs
(NCCL refuses two ranks on one GPU): such a file prices gloo's host round trips, not NCCL's
wire, and says so in its notes. World 1 is allowed on CUDA (one GPU over NCCL): its
"collectives" have no peer, so the file notes that their figures are a rank's own.
The kernel families are measured as the planner prices them (planners/cost.py `family`):
"fused" is row-wise Adagrad (fbgemm's CUDA kernel; its column pieces and data-parallel copies
take the torch emulation off CPU, which the probes' fitted factors take in), "emulated" is what
the planner prices the Adam family with (on CUDA fbgemm's own Adam kernel, not the emulation),
"dense" torch SGD over the dense kernel's gradients.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable, Optional

__all__ = ["check", "collective_device", "device", "init_rank", "interleaved", "median_seconds", "notes",
           "slowest", "sync"]

_HERE: dict = {}  # this rank process's device and backend (`init_rank`)


def check(device: str, backend: Optional[str], world: int, gpus: Optional[int] = None) -> str:
    """The backend `device`'s ranks run (given, or the default), or a ValueError that says what
    is wrong and what to do, before any rank starts; `gpus`: the CUDA devices (None: as torch
    sees them here)."""
    if device == "cpu":
        if backend not in (None, "gloo"):
            raise ValueError(f"calibrate --device cpu runs gloo, not --backend {backend}")
        return "gloo"
    if device != "cuda":
        raise ValueError(f"calibrate --device must be cpu or cuda, got {device!r}")
    if backend not in (None, "nccl", "gloo"):
        raise ValueError(f"calibrate --backend must be nccl or gloo, got {backend!r}")
    import torch

    if gpus is None:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        raise ValueError("calibrate --device cuda: torch sees no CUDA device here (torch "
                         f"{torch.__version__}, CUDA {torch.version.cuda}); calibrate on the GPU "
                         "machine, or use --device cpu")  # fmt: skip
    if backend == "nccl" and world > gpus:
        raise ValueError(f"calibrate --device cuda --backend nccl --world-size {world}: this machine "
                         f"has {gpus} CUDA device(s) and NCCL needs one per rank; use --backend gloo "
                         f"(the ranks share the GPUs) or --world-size {gpus}")  # fmt: skip
    return backend or ("nccl" if gpus >= world else "gloo")


def init_rank(rank: int, world: int, port: int, device_type: str, backend: str) -> None:
    """This rank's process group (and GPU), as `check` chose them."""
    import torch
    import torch.distributed as dist

    init = dict(init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    if device_type == "cpu":
        dist.init_process_group("gloo", **init)
        _HERE.clear()
        return
    gpu = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(gpu)
    if backend == "nccl":
        dist.init_process_group("nccl", device_id=gpu, **init)
    else:
        dist.init_process_group("gloo", **init)
    _HERE.update(device=gpu, backend=backend)


def device():
    """The device this rank's tables and batches live on; None on CPU (modular's default)."""
    return _HERE.get("device")


def collective_device():
    """The device of the tensors this rank's collectives take: the GPU under NCCL, else the CPU."""
    import torch

    return _HERE["device"] if _HERE.get("backend") == "nccl" else torch.device("cpu")


def sync() -> None:
    """Waits for this rank's GPU work (a timed step includes it); nothing on CPU."""
    if _HERE:
        import torch

        torch.cuda.synchronize()


def notes(device_type: str, backend: str, world: int) -> tuple[str, ...]:
    """What a file measured on `device_type` says beside its numbers (Note [calibrating a GPU
    machine]); none on CPU."""
    if device_type == "cpu":
        return ()
    import torch

    gpus, name = torch.cuda.device_count(), torch.cuda.get_device_name()
    out = [f"{world} rank(s) on {min(world, gpus)} x {name} over {backend}"]
    if backend == "gloo":
        out.append("collectives over gloo move CUDA tensors through host memory: their latency and "
                   "bandwidth are gloo's, not NCCL's; calibrate with --backend nccl on one GPU per "
                   "rank for a job that runs NCCL")  # fmt: skip
    if world == 1:
        out.append("world 1: the collectives have no peer, so their latency and bandwidth are a "
                   "rank's own copy, not a peer's; calibrate at --world-size >= 2 to price them")  # fmt: skip
    if world > gpus:
        out.append(f"{world} ranks share {gpus} GPU(s): each kernel's rate is the shared GPU's")
    out.append("kernel families as the planner prices them: 'emulated' is the Adam family (fbgemm's "
               "CUDA Adam kernel here, not the emulation); column pieces under row-wise Adagrad take "
               "the torch emulation on CUDA and are priced at the 'fused' rates, as the probes' "
               "fitted factors left them; data-parallel copies take it too, at their own fitted "
               "'*_dp' rates")  # fmt: skip
    if os.environ.get("CUDA_VISIBLE_DEVICES"):
        out.append(f"CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']}")
    return tuple(out)


def median_seconds(step: Callable[[int], None], n: int, warmup: int = 3) -> float:
    """`step`'s median seconds over `n` calls after `warmup`, each ended on the GPU (`sync`)."""
    for i in range(warmup):
        step(i)
    times = []
    for i in range(n):
        sync()
        t0 = time.perf_counter()
        step(i)
        sync()  # the GPU's work is the step's (nothing on CPU)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def slowest(seconds: float) -> float:
    """The slowest rank's figure (a step waits for it)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64, device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def interleaved(steps: dict, n: int, rounds: int = 3, warmup: int = 3) -> dict:
    """Each step's median seconds over `rounds` blocks of `n` calls, the blocks taken in turn
    (A B C A B C ...): a slow minute of the machine falls on every step alike, not on one."""
    times: dict = {k: [] for k in steps}
    for k, step in steps.items():
        for i in range(warmup):
            step(i)
    for _ in range(rounds):
        for k, step in steps.items():
            for i in range(n):
                sync()
                t0 = time.perf_counter()
                step(i)
                sync()
                times[k].append(time.perf_counter() - t0)
    return {k: slowest(statistics.median(v)) for k, v in times.items()}
