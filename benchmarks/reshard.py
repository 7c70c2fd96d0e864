"""`modular.reshard` against a checkpoint round trip to the same new plan (issue 39).

    python benchmarks/reshard.py                         # 4 tables x 1M rows x 64, worlds 2 and 3
    python benchmarks/reshard.py --rows 250000 --world-sizes 2 --optimizers dense
    python benchmarks/reshard.py --device cuda --cuda-backend gloo --world-sizes 2 \
        --methods reshard --stage on off         # 2 ranks on one GPU, host staging on and off

The model: `--tables` FP32 tables of `--rows` x `--dim`, built on `meta` and sharded table-wise,
table i on rank i % W (unfused, or fused with exact row-wise Adagrad, which adds one FP32
statistic per row). Two new plans: "one table" moves t0 to the next rank, "all tables" moves
every table to the next rank. Each (world, optimizer, move, method) runs in fresh processes:

  * reshard: `modular.reshard(model, new_plan)`;
  * checkpoint: `modular.checkpoint.save` to a temporary directory, the old model dropped, a new
    model built on meta and sharded by the new plan (its shards allocated and filled by init_fn),
    then `modular.checkpoint.load`: what changing plans took before reshard.

Per rank: the wall time (between barriers; the slowest rank's is printed; for the checkpoint its
save, build and load parts), the bytes it sent and received in the reshard's all-to-alls (the
checkpoint's are the bytes written to disk, all ranks together), and the growth of its peak
resident set over its resident set before the call: VmHWM after resetting it to the current RSS
through /proc/self/clear_refs ("5"), minus VmRSS before. That is what the OS counts, so it sees
torch's CPU allocations (tracemalloc does not), pages given back (madvise) and pages never
touched; its noise is the interpreter's own allocations, well under 1 MiB here. Before the call
every rank trains one step (a forward and backward of 16 ids per feature, the fused update or
the dense gradients dropped), as a reshard between training steps finds it: the collectives'
library code is mapped in then, not during the call (192 KiB on a rank that never ran an
all-to-all). Beside it: issue 39's bound (the bytes the rank receives plus its largest moved
shard, weights and row statistic), whether the growth stays within it (`--slack-kib`, 256 by
default, allows for the new module's Python objects, 40-50 KiB measured, which are no shard's
memory; 0 checks strictly), and what building the new kernels beside the old ones held
before Note [reshard memory] (modular/resharding/memory.py): the bytes received plus the new
layout's shards on the rank.

`--device cuda` puts each rank's shards on a GPU (one per rank over NCCL, or with
`--cuda-backend gloo` the ranks share the GPUs round-robin, as step_time.py and low_precision.py
do), and the growth is then torch's: `torch.cuda.max_memory_allocated()` after
`reset_peak_memory_stats()` just before the call, minus `memory_allocated()` before it (ranks
sharing a GPU each count their own process's allocator). `--stage on|off` sets
`modular.resharding.host_staging._STAGE_THROUGH_HOST` (True|False) in every rank before the call:
whether the old shards of rebuilt kernels pass through host memory (Note [reshard memory], "On a
device"); `default` leaves it as the code has it. Several values run side by side. Where it stages,
or on CUDA, the parts column gives the time of the copy to host ("to host": the old storages
copied off the device and freed) and of the all-to-alls; the copies back from host are inside
the total.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks._common import add_device_args, init_ranks, status_kib  # noqa: E402
from benchmarks._rendezvous import Rendezvous, hosted_rendezvous  # noqa: E402

MiB = 1 << 20
STAGES = {"on": True, "off": False}  # --stage: _STAGE_THROUGH_HOST in every rank ("default": left)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset the peak RSS (VmHWM) to now
        f.write("5")


def _init(weight: torch.Tensor) -> None:
    torch.nn.init.uniform_(weight, -0.01, 0.01)


class Model(nn.Module):
    def __init__(self, ebc: nn.Module) -> None:
        super().__init__()
        self.ebc = ebc


def _placements(args, world: int, shift: int, moved: set[int]):
    from planners.types import ShardingType, TablePlacement

    return {
        f"t{i}": TablePlacement(ShardingType.TABLE_WISE, ranks=((i + (shift if i in moved else 0)) % world,))
        for i in range(args.tables)
    }


def _build(args, world: int, placements, optimizer: str, device: torch.device):
    import modular
    from planners.types import ShardingPlan
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    configs = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=args.dim, num_embeddings=args.rows,
                           feature_names=[f"f{i}"], init_fn=_init)
        for i in range(args.tables)
    ]  # fmt: skip
    model = Model(EmbeddingBagCollection(tables=configs, device=torch.device("meta")))
    opt = None
    if optimizer == "fused":
        opt = modular.fuse_optimizer(model, "exact_rowwise_adagrad", lr=0.01, eps=1e-8)
    plan = ShardingPlan(world_size=world, modules={"ebc": placements})
    if device.type == "cpu":
        modular.shard(model, plan)
    else:  # under gloo `shard` would place it on the CPU
        modular.shard(model, plan, device=device)
    return model, opt


def _warm_up(model: nn.Module, args, device: torch.device) -> None:
    """One training step before the call, as a reshard between steps finds the model."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = torch.Generator().manual_seed(dist.get_rank())
    ids = 16
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f{i}" for i in range(args.tables)],
        values=torch.randint(0, args.rows, (args.tables * ids,), generator=g).to(device),
        lengths=torch.full((args.tables * 2,), ids // 2, dtype=torch.int64).to(device),
    )  # fmt: skip
    import modular

    model.ebc(kjt).values().sum().backward()
    for p in modular.local_parameters(model):  # a dense table's gradient: a step would use it
        p.grad = None
    if device.type == "cuda":
        torch.cuda.synchronize()


def _used(device: torch.device) -> int:
    """What this rank holds now: its resident set on CPU, torch's allocation on its GPU."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()
    return status_kib("VmRSS") * 1024


def _peak(device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    return status_kib("VmHWM") * 1024


def _reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    else:
        _reset_peak()


def _worker(
    rank: int, args, world: int, optimizer: str, move: str, method: str, stage: str,
    rendezvous: Rendezvous, queue,
) -> None:
    torch.set_num_threads(1)
    device = init_ranks(rank, world, args.device, args.cuda_backend, store=rendezvous.store())
    import modular
    import modular.resharding.rounds as exchange
    import modular.resharding.host_staging as staging
    from planners.types import ShardingPlan

    if stage in STAGES:
        staging._STAGE_THROUGH_HOST = STAGES[stage]
    moved = {0} if move == "one table" else set(range(args.tables))
    model, opt = _build(args, world, _placements(args, world, 0, moved), optimizer, device)
    new_plan = ShardingPlan(world_size=world, modules={"ebc": _placements(args, world, 1, moved)})
    row_bytes = args.dim * 4 + (4 if optimizer == "fused" else 0)  # FP32 row (+ its statistic)
    shards_after = sum(row_bytes * args.rows for i in range(args.tables) if (i + (i in moved)) % world == rank)
    sends = sum(row_bytes * args.rows for i in moved if i % world == rank)
    receives = sum(row_bytes * args.rows for i in moved if (i + 1) % world == rank)
    traffic = [0, 0]
    real, stage_init = exchange.all_to_all, staging.Staged.__init__
    timed = {"to host": 0.0, "all-to-all": 0.0}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def counted(tensor, *, input_splits, output_splits, **kwargs):
        size = tensor.element_size()
        traffic[0] += sum(input_splits) * size
        traffic[1] += sum(output_splits) * size
        t = time.perf_counter()
        out = real(tensor, input_splits=input_splits, output_splits=output_splits, **kwargs)
        sync()
        timed["all-to-all"] += time.perf_counter() - t
        return out

    def staged(self, *a, **kw) -> None:  # the old storages copied to host and freed
        t = time.perf_counter()
        stage_init(self, *a, **kw)
        sync()
        timed["to host"] += time.perf_counter() - t

    exchange.all_to_all = counted
    staging.Staged.__init__ = staged
    parts: dict[str, float] = {}
    directory = tempfile.mkdtemp(prefix="reshard_bench_") if rank == 0 else None
    holder = [directory]
    dist.broadcast_object_list(holder, src=0)
    path = os.path.join(holder[0], "ckpt")
    _warm_up(model, args, device)
    dist.barrier()
    before = _used(device)
    _reset(device)
    start = time.perf_counter()
    if method == "reshard":
        modular.reshard(model, new_plan)
        sync()
        dist.barrier()
        parts["total"] = time.perf_counter() - start
        if device.type == "cuda" or staging.stages(device):
            parts.update(timed)
    else:
        modular.checkpoint.save(path, model, opt)
        dist.barrier()
        parts["save"] = time.perf_counter() - start
        del model, opt
        t = time.perf_counter()
        model, opt = _build(args, world, dict(new_plan.modules["ebc"]), optimizer, device)
        dist.barrier()
        parts["build"] = time.perf_counter() - t
        t = time.perf_counter()
        modular.checkpoint.load(path, model, opt)
        sync()
        dist.barrier()
        parts["load"] = time.perf_counter() - t
        parts["total"] = time.perf_counter() - start
    peak = _peak(device)
    written = 0
    if rank == 0 and method == "checkpoint":
        for root, _, files in os.walk(path):
            written += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    queue.put({
        "rank": rank, "parts": parts, "sent": traffic[0], "received": traffic[1], "written": written,
        "growth": peak - before, "before": before, "expect_sent": sends, "expect_received": receives,
        "largest": args.rows * row_bytes if (sends or receives) else 0, "shards_after": shards_after,
    })  # fmt: skip
    dist.barrier()
    if rank == 0:
        shutil.rmtree(holder[0], ignore_errors=True)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tables", type=int, default=4)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3])
    p.add_argument("--optimizers", nargs="+", choices=("dense", "fused"), default=["dense", "fused"])
    p.add_argument("--moves", nargs="+", choices=("one table", "all tables"), default=["one table", "all tables"])
    p.add_argument("--methods", nargs="+", choices=("reshard", "checkpoint"), default=["reshard", "checkpoint"])
    p.add_argument("--stage", nargs="+", choices=("default", *STAGES), default=["default"],
                   help="host staging of rebuilt kernels' old shards in reshard (staging."
                        "_STAGE_THROUGH_HOST): on (True), off (False), default (as the code has it); "
                        "several run side by side")  # fmt: skip
    p.add_argument("--slack-kib", type=int, default=256,
                   help="growth over the bound still counted within it: the new module's Python "
                        "objects (0: strict)")  # fmt: skip
    add_device_args(p)
    args = p.parse_args()
    _check_device(p, args)
    size = args.tables * args.rows * args.dim * 4
    load = os.getloadavg()[0]
    where = f"{os.cpu_count()} cores"
    if args.device == "cuda":
        backend = "gloo, sharing" if args.cuda_backend == "gloo" else "NCCL, one GPU each"
        where = f"ranks on {torch.cuda.get_device_name()} ({backend}), torch {torch.__version__}, {where}"
    print(f"## {args.tables} tables x {args.rows:,} rows x {args.dim} dims fp32 = {size / MiB:,.0f} MiB, "
          f"table-wise; {datetime.date.today().isoformat()}, {where}, load average "
          f"{load:.1f} at the start\n")  # fmt: skip
    growth = "peak allocated growth" if args.device == "cuda" else "peak RSS growth"
    print("| ranks | optimizer | move | method | time s (slowest rank) | parts s | sent MiB per rank "
          f"| received MiB per rank | {growth} MiB per rank | bound: received + largest moved "
          f"shard MiB | within bound (+{args.slack_kib} KiB) | received + new shards MiB (kernels built beside the old) |")  # fmt: skip
    print("|---:|---|---|---|---:|---|---|---|---|---|---|---|")
    ctx = mp.get_context("spawn")
    for world in args.world_sizes:
        for optimizer in args.optimizers:
            for move in args.moves:
                for method in args.methods:
                    for stage in args.stage if method == "reshard" else ["default"]:
                        queue = ctx.Queue()
                        with hosted_rendezvous() as rendezvous:
                            mp.start_processes(
                                _worker, args=(args, world, optimizer, move, method, stage, rendezvous, queue),
                                nprocs=world, join=True, start_method="spawn",
                            )  # fmt: skip
                        rows = sorted((queue.get() for _ in range(world)), key=lambda r: r["rank"])
                        label = method if stage == "default" else f"{method} (stage {stage})"
                        _print(world, optimizer, move, method, rows, label=label, slack=args.slack_kib << 10)


def _check_device(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses, before any process starts, a device this machine does not have."""
    if args.device == "cpu":
        return
    if not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device here (run on a GPU machine, or leave "
                "--device out for CPU ranks)")  # fmt: skip
    gpus = torch.cuda.device_count()
    if args.cuda_backend == "nccl" and max(args.world_sizes) > gpus:
        p.error(f"--device cuda --world-sizes {' '.join(map(str, args.world_sizes))}: this machine has "
                f"{gpus} CUDA device(s) and NCCL needs one per rank; --cuda-backend gloo lets ranks "
                "share them")  # fmt: skip


def _print(
    world: int, optimizer: str, move: str, method: str, rows: list[dict], *, label: str, slack: int
) -> None:
    def mib(key: str) -> str:
        return ", ".join(f"{r[key] / MiB:.1f}" for r in rows)

    slowest = max(rows, key=lambda r: r["parts"]["total"])["parts"]
    parts = ", ".join(f"{k} {v:.2f}" for k, v in slowest.items() if k != "total")
    if method == "reshard":
        for r in rows:  # what the plans say moves is what went on the wire
            if (r["sent"], r["received"]) != (r["expect_sent"], r["expect_received"]):
                raise AssertionError(f"rank {r['rank']} moved {r['sent']}/{r['received']} bytes, "
                                     f"expected {r['expect_sent']}/{r['expect_received']}")  # fmt: skip
        sent, received = mib("sent"), mib("received")
    else:
        sent, received = f"{rows[0]['written'] / MiB:.1f} written in all", "-"
    bound, within, beside = "-", "-", "-"
    if method == "reshard":
        bound = ", ".join(f"{(r['received'] + r['largest']) / MiB:.1f}" for r in rows)
        over = {
            r["rank"]: r["growth"] - r["received"] - r["largest"]
            for r in rows if r["growth"] > r["received"] + r["largest"] + slack
        }  # fmt: skip
        within = "yes" if not over else "no (" + ", ".join(f"rank {k} by {v / MiB:.1f}" for k, v in over.items()) + ")"
        beside = ", ".join(f"{(r['received'] + r['shards_after']) / MiB:.1f}" for r in rows)
    print(f"| {world} | {optimizer} | {move} | {label} | {slowest['total']:.2f} | {parts or '-'} | "
          f"{sent} | {received} | {mib('growth')} | {bound} | {within} | {beside} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
