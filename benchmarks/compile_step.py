"""Eager against compiled training steps of the example DLRM, side by side in one run.

    python benchmarks/compile_step.py                      # 1 rank, default and wide towers
    python benchmarks/compile_step.py --world-size 2 --batch-size 512 --steps 40

For each dense configuration ("default": the example's towers, bottom 64-16 and top 64-32-1;
"wide": bottom 512-256-16 and top 1024-1024-512-256-1) the ranks build the example's model twice
from the same seed, the way `examples/train_dlrm.py` does (its plan, `modular.shard`, fused
row-wise Adagrad for the tables, FSDP2 on the two towers, or DDP instead, Adam for them), and
train one eagerly and one compiled (see `_build`; each sharded EBC eager behind its one graph
break, Note [compiling a sharded model] in modular/compose/compile.py), on the same synthetic batches:

  first step  the first step's wall time: for "compiled", dynamo and inductor's compile (with
              whatever inductor's on-disk cache already holds: run twice to see a warm cache)
  step        the median step (forward + backward + optimizer) after `--warmup` steps, in
              alternating blocks of eager and compiled steps so both see the same machine load

A step's time is the max over ranks. The two runs' losses are compared: at the first step (same
weights, same batch) they must agree to 1e-5, since inductor only reorders float sums; the
largest gap over the run is printed too; it grows because Adam's normalised updates turn 1e-7
gradient differences into lr-sized steps (the tests, with SGD, hold compiled training to eager
within 1e-5). CPU only (no GPU was lent to the session that wrote this); each rank runs one thread.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
import warnings
from typing import NamedTuple

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks._rendezvous import Rendezvous, hosted_rendezvous  # noqa: E402
from examples.dlrm import DLRM  # noqa: E402
import modular  # noqa: E402
from examples.train_dlrm import (  # noqa: E402
    BOTTOM_MLP, DIM, TOP_MLP, Data, TrainConfig, make_plan, table_configs,
)

TOWERS = {
    "default": (BOTTOM_MLP, TOP_MLP),
    "wide": ((512, 256, DIM), (1024, 1024, 512, 256)),
}


class Timing(NamedTuple):
    first_s: float
    step_ms: float
    losses: list[float]


def _step(call, opt, batch) -> tuple[float, float]:
    began = time.perf_counter()
    loss = F.binary_cross_entropy_with_logits(call(batch.dense, batch.sparse), batch.labels)
    opt.zero_grad()
    loss.backward()
    opt.step()
    took = torch.tensor([time.perf_counter() - began])
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return took.item(), loss.item()


def _build(model: DLRM, plan, config: TrainConfig, fsdp: bool, compiled: bool):
    """`examples/train_dlrm.py`'s shard_model (FSDP2 on the towers), or with DDP instead; what
    to call and the optimizer. Compiled as `examples/train_dlrm.py --compile` does: under FSDP2
    each tower's forward by `modular.apply_compile` (FSDP2 keeps dynamo out of its modules'
    calls), then `torch.compile` over the model (under DDP, which compiles the towers)."""
    fused = modular.fuse_optimizer(model, "exact_rowwise_adagrad", lr=config.lr, eps=1e-8)
    model = modular.shard(model, plan)
    towers = lambda m: m is model.dense or m is model.over  # noqa: E731
    if fsdp:
        model = modular.apply_fully_shard(model, modules=towers)
        if compiled:
            model = modular.apply_compile(model, modules=towers)
        call = model
    else:
        call = modular.apply_ddp(model)
    if compiled:
        call = torch.compile(call)
    dense = torch.optim.Adam(modular.local_parameters(model), lr=config.dense_lr)
    return call, modular.CombinedOptimizer({"tables": fused, "dense": dense})


def _measure(towers: str, fsdp: bool, a: argparse.Namespace) -> dict[str, Timing]:
    world, rank = dist.get_world_size(), dist.get_rank()
    config = TrainConfig(batch_size=a.batch_size, steps=a.steps)
    bottom, top = TOWERS[towers]
    torch._dynamo.reset()  # each configuration compiles from scratch, with static shapes
    models = {}
    for mode in ("eager", "compiled"):
        torch.manual_seed(0)
        model = DLRM(table_configs(), bottom_mlp=bottom, top_mlp=top, device="meta")
        plan, _ = make_plan(model, world_size=world, batch_size=a.batch_size, device_memory=config.device_memory)
        models[mode] = _build(model, plan, config, fsdp, mode == "compiled")
    data = Data(config, rank, world)
    batches = [data.batch_at(s) for s in range(a.warmup + a.steps)]
    times = {m: [] for m in models}
    losses = {m: [] for m in models}
    first = {}
    for mode, (call, opt) in models.items():
        first[mode], loss = _step(call, opt, batches[0])
        losses[mode].append(loss)
    per_block = max(1, a.steps // a.blocks)
    step = 1
    while step < len(batches):
        for mode, (call, opt) in models.items():
            for s in range(step, min(step + per_block, len(batches))):
                took, loss = _step(call, opt, batches[s])
                losses[mode].append(loss)
                if s >= a.warmup:
                    times[mode].append(took)
        step += per_block
    return {m: Timing(first[m], 1000 * statistics.median(times[m]), losses[m]) for m in models}


def _worker(rank: int, a: argparse.Namespace, rendezvous: Rendezvous) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=rendezvous.store(), rank=rank, world_size=a.world_size)
    rows = []
    for towers, fsdp in [(t, f) for t in a.towers for f in (True, False)]:
        got = _measure(towers, fsdp, a)
        gaps = [abs(x - y) for x, y in zip(got["eager"].losses, got["compiled"].losses)]
        if gaps[0] > 1e-5:
            raise RuntimeError(f"{towers}: the compiled first step's loss differs from eager by {gaps[0]:.2e}")
        e, c = got["eager"], got["compiled"]
        rows.append(
            f"| {towers} | {'FSDP2' if fsdp else 'DDP'} | {e.step_ms:.2f} | {c.step_ms:.2f} | {e.step_ms / c.step_ms:.2f}x "
            f"| {e.first_s:.2f} | {c.first_s:.1f} | {gaps[0]:.1e} | {max(gaps):.1e} |"
        )
    if rank == 0:
        print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, "
              f"{a.world_size} gloo rank(s) x 1 thread, {os.cpu_count()} cores, batch {a.batch_size} per rank, "
              f"{a.steps} timed steps after {a.warmup} ({a.blocks} alternating blocks)")
        print("| towers | dense part | eager step (ms) | compiled step (ms) | speed-up | eager first step (s) "
              "| compiled first step (s) | first loss gap | max loss gap |")
        print("|---|---|---|---|---|---|---|---|---|")
        print("\n".join(rows))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=TrainConfig.batch_size, help="per rank")
    p.add_argument("--steps", type=int, default=30, help="timed steps per mode")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--blocks", type=int, default=3, help="alternating blocks the steps are split in")
    p.add_argument("--towers", nargs="+", choices=sorted(TOWERS), default=list(TOWERS))
    a = p.parse_args()
    with hosted_rendezvous() as rendezvous:
        mp.spawn(_worker, args=(a, rendezvous), nprocs=a.world_size, join=True)


if __name__ == "__main__":
    main()
