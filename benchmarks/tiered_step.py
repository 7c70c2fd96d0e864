"""Issue 47's benchmark: a DLRM whose tables exceed this machine's RAM, tiered, against the same
model with tables that fit, side by side.

    python benchmarks/tiered_step.py                  # 8 tables x 18.9M rows x 64: 36 GiB on disk
    python benchmarks/tiered_step.py --quick          # 8 tables x 200k rows, 60 steps: a check

Two gloo ranks on CPU train torchrec's DLRM (13 dense features, dense arch 64-D, over arch
64-1, DDP over the dense part via modular.apply_ddp) whose `--tables` tables of `--rows` x
`--dim` are row-wise, fused exact row-wise Adagrad, every table tiered with
`cache_load_factor=--cache` (LRU) under a `tier_dir` in `--dir` (removed at the end). The EBC is
built on meta: each rank's shards are initialised in their files (Note [shard init]). Ids are
Zipf (alpha `--alpha`) over each table's rows, scattered over the rows by a multiplicative hash
(so that hot rows are spread over the row-wise shards), `--pooling` per bag, `--batch` samples per
rank. Each step prefetches the next batch (`modular.prefetch`).

The comparison, in the same processes: the same DLRM with `--small-rows` rows per table,
resident, fed the same ids modulo `--small-rows` (the same number of ids and about the same
distinct ones per step). The two train in alternating blocks of `--block` steps after
`--warmup` steps each; reported: the steady step (median over blocks of the block median, the
slowest rank's), tiered / resident, each rank's anonymous RSS (RssAnon) against its caches +
2 GiB (after the tiered model's warm-up, before the resident one is built; and at the end less
the resident model's tables), and the caches' hit rate (1 - rows fetched / distinct rows looked up, per shard and step)
beside Belady's optimal offline policy on the same per-step trace of rank 0's shards with the
same cache sizes. Targets (issue 47): RssAnon <= caches + 2 GiB; tiered <= 1.5x resident.
"""

from __future__ import annotations

import argparse
import datetime
import heapq
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks._common import init_ranks, max_over_ranks, run_ranks, status_kib  # noqa: E402
from benchmarks._rendezvous import Rendezvous  # noqa: E402

LR, EPS, DENSE = 0.05, 1e-8, 13


def _dlrm(args, rows: int, device: str):
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    torch.manual_seed(0)
    tables = [EmbeddingBagConfig(name=f"t{i}", num_embeddings=rows, embedding_dim=args.dim,
                                 feature_names=[f"f{i}"]) for i in range(args.tables)]  # fmt: skip
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device(device))
    return DLRM(embedding_bag_collection=ebc, dense_in_features=DENSE,
                dense_arch_layer_sizes=[64, args.dim], over_arch_layer_sizes=[64, 1])  # fmt: skip


def _shard(args, model, tier_dir, cache):
    import modular
    from planners.types import ShardingPlan, ShardingType, TablePlacement

    opt = modular.fuse_optimizer(model, "exact_rowwise_adagrad", lr=LR, eps=EPS)
    extra = {} if cache is None else {"cache_load_factor": cache, "cache_policy": "lru"}
    places = {f"t{i}": TablePlacement(ShardingType.ROW_WISE, **extra) for i in range(args.tables)}
    plan = ShardingPlan(world_size=args.world_size, modules={"sparse_arch.embedding_bag_collection": places})
    modular.shard(model, plan, tier_dir=tier_dir)
    modular.apply_ddp(model)
    dense = torch.optim.SGD(modular.local_parameters(model), lr=LR)
    return opt, dense


def _batches(args, rank: int, n: int, rows: int):
    """`n` batches: Zipf ids scattered over `rows` by a multiplicative hash."""
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    rng = np.random.default_rng([11, rank])
    out = []
    for _ in range(n):
        count = args.batch * args.tables * args.pooling
        ranks_ = rng.zipf(args.alpha, count).astype(np.uint64)
        ids = torch.from_numpy(((ranks_ * np.uint64(2_654_435_761)) % np.uint64(rows)).astype(np.int64))
        sparse = KeyedJaggedTensor(
            keys=[f"f{i}" for i in range(args.tables)], values=ids,
            lengths=torch.full((args.batch * args.tables,), args.pooling, dtype=torch.int64))  # fmt: skip
        out.append(Batch(dense_features=torch.from_numpy(rng.standard_normal((args.batch, DENSE), dtype=np.float32)),
                         sparse_features=sparse,
                         labels=torch.from_numpy((rng.random(args.batch) < 0.3).astype(np.float32))))  # fmt: skip
    return out


def _modulo(batch, rows: int):
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    s = batch.sparse_features
    kjt = KeyedJaggedTensor(keys=s.keys(), values=s.values() % rows, lengths=s.lengths())
    return Batch(dense_features=batch.dense_features, sparse_features=kjt, labels=batch.labels)


def _step(model, opts, batch, next_batch=None):
    import modular

    if next_batch is not None:
        modular.prefetch(model, next_batch.sparse_features)
    logits = model(batch.dense_features, batch.sparse_features).squeeze(-1)
    torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels).backward()
    for o in opts:
        o.step()
        o.zero_grad()


def _belady(trace: list[np.ndarray], capacity: int, skip: int) -> tuple[int, int]:
    """Belady's hits and accesses over a trace of per-step distinct ids with `capacity` slots
    (evict the id used furthest in the future), counted from step `skip` on: the steps before
    warm the cache, as they warmed the measured one."""
    counted_from = sum(x.size for x in trace[:skip])
    flat = np.concatenate(trace) if trace else np.zeros(0, np.int64)
    nxt = np.full(flat.size, np.iinfo(np.int64).max, dtype=np.int64)
    last: dict[int, int] = {}
    for i in range(flat.size - 1, -1, -1):
        v = int(flat[i])
        nxt[i] = last.get(v, np.iinfo(np.int64).max)
        last[v] = i
    cached: dict[int, int] = {}  # id -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, id), lazily cleaned
    hits = 0
    for i in range(flat.size):
        v = int(flat[i])
        if v in cached:
            hits += i >= counted_from
        elif len(cached) >= capacity:
            while True:
                neg, victim = heapq.heappop(heap)
                if cached.get(victim) == -neg:
                    del cached[victim]
                    break
        cached[v] = int(nxt[i])
        heapq.heappush(heap, (-int(nxt[i]), v))
    return hits, flat.size - counted_from


def _worker(rank: int, args, rendezvous: Rendezvous, queue) -> None:
    import warnings

    import modular

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    init_ranks(rank, args.world_size, store=rendezvous.store())
    t0 = time.perf_counter()
    tiered = _dlrm(args, args.rows, "meta")
    topts = _shard(args, tiered, os.path.join(args.dir, "tiers"), args.cache)
    built = time.perf_counter() - t0
    n = args.warmup + args.blocks * args.block
    batches = _batches(args, rank, n + 1, args.rows)
    base = status_kib("RssAnon") * 1024  # before the resident model: the tiered one's
    small = [_modulo(b, args.small_rows) for b in batches]
    ebc = tiered.sparse_arch.embedding_bag_collection
    kernels = [k for k in ebc._kernels if hasattr(k, "maps")]
    trace = {(i, t): [] for i, k in enumerate(kernels) for t in range(len(k.maps))}
    moved = looked = 0

    def tiered_step(i):
        nonlocal moved, looked
        _step(tiered, topts, batches[i], batches[i + 1])
        stats = modular.tier_stats(tiered)
        moved += sum(s["rows_fetched"] for s in stats.values())
        looked += sum(s["hits"] + s["misses"] for s in stats.values())
        for (k, t) in trace:  # the step's distinct rows of each shard: what the slots hold pinned
            m = kernels[k].maps[t]
            trace[(k, t)].append(m.id_of[m.pinned].numpy().copy())

    modular.prefetch(tiered, batches[0].sparse_features)
    for i in range(args.warmup):
        tiered_step(i)
    alone = status_kib("RssAnon") * 1024  # the tiered model after its warm-up, nothing else
    resident = _dlrm(args, args.small_rows, "cpu")
    ropts = _shard(args, resident, None, None)
    views = resident.sparse_arch.embedding_bag_collection.local_shard_views().values()
    resident_bytes = sum(v.numel() * 4 + v.shape[0] * 4 for v in views)  # rows + row-wise state
    for i in range(args.warmup):
        _step(resident, ropts, small[i])
    moved = looked = 0
    times = {"tiered": [], "resident": []}
    for b in range(args.blocks):
        for name in (("tiered", "resident") if b % 2 == 0 else ("resident", "tiered")):
            block = []
            for j in range(args.block):
                i = args.warmup + b * args.block + j
                t = time.perf_counter()
                tiered_step(i) if name == "tiered" else _step(resident, ropts, small[i])
                block.append(time.perf_counter() - t)
            times[name].append(statistics.median(max_over_ranks(block)))
    caches = sum(m.cache_rows * (args.dim + 1) * 4 for k in kernels for m in k.maps)
    anon = status_kib("RssAnon") * 1024 - resident_bytes  # the end, less the resident tables
    belady = None
    if rank == 0:
        counts = [_belady(trace[(k, t)], kernels[k].maps[t].cache_rows, args.warmup) for (k, t) in trace]
        belady = sum(h for h, _ in counts) / max(1, sum(n for _, n in counts))
    queue.put((rank, times, built, (base, alone, anon), caches, 1 - moved / max(1, looked), belady))
    del tiered, resident
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=18_900_000, help="rows per table")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--small-rows", type=int, default=1_000_000, help="the resident tables' rows")
    p.add_argument("--cache", type=float, default=0.02, help="cache_load_factor")
    p.add_argument("--alpha", type=float, default=1.05, help="Zipf exponent of the ids")
    p.add_argument("--batch", type=int, default=2048, help="samples per rank")
    p.add_argument("--pooling", type=int, default=1)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--blocks", type=int, default=9, help="alternating blocks of each contender")
    p.add_argument("--block", type=int, default=20, help="steps per block")
    p.add_argument("--dir", default=None, help="where the tier files go (default: a temp dir)")
    p.add_argument("--quick", action="store_true", help="200k rows per table, 3 blocks of 10")
    args = p.parse_args()
    if args.quick:
        args.rows, args.small_rows, args.blocks, args.block, args.warmup = 200_000, 50_000, 3, 10, 5
        args.cache = max(args.cache, 0.05)
    owned = args.dir is None
    args.dir = tempfile.mkdtemp(prefix="tiered_step.", dir=args.dir or "/tmp")
    table_bytes = args.tables * args.rows * args.dim * 4
    with open("/proc/meminfo") as f:
        ram = int(f.readline().split()[1]) * 1024
    print(f"## Tiered DLRM: {args.tables} tables x {args.rows:,} rows x {args.dim} "
          f"({table_bytes / 2**30:.1f} GiB of tables; RAM {ram / 2**30:.1f} GiB), row-wise, "
          f"cache_load_factor {args.cache} (LRU), fused row-wise Adagrad, Zipf {args.alpha}, batch "
          f"{args.batch} x {args.pooling} ids per rank, {args.world_size} gloo ranks "
          f"({os.cpu_count()} cores), prefetch on, {datetime.date.today().isoformat()}, "
          f"torch {torch.__version__}\n")  # fmt: skip
    try:
        results = run_ranks(_worker, (args,), args.world_size)
    finally:
        shutil.rmtree(args.dir if owned else os.path.join(args.dir), ignore_errors=True)
    times = results[0][1]
    tier, res = statistics.median(times["tiered"]), statistics.median(times["resident"])
    print("| rank | built (s) | RssAnon GiB: built, warmed up, at the end less the resident model's "
          "tables | caches + 2 GiB | hit rate |\n|---|---:|---:|---:|---:|")
    for rank, _, built, anon, caches, hit, _ in results:
        gib = ", ".join(f"{a / 2**30:.2f}" for a in anon)
        print(f"| {rank} | {built:.0f} | {gib} | {(caches + 2**31) / 2**30:.2f} | {hit:.3f} |")
    print(f"\nsteady step: tiered {1e3 * tier:.1f} ms, resident ({args.small_rows:,} rows) "
          f"{1e3 * res:.1f} ms; tiered / resident {tier / res:.2f} (target <= 1.5); block medians "
          f"tiered {', '.join(f'{1e3 * x:.0f}' for x in times['tiered'])}, resident "
          f"{', '.join(f'{1e3 * x:.0f}' for x in times['resident'])}")
    print(f"hit rate of rank 0's caches {results[0][5]:.3f}; Belady's on the same trace "
          f"{results[0][6]:.3f}")


if __name__ == "__main__":
    main()
