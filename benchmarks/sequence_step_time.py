"""Training-step time of our sharded EmbeddingCollection against TorchRec's, side by side.

    python benchmarks/sequence_step_time.py                        # world 2, tw/rw/cw, fused
    python benchmarks/sequence_step_time.py --plans rw --optimizers dense fused --steps 20
    python benchmarks/sequence_step_time.py --length 5 35            # features of 5, 35, 5, ... ids

The sibling of benchmarks/step_time.py for sequences (issue 27). For each (plan, optimizer) the
ranks build both contenders from the same EmbeddingCollection and time them on the same
synthetic batches (every feature a sequence of `--length` ids per sample; several lengths are
dealt to the features in turn), alternating blocks:

  ours      modular.shard, with modular.fuse_optimizer(.., "exact_rowwise_adagrad") first
            ("fused") or torch SGD over modular.local_parameters ("dense")
  torchrec  DistributedModelParallel with EmbeddingCollectionSharder and the same plan
            (planners.torchrec_interop.to_torchrec), compute kernel "fused" with
            EXACT_ROWWISE_ADAGRAD, or "dense" with the same torch SGD

A step is forward + backward + optimizer on the loss sum(rows); its time is the max over ranks
of that step's wall time; the table shows the median over the timed steps. Each rank runs one
thread (OMP_NUM_THREADS=1), gloo on CPU.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import statistics
import sys
import time
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks._rendezvous import Rendezvous, hosted_rendezvous  # noqa: E402

LR, EPS = 0.01, 1e-8
PLANS = {"tw": "table_wise", "rw": "row_wise", "cw": "column_wise"}


@dataclasses.dataclass(frozen=True)
class Config:
    tables: int
    rows: int
    dim: int
    batch: int
    length: tuple[int, ...]  # ids per sequence, feature i's is length[i % len(length)]
    world_size: int
    plans: tuple[str, ...]
    optimizers: tuple[str, ...]
    steps: int
    blocks: int
    warmup: int
    only: str | None = None


class Model(nn.Module):
    """A bare EmbeddingCollection under the FQN "ec" (both frameworks get the same plan key)."""

    def __init__(self, ec: nn.Module) -> None:
        super().__init__()
        self.ec = ec

    def forward(self, kjt):
        return self.ec(kjt)


def _make_ec(cfg: Config):
    from torchrec.modules.embedding_configs import EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingCollection

    torch.manual_seed(0)
    tables = [
        EmbeddingConfig(name=f"t{i}", embedding_dim=cfg.dim, num_embeddings=cfg.rows, feature_names=[f"f{i}"])
        for i in range(cfg.tables)
    ]
    return EmbeddingCollection(tables=tables)


def _plan(cfg: Config, plan: str):
    from planners.types import ShardingPlan, ShardingType, TablePlacement

    kind = ShardingType.parse(PLANS[plan])
    everyone = tuple(range(cfg.world_size))
    placements = {
        f"t{i}": TablePlacement(kind, ranks=(i % cfg.world_size,) if kind is ShardingType.TABLE_WISE else everyone)
        for i in range(cfg.tables)
    }
    return ShardingPlan(world_size=cfg.world_size, modules={"ec": placements})


def _batches(cfg: Config, rank: int, n: int = 4):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = torch.Generator().manual_seed(1234 + rank)
    per_feature = [cfg.length[i % len(cfg.length)] for i in range(cfg.tables)]
    lengths = torch.tensor(per_feature, dtype=torch.int64).repeat_interleave(cfg.batch)
    return [
        KeyedJaggedTensor(
            keys=[f"f{i}" for i in range(cfg.tables)], lengths=lengths, stride=cfg.batch,
            values=torch.randint(0, cfg.rows, (int(lengths.sum()),), generator=g),
        )  # fmt: skip
        for _ in range(n)
    ]


def _loss(out) -> torch.Tensor:
    return sum(jt.values().sum() for jt in out.values())


def _ours(cfg: Config, ec, plan: str, kind: str):
    import modular

    model = Model(copy.deepcopy(ec))
    opt = modular.fuse_optimizer(model, "exact_rowwise_adagrad", lr=LR, eps=EPS) if kind == "fused" else None
    modular.shard(model, _plan(cfg, plan))
    opt = opt or torch.optim.SGD(modular.local_parameters(model), lr=LR)

    def step(kjt) -> None:
        opt.zero_grad()
        _loss(model(kjt)).backward()
        opt.step()

    return step


def _torchrec(cfg: Config, ec, plan: str, kind: str):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from planners.torchrec_interop import to_torchrec

    module = Model(copy.deepcopy(ec))
    tr_plan = to_torchrec(_plan(cfg, plan), module, device_type="cpu")
    for by_table in tr_plan.plan.values():
        for name, ps in by_table.items():
            by_table[name] = dataclasses.replace(ps, compute_kernel=kind)
    sharder = EmbeddingCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": LR, "eps": EPS}
    )
    model = DistributedModelParallel(
        module, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
        plan=tr_plan, sharders=[sharder],
    )  # fmt: skip
    dense = list(dict(in_backward_optimizer_filter(model.named_parameters())).values())
    opt = torch.optim.SGD(dense, lr=LR) if dense else None

    def step(kjt) -> None:
        if opt is not None:
            opt.zero_grad()
        _loss(model(kjt)).backward()
        if opt is not None:
            opt.step()

    return step


def _time(step, kjts, n: int) -> list[float]:
    out = []
    for i in range(n):
        dist.barrier()
        t0 = time.perf_counter()
        step(kjts[i % len(kjts)])
        elapsed = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        out.append(float(elapsed))
    return out


def _rank(rank: int, cfg: Config, rendezvous: Rendezvous, queue) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=rendezvous.store(), rank=rank, world_size=cfg.world_size)
    ec = _make_ec(cfg)
    kjts = _batches(cfg, rank)
    results = {}
    for plan in cfg.plans:
        for kind in cfg.optimizers:
            steps = {}
            if cfg.only in (None, "ours"):
                steps["ours"] = _ours(cfg, ec, plan, kind)
            # TorchRec's sharded EC with the "dense" compute kernel corrupts the heap on CPU
            # (torchrec 1.8.0, fbgemm-gpu-cpu 1.8.0: "munmap_chunk(): invalid pointer" within a
            # few steps, table-wise, 2 gloo ranks), so "dense" times ours alone.
            if cfg.only in (None, "torchrec") and kind == "fused":
                steps["torchrec"] = _torchrec(cfg, ec, plan, kind)
            times = {name: [] for name in steps}
            for name, step in steps.items():
                _time(step, kjts, cfg.warmup)
            for _ in range(cfg.blocks):
                for name, step in steps.items():
                    times[name] += _time(step, kjts, cfg.steps)
            results[(plan, kind)] = {name: statistics.median(t) for name, t in times.items()}
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=128, help="samples per rank")
    p.add_argument("--length", type=int, nargs="+", default=[20], help="ids per sequence (per feature, in turn)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--plans", nargs="+", default=list(PLANS), choices=list(PLANS))
    p.add_argument("--optimizers", nargs="+", default=["fused"], choices=["dense", "fused"])
    p.add_argument("--steps", type=int, default=10, help="timed steps per block")
    p.add_argument("--blocks", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--only", choices=["ours", "torchrec"], default=None, help="one contender")
    a = p.parse_args()
    cfg = Config(a.tables, a.rows, a.dim, a.batch, tuple(a.length), a.world_size, tuple(a.plans),
                 tuple(a.optimizers), a.steps, a.blocks, a.warmup, a.only)  # fmt: skip
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with hosted_rendezvous() as rendezvous:
        procs = [ctx.Process(target=_rank, args=(r, cfg, rendezvous, queue)) for r in range(cfg.world_size)]
        for proc in procs:
            proc.start()
        results = queue.get()
        for proc in procs:
            proc.join()
    print(f"{cfg.tables} tables x {cfg.rows} rows x {cfg.dim}, batch {cfg.batch} per rank, "
          f"sequences of {'/'.join(map(str, cfg.length))} ids, world {cfg.world_size} (gloo, CPU, 1 thread per rank)")  # fmt: skip
    print(f"{'case':<10} {'ours ms':>9} {'torchrec ms':>12} {'ours/torchrec':>14}")
    for (plan, kind), t in results.items():
        ours, tr = t.get("ours", float("nan")), t.get("torchrec", float("nan"))
        print(f"{plan + '/' + kind:<10} {1e3 * ours:>9.2f} {1e3 * tr:>12.2f} {ours / tr:>14.2f}")


if __name__ == "__main__":
    main()
