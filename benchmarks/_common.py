"""What the benchmarks share: the synthetic workload of issue 7 (tables, plans, batches, its
command-line flags) and the timing helpers.

Used by benchmarks/step_time.py and benchmarks/input_checks.py (and scripts/gpu/host_syncs.py),
so that both time the same tables, plans and batches; each benchmark's config is a `Workload`.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "PLANS", "Model", "Workload", "add_workload_args", "make_batches", "make_ebc",
    "max_over_ranks", "our_plan", "status_kib", "time_block", "workload_fields",
]  # fmt: skip

PLANS = {
    "tw": "table_wise", "rw": "row_wise", "cw": "column_wise", "dp": "data_parallel",
    # A quarter of the tables column-wise over every rank, the rest table-wise: the shape of
    # planned plans (the example's DLRM on 4 and 8 ranks puts one column piece beside whole
    # tables on each rank).
    "mix": "mixed",
}  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    """The config fields every workload benchmark has: what it runs and how long it times it.
    A benchmark's own config subclasses it (kw_only=True too) with its own fields."""

    tables: int
    rows: int
    dim: int
    batch: int  # samples per rank
    pooling: int  # ids per bag
    world_size: int
    plans: tuple[str, ...]
    steps: int  # timed steps per contender and case
    blocks: int  # alternating blocks the steps are split in
    warmup: int
    weighted: bool = False  # a per-sample weight on every id (an EBC with is_weighted=True)


def workload_fields(args: argparse.Namespace) -> dict:
    """`Workload`'s fields from parsed `add_workload_args` flags (and --steps, --blocks,
    --warmup, which each benchmark defines with its own defaults)."""
    return dict(
        tables=args.tables, rows=args.rows, dim=args.dim, batch=args.batch, pooling=args.pooling,
        world_size=args.world_size, plans=tuple(args.plans), steps=args.steps,
        blocks=args.blocks, warmup=args.warmup,
    )  # fmt: skip


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The workload flags (issue 7's default config)."""
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1024, help="samples per rank")
    p.add_argument("--pooling", type=int, default=20, help="ids per bag")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--plans", nargs="+", choices=sorted(PLANS), default=["tw", "rw", "cw", "dp"])


class Model(nn.Module):
    """A bare EBC under the FQN "ebc" (so both frameworks get the same plan key)."""

    def __init__(self, ebc: nn.Module) -> None:
        super().__init__()
        self.ebc = ebc

    def forward(self, kjt):
        return self.ebc(kjt).values()


def make_ebc(cfg: Workload):
    """`cfg.tables` SUM tables t0, t1, ... of `cfg.rows` x `cfg.dim`, one feature each (f0, ...)."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    tables = [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=cfg.dim, num_embeddings=cfg.rows,
            feature_names=[f"f{i}"], pooling=PoolingType.SUM,
        )
        for i in range(cfg.tables)
    ]  # fmt: skip
    return EmbeddingBagCollection(tables=tables, is_weighted=cfg.weighted)


def our_plan(cfg: Workload, plan: str):
    """The `modular` plan of `PLANS[plan]` for the `Model` of `make_ebc(cfg)`."""
    from planners.types import ShardingPlan, ShardingType, TablePlacement

    placements = {}
    if plan == "mix":
        for i in range(cfg.tables):
            if i < max(1, cfg.tables // 4):
                placements[f"t{i}"] = TablePlacement(
                    ShardingType.COLUMN_WISE, ranks=tuple(range(cfg.world_size))
                )
            else:
                placements[f"t{i}"] = TablePlacement(
                    ShardingType.TABLE_WISE, ranks=(i % cfg.world_size,)
                )
        return ShardingPlan(world_size=cfg.world_size, modules={"ebc": placements})
    kind = ShardingType.parse(PLANS[plan])
    for i in range(cfg.tables):
        if kind is ShardingType.TABLE_WISE:
            placements[f"t{i}"] = TablePlacement(kind, ranks=(i % cfg.world_size,))
        elif kind is ShardingType.DATA_PARALLEL:
            placements[f"t{i}"] = TablePlacement(kind)
        else:
            placements[f"t{i}"] = TablePlacement(kind, ranks=tuple(range(cfg.world_size)))
    return ShardingPlan(world_size=cfg.world_size, modules={"ebc": placements})


def make_batches(cfg: Workload, rank: int, n: int = 4):
    """`n` batches of this rank: `cfg.batch` bags per feature of exactly `cfg.pooling` ids."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = torch.Generator().manual_seed(1234 + rank)
    out = []
    for _ in range(n):
        lengths = torch.full((cfg.tables * cfg.batch,), cfg.pooling, dtype=torch.int64)
        values = torch.randint(0, cfg.rows, (int(lengths.sum()),), generator=g)
        weights = torch.rand(values.numel(), generator=g) + 0.5 if cfg.weighted else None
        out.append(
            KeyedJaggedTensor(
                keys=[f"f{i}" for i in range(cfg.tables)], values=values, lengths=lengths,
                weights=weights, stride=cfg.batch,
            )
        )  # fmt: skip
    return out


# -- memory ---------------------------------------------------------------------------------------


def status_kib(field: str) -> int:
    """A field of this process's /proc/self/status in KiB (VmRSS now, VmHWM its peak)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


# -- timing ---------------------------------------------------------------------------------------


def time_block(step: Callable, kjts, n: int, start: int) -> list[float]:
    """The wall time of each of `n` calls `step(kjt)`, cycling through `kjts` from `start`."""
    # A step on a GPU is done when its kernels are: wait for them (a no-op on CPU).
    sync = torch.cuda.synchronize if kjts[0].values().is_cuda else (lambda: None)
    times = []
    sync()
    for i in range(n):
        kjt = kjts[(start + i) % len(kjts)]
        t0 = time.perf_counter()
        step(kjt)
        sync()
        times.append(time.perf_counter() - t0)
    return times


def max_over_ranks(times: list[float]) -> list[float]:
    """Each time's maximum over the ranks (collective): a step takes as long as its slowest rank."""
    from modular.comm import collective_device

    t = torch.tensor(times, dtype=torch.float64, device=collective_device(None))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def init_ranks(
    rank: int, world_size: int, device: str = "cpu", cuda_backend: str = "nccl",
    *, store: dist.Store | None = None,
) -> torch.device:
    """This rank's process group and device. CPU: gloo. CUDA: one GPU per rank over NCCL, or
    with `cuda_backend="gloo"` the ranks share the GPUs round-robin (gloo moves CUDA tensors
    through host memory: the shape of a multi-rank step on one GPU, not NCCL's timing). The ranks
    meet at `store` (`Rendezvous.store()`, benchmarks/_rendezvous.py), or without it at env://'s
    MASTER_ADDR and MASTER_PORT."""
    if device == "cuda":
        gpu = rank % torch.cuda.device_count() if cuda_backend == "gloo" else rank
        torch.cuda.set_device(gpu)
        if cuda_backend == "gloo":
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        else:
            dist.init_process_group("nccl", store=store, rank=rank, world_size=world_size,
                                    device_id=torch.device("cuda", gpu))  # fmt: skip
        return torch.device("cuda", gpu)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    return torch.device("cpu")


def add_device_args(p: argparse.ArgumentParser) -> None:
    """--device and --cuda-backend, as `init_ranks` takes them."""
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: one GPU per rank with NCCL (--world-size at most the GPUs)")
    p.add_argument("--cuda-backend", choices=("nccl", "gloo"), default="nccl",
                   help="with --device cuda: gloo lets ranks share a GPU (e.g. 2 ranks on 1)")  # fmt: skip


def check_device_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Refuses, before any process starts, a device this machine does not have."""
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device here")
    if a.device == "cuda" and a.cuda_backend == "nccl" and a.world_size > torch.cuda.device_count():
        p.error(f"--device cuda --world-size {a.world_size}: this machine has "
                f"{torch.cuda.device_count()} CUDA device(s); NCCL needs one per rank "
                "(--cuda-backend gloo shares them)")  # fmt: skip


def run_ranks(worker: Callable, args: tuple, world_size: int) -> list:
    """`worker(rank, *args, rendezvous, queue)` on `world_size` spawned ranks, each putting one
    result on `queue` whose first item is its rank; the results in rank order."""
    import torch.multiprocessing as mp

    from benchmarks._rendezvous import hosted_rendezvous

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with hosted_rendezvous() as rendezvous:
        mp.start_processes(worker, args=(*args, rendezvous, queue), nprocs=world_size, join=True,
                           start_method="spawn")  # fmt: skip
    return sorted((queue.get() for _ in range(world_size)), key=lambda r: r[0])
