"""Training-step time of the fused Adam family on CPU, against TorchRec's only way to train Adam
there (issue 35).

    python benchmarks/adam_step.py                                  # the default config
    python benchmarks/adam_step.py --plans tw --optimizers adam lamb --steps 10

fbgemm-gpu-cpu 1.8.0 has no Adam or LAMB kernel ("Optimizer adam is not supported in CPU mode"),
so TorchRec cannot fuse them on CPU. For each (plan, optimizer) the ranks build one model per
contender from the same weights and time them on the same batches in alternating blocks:

  ours      modular.fuse_optimizer(model, optimizer) then modular.shard: the torch emulation of
            fbgemm's kernel, only the rows a step touched updated (Note [fused Adam and LAMB])
  torchrec  DistributedModelParallel with the equivalent plan, compute kernel "dense", and
            torch.optim.Adam over its parameters (the dense gradient of every shard, every row
            of it stepped; torch has no LAMB, so Adam stands in for all four)
  floor     ours' kernels alone on exactly the ids ours' input dist gives this rank: fbgemm's
            forward, the sparse gradient and the update, with no input or output dist

A step is forward + backward + optimizer, its time the max over ranks of that step's wall time;
each rank runs with one thread (OMP_NUM_THREADS=1). The target (issue 35): ours <= 0.5 x
torchrec on the default config (the workload flags' defaults: 8 tables x 100,000 x 64, batch
1,024 a rank, pooling 20, 2 ranks, every plan); the run ends with every ratio side by side and
says whether its config is the default one.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import logging
import os
import statistics
import sys
import warnings
from typing import Callable, Optional

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from benchmarks._common import (  # noqa: E402
    PLANS, Model, Workload, add_workload_args, make_batches, make_ebc, max_over_ranks, our_plan,
    time_block, workload_fields,
)
from benchmarks._rendezvous import Rendezvous, hosted_rendezvous  # noqa: E402

OPTIMIZERS = ("adam", "partial_rowwise_adam", "lamb", "partial_rowwise_lamb")
CONTENDERS = ("ours", "torchrec", "floor")
LR, EPS = 0.01, 1e-8
TARGET = 0.5


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config(Workload):
    optimizers: tuple[str, ...]
    default: bool = True  # the workload flags' defaults: where the target is judged


def _loss(pooled: torch.Tensor, probe: torch.Tensor) -> torch.Tensor:
    return (pooled * probe).sum()


def _ours(cfg: Config, ebc, plan: str, kind: str, probe) -> tuple[torch.nn.Module, Callable]:
    import modular

    model = Model(copy.deepcopy(ebc))
    modular.fuse_optimizer(model, kind, lr=LR, eps=EPS)  # before shard
    modular.shard(model, our_plan(cfg, plan))

    def step(kjt) -> None:
        _loss(model(kjt), probe).backward()

    return model, step


def _torchrec(cfg: Config, ebc, plan: str, probe) -> Callable:
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv

    from planners.torchrec_interop import to_torchrec

    module = Model(copy.deepcopy(ebc))
    tr_plan = to_torchrec(our_plan(cfg, plan), Model(ebc), device_type="cpu", compute_kernel="dense")
    model = DistributedModelParallel(
        module, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
        plan=tr_plan, sharders=[EmbeddingBagCollectionSharder()],
    )  # fmt: skip
    opt = torch.optim.Adam(model.parameters(), lr=LR, eps=EPS)

    def step(kjt) -> None:
        opt.zero_grad()
        _loss(model(kjt), probe).backward()
        opt.step()

    return step


def _floor(ours_model, kjts, cfg: Config) -> Callable:
    """Ours' kernels on the ids our input dist gives this rank (collective to build: it runs the
    input dist once per batch), each forward's gradient a fixed tensor, then the update."""
    from modular.kernels.base import pool

    sebc = ours_model.ebc
    remote, local = sebc._kernels, sebc._local_kernels
    kernels, per_route = (local, cfg.batch) if local else (remote, cfg.world_size * cfg.batch)
    received = []
    with torch.no_grad():
        for kjt in kjts:
            r = sebc.input_dist(kjt)
            if local:  # data-parallel tables look up this rank's own batch
                lengths, values, weights = r.local.lengths(), r.local.values(), r.local.weights_or_none()
            else:
                lengths, values, weights = r.lengths.reshape(-1), r.values, r.weights
            received.append((values, torch.ops.fbgemm.asynchronous_complete_cumsum(lengths), weights))
    width = sum(c for k in kernels for _, c in k.sizes)
    grad = torch.randn(per_route, width)
    state = {"i": 0}

    def step(_kjt) -> None:
        values, offsets, weights = received[state["i"] % len(received)]
        state["i"] += 1
        sebc.fused_tables.steps.advance()  # as the module's forward does
        pool(kernels, values, offsets, weights, per_route).backward(grad)
        for k in kernels:
            k.apply(k.take_pending())

    return step


def _run_case(cfg: Config, plan: str, kind: str, ebc, kjts, probe) -> dict[str, list[float]]:
    model, ours = _ours(cfg, ebc, plan, kind, probe)
    floor_model, _ = _ours(cfg, ebc, plan, kind, probe)
    contenders = {"ours": ours, "torchrec": _torchrec(cfg, ebc, plan, probe), "floor": _floor(floor_model, kjts, cfg)}
    times: dict[str, list[float]] = {name: [] for name in contenders}
    per_block = max(1, cfg.steps // cfg.blocks)
    for fn in contenders.values():
        time_block(fn, kjts, cfg.warmup, 0)
    for block in range(cfg.blocks):
        for name, fn in contenders.items():
            dist.barrier()
            times[name] += max_over_ranks(time_block(fn, kjts, per_block, block * per_block))
    return times


def _worker(rank: int, cfg: Config, rendezvous: Rendezvous) -> None:
    warnings.simplefilter("ignore")
    logging.getLogger("torchrec").setLevel(logging.ERROR)  # a line per data-parallel table
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=rendezvous.store(), rank=rank, world_size=cfg.world_size)
    torch.manual_seed(0)
    ebc = make_ebc(cfg)
    kjts = make_batches(cfg, rank)
    probe = torch.randn(cfg.batch, cfg.tables * cfg.dim, generator=torch.Generator().manual_seed(7))
    if rank == 0:
        print(f"{cfg.tables} tables x {cfg.rows:_} rows x {cfg.dim} dims, batch {cfg.batch}/rank, "
              f"pooling {cfg.pooling}, {cfg.world_size} gloo ranks x 1 thread, {cfg.steps} steps, "
              "medians of the max over ranks\n")  # fmt: skip
        print("| plan | optimizer | ours ms | TorchRec dense + Adam ms | floor ms | ours / TorchRec "
              f"(target <= {TARGET}) | ours / floor |")
        print("|---|---|---:|---:|---:|---:|---:|")
    ratios: dict[tuple[str, str], float] = {}
    for plan in cfg.plans:
        for kind in cfg.optimizers:
            times = _run_case(cfg, plan, kind, ebc, kjts, probe)
            gc.collect()  # the case's three models go before the next case's are built
            if rank == 0:
                med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
                ratio = ratios[plan, kind] = med["ours"] / med["torchrec"]
                met = "met" if ratio <= TARGET else "NOT met"
                print(f"| {PLANS[plan]} | {kind} | {med['ours']:.1f} | {med['torchrec']:.1f} | "
                      f"{med['floor']:.1f} | {ratio:.2f} ({met}) | {med['ours'] / med['floor']:.2f} |",
                      flush=True)  # fmt: skip
    if rank == 0:
        _print_side_by_side(cfg, ratios)
    dist.barrier()
    dist.destroy_process_group()


def _print_side_by_side(cfg: Config, ratios: dict[tuple[str, str], float]) -> None:
    """Every ours / TorchRec ratio, an optimizer a row and a plan a column, and the verdict."""
    print(f"\nours / TorchRec, side by side (target <= {TARGET}; "
          f"{'the default config' if cfg.default else 'NOT the default config: the target is judged on it'}):\n")  # fmt: skip
    print("| optimizer | " + " | ".join(PLANS[p] for p in cfg.plans) + " |")
    print("|---|" + "---:|" * len(cfg.plans))
    for kind in cfg.optimizers:
        print(f"| {kind} | " + " | ".join(f"{ratios[p, kind]:.2f}" for p in cfg.plans) + " |")
    met = sum(r <= TARGET for r in ratios.values())
    print(f"\nmet in {met} of {len(ratios)} cases", flush=True)


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(p)
    p.add_argument("--optimizers", nargs="+", choices=OPTIMIZERS, default=list(OPTIMIZERS))
    p.add_argument("--steps", type=int, default=12, help="timed steps per contender and case")
    p.add_argument("--blocks", type=int, default=3, help="alternating blocks the steps are split in")
    p.add_argument("--warmup", type=int, default=2)
    a = p.parse_args(argv)
    timing = ("steps", "blocks", "warmup")  # how long it times, not what it runs
    given, defaults = workload_fields(a), workload_fields(p.parse_args([]))
    default = all(given[k] == defaults[k] for k in given if k not in timing)
    cfg = Config(**given, optimizers=tuple(a.optimizers), default=default)
    with hosted_rendezvous() as rendezvous:
        mp.spawn(_worker, args=(cfg, rendezvous), nprocs=cfg.world_size, join=True)


if __name__ == "__main__":
    main()
