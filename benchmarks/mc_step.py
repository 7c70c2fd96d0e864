"""A managed-collision step against the same ids pre-remapped into a plain EBC, side by side.

    python benchmarks/mc_step.py                      # zch_size 1M, batch 4,096 per rank
    python benchmarks/mc_step.py --zch-size 100000 --batch-size 1024 --steps 5 --blocks 3

Issue 46's workload: 2 gloo ranks on CPU, one raw-id table of `--zch-size` rows x `--dim` behind
torchrec's `ManagedCollisionEmbeddingBagCollection` (MCH, DistanceLFU, eviction_interval 1,
`--features` features), row-wise over the ranks, fused exact row-wise Adagrad; raw ids drawn
from a Zipf law (a=1.2) over a space that drifts every step (churn), so that slots are evicted.
The contenders, every rank holding all of them and timing them in `--blocks` alternating blocks
(each block rotates their order):
    mc        the MC-EBC under modular: the split collision state (Note [sharded managed
              collisions]) remaps the ids, then the sharded EBC; it sees every raw batch once,
              in order, so that each step brings new ids and evicts (`--cycle`: it cycles
              through batches it has seen, and evicts nothing); by default into the empty slots
              of a filling table (`--full`: a full table, each new id evicting a held one)
    plain     the same table as a plain sharded EBC, fed the ids the MC run remapped them to
    torchrec  TorchRec's DistributedModelParallel of the MC-EBC, if its CPU path runs (otherwise
              the line says why: torchrec 1.8 refuses a table of one bucket over 2 ranks, and
              has no CPU kernel for one of more)
Reported: each contender's median step (max over ranks, median of block medians) and mc / plain
per block. Target: <= 1.3.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import statistics
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks._common import init_ranks, max_over_ranks, run_ranks, time_block  # noqa: E402
from benchmarks._rendezvous import Rendezvous  # noqa: E402

LR, EPS = 0.05, 1e-8
CONTENDERS = ("mc", "plain", "torchrec")


def _model(args):
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
    from torchrec.modules.mc_modules import (
        DistanceLFU_EvictionPolicy, ManagedCollisionCollection, MCHManagedCollisionModule,
    )  # fmt: skip

    torch.manual_seed(0)
    features = [f"f{i}" for i in range(args.features)]
    tables = [EmbeddingBagConfig(name="t_raw", num_embeddings=args.zch_size, embedding_dim=args.dim,
                                 feature_names=features)]  # fmt: skip
    mcc = ManagedCollisionCollection(
        managed_collision_modules={"t_raw": MCHManagedCollisionModule(
            zch_size=args.zch_size, device=torch.device("cpu"),
            eviction_policy=DistanceLFU_EvictionPolicy(), eviction_interval=1, input_hash_size=2**62)},
        embedding_configs=tables,
    )  # fmt: skip
    model = torch.nn.Module()
    model.mc = ManagedCollisionEmbeddingBagCollection(EmbeddingBagCollection(tables=tables), mcc,
                                                      return_remapped_features=True)  # fmt: skip
    if args.full:
        _fill(mcc._managed_collision_modules["t_raw"], args.zch_size)
    return model


def _fill(module, zch: int) -> None:
    """Every usable slot holds a random 62-bit raw id (which the stream all but never sends) with a
    count of 1-4, last seen at iteration 0: a table long past filling, where every new id evicts
    a held one."""
    generator = torch.Generator().manual_seed(3)
    raw = torch.unique(torch.randint(0, 2**62, (zch + zch // 8,), generator=generator))
    raw = raw[torch.randperm(raw.numel(), generator=generator)[: zch - 1]].sort().values
    with torch.no_grad():
        module._mch_sorted_raw_ids.copy_(torch.cat([raw, torch.tensor([torch.iinfo(torch.int64).max])]))
        module._mch_remapped_ids_mapping.copy_(torch.cat([torch.randperm(zch - 1, generator=generator), torch.tensor([zch - 1])]))
        for name, value in module._mch_metadata.items():
            if name == "counts":
                value[:-1].copy_(torch.randint(1, 5, (zch - 1,), generator=generator))


def _batches(args, rank: int, n: int):
    """`n` batches of raw ids: Zipf over a space that drifts by `--churn` ids each step."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    rng = np.random.default_rng([7, rank])
    out = []
    for step in range(n):
        count = args.batch_size * args.features * args.pooling
        ids = (rng.zipf(1.2, count) + step * args.churn) * 2_654_435_761 % 2**62
        out.append(KeyedJaggedTensor(
            keys=[f"f{i}" for i in range(args.features)], values=torch.tensor(ids, dtype=torch.int64),
            lengths=torch.full((args.batch_size * args.features,), args.pooling, dtype=torch.int64)))  # fmt: skip
    return out


def _plan(args, fqn: str):
    from planners.types import ShardingPlan, ShardingType, TablePlacement

    return ShardingPlan(world_size=args.world_size, modules={fqn: {
        "t_raw": TablePlacement(ShardingType.ROW_WISE, ranks=tuple(range(args.world_size)))}})  # fmt: skip


def _ours_mc(args, model):
    import modular

    m = copy.deepcopy(model)
    modular.fuse_optimizer(m, "exact_rowwise_adagrad", lr=LR, eps=EPS)
    modular.shard(m, _plan(args, "mc._embedding_module"))
    return m, lambda kjt: m.mc(kjt)[0].values().square().mean().backward()


def _ours_plain(args, model):
    import modular

    ebc = copy.deepcopy(model.mc._embedding_module)
    modular.fuse_optimizer(ebc, "exact_rowwise_adagrad", lr=LR, eps=EPS)
    modular.shard(ebc, _plan(args, ""))
    return lambda kjt: ebc(kjt).values().square().mean().backward()


def _torchrec(args, model):
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv

    # its own group, whose collectives time out: a rank that raises while planning leaves the
    # others in one of DMP's collectives, which must end (with an error) for the ranks to agree
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=args.torchrec_timeout))
    m = DistributedModelParallel(copy.deepcopy(model), env=ShardingEnv.from_process_group(group),
                                 device=torch.device("cpu"))  # fmt: skip
    return lambda kjt: m.mc(kjt)[0].values().square().mean().backward()


def _worker(rank: int, args, rendezvous: Rendezvous, queue) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    init_ranks(rank, args.world_size, store=rendezvous.store())
    model = _model(args)
    if args.cycle:
        raw = _batches(args, rank, args.batches)
        mc_model, mc_step = _ours_mc(args, model)
        # the plain contender's ids: what the MC model remapped each raw batch to (a warm-up
        # pass; the timed steps then see ids the table holds, and evict nothing)
        remapped = [mc_model.mc(kjt)[1] for kjt in raw]
        steps = {"mc": (mc_step, raw), "plain": (_ours_plain(args, model), remapped)}
    else:
        # the MC model sees each raw batch once, in order, so that every step brings new ids;
        # the plain contender gets what a twin fed the same batches in the same order remapped
        # them to, which is what the MC model remaps them to
        raw = _batches(args, rank, max(args.batches, args.warmup + args.blocks * args.steps))
        _, mc_step = _ours_mc(args, model)
        twin, _ = _ours_mc(args, model)
        remapped = [twin.mc(kjt)[1] for kjt in raw]
        del twin
        fresh = iter(raw)
        steps = {"mc": (lambda _: mc_step(next(fresh)), raw), "plain": (_ours_plain(args, model), remapped)}
    skipped = {"torchrec": "pass --torchrec to try it"}
    if args.torchrec:
        skipped = {}
        try:
            step = _torchrec(args, model)
            step(raw[0])
            steps["torchrec"] = (step, raw)
        except Exception as e:  # TorchRec's CPU path may not run MC modules: say why
            skipped["torchrec"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        ok = torch.tensor([float("torchrec" in steps)])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # every rank times it, or none
        if not ok.item():
            steps.pop("torchrec", None)
            skipped.setdefault("torchrec", "it failed on another rank")
    for step, kjts in steps.values():
        time_block(step, kjts, args.warmup, 0)
    blocks = {name: [] for name in steps}
    names = list(steps)
    for b in range(args.blocks):
        for name in names[b % len(names):] + names[: b % len(names)]:
            step, kjts = steps[name]
            blocks[name].append(statistics.median(max_over_ranks(time_block(step, kjts, args.steps, b))))
    queue.put((rank, blocks, skipped))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--zch-size", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--features", type=int, default=2)
    p.add_argument("--pooling", type=int, default=1, help="ids per bag")
    p.add_argument("--batch-size", type=int, default=4096, help="samples per rank")
    p.add_argument("--churn", type=int, default=5000, help="how far the id space drifts per step")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--batches", type=int, default=8, help="distinct batches cycled through (at least)")
    p.add_argument("--cycle", action="store_true",
                   help="the MC model cycles through --batches batches it has remapped once already "
                        "(no new ids in the timed steps), as before 2026-11-28")
    p.add_argument("--steps", type=int, default=8, help="timed steps per block")
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--full", action="store_true",
                   help="start from a full table (every slot holding an id the stream never sends), so "
                        "that every new id evicts a held one: the steady state after the table filled")
    p.add_argument("--torchrec", action="store_true",
                   help="also time TorchRec's DMP of the MC-EBC (its CPU path may fail: the line says why)")
    p.add_argument("--torchrec-timeout", type=float, default=60.0,
                   help="seconds a TorchRec collective may wait before it fails (a rank that fails to "
                        "build TorchRec's model leaves the others waiting in one)")
    args = p.parse_args()
    print(f"## MC-EBC of zch_size {args.zch_size:,} x {args.dim}, {args.features} features x "
          f"{args.pooling} ids, row-wise, fused row-wise Adagrad, {args.world_size} gloo ranks on CPU "
          f"({os.cpu_count()} cores), batch {args.batch_size} per rank, Zipf ids with churn "
          f"{args.churn}/step ({f'cycling {args.batches} seen batches' if args.cycle else 'new ids every step'}"
          f"{', a full table' if args.full else ''}), "
          f"{datetime.date.today().isoformat()}, torch {torch.__version__}\n")  # fmt: skip
    results = run_ranks(_worker, (args,), args.world_size)
    _, blocks, skipped = results[0]
    print("| contender | median step ms (block medians min - max) |\n|---|---:|")
    for name in CONTENDERS:
        if name in skipped:
            print(f"| {name} | not run: {skipped[name]} |")
        elif name in blocks:
            b = [1e3 * x for x in blocks[name]]
            print(f"| {name} | {statistics.median(b):.1f} ({min(b):.1f} - {max(b):.1f}) |")
    ratios = [m / p for m, p in zip(blocks["mc"], blocks["plain"])]
    print(f"\nmc / plain per block: {', '.join(f'{r:.2f}' for r in ratios)}; median "
          f"{statistics.median(ratios):.2f} (target <= 1.3)")


if __name__ == "__main__":
    main()
