"""DTensor tables against ShardedTensor tables (issue 26), and the memory `modular.unshard` takes.

    python benchmarks/dtensor_tables.py                  # both parts, 2 gloo ranks on CPU
    python benchmarks/dtensor_tables.py --steps 60 --world-size 3

Step time: the same EBC (8 tables x 20,000 rows x 64 dims, one feature each, batch 512 per rank,
pooling 10) is sharded twice by the same mixed plan (table-wise, row-wise, column-wise and
data-parallel tables), once with `tensor_type="sharded_tensor"` and once with "dtensor", dense
(SGD over `modular.local_parameters`) and fused (exact row-wise Adagrad). The two models step in
alternation, one step each on the same batch (which goes first alternates too), so drift in the machine's load hits both alike;
the median of the timed steps (forward, backward, optimizer step, after a barrier) is reported
per form, and the median of the per-step ratios (each pair timed back to back); the slowest rank
counts.

Unshard memory (`--part unshard` runs it alone, in fresh processes, so that no heap freed by
the step-time part is reused and hides the growth): one table of `--big-rows` x 64 (row-wise) next to seven small ones. Each rank
resets its peak RSS (/proc/self/clear_refs), runs `modular.unshard` on the big table alone and
then on every table, and reports the growth of its peak RSS over the RSS before, against Note
[unshard memory]'s peak: the selected tables' full size plus one shard in flight.
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

from benchmarks._common import status_kib  # noqa: E402
from benchmarks._rendezvous import Rendezvous, hosted_rendezvous  # noqa: E402

MiB = 1 << 20


def _ebc(rows: list[int], dim: int):
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(name=f"t{i}", num_embeddings=n, embedding_dim=dim, feature_names=[f"f{i}"])
        for i, n in enumerate(rows)
    ]
    return EmbeddingBagCollection(tables=tables)


def _plan(world: int, names: list[str]):
    from planners.types import ShardingPlan, ShardingType, TablePlacement

    kinds = [
        TablePlacement(ShardingType.TABLE_WISE, ranks=(0,)),
        TablePlacement(ShardingType.ROW_WISE),
        TablePlacement(ShardingType.COLUMN_WISE),
        TablePlacement(ShardingType.DATA_PARALLEL),
    ]
    return ShardingPlan(world_size=world, modules={"": {n: kinds[i % 4] for i, n in enumerate(names)}})


def _batch(names: list[str], rows: int, batch: int, pooling: int, seed: int):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = torch.Generator().manual_seed(seed)
    lengths = torch.full((len(names) * batch,), pooling)
    values = torch.randint(0, rows, (int(lengths.sum()),), generator=g)
    return KeyedJaggedTensor(keys=[f"f{i}" for i in range(len(names))], values=values, lengths=lengths)


def _step_times(args, rank: int, world: int) -> dict[str, float]:
    import modular

    out = {}
    for optimizer in ("dense", "fused"):
        models, opts = {}, {}
        for kind in ("sharded_tensor", "dtensor"):
            ebc = _ebc([args.rows] * 8, args.dim)
            names = [c.name for c in ebc.embedding_bag_configs()]
            if optimizer == "fused":
                opts[kind] = modular.fuse_optimizer(ebc, "exact_rowwise_adagrad", lr=0.01)
            models[kind] = modular.shard(ebc, _plan(world, names), tensor_type=kind)
            if optimizer == "dense":
                opts[kind] = torch.optim.SGD(modular.local_parameters(models[kind]), lr=0.01)
        times: dict[str, list[float]] = {k: [] for k in models}
        for step in range(args.warmup + args.steps):
            kjt = _batch(names, args.rows, args.batch, args.pooling, seed=1000 * step + rank)
            order = list(models) if step % 2 == 0 else list(models)[::-1]  # no position bias
            for kind in order:
                model = models[kind]
                dist.barrier()
                start = time.perf_counter()
                model(kjt).values().sum().backward()
                opts[kind].step()
                opts[kind].zero_grad()
                elapsed = time.perf_counter() - start
                if step >= args.warmup:
                    times[kind].append(elapsed)
        for kind, ts in times.items():
            out[f"{optimizer}/{kind}"] = statistics.median(ts) * 1e3
        pairs = zip(times["dtensor"], times["sharded_tensor"])
        out[f"{optimizer}/paired"] = statistics.median(d / s for d, s in pairs)
    return out


def _unshard_memory(args, rank: int, world: int) -> dict[str, float]:
    import modular

    small = 2_000
    ebc = _ebc([args.big_rows] + [small] * 7, 64)
    names = [c.name for c in ebc.embedding_bag_configs()]
    from planners.types import ShardingPlan, ShardingType, TablePlacement

    plan = ShardingPlan(world_size=world, modules={"": {n: TablePlacement(ShardingType.ROW_WISE) for n in names}})
    model = modular.shard(ebc, plan)
    del ebc
    out = {}
    for label, tables in (("big table", ["t0"]), ("every table", None)):
        before = status_kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        with modular.unshard(model, tables=tables) as full:
            held = sum(t.numel() * t.element_size() for t in full.values())
        peak = status_kib("VmHWM")
        out[label] = ((peak - before) / 1024, held / MiB)
    return out


def _worker(rank: int, args, rendezvous: Rendezvous, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=rendezvous.store(), rank=rank, world_size=args.world_size)
    result = {}
    if args.part in ("both", "steps"):
        result["steps"] = _step_times(args, rank, args.world_size)
    if args.part in ("both", "unshard"):  # alone in fresh processes, no freed heap to reuse
        result["unshard"] = _unshard_memory(args, rank, args.world_size)
    queue.put((rank, result))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--rows", type=int, default=20_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--pooling", type=int, default=10)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--big-rows", type=int, default=1_000_000)
    p.add_argument("--part", choices=("both", "steps", "unshard"), default="both")
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with hosted_rendezvous() as rendezvous:
        procs = [ctx.Process(target=_worker, args=(r, args, rendezvous, queue)) for r in range(args.world_size)]
        for proc in procs:
            proc.start()
        results = dict(queue.get() for _ in procs)
        for proc in procs:
            proc.join()
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, "
          f"{args.world_size} gloo ranks on CPU, {os.cpu_count()} cores")
    if "steps" in results[0]:
        print("\n| optimizer | ShardedTensor ms | DTensor ms | ratio of medians | median of paired ratios |")
        print("|---|---:|---:|---:|---:|")
        for optimizer in ("dense", "fused"):
            st = max(results[r]["steps"][f"{optimizer}/sharded_tensor"] for r in results)
            dt = max(results[r]["steps"][f"{optimizer}/dtensor"] for r in results)
            paired = max(results[r]["steps"][f"{optimizer}/paired"] for r in results)
            print(f"| {optimizer} | {st:.2f} | {dt:.2f} | {dt / st:.3f} | {paired:.3f} |")
    if "unshard" not in results[0]:
        return
    print("\n| unshard of | rank | peak RSS growth MiB | full tables held MiB | one row shard MiB |\n|---|---:|---:|---:|---:|")
    shard_mib = args.big_rows * 64 * 4 / args.world_size / MiB
    for label in ("big table", "every table"):
        for r in sorted(results):
            grown, held = results[r]["unshard"][label]
            print(f"| {label} | {r} | {grown:.1f} | {held:.1f} | {shard_mib:.1f} |")


if __name__ == "__main__":
    main()
