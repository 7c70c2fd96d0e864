"""Issue 51's peak-RSS check: each rank's peak RSS growth over `fuse_optimizer` + `shard` + one
step, against the planner's prediction for that rank: `plan_stats(...).ranks[r].memory`, or with
`--meta` the larger of its `peak` (held + the runtime's + the larger of the batch's buffers and
an unfused optimizer's step temporaries) and `shard_peak` (what `shard` holds as it ends).

    python benchmarks/rss_growth.py                 # tables x100 the suite's: 40-200 MB a config
    python benchmarks/rss_growth.py --scale 1000    # 0.4-2 GB a config

The configurations are benchmarks/_memory_configs.py's (tests/modular/test_memory_prices.py's) (fused and unfused optimizers,
every sharding kind, FP32 and FP16), their row counts times `--scale`, each on 2 fresh gloo
ranks: a materialised EBC is built, the RSS read (VmRSS), the peak reset (/proc/self/clear_refs),
then `fuse_optimizer` (fused configurations) + `shard` + one step on uniform ids (+ the torch
optimizer's step, unfused), and the peak (VmHWM) read. Target (issue 51): within +-15%.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import sys
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks._common import init_ranks, run_ranks, status_kib  # noqa: E402
from benchmarks._rendezvous import Rendezvous  # noqa: E402


def _configs(scale: int, random: tuple[int, int, int] | None = None) -> dict:
    """name -> (optimizer, specs with rows x `scale`, world, batch, pooling): the suite's, or
    `random` = (seed, count, world) seeded random ones (benchmarks/_memory_configs.py)."""
    from benchmarks import _memory_configs as configs

    if random is None:
        drawn = {k: (o, specs, configs.WORLD, configs.BATCH, configs.POOLING) for k, (o, specs) in configs.CONFIGS.items()}
    else:
        seed, count, world = random
        drawn = {k: (o, specs, world, b, p) for k, (o, specs, b, p) in configs.random_configs(seed, count, world).items()}
    return {k: (o, [(r * scale, d, dt, kind, n) for r, d, dt, kind, n in specs], w, b, p)
            for k, (o, specs, w, b, p) in drawn.items()}  # fmt: skip


def _worker(rank: int, name: str, scale: int, meta: bool, random, rendezvous: Rendezvous, queue) -> None:
    import modular
    import planners
    from benchmarks import _memory_configs as configs
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    optimizer, specs, world, batch, pooling = _configs(scale, random)[name]
    init_ranks(rank, world, store=rendezvous.store())
    plan, stats = configs.plan_specs(optimizer, specs, world, batch, pooling, device_memory="64GiB")  # resident
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=f"t{i}", num_embeddings=rows, embedding_dim=dim, feature_names=[f"f{i}"],
                           data_type=configs.DTYPES[dtype])
        for i, (rows, dim, dtype, _, _) in enumerate(specs)], device=torch.device("meta" if meta else "cpu"))  # fmt: skip
    gc.collect()
    before = status_kib("VmRSS") * 1024
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := the RSS now
    unfused = optimizer in configs.TORCH_OPTIMIZERS
    if not unfused:
        modular.fuse_optimizer(ebc, planners.Optimizer.parse(optimizer).fused_name, lr=0.01)
    modular.shard(ebc, plan)
    opt = configs.TORCH_OPTIMIZERS[optimizer](modular.local_parameters(ebc)) if unfused else None
    gen = torch.Generator().manual_seed(1000 * rank + 7)
    keys = [f"f{i}" for i in range(len(specs))]
    ids = [torch.randint(0, rows, (batch * pooling,), generator=gen) for rows, *_ in specs]
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.cat(ids),
                                              lengths=torch.full((batch * len(keys),), pooling))  # fmt: skip
    ebc(kjt).values().float().sum().backward()
    if opt is not None:
        opt.step()
    # On meta, everything is new: the larger of the step's peak (held + the runtime's + the larger
    # of the batch and an unfused optimizer's step temporaries, Note [pricing step transients],
    # Note [pricing a step's runtime]) and shard's (weights, fused state and the largest table it
    # initialises whole, Note [pricing meta init], freed before the step: `shard_peak`). A materialised model's growth is net of
    # the weights shard frees, which the step's temporaries then reuse: its memory and the runtime's.
    r = stats.ranks[rank]
    predicted = max(r.peak, r.shard_peak) if meta else r.memory + r.runtime
    parts = (r.held, r.batch, r.step_transient, r.meta_init)
    queue.put((rank, optimizer, status_kib("VmHWM") * 1024 - before, predicted, parts))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", type=int, default=100, help="row counts times the suite's")
    p.add_argument("--meta", action="store_true",
                   help="build the model on meta: shard materialises each rank's shards, so the growth is all "
                        "of what the rank holds (a materialised model's growth is net of its freed weights)")
    p.add_argument("--random", type=int, default=0, metavar="N",
                   help="N seeded random configurations (any optimizer, kind, dtype, batch, pooling) instead")
    p.add_argument("--seed", type=int, default=51)
    p.add_argument("--world-size", type=int, default=2, help="ranks of the random configurations")
    args = p.parse_args()
    random = (args.seed, args.random, args.world_size) if args.random else None
    print(f"## Peak RSS growth over fuse_optimizer + shard + one step against the predicted total, "
          f"tables x{args.scale}{' on meta' if args.meta else ''}, "
          f"{f'{args.random} random configurations (seed {args.seed}) on {args.world_size}' if args.random else '2'} "
          f"gloo ranks ({os.cpu_count()} cores), "
          f"{datetime.date.today().isoformat()}, torch {torch.__version__}\n")  # fmt: skip
    print("| config | optimizer | rank | predicted MiB | peak growth MiB | ratio | held / batch / step-temp / meta-init MiB |\n"
          "|---|---|---|---:|---:|---:|---:|")
    ratios = []
    for name, (_, _, world, _, _) in _configs(args.scale, random).items():  # fresh ranks for each
        for rank, optimizer, growth, predicted, parts in run_ranks(_worker, (name, args.scale, args.meta, random), world):
            ratios.append(growth / predicted)
            print(f"| {name} | {optimizer} | {rank} | {predicted / 2**20:.1f} | {growth / 2**20:.1f} | "
                  f"{growth / predicted:.2f} | " + " / ".join(f"{p / 2**20:.1f}" for p in parts) + " |")  # fmt: skip
    within = sum(abs(r - 1) <= 0.15 for r in ratios)
    print(f"\n{within} of {len(ratios)} within +-15% (target: all)")


if __name__ == "__main__":
    main()
