"""FP16 tables and FP16 comms against FP32, side by side: peak memory per rank and step time.

    python benchmarks/low_precision.py                       # 4 tables x 1M rows x 64, 2 ranks
    python benchmarks/low_precision.py --rows 250000 --steps 10 --blocks 5
    python benchmarks/low_precision.py --no-memory                       # step times only
    python benchmarks/low_precision.py --device cuda --world-size 1      # one GPU, NCCL
    python benchmarks/low_precision.py --device cuda --cuda-backend gloo # 2 ranks on one GPU

Each configuration runs in fresh processes (peak RSS only grows): the ranks build the same EBC
on `meta`, fuse exact row-wise Adagrad, shard it (two tables row-wise, two table-wise, so both
partial sums and whole bags travel), then train `--steps` steps on a synthetic batch. Per rank:
the RSS growth from before the EBC is built to the peak after the last step (`peak - before`,
which is what the tables, state and step buffers cost; on a GPU, `--device cuda`, the growth of
torch's peak allocation on the rank's device instead), and the median step time after
`--warmup` steps (on a GPU a step ends with `torch.cuda.synchronize()`). The configurations:
    fp32            FP32 tables, FP32 comms (the baseline)
    fp16            FP16 tables (`EmbeddingBagConfig(data_type=DataType.FP16)`), FP32 comms
    fp16+fp16comms  FP16 tables, `modular.shard(comm_dtype=torch.float16)`
    fp32+fp16comms  FP32 tables, FP16 comms

Step time is measured separately, in one run where every rank holds all the configurations'
models at once and times them in `--blocks` alternating blocks of `--steps` steps (each block
takes the configurations in a rotated order, so none is always first or last after another): a
slow spell on a shared machine then hits every configuration alike instead of one. Reported per
configuration: the median of its block medians (and their range); per comparison (FP16 against
FP32 tables, FP16 against FP32 comms), the median over blocks of the ratio of the two block
medians taken in the same block.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from benchmarks._common import add_device_args, check_device_args, init_ranks, status_kib  # noqa: E402
from benchmarks._rendezvous import Rendezvous, hosted_rendezvous  # noqa: E402

MiB = 1 << 20
CONFIGS = {  # name: (tables in FP16, comm dtype)
    "fp32": (False, None),
    "fp16": (True, None),
    "fp16+fp16comms": (True, torch.float16),
    "fp32+fp16comms": (False, torch.float16),
}



def _init(weight: torch.Tensor) -> None:
    torch.nn.init.uniform_(weight, -0.01, 0.01)


def _setup(rank: int, args, rendezvous: Rendezvous) -> None:
    torch.set_num_threads(1)
    args.rank_device = init_ranks(rank, args.world_size, args.device, args.cuda_backend, store=rendezvous.store())


def _batch(args, rank: int):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = torch.Generator().manual_seed(rank)
    keys = [f"f{i}" for i in range(args.tables)]
    lengths = torch.randint(0, 2 * args.pooling + 1, (len(keys) * args.batch_size,), generator=g)
    values = torch.randint(0, args.rows, (int(lengths.sum()),), generator=g)
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths).to(args.rank_device)


def _used_bytes(args) -> int:
    """What this rank holds now: its RSS on CPU, torch's allocation on its GPU."""
    if args.device == "cuda":
        return torch.cuda.memory_allocated()
    return status_kib("VmRSS") * 1024


def _peak_bytes(args) -> int:
    if args.device == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    return status_kib("VmHWM") * 1024


def _build(args, name: str):
    """One configuration's sharded EBC: built on meta, fused row-wise Adagrad, then sharded."""
    import modular
    from planners.types import ShardingPlan, ShardingType, TablePlacement
    from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    fp16, comm = CONFIGS[name]
    world = args.world_size
    configs = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=args.dim, num_embeddings=args.rows,
                           feature_names=[f"f{i}"], init_fn=_init,
                           data_type=DataType.FP16 if fp16 else DataType.FP32)
        for i in range(args.tables)
    ]  # fmt: skip
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    placements = {
        c.name: TablePlacement(ShardingType.ROW_WISE) if i % 2 == 0
        else TablePlacement(ShardingType.TABLE_WISE, ranks=((i // 2) % world,))
        for i, c in enumerate(configs)
    }  # fmt: skip
    modular.fuse_optimizer(ebc, "exact_rowwise_adagrad", lr=0.01, eps=1e-8)
    plan = ShardingPlan(world_size=world, modules={"": placements})
    return modular.shard(ebc, plan, comm_dtype=comm, device=args.rank_device)


def _steps(ebc, kjt, n: int) -> list[float]:
    sync = torch.cuda.synchronize if kjt.values().is_cuda else (lambda: None)
    times = []
    for _ in range(n):
        sync()
        dist.barrier()
        start = time.perf_counter()
        ebc(kjt).values().sum().backward()
        sync()
        times.append(time.perf_counter() - start)
    return times


def _memory_worker(rank: int, args, rendezvous: Rendezvous, name: str, queue) -> None:
    """One configuration alone in fresh processes: its RSS growth to the peak."""
    _setup(rank, args, rendezvous)
    kjt = _batch(args, rank)
    dist.barrier()
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    before = _used_bytes(args)
    ebc = _build(args, name)
    _steps(ebc, kjt, args.warmup + args.steps)
    dist.barrier()
    queue.put((rank, before, _peak_bytes(args)))
    dist.barrier()
    dist.destroy_process_group()


def _timing_worker(rank: int, args, rendezvous: Rendezvous, queue) -> None:
    """Every configuration's model in the same processes, timed in alternating blocks."""
    _setup(rank, args, rendezvous)
    kjt = _batch(args, rank)
    models = {name: _build(args, name) for name in args.configs}
    for ebc in models.values():
        _steps(ebc, kjt, args.warmup)
    blocks: dict[str, list[float]] = {name: [] for name in args.configs}
    names = list(args.configs)
    for b in range(args.blocks):
        k = b % len(names)
        for name in names[k:] + names[:k]:  # rotated: each configuration leads in turn
            blocks[name].append(statistics.median(_steps(models[name], kjt, args.steps)))
    queue.put((rank, blocks))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tables", type=int, default=4)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=2048, help="per rank")
    p.add_argument("--pooling", type=int, default=5, help="mean ids per bag")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=10, help="timed steps per block")
    p.add_argument("--blocks", type=int, default=5, help="alternating blocks per configuration")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--configs", nargs="+", choices=tuple(CONFIGS), default=list(CONFIGS))
    p.add_argument("--no-memory", action="store_true", help="skip the per-configuration memory runs")
    add_device_args(p)
    args = p.parse_args()
    check_device_args(p, args)
    size = args.tables * args.rows * args.dim * 4
    if args.device == "cuda":
        backend = "gloo, sharing" if args.cuda_backend == "gloo" else "NCCL, one GPU each"
        where = f"{args.world_size} ranks ({backend}) on {torch.cuda.get_device_name()}"
    else:
        where = f"{args.world_size} gloo ranks on CPU, {os.cpu_count()} cores"
    print(f"## {args.tables} tables x {args.rows:,} rows x {args.dim} dims ({size / MiB:,.0f} MiB "
          f"in FP32), fused row-wise Adagrad, 2 row-wise + 2 table-wise, {where}, "
          f"batch {args.batch_size} per rank, ~{args.pooling} ids per bag, "
          f"{datetime.date.today().isoformat()}, torch {torch.__version__}\n")  # fmt: skip
    ctx = mp.get_context("spawn")
    if not args.no_memory:
        _memory(args, ctx)
    _timing(args, ctx)


def _spawn(ctx, worker, args, *extra) -> list:
    queue = ctx.Queue()
    with hosted_rendezvous() as rendezvous:
        mp.start_processes(
            worker, args=(args, rendezvous, *extra, queue), nprocs=args.world_size, join=True,
            start_method="spawn",
        )  # fmt: skip
    return sorted((queue.get() for _ in range(args.world_size)), key=lambda r: r[0])


def _memory(args, ctx) -> None:
    what = "peak allocated - allocated before" if args.device == "cuda" else "peak - before"
    print(f"Memory: each configuration alone, {args.warmup + args.steps} steps\n")
    print(f"| config | rank | {what} MiB | x fp32 |")
    print("|---|---:|---:|---:|")
    base: dict[int, float] = {}
    for name in args.configs:
        for rank, before, peak in _spawn(ctx, _memory_worker, args, name):
            grown = peak - before
            if name == "fp32":
                base[rank] = grown
            ratio = f"{grown / base[rank]:.2f}" if rank in base else "-"
            print(f"| {name} | {rank} | {grown / MiB:,.1f} | {ratio} |", flush=True)
    print()


# (label, configuration, its reference): FP16 tables against FP32 ones under the same comms,
# FP16 comms against FP32 comms under the same tables.
COMPARISONS = (
    ("fp16 tables / fp32 tables (fp32 comms)", "fp16", "fp32"),
    ("fp16 tables / fp32 tables (fp16 comms)", "fp16+fp16comms", "fp32+fp16comms"),
    ("fp16 comms / fp32 comms (fp32 tables)", "fp32+fp16comms", "fp32"),
    ("fp16 comms / fp32 comms (fp16 tables)", "fp16+fp16comms", "fp16"),
)


def _timing(args, ctx) -> None:
    results = _spawn(ctx, _timing_worker, args)
    print(f"Step time: all configurations in one run, {args.blocks} alternating blocks of "
          f"{args.steps} steps after {args.warmup} warm-up steps each\n")  # fmt: skip
    print("| config | rank | median of block medians ms | block medians ms (min - max) |")
    print("|---|---:|---:|---|")
    for name in args.configs:
        for rank, blocks in results:
            ms = [t * 1e3 for t in blocks[name]]
            print(f"| {name} | {rank} | {statistics.median(ms):.1f} | {min(ms):.1f} - {max(ms):.1f} |")
    print()
    print("| comparison | rank | median ratio | block ratios (min - max) |")
    print("|---|---:|---:|---|")
    for label, name, ref in COMPARISONS:
        if name not in args.configs or ref not in args.configs:
            continue
        for rank, blocks in results:
            ratios = [a / b for a, b in zip(blocks[name], blocks[ref])]  # same block: paired
            print(f"| {label} | {rank} | {statistics.median(ratios):.2f} | "
                  f"{min(ratios):.2f} - {max(ratios):.2f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
