"""FP16 tables and FP16 comms against FP32, side by side: peak memory per rank and step time.

    python benchmarks/low_precision.py                       # 4 tables x 1M rows x 64, 2 ranks
    python benchmarks/low_precision.py --rows 250000 --steps 10

Each configuration runs in fresh processes (peak RSS only grows): the ranks build the same EBC
on `meta`, fuse exact row-wise Adagrad, shard it (two tables row-wise, two table-wise, so both
partial sums and whole bags travel), then train `--steps` steps on a synthetic batch. Per rank:
the RSS growth from before the EBC is built to the peak after the last step (`peak - before`,
which is what the tables, state and step buffers cost), and the median step time after
`--warmup` steps. The configurations:
    fp32            FP32 tables, FP32 comms (the baseline)
    fp16            FP16 tables (`EmbeddingBagConfig(data_type=DataType.FP16)`), FP32 comms
    fp16+fp16comms  FP16 tables, `modular.shard(comm_dtype=torch.float16)`
    fp32+fp16comms  FP32 tables, FP16 comms
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

MiB = 1 << 20
CONFIGS = {  # name: (tables in FP16, comm dtype)
    "fp32": (False, None),
    "fp16": (True, None),
    "fp16+fp16comms": (True, torch.float16),
    "fp32+fp16comms": (False, torch.float16),
}


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _init(weight: torch.Tensor) -> None:
    torch.nn.init.uniform_(weight, -0.01, 0.01)


def _worker(rank: int, args, port: int, name: str, queue) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.world_size)
    import modular
    from planners.types import ShardingPlan, ShardingType, TablePlacement
    from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    fp16, comm = CONFIGS[name]
    world = args.world_size
    configs = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=args.dim, num_embeddings=args.rows,
                           feature_names=[f"f{i}"], init_fn=_init,
                           data_type=DataType.FP16 if fp16 else DataType.FP32)
        for i in range(args.tables)
    ]  # fmt: skip
    g = torch.Generator().manual_seed(rank)
    keys = [c.feature_names[0] for c in configs]
    lengths = torch.randint(0, 2 * args.pooling + 1, (len(keys) * args.batch_size,), generator=g)
    values = torch.randint(0, args.rows, (int(lengths.sum()),), generator=g)
    kjt = KeyedJaggedTensor(keys=keys, values=values, lengths=lengths)
    dist.barrier()
    before = _status_bytes("VmRSS")
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    placements = {
        c.name: TablePlacement(ShardingType.ROW_WISE) if i % 2 == 0
        else TablePlacement(ShardingType.TABLE_WISE, ranks=((i // 2) % world,))
        for i, c in enumerate(configs)
    }  # fmt: skip
    modular.fuse_optimizer(ebc, "exact_rowwise_adagrad", lr=0.01, eps=1e-8)
    ebc = modular.shard(ebc, ShardingPlan(world_size=world, modules={"": placements}), comm_dtype=comm)
    times = []
    for step in range(args.warmup + args.steps):
        dist.barrier()
        start = time.perf_counter()
        ebc(kjt).values().sum().backward()
        times.append(time.perf_counter() - start)
    dist.barrier()
    peak = _status_bytes("VmHWM")
    queue.put((rank, before, peak, statistics.median(times[args.warmup:])))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tables", type=int, default=4)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=2048, help="per rank")
    p.add_argument("--pooling", type=int, default=5, help="mean ids per bag")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--configs", nargs="+", choices=tuple(CONFIGS), default=list(CONFIGS))
    args = p.parse_args()
    size = args.tables * args.rows * args.dim * 4
    print(f"## {args.tables} tables x {args.rows:,} rows x {args.dim} dims ({size / MiB:,.0f} MiB "
          f"in FP32), fused row-wise Adagrad, 2 row-wise + 2 table-wise, {args.world_size} gloo "
          f"ranks, batch {args.batch_size} per rank, ~{args.pooling} ids per bag, "
          f"{datetime.date.today().isoformat()}, {os.cpu_count()} cores\n")  # fmt: skip
    print("| config | rank | peak - before MiB | x fp32 | median step ms | x fp32 |")
    print("|---|---:|---:|---:|---:|---:|")
    ctx = mp.get_context("spawn")
    base: dict[int, tuple[float, float]] = {}
    for name in args.configs:
        queue = ctx.Queue()
        mp.start_processes(
            _worker, args=(args, _free_port(), name, queue), nprocs=args.world_size,
            join=True, start_method="spawn",
        )  # fmt: skip
        for rank, before, peak, step in sorted(queue.get() for _ in range(args.world_size)):
            grown = peak - before
            if name == "fp32":
                base[rank] = (grown, step)
            ref = base.get(rank)
            mem_x = f"{grown / ref[0]:.2f}" if ref else "-"
            time_x = f"{step / ref[1]:.2f}" if ref else "-"
            print(f"| {name} | {rank} | {grown / MiB:,.1f} | {mem_x} | {step * 1e3:.1f} | "
                  f"{time_x} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
