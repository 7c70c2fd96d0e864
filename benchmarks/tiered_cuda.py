"""Issue 47 on a GPU: modular's tiered tables (a GPU cache over pinned host memory) against
TorchRec's FUSED_UVM_CACHING (fbgemm's GPU cache over UVM), side by side in one process.

    python benchmarks/tiered_cuda.py                     # 8 x 8,388,608 x 128 FP32: 32 GiB of tables
    python benchmarks/tiered_cuda.py --quick             # 8 x 1,048,576 rows, 3 blocks of 10: a check
    python benchmarks/tiered_cuda.py --device cpu --quick --world-size 1   # the harness on CPU

A DLRM (examples/dlrm's: 13 dense features, dense arch 64-D, over arch 64-1) whose `--tables` tables
of `--rows` x `--dim` FP32 are trained with fused exact row-wise Adagrad on Zipf ids (alpha
`--alpha`, scattered over the rows by a multiplicative hash), `--batch` samples of `--pooling`
ids per table and rank; the dense part takes torch's SGD. `--world-size 1` is one GPU (NCCL);
2 on a machine of one GPU puts two ranks on it over gloo (as benchmarks/step_time.py's
`--cuda-backend gloo` does). Contenders,
each built from a meta EBC, all alive at once, timed in alternating blocks of `--block` steps
after `--warmup` steps each, every step between two `torch.cuda.synchronize()`:

  tiered     modular: `planners.plan` with `TableConstraint(cache_load_factor=--cache,
             cache_policy="lru", sharding_types=(--sharding,))` on every table, `modular.shard`
             under MODULAR_CUDA_TIERS=1 (rows and state in pinned host memory, the cache in
             fbgemm's kernel on the GPU), `modular.prefetch` of the next batch every step
  uvm        TorchRec: torchrec's own EmbeddingShardingPlanner with ParameterConstraints(
             compute_kernels=["fused_uvm_caching"], cache_params=CacheParams(load_factor=--cache,
             algorithm=LRU), sharding_types=[--sharding]) and DistributedModelParallel; fbgemm
             gathers its cache statistics (`gather_uvm_cache_stats=True` in fused_params)
  resident   modular with `--resident-rows` rows per table (default: all of them) in HBM, fed
             the same ids (modulo its rows): what the cache costs against no cache. 0 skips it

Reported per contender: the steady step (median over blocks of the block median, the slowest
rank's), the hit rate over the timed steps (1 - rows brought into the cache / distinct rows
looked up, per table and step: `modular.tier_stats`' rows_fetched over hits + misses, and
fbgemm's num_unique_misses over num_unique_indices for TorchRec), the GPU memory it holds
(`torch.cuda.memory_allocated` and the driver's used memory, before and after it is built), the
peak of its steps over what it holds (`torch.cuda.max_memory_allocated` per block), and its
host memory (VmRSS before and after it is built); and tiered / uvm. With the resident tables
of the same rows, the losses of tiered and resident are compared step by step (tiered tables
train like resident ones: Note [tiered tables] in modular/tiered/__init__.py). A markdown table
goes to stdout and, with `--json` (default $OUT/tiered_cuda.json where OUT is set), a JSON. A
contender that fails to build or to warm up is reported as not run, with its error, on every
rank, and the others still run.

`--device cpu` runs the same harness on CPU gloo ranks (the tier in files under a temporary
directory), with TorchRec's plain "fused" kernel in place of fused_uvm_caching, which CPU does
not have: a check of the script, not a figure.

Rows default to a power of two: torch's pinned-memory allocator rounds an allocation under its
threshold up to the next power of two, and 8 x 10M x 128 x 4 bytes would pin 64 GiB, not 38.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Callable, Optional

# The CUDA tier is off unless this is set (modular/tiered/tier_plan.py); the spawned ranks
# inherit it.
os.environ.setdefault("MODULAR_CUDA_TIERS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks._common import (  # noqa: E402
    add_device_args, check_device_args, init_ranks, max_over_ranks, run_ranks, status_kib,
)  # fmt: skip

LR, EPS, DENSE = 0.05, 1e-8, 13
SHARDINGS = ("table_wise", "row_wise")


def table_configs(tables: int, rows: int, dim: int) -> list:
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    init = functools.partial(init_rows, bound=rows**-0.5)  # torchrec's default bounds
    return [EmbeddingBagConfig(name=f"t{i}", num_embeddings=rows, embedding_dim=dim,
                               feature_names=[f"f{i}"], init_fn=init) for i in range(tables)]  # fmt: skip


@torch.no_grad()  # TorchRec calls it on its shards' parameters too
def init_rows(weight: torch.Tensor, *, bound: float) -> None:
    """A meta table's init_fn, which `modular.shard` runs on each shard under a seeded CPU
    generator (Note [shard init]): uniform in [-bound, bound], drawn on the GPU where there is
    one, from a seed taken from that generator, whatever the shard's own device. A tiered
    shard on a GPU rank lives in host memory and a resident one on the GPU, and a draw on each
    one's own device would give them different values (the CPU's generator and the GPU's
    differ), so the losses could not be compared; drawing 32 GiB on the CPU also takes ~40 s."""
    seed = int(torch.randint(0, 2**62, (1,)))
    on = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    generator = torch.Generator(on).manual_seed(seed)
    drawn = torch.empty(weight.shape, device=on).uniform_(-bound, bound, generator=generator)
    weight.copy_(drawn)


def dlrm(tables: list, dense_device: torch.device):
    """The example's DLRM (examples/dlrm/model.py: dense arch 64-D, dot interaction, over arch
    64-1) of `tables`, with its EBC on meta (each contender fills its own shards) and its dense
    part, the same on every call, on `dense_device`. Not torchrec.models.dlrm: the GPU
    machine's torchrec 1.6.1 imports torchrec.datasets there, which needs iopath, not packed."""
    from examples.dlrm import DLRM

    torch.manual_seed(0)
    model = DLRM(tables, bottom_mlp=[64, tables[0].embedding_dim], top_mlp=[64], dense_in_features=DENSE,
                 device="meta")  # fmt: skip
    model.dense.to(dense_device)
    model.over.to(dense_device)
    return model


def torchrec_uvm_plan(
    tables: list, *, world_size: int, cache: Optional[float], sharding: str, batch: int,
    device_memory: int, host_memory: int, compute_device: str = "cuda", devices: Optional[int] = None,
):  # fmt: skip
    """TorchRec's own plan for a DLRM of `tables` (its EBC at "sparse.ebc"), from its
    EmbeddingShardingPlanner: every table `sharding`, under fused_uvm_caching with a cache of
    `cache` of its rows (LRU), or under the plain "fused" kernel where `cache` is None (the CPU
    stand-in). Planning needs no GPU; the plan names `compute_device`'s devices, `devices` of
    them per host (default one per rank)."""
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.types import CacheAlgorithm, CacheParams

    if cache is None:
        kernel, params = EmbeddingComputeKernel.FUSED.value, None
    else:
        kernel = EmbeddingComputeKernel.FUSED_UVM_CACHING.value
        params = CacheParams(load_factor=cache, algorithm=CacheAlgorithm.LRU)
    constraints = {
        t.name: ParameterConstraints(
            sharding_types=[sharding], compute_kernels=[kernel], cache_params=params
        )
        for t in tables
    }  # fmt: skip
    topology = Topology(world_size=world_size, compute_device=compute_device, hbm_cap=device_memory,
                        ddr_cap=host_memory, local_world_size=devices or world_size)  # fmt: skip
    planner = EmbeddingShardingPlanner(topology=topology, constraints=constraints, batch_size=batch)
    return planner.plan(dlrm(tables, torch.device("meta")), [_sharder()])


def _sharder():
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": LR, "eps": EPS}
    # fbgemm's UVM cache counts its unique ids and misses per call (a kernel without a cache,
    # the CPU stand-in's, takes the flag and counts nothing)
    fused["gather_uvm_cache_stats"] = True
    return EmbeddingBagCollectionSharder(fused_params=fused)


def modular_plan(model, *, world_size: int, cache: Optional[float], sharding: str,
                 batch: int, device_memory: int, host_memory: int, on_gpu: bool):  # fmt: skip
    """modular's plan of `model`, a DLRM, as a user makes it: `planners.plan` with each table's
    `TableConstraint` (tiered with a cache of `cache` of its rows, LRU, unless None)."""
    import planners

    extra = {} if cache is None else {"cache_load_factor": cache, "cache_policy": "lru"}
    kind = planners.ShardingType.parse(sharding)
    constraints = {t.name: planners.TableConstraint(sharding_types=(kind,), **extra)
                   for t in model.sparse.ebc.embedding_bag_configs()}  # fmt: skip
    topology = planners.Topology(
        world_size=world_size, ranks_per_host=world_size, device_memory=device_memory,
        host_memory=host_memory, tier_memory=host_memory, tier_bandwidth=25e9 if on_gpu else 2e9,
    )  # fmt: skip
    return planners.plan(model, topology, batch_size=batch, constraints=constraints)


def batches(args, rank: int, n: int, rows: int, device: torch.device) -> list:
    """`n` batches on `device`: Zipf ids scattered over `rows` by a multiplicative hash (so that
    hot rows are spread over shards), the same on every call with the same rank."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from examples.dlrm import Batch

    rng = np.random.default_rng([11, rank])
    out = []
    for _ in range(n):
        ranks_ = rng.zipf(args.alpha, args.batch * args.tables * args.pooling).astype(np.uint64)
        ids = torch.from_numpy(((ranks_ * np.uint64(2_654_435_761)) % np.uint64(rows)).astype(np.int64))
        sparse = KeyedJaggedTensor(
            keys=[f"f{i}" for i in range(args.tables)], values=ids,
            lengths=torch.full((args.batch * args.tables,), args.pooling, dtype=torch.int64))  # fmt: skip
        dense = torch.from_numpy(rng.standard_normal((args.batch, DENSE), dtype=np.float32))
        labels = torch.from_numpy((rng.random(args.batch) < 0.3).astype(np.float32))
        out.append(Batch(dense=dense.to(device), sparse=sparse.to(device), labels=labels.to(device)))
    return out


def _modulo(batch, rows: int):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from examples.dlrm import Batch

    s = batch.sparse
    kjt = KeyedJaggedTensor(keys=s.keys(), values=s.values() % rows, lengths=s.lengths())
    return Batch(dense=batch.dense, sparse=kjt, labels=batch.labels)


class Contender:
    """One model, its optimizers, its batches and what it measured."""

    def __init__(self, name: str, model, opts: list, data: list, *, prefetch: bool) -> None:
        self.name, self.model, self.opts, self.data, self.prefetch = name, model, opts, data, prefetch
        self.losses: list[torch.Tensor] = []
        self.blocks: list[float] = []
        self.peaks: list[int] = []  # per block: max_memory_allocated over allocated at its start
        self.held = self.driver_used = self.host = 0  # bytes, from its build

    def step(self, i: int) -> None:
        import modular

        batch = self.data[i]
        if self.prefetch:
            modular.prefetch(self.model, self.data[i + 1].sparse)
        logits = self.model(batch.dense, batch.sparse)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        loss.backward()
        for o in self.opts:
            o.step()
            o.zero_grad()
        self.losses.append(loss.detach())


def _build_modular(args, name: str, device: torch.device, rows: int, cache: Optional[float], data: list):
    import modular

    model = dlrm(table_configs(args.tables, rows, args.dim), device)
    plan = modular_plan(model, world_size=args.world_size, cache=cache, sharding=args.sharding,
                        batch=args.batch, device_memory=args.device_memory,
                        host_memory=args.host_memory, on_gpu=device.type == "cuda")  # fmt: skip
    opt = modular.fuse_optimizer(model, "exact_rowwise_adagrad", lr=LR, eps=EPS)
    tier_dir = os.path.join(args.dir, "tiers") if cache is not None and device.type == "cpu" else None
    modular.shard(model, plan, device=device, tier_dir=tier_dir)
    if args.world_size > 1:  # a world of one has nothing to all-reduce (TorchRec's DDP of one rank
        modular.apply_ddp(model)  # all-reduces nothing either)
    dense = torch.optim.SGD(modular.local_parameters(model), lr=LR)
    return Contender(name, model, [opt, dense], data, prefetch=not args.no_prefetch)


def _build_uvm(args, device: torch.device, data: list):
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    cache = args.cache if device.type == "cuda" else None  # CPU: the plain fused kernel
    plan = torchrec_uvm_plan(
        table_configs(args.tables, args.rows, args.dim), world_size=args.world_size, cache=cache,
        sharding=args.sharding, batch=args.batch, device_memory=args.device_memory,
        host_memory=args.host_memory, compute_device=device.type,
        # ranks sharing a GPU: as many "hosts" of it, so that rank r's shards name cuda:0, which
        # it has, not cuda:r
        devices=min(args.world_size, torch.cuda.device_count()) if device.type == "cuda" else None,
    )  # fmt: skip
    model = DistributedModelParallel(
        dlrm(table_configs(args.tables, args.rows, args.dim), device),
        env=ShardingEnv.from_process_group(dist.group.WORLD), device=device, plan=plan,
        sharders=[_sharder()],
    )  # fmt: skip
    dense = list(dict(in_backward_optimizer_filter(model.named_parameters())).values())
    return Contender("uvm", model, [torch.optim.SGD(dense, lr=LR)], data, prefetch=False)


def uvm_tbes(model) -> list:
    """fbgemm's TBEs of a DMP that gather UVM cache statistics. TorchRec keeps them out of
    `modules()`: a sharded EBC's `_lookups`, each lookup's `_emb_modules`, each one's
    `_emb_module`."""
    out = []
    for m in model.modules():
        for lookup in getattr(m, "_lookups", ()):
            for emb in getattr(lookup, "_emb_modules", ()):
                if getattr(emb._emb_module, "gather_uvm_cache_stats", False):
                    out.append(emb._emb_module)
    return out


def _memory(device: torch.device) -> tuple[int, int, int]:
    """(torch's allocated bytes, the driver's used bytes, this process's VmRSS) now."""
    if device.type != "cuda":
        return 0, 0, status_kib("VmRSS") * 1024
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return torch.cuda.memory_allocated(), total - free, status_kib("VmRSS") * 1024


def _built(build: Callable[[], Contender], device: torch.device) -> Contender:
    before = _memory(device)
    contender = build()
    if device.type == "cuda":  # what init drew (`init_rows`) goes back to the driver
        torch.cuda.empty_cache()
    after = _memory(device)
    contender.held, contender.driver_used, contender.host = (a - b for a, b in zip(after, before))
    return contender


def _block(c: Contender, device: torch.device, start: int, n: int) -> None:
    on_gpu = device.type == "cuda"
    _sync(device)
    if on_gpu:
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(start, start + n):
        t = time.perf_counter()
        c.step(i)
        _sync(device)
        times.append(time.perf_counter() - t)
    c.blocks.append(statistics.median(max_over_ranks(times)))
    if on_gpu:
        c.peaks.append(torch.cuda.max_memory_allocated() - base)


def _start_counting(c: Contender) -> None:
    import modular

    if c.name == "tiered":
        modular.tier_stats(c.model)  # counts restart at each call
    elif c.name == "uvm":
        for tbe in uvm_tbes(c.model):
            tbe.reset_uvm_cache_stats()


def _hit_rate(c: Contender) -> Optional[dict]:
    """Over the timed steps: distinct rows looked up and those brought into the cache."""
    import modular

    if c.name == "tiered":
        stats = modular.tier_stats(c.model).values()
        looked = sum(s["hits"] + s["misses"] for s in stats)
        fetched = sum(s["rows_fetched"] for s in stats)
        return {"looked_up": looked, "fetched": fetched, "step_misses": sum(s["misses"] for s in stats),
                "hit_rate": 1 - fetched / max(1, looked)}  # fmt: skip
    if c.name == "uvm" and uvm_tbes(c.model):
        # fbgemm's UVMCacheStatsIndex: 2 num_unique_indices, 3 num_unique_misses, 4
        # num_conflict_unique_misses (rows its 32-way sets could not take, read from UVM in
        # place), per call; none counted where the kernel has no cache (the CPU stand-in)
        tbes = uvm_tbes(c.model)
        counts = sum(tbe.get_uvm_cache_stats().cpu() for tbe in tbes)
        looked, missed = int(counts[2]), int(counts[3])
        return {"tbes": len(tbes), "looked_up": looked, "fetched": missed,
                "conflict_misses": int(counts[4]), "hit_rate": 1 - missed / looked if looked else None}  # fmt: skip
    return None


def _agreed(what, rank: int) -> tuple[object, Optional[str]]:
    """`what()`, or the error it raised on any rank, on every rank alike: a contender that fails
    to build or warm up (out of memory, an API the GPU machine's torchrec lacks) is reported as
    not run, and the others still run. A rank that fails inside a collective still leaves its
    peers waiting there, at the process group's timeout."""
    from modular.comm import collective_device

    try:
        value, why = what(), None
    except Exception as e:  # reported, on every rank: the point of a first run on a device
        first = str(e).splitlines()[0][:300] if str(e) else ""
        value, why = None, f"rank {rank}: {type(e).__name__}: {first}"
    failed = torch.tensor([why is not None], dtype=torch.int32, device=collective_device(None))
    dist.all_reduce(failed)
    if failed.item() and why is None:
        why = "failed on another rank"
    return (None if why else value), why


def _worker(rank: int, args, rendezvous, queue) -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    if args.device == "cpu":
        torch.set_num_threads(1)
    else:  # the host store's gathers and the tables' init run on the CPU: share its cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world_size))
    device = init_ranks(rank, args.world_size, args.device, args.cuda_backend, store=rendezvous.store())
    n = args.warmup + args.blocks * args.block
    data = batches(args, rank, n + 1, args.rows, device)
    builders = {"tiered": lambda: _build_modular(args, "tiered", device, args.rows, args.cache, data)}
    if not args.no_torchrec:
        builders["uvm"] = lambda: _build_uvm(args, device, data)
    if args.resident_rows:  # its own batches (the same ids, modulo its rows): its own prefetches
        small = [_modulo(b, args.resident_rows) for b in data]
        builders["resident"] = lambda: _build_modular(
            args, "resident", device, args.resident_rows, None, small
        )
    contenders, seconds, failed = {}, {}, {}
    for name, build in builders.items():
        t0 = time.perf_counter()
        c, why = _agreed(lambda: _built(build, device), rank)
        seconds[name] = time.perf_counter() - t0
        _progress(rank, f"{name} built in {seconds[name]:.1f} s" if c else f"{name} not built: {why}")
        if c is None:
            failed[name] = f"not built: {why}"
            continue
        t0 = time.perf_counter()
        _, why = _agreed(lambda: _warm_up(c, args.warmup, device), rank)
        seconds[name + " warm-up"] = time.perf_counter() - t0
        _progress(rank, f"{name} warmed up in {seconds[name + ' warm-up']:.1f} s" if not why
                  else f"{name} failed in warm-up: {why}")  # fmt: skip
        if why:
            failed[name] = f"failed in warm-up: {why}"
            continue
        _start_counting(c)
        contenders[name] = c
    order = list(contenders.values())
    for b in range(args.blocks):
        for c in order if b % 2 == 0 else order[::-1]:
            _block(c, device, args.warmup + b * args.block, args.block)
        _progress(rank, f"block {b + 1} of {args.blocks}: " + ", ".join(
            f"{c.name} {1e3 * c.blocks[-1]:.1f} ms" for c in order))  # fmt: skip
    result = {"rank": rank, "seconds": seconds, "hwm": status_kib("VmHWM") * 1024, "contenders": {},
              "not_run": failed}  # fmt: skip
    for c in contenders.values():
        result["contenders"][c.name] = {
            "step_s": statistics.median(c.blocks), "blocks_s": c.blocks, "hit": _hit_rate(c),
            "held": c.held, "driver_used": c.driver_used, "host": c.host,
            "step_peak": max(c.peaks) if c.peaks else None,
            "peak": c.held + max(c.peaks) if c.peaks else None,
            "losses": torch.stack(c.losses).float().cpu().tolist(),
        }  # fmt: skip
    queue.put((rank, result))
    del contenders, order
    dist.barrier()
    dist.destroy_process_group()


def _progress(rank: int, line: str) -> None:
    """A line as it happens (rank 0's), so that a run cut short still says how far it got."""
    if rank == 0:
        print(f"[{time.strftime('%H:%M:%S')}] {line}", flush=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _warm_up(c: Contender, steps: int, device: torch.device) -> None:
    for i in range(steps):
        c.step(i)
    _sync(device)


def _gib(x: Optional[int]) -> str:
    return "-" if x is None else f"{x / 2**30:.2f}"


def _gpu_gib(args, x: Optional[int]) -> str:
    return _gib(x) if args.device == "cuda" else "-"


def report(args, results: list[dict]) -> tuple[str, dict]:
    """The markdown table and the JSON of rank 0's view (steps are the slowest rank's)."""
    r0 = results[0]["contenders"]
    kernel = "fused_uvm_caching" if args.device == "cuda" else "fused (CPU stand-in, no UVM on CPU)"
    fetch = "no prefetch" if args.no_prefetch else "prefetch"
    names = {"tiered": f"modular tiered (cache {args.cache}, LRU, {fetch})",
             "uvm": f"TorchRec DMP, {kernel}" + (f" (cache {args.cache}, LRU)" if args.device == "cuda"
                                                 else ""),
             "resident": f"modular resident ({args.resident_rows:,} rows in {args.device} memory)"}  # fmt: skip
    lines = ["| contender | step (ms) | block medians (ms) | hit rate | GPU held GiB (torch, driver) "
             "| GPU peak GiB (held + its steps' max_memory_allocated over it) "
             "| host RSS GiB (growth at build) |",
             "|---|---:|---|---:|---:|---:|---:|"]  # fmt: skip
    for name, c in r0.items():
        rate = None if c["hit"] is None else c["hit"]["hit_rate"]
        hit = "not reported" if rate is None else f"{rate:.3f}"
        if c["hit"] is not None and c["hit"].get("step_misses"):
            hit += f" ({c['hit']['step_misses']:,} misses at steps)"
        lines.append(
            f"| {names[name]} | {1e3 * c['step_s']:.1f} "
            f"| {', '.join(f'{1e3 * x:.0f}' for x in c['blocks_s'])} | {hit} "
            f"| {_gpu_gib(args, c['held'])}, {_gpu_gib(args, c['driver_used'])} "
            f"| {_gpu_gib(args, c['peak'])} | {_gib(c['host'])} |"
        )  # fmt: skip
    summary = {}
    if "uvm" in r0 and "tiered" in r0:
        summary["tiered_over_uvm"] = r0["tiered"]["step_s"] / r0["uvm"]["step_s"]
        lines.append(f"\ntiered / TorchRec {kernel}: {summary['tiered_over_uvm']:.2f}")
    if "resident" in r0 and "tiered" in r0:
        summary["tiered_over_resident"] = r0["tiered"]["step_s"] / r0["resident"]["step_s"]
        lines.append(f"tiered / resident: {summary['tiered_over_resident']:.2f}")
        if args.resident_rows == args.rows:
            diff = max(max(abs(a - b) for a, b in zip(r["contenders"]["tiered"]["losses"],
                                                       r["contenders"]["resident"]["losses"]))
                       for r in results)  # fmt: skip
            summary["loss_diff_tiered_resident"] = diff
            lines.append(f"largest |loss tiered - loss resident| over {args.warmup + args.blocks * args.block} "
                         f"steps and every rank: {diff:.3g} (the same tables, the same ids)")  # fmt: skip
    for name, why in results[0]["not_run"].items():
        lines.append(f"{names[name]}: not run, {why}")
    for r in results:
        secs = ", ".join(f"{k} {v:.1f} s" for k, v in r["seconds"].items())
        lines.append(f"rank {r['rank']}: {secs}; peak RSS (VmHWM) {_gib(r['hwm'])} GiB")
    return "\n".join(lines), {"args": vars(args), "summary": summary, "ranks": results}


def parse(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=1 << 23, help="rows per table (default 8,388,608)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--cache", type=float, default=0.05, help="cache_load_factor, both contenders")
    p.add_argument("--resident-rows", type=int, default=None,
                   help="the resident contender's rows per table (default --rows; 0: none)")
    p.add_argument("--sharding", choices=SHARDINGS, default="table_wise")
    p.add_argument("--alpha", type=float, default=1.05, help="Zipf exponent of the ids")
    p.add_argument("--batch", type=int, default=16384, help="samples per rank")
    p.add_argument("--pooling", type=int, default=1, help="ids per table and sample")
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--warmup", type=int, default=20, help="steps of each contender before timing")
    p.add_argument("--blocks", type=int, default=6, help="alternating blocks of each contender")
    p.add_argument("--block", type=int, default=20, help="steps per block")
    p.add_argument("--no-torchrec", action="store_true", help="no TorchRec contender")
    p.add_argument("--no-prefetch", action="store_true", help="modular's contenders without modular.prefetch")
    p.add_argument("--dir", default=None, help="--device cpu: where the tier files go (default a temp dir)")
    p.add_argument("--json", default=None,
                   help="where the JSON goes (default $OUT/tiered_cuda.json if OUT is set)")
    p.add_argument("--quick", action="store_true", help="1,048,576 rows per table, 3 blocks of 10 after 5")
    add_device_args(p)
    p.set_defaults(device="cuda", cuda_backend=None)
    a = p.parse_args(argv)
    # One rank per GPU over NCCL where there are enough; else the ranks share them over gloo.
    if a.cuda_backend is None:
        a.cuda_backend = "nccl" if a.world_size <= torch.cuda.device_count() else "gloo"
    if a.quick:
        a.rows, a.blocks, a.block, a.warmup = 1 << 20, 3, 10, 5
        a.batch = min(a.batch, 4096)
    a.resident_rows = a.rows if a.resident_rows is None else a.resident_rows
    if a.json is None and os.environ.get("OUT"):
        a.json = os.path.join(os.environ["OUT"], "tiered_cuda.json")
    for flag, value, low in (("--tables", a.tables, 1), ("--rows", a.rows, 1), ("--batch", a.batch, 1),
                             ("--pooling", a.pooling, 1), ("--world-size", a.world_size, 1),
                             ("--blocks", a.blocks, 1), ("--block", a.block, 1), ("--warmup", a.warmup, 0),
                             ("--resident-rows", a.resident_rows, 0)):  # fmt: skip
        if value < low:
            p.error(f"{flag} must be at least {low}, got {value}")
    if not 0 < a.cache <= 1:
        p.error(f"--cache is a cache_load_factor, 0 < f <= 1, got {a.cache}")
    if a.dim % 4:
        p.error(f"--dim {a.dim}: fbgemm's fused kernels take widths that are multiples of 4")
    if a.resident_rows > a.rows:
        p.error(f"--resident-rows {a.resident_rows:,} is more than --rows {a.rows:,}")
    check_device_args(p, a)
    with open("/proc/meminfo") as f:
        a.host_memory = int(f.readline().split()[1]) * 1024
    on_gpu = a.device == "cuda"
    a.device_memory = torch.cuda.get_device_properties(0).total_memory if on_gpu else 80 * 2**30
    _check_memory(p, a)
    return a


def _check_memory(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Refuses a size whose tables (4 bytes a value, row-wise Adagrad's one per row) would not
    fit beside each other: on the host the tiered tables and TorchRec's UVM tables (both whole
    there; on CPU the tier's files count as page cache, not here); on the device the resident
    tables and both caches. Per machine, every rank's share together."""
    row = 4 * (a.dim + 1)
    tables = a.tables * a.rows * row
    caches = 2 * a.tables * math.ceil(a.rows * a.cache) * row
    resident = a.tables * a.resident_rows * row
    if a.device == "cuda":
        host = tables * (1 if a.no_torchrec else 2)
        if host > 0.8 * a.host_memory:
            p.error(f"{a.tables} tables x {a.rows:,} rows x {a.dim} take {tables / 2**30:.1f} GiB of host "
                    f"memory per contender, {host / 2**30:.1f} GiB in all, over 80% of this machine's "
                    f"{a.host_memory / 2**30:.1f} GiB: pass fewer --rows or --no-torchrec")  # fmt: skip
        gpus = max(1, min(a.world_size, torch.cuda.device_count()))
        device = (resident + caches) / gpus
        if device > 0.85 * a.device_memory:
            p.error(f"the resident tables ({resident / 2**30:.1f} GiB) and both caches "
                    f"({caches / 2**30:.1f} GiB) take {device / 2**30:.1f} GiB per GPU, over 85% of "
                    f"its {a.device_memory / 2**30:.1f} GiB: pass fewer --resident-rows (0: none)")  # fmt: skip
    elif resident + tables > 0.5 * a.host_memory:  # TorchRec's stand-in and the resident tables
        p.error(f"--device cpu holds {(resident + tables) / 2**30:.1f} GiB of tables in memory, over half "
                f"of this machine's {a.host_memory / 2**30:.1f} GiB: pass fewer --rows")  # fmt: skip


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse(argv)
    args.dir = tempfile.mkdtemp(prefix="tiered_cuda.", dir=args.dir)  # removed at the end
    table_bytes = args.tables * args.rows * args.dim * 4
    if args.device == "cuda":
        where = f"{torch.cuda.get_device_name()}, {args.world_size} rank(s) over {args.cuda_backend}"
    else:
        where = f"CPU, {args.world_size} gloo rank(s)"
    print(f"## Tiered DLRM on {where}: {args.tables} tables x {args.rows:,} rows x {args.dim} FP32 "
          f"({table_bytes / 2**30:.1f} GiB of tables; host RAM {args.host_memory / 2**30:.0f} GiB), "
          f"{args.sharding}, cache_load_factor {args.cache} (LRU), fused row-wise Adagrad, Zipf "
          f"{args.alpha}, batch {args.batch} x {args.pooling} ids per table and rank, "
          f"{args.warmup} warm-up steps then {args.blocks} alternating blocks of {args.block}, "
          f"{datetime.date.today().isoformat()}, torch {torch.__version__}\n", flush=True)  # fmt: skip
    try:
        results = [r for _, r in run_ranks(_worker, (args,), args.world_size)]
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    table, out = report(args, results)
    print(table)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return out


if __name__ == "__main__":
    main()
