"""Peak memory per rank while sharding a large `meta` EBC row-wise (issue 7's memory target).

    python benchmarks/shard_memory.py                    # 4 tables x 4M rows x 64 dims = 4 GiB
    python benchmarks/shard_memory.py --rows 1000000     # a smaller model

Each configuration runs in fresh processes (peak RSS only grows): the ranks build the EBC on
`meta`, in the "fused" run fuse exact row-wise Adagrad into it first (on meta this only marks
it), then shard it row-wise with `modular.shard` (each rank allocates its shards, fused in the
"fused" run, and fills them with the table's init_fn). Each rank reports its peak RSS (VmHWM)
against the bound: 1.2 x (local shards + optimizer state + 1 GiB). A full table materialised
anywhere would overshoot it by a table (1 GiB here).

Only this order is measured: `modular.fuse_optimizer` on a sharded model raises ShardingError
(Note [order of sharding calls] in modular/compose/fsdp.py), because fusing after `shard` held
every shard twice while the kernels were swapped (measured before it was refused, 4 x 4M x 64
on 2 ranks: a peak of 4.18 GiB per rank against 2.27 GiB fused first, for 1.91 GiB of shards).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks._common import status_kib  # noqa: E402
from benchmarks._rendezvous import Rendezvous, hosted_rendezvous  # noqa: E402

GiB = 1 << 30


def _init(weight: torch.Tensor) -> None:
    torch.nn.init.uniform_(weight, -0.01, 0.01)


def _worker(rank: int, args, rendezvous: Rendezvous, mode: str, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=rendezvous.store(), rank=rank, world_size=args.world_size)
    import modular
    from planners.types import ShardingPlan, ShardingType, TablePlacement
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    class Model(nn.Module):
        def __init__(self, ebc: nn.Module) -> None:
            super().__init__()
            self.ebc = ebc

    configs = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=args.dim, num_embeddings=args.rows,
                           feature_names=[f"f{i}"], init_fn=_init)
        for i in range(args.tables)
    ]  # fmt: skip
    dist.barrier()
    before = status_kib("VmRSS") * 1024
    model = Model(EmbeddingBagCollection(tables=configs, device=torch.device("meta")))
    ranks = tuple(range(args.world_size))
    plan = ShardingPlan(
        world_size=args.world_size,
        modules={"ebc": {c.name: TablePlacement(ShardingType.ROW_WISE, ranks=ranks) for c in configs}},
    )
    opt = None
    if mode == "fused":  # fused on meta, before shard: shard builds fused kernels directly
        opt = modular.fuse_optimizer(model, "exact_rowwise_adagrad", lr=0.01, eps=1e-8)
    modular.shard(model, plan)
    dist.barrier()
    peak = status_kib("VmHWM") * 1024
    shards = sum(
        s.tensor.numel() * s.tensor.element_size()
        for p in model.parameters()
        if hasattr(p, "local_shards")
        for s in p.local_shards()
    )
    state = 0
    if opt is not None:  # one fp32 accumulator per local row
        state = sum(
            t.numel() * t.element_size()
            for per_table in opt.state_dict()["state"].values()
            for t in _tensors(per_table)
        )
    queue.put((rank, before, peak, shards, state))
    dist.barrier()
    dist.destroy_process_group()


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        if hasattr(obj, "local_shards"):
            yield from (s.tensor for s in obj.local_shards())
        else:
            yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tables", type=int, default=4)
    p.add_argument("--rows", type=int, default=4_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--optimizers", nargs="+", choices=("dense", "fused"), default=["dense", "fused"])
    args = p.parse_args()
    size = args.tables * args.rows * args.dim * 4
    print(f"## {args.tables} tables x {args.rows:,} rows x {args.dim} dims fp32 = "
          f"{size / GiB:.2f} GiB on meta, row-wise over {args.world_size} CPU ranks, "
          f"{datetime.date.today().isoformat()}, {os.cpu_count()} cores\n")  # fmt: skip
    print("| optimizer | rank | RSS before shard GiB | peak RSS GiB | local shards GiB | "
          "optimizer state GiB | bound 1.2 x (shards + state + 1 GiB) | peak / bound |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    ctx = mp.get_context("spawn")
    for opt in args.optimizers:
        queue = ctx.Queue()
        with hosted_rendezvous() as rendezvous:
            mp.start_processes(
                _worker, args=(args, rendezvous, opt, queue), nprocs=args.world_size,
                join=True, start_method="spawn",
            )  # fmt: skip
        rows = sorted(queue.get() for _ in range(args.world_size))
        for rank, before, peak, shards, state in rows:
            bound = 1.2 * (shards + state + GiB)
            print(f"| {opt} | {rank} | {before / GiB:.2f} | {peak / GiB:.2f} | {shards / GiB:.2f} | "
                  f"{state / GiB:.3f} | {bound / GiB:.2f} | {peak / bound:.2f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
