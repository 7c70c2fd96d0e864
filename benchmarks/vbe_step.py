"""Variable batch per feature (VBE) against the same batches expanded, side by side in one run.

    python benchmarks/vbe_step.py                        # 8 tables, half request-level (8x)
    python benchmarks/vbe_step.py --batch-size 4096 --steps 10 --blocks 5

Issue 37's workload: 2 gloo ranks on CPU, 8 tables of `--rows` x `--dim`, table-wise over the
ranks, fused exact row-wise Adagrad. Half the features are request-level: a batch of
`--batch-size` samples comes from `--batch-size / --dedup` requests, and those features hold one
bag per request (torchrec's VBE KeyedJaggedTensor: `stride_per_key_per_rank`, `inverse_indices`).
The contenders, every rank holding all of them and timing them in `--blocks` alternating blocks
(each block rotates their order), on the same batches:
    vbe       ours, given the VBE KJTs: only the bags are routed, looked up and sent back
    expanded  ours, given the same batches expanded to one bag per sample (ordinary KJTs)
    torchrec  TorchRec's DistributedModelParallel given the VBE KJTs, when its CPU path runs
              them (otherwise the line says why)
Reported: each contender's median step (max over ranks, median of block medians), its median
CPU time per step (each rank's process, gloo's threads included: what other load on the machine
moves least), the floats the output dist sends per step (forward), and vbe / expanded, paired
per block, in wall and CPU time. Target: <= 0.7.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks._common import init_ranks, max_over_ranks, run_ranks, time_block  # noqa: E402
from benchmarks._rendezvous import Rendezvous  # noqa: E402

LR, EPS = 0.05, 1e-8
CONTENDERS = ("vbe", "expanded", "torchrec")


def _tables(args):
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    return [
        EmbeddingBagConfig(name=f"t{i}", num_embeddings=args.rows, embedding_dim=args.dim,
                           feature_names=[f"f{i}"])  # fmt: skip
        for i in range(args.tables)
    ]


def _batches(args, rank: int, n: int = 4):
    """`n` (VBE, expanded) pairs: features f0..f{k-1} (the first half) request-level."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    out = []
    keys = [f"f{i}" for i in range(args.tables)]
    requests = args.batch_size // args.dedup
    request_of = torch.arange(args.batch_size) // args.dedup
    for i in range(n):
        g = torch.Generator().manual_seed(1000 * rank + i)
        lengths, values, strides, inverse, full_lengths, full_values = [], [], [], [], [], []
        for f in range(args.tables):
            deduped = f < args.tables // 2
            bags = requests if deduped else args.batch_size
            n_ids = torch.randint(0, 2 * args.pooling + 1, (bags,), generator=g)
            ids = torch.randint(0, args.rows, (int(n_ids.sum()),), generator=g)
            lengths.append(n_ids)
            values.append(ids)
            strides.append([bags])
            inverse.append(request_of if deduped else torch.arange(args.batch_size))
            if deduped:  # the request's bag, once per sample
                per_bag = list(ids.split(n_ids.tolist()))
                full_lengths.append(n_ids[request_of])
                full_values.append(torch.cat([per_bag[int(r)] for r in request_of]))
            else:
                full_lengths.append(n_ids)
                full_values.append(ids)
        vbe = KeyedJaggedTensor(
            keys=keys, values=torch.cat(values), lengths=torch.cat(lengths),
            stride_per_key_per_rank=strides, inverse_indices=(keys, torch.stack(inverse)),
        )  # fmt: skip
        expanded = KeyedJaggedTensor(keys=keys, values=torch.cat(full_values), lengths=torch.cat(full_lengths))
        out.append((vbe, expanded))
    return out


def _plan(args):
    from planners.types import ShardingPlan, ShardingType, TablePlacement

    return ShardingPlan(world_size=args.world_size, modules={"": {
        f"t{i}": TablePlacement(ShardingType.TABLE_WISE, ranks=(i % args.world_size,))
        for i in range(args.tables)
    }})  # fmt: skip


def _ours(args, ebc):
    import modular

    model = copy.deepcopy(ebc)
    modular.fuse_optimizer(model, "exact_rowwise_adagrad", lr=LR, eps=EPS)
    modular.shard(model, _plan(args))
    return lambda kjt: model(kjt).values().square().mean().backward()


def _torchrec(args, ebc):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv

    from planners.torchrec_interop import to_torchrec

    plan = to_torchrec(_plan(args), ebc, device_type="cpu", compute_kernel="fused")
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": LR, "eps": EPS}
    )
    model = DistributedModelParallel(
        copy.deepcopy(ebc), env=ShardingEnv.from_process_group(dist.group.WORLD),
        device=torch.device("cpu"), plan=plan, sharders=[sharder],
    )  # fmt: skip
    return lambda kjt: model(kjt).values().square().mean().backward()


def _output_floats(step, kjt) -> int:
    """Floats the step's floating-point all-to-alls send (the output dist, forward and backward)."""
    sent, original = [0], dist.all_to_all_single

    def counting(output, input, *a, **k):
        if input.is_floating_point():
            sent[0] += input.numel()
        return original(output, input, *a, **k)

    dist.all_to_all_single = counting
    try:
        step(kjt)
    finally:
        dist.all_to_all_single = original
    return sent[0]


def _worker(rank: int, args, rendezvous: Rendezvous, queue) -> None:
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    torch.set_num_threads(1)
    init_ranks(rank, args.world_size, store=rendezvous.store())
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables=_tables(args))
    pairs = _batches(args, rank)
    vbe, expanded = [p[0] for p in pairs], [p[1] for p in pairs]
    steps = {"vbe": (_ours(args, ebc), vbe), "expanded": (_ours(args, ebc), expanded)}
    skipped = {}
    try:
        step = _torchrec(args, ebc)
        step(vbe[0])
        steps["torchrec"] = (step, vbe)
    except Exception as e:  # TorchRec's CPU path may not run VBE: say why, time the rest
        skipped["torchrec"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    floats = {name: _output_floats(step, kjts[0]) for name, (step, kjts) in steps.items()}
    for step, kjts in steps.values():
        time_block(step, kjts, args.warmup, 0)
    blocks = {name: [] for name in steps}
    cpu = {name: [] for name in steps}  # this rank's CPU seconds per step, block by block
    names = list(steps)
    for b in range(args.blocks):
        for name in names[b % len(names):] + names[: b % len(names)]:
            step, kjts = steps[name]
            c0 = time.process_time()
            times = time_block(step, kjts, args.steps, b)
            cpu[name].append((time.process_time() - c0) / args.steps)
            blocks[name].append(statistics.median(max_over_ranks(times)))
    queue.put((rank, blocks, floats, skipped, cpu))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=2048, help="samples per rank")
    p.add_argument("--dedup", type=int, default=8, help="samples per request")
    p.add_argument("--pooling", type=int, default=5, help="mean ids per bag")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=10, help="timed steps per block")
    p.add_argument("--blocks", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()
    print(f"## {args.tables} tables x {args.rows:,} x {args.dim}, half request-level "
          f"({args.dedup} samples a request), table-wise, fused row-wise Adagrad, "
          f"{args.world_size} gloo ranks on CPU ({os.cpu_count()} cores), batch "
          f"{args.batch_size} per rank, ~{args.pooling} ids per bag, "
          f"{datetime.date.today().isoformat()}, torch {torch.__version__}\n")  # fmt: skip
    results = run_ranks(_worker, (args,), args.world_size)
    _, blocks, _, skipped, _ = results[0]
    print("| contender | median step ms (block medians min - max) | CPU ms / step, per rank "
          "| output-dist floats / step, per rank |")
    print("|---|---:|---|---|")
    for name in CONTENDERS:
        if name in skipped:
            print(f"| {name} | not run: {skipped[name]} | | |")
            continue
        ms = [t * 1e3 for t in blocks[name]]
        cpu = ", ".join(f"{statistics.median(r[4][name]) * 1e3:.1f}" for r in results)
        floats = ", ".join(f"{r[2][name]:,}" for r in results)
        print(f"| {name} | {statistics.median(ms):.1f} ({min(ms):.1f} - {max(ms):.1f}) | {cpu} | {floats} |")
    ratios = [a / b for a, b in zip(blocks["vbe"], blocks["expanded"])]
    print(f"\nvbe / expanded step, paired per block: median {statistics.median(ratios):.2f} "
          f"({min(ratios):.2f} - {max(ratios):.2f}); target <= 0.7")
    cpu_ratios = [a / b for r in results for a, b in zip(r[4]["vbe"], r[4]["expanded"])]
    print(f"vbe / expanded CPU time, paired per block and rank: median "
          f"{statistics.median(cpu_ratios):.2f} ({min(cpu_ratios):.2f} - {max(cpu_ratios):.2f})")


if __name__ == "__main__":
    main()
