"""What the input checks of a sharded EBC cost per training step, side by side with the step.

    python benchmarks/input_checks.py                          # the default config, 2 gloo ranks
    python benchmarks/input_checks.py --plans rw --steps 40

Input dist starts by checking the batch (`Router.normalise`, then `Router.check`: dtypes, lengths
against values, weights, every id against its table's rows; see modular/routing/router.py) so that a bad
batch raises on every rank instead of hanging them or reading out of bounds. On each rank and for
each plan this times, on the same batches and in alternating blocks:

  step      one training step of the sharded EBC (forward + backward + SGD), checks included
  checks    normalise + check alone, on a batch already in the module's feature order
  shuffled  normalise + check on the same batch with its features in reverse order (normalise
            then also checks the structure first and permutes the batch, as a real input would)

A time is the max over ranks of one step's wall time; the report gives medians and the checks'
share of a step. Each rank runs with one thread (OMP_NUM_THREADS=1).
"""

from __future__ import annotations

import argparse
import dataclasses
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
# The same tables, plans and batches as the step-time benchmark.
from benchmarks._common import (  # noqa: E402
    PLANS, Model, Workload, add_workload_args, make_batches, make_ebc, max_over_ranks, our_plan,
    time_block, workload_fields,
)
from benchmarks._rendezvous import Rendezvous, hosted_rendezvous  # noqa: E402


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config(Workload):
    """The workload, unweighted (the checks of weights are timed by the weighted step time)."""


def _shuffled(kjt):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    return KeyedJaggedTensor.from_jt_dict({k: kjt[k] for k in reversed(kjt.keys())})


def _contenders(cfg: Config, plan: str, ebc) -> dict[str, tuple[Callable, bool]]:
    """name -> (step(kjt), whether it takes the shuffled batch)."""
    import modular

    model = modular.shard(Model(ebc), our_plan(cfg, plan))
    router = model.ebc._router
    opt = torch.optim.SGD(modular.local_parameters(model), lr=0.01)

    def step(kjt) -> None:
        opt.zero_grad()
        model(kjt).sum().backward()
        opt.step()

    def checks(kjt) -> None:
        rejection, kjt = router.normalise(kjt)
        if rejection is None:
            rejection = router.check(kjt)
        if rejection is not None:
            raise RuntimeError(rejection.message)

    return {"step": (step, False), "checks": (checks, False), "shuffled": (checks, True)}


def _run_plan(cfg: Config, plan: str, kjts) -> dict[str, list[float]]:
    torch.manual_seed(0)
    contenders = _contenders(cfg, plan, make_ebc(cfg))
    shuffled = [_shuffled(k) for k in kjts]
    times: dict[str, list[float]] = {name: [] for name in contenders}
    per_block = max(1, cfg.steps // cfg.blocks)
    for name, (fn, shuffle) in contenders.items():
        time_block(fn, shuffled if shuffle else kjts, cfg.warmup, 0)
    for block in range(cfg.blocks):
        for name, (fn, shuffle) in contenders.items():
            dist.barrier()
            t = time_block(fn, shuffled if shuffle else kjts, per_block, block * per_block)
            times[name] += max_over_ranks(t)
    return times


def _worker(rank: int, cfg: Config, rendezvous: Rendezvous) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=rendezvous.store(), rank=rank, world_size=cfg.world_size)
    kjts = make_batches(cfg, rank)
    if rank == 0:
        ids = cfg.tables * cfg.batch * cfg.pooling
        print(f"{cfg.tables} tables x {cfg.rows:_} rows x {cfg.dim} dims, batch {cfg.batch}/rank, "
              f"pooling {cfg.pooling} ({ids:_} ids/rank/step), {cfg.world_size} gloo ranks, "
              f"{cfg.steps} steps, medians of the max over ranks\n")  # fmt: skip
        print(f"{'plan':<14} {'step ms':>9} {'checks ms':>10} {'share':>7} {'shuffled ms':>12} {'share':>7}")
    for plan in cfg.plans:
        times = _run_plan(cfg, plan, kjts)
        if rank == 0:
            med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
            print(f"{PLANS[plan]:<14} {med['step']:>9.2f} {med['checks']:>10.3f} "
                  f"{100 * med['checks'] / med['step']:>6.2f}% {med['shuffled']:>12.3f} "
                  f"{100 * med['shuffled'] / med['step']:>6.2f}%", flush=True)  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(p)
    p.add_argument("--steps", type=int, default=20, help="timed steps per contender and plan")
    p.add_argument("--blocks", type=int, default=4, help="alternating blocks the steps are split in")
    p.add_argument("--warmup", type=int, default=3)
    a = p.parse_args(argv)
    cfg = Config(**workload_fields(a))
    with hosted_rendezvous() as rendezvous:
        mp.spawn(_worker, args=(cfg, rendezvous), nprocs=cfg.world_size, join=True)


if __name__ == "__main__":
    main()
