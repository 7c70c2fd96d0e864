"""Train a small sequential recommender (an EmbeddingCollection and an EBC) sharded by a plan.

    python examples/train_sequential.py --world-size 2 --steps 20 --checkpoint-dir out/seq
    python examples/train_sequential.py --world-size 3 --steps 40 --checkpoint-dir out/seq --resume

The model is examples/sequential/model.py. One setup, in the order Note [order of sharding
calls] (modular/compose/fsdp.py) asks for: the model with its collections on `meta` ->
`planners.plan` for this world size (the item history is a sequence table, priced per id) ->
`modular.fuse_optimizer` (row-wise Adagrad inside backward; the meta collections are built fused)
-> `modular.shard` (each rank allocates only its shards) -> `modular.apply_fully_shard` on the
dense tower -> the dense optimizer. Each step prefetches the next batch's input dist of both
collections. A checkpoint saved at one world size resumes at another: the plan changes with the
world size, `modular.checkpoint.load` reshards tables and optimizer state. Batches are seeded by
(step, rank), so a resumed run sees the batches its world size gives for the remaining steps.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Optional, Sequence

if __package__ in (None, ""):  # run as a script: make `examples`, `modular`, `planners` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist

import modular
import planners
from examples.ports import free_port
from examples.sequential.model import SequentialRecommender, Tower, make_batch


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 20  # train until this global step
    batch_size: int = 16  # per rank
    lr: float = 0.05  # tables: fused row-wise Adagrad
    dense_lr: float = 0.01  # the tower: Adam
    checkpoint_dir: Optional[str] = None
    resume: bool = False


@dataclass(frozen=True)
class TrainResult:
    start_step: int
    losses: list[float]  # the mean over ranks of each step's loss
    plan: planners.ShardingPlan
    model: torch.nn.Module


def build(config: TrainConfig, world: int):
    """The sharded model and its optimizer; collective."""
    torch.manual_seed(0)  # the tower's init is the same on every rank
    model = SequentialRecommender(device=torch.device("meta"))
    tables = planners.tables_from_model(model, pooling_factors={"history": 2.5, "history_category": 2.5})
    topology = planners.Topology(world, ranks_per_host=world, device_memory="1GiB")
    plan = planners.plan(tables, topology, batch_size=config.batch_size)
    fused = modular.fuse_optimizer(model, "exact_rowwise_adagrad", lr=config.lr, eps=1e-8)
    modular.shard(model, plan)
    modular.apply_fully_shard(model, modules={Tower})
    dense = torch.optim.Adam(modular.local_parameters(model), lr=config.dense_lr)
    return model, modular.CombinedOptimizer({"tables": fused, "dense": dense}), plan


def latest(checkpoint_dir: str) -> Optional[tuple[int, Path]]:
    steps = sorted(Path(checkpoint_dir).glob("step_*"))
    return (int(steps[-1].name[5:]), steps[-1]) if steps else None


def train(config: TrainConfig) -> TrainResult:
    """Runs on every rank of an initialised process group."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt, plan = build(config, world)
    start = 0
    if config.resume and config.checkpoint_dir and (found := latest(config.checkpoint_dir)):
        start, path = found
        modular.checkpoint.load(path, model, opt)
    losses = []
    batch = make_batch(start, rank, batch_size=config.batch_size)
    for step in range(start, config.steps):
        if step + 1 < config.steps:  # the next batch travels while this one trains
            nxt = make_batch(step + 1, rank, batch_size=config.batch_size)
            # Each batch names its collections: they read different features (README).
            modular.prefetch(model, nxt.sequences, modules=["seq"])
            modular.prefetch(model, nxt.users, modules=["user"])
        loss = model.loss(batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        if step + 1 < config.steps:
            batch = nxt
    if config.checkpoint_dir and config.steps > start:
        modular.checkpoint.save(Path(config.checkpoint_dir) / f"step_{config.steps:08d}", model, opt)
    if rank == 0 and losses:
        print(f"world {world}: steps {start}..{config.steps - 1}, loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    return TrainResult(start, losses, plan, model)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = TrainConfig()
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--world-size", type=int, default=1, help="CPU ranks to launch")
    a = p.parse_args(argv)
    config = TrainConfig(steps=a.steps, batch_size=a.batch_size, checkpoint_dir=a.checkpoint_dir, resume=a.resume)
    if "RANK" in os.environ:  # one of the ranks `main` launched
        torch.set_num_threads(1)
        # A lost peer stops the job in minutes, not gloo's default 30 (docs/troubleshooting.md)
        dist.init_process_group("gloo", timeout=timedelta(minutes=5))
        try:
            train(config)
        finally:
            dist.destroy_process_group()
        # A normal exit: `import modular`'s exit hook makes teardown safe (Note [exit after
        # destroy_process_group] in modular/exit.py).
        return 0
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(a.world_size))
    procs = [
        subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *(argv or sys.argv[1:])],
                         env=dict(env, RANK=str(r), LOCAL_RANK=str(r)))
        for r in range(a.world_size)
    ]  # fmt: skip
    codes = [proc.wait() for proc in procs]
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
