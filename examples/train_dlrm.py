"""Train a DLRM whose tables are sharded by a plan, end to end, on CPU ranks or GPUs.

    python examples/train_dlrm.py --world-size 2               # launches 2 gloo CPU ranks itself
    torchrun --standalone --nproc_per_node=2 examples/train_dlrm.py   # NCCL when CUDA is there
    python examples/train_dlrm.py --world-size 2 --resume      # continue from the last checkpoint
    python examples/train_dlrm.py --world-size 2 --steps 0 --resume --export out/dlrm.pt
    python examples/train_dlrm.py --world-size 2 --no-prefetch # no overlap of the next input dist
    python examples/train_dlrm.py --world-size 4 --column-wise-statistic per_shard  # TorchRec's
    python examples/train_dlrm.py --world-size 2 --compile     # torch.compile around the tables
    python examples/train_dlrm.py --world-size 2 --fp16 --fp16-comms  # FP16 tables and comms
    python examples/train_dlrm.py --world-size 2 --optimizer adam --lr 0.01  # or lamb, ...
    python examples/train_dlrm.py --world-size 2 --rebalance-every 50 \
        --drift-feature f_cat_3 --drift-pooling 20 --drift-at 100  # replan + reshard as it drifts
    python examples/train_dlrm.py --world-size 2 --raw-ids     # 64-bit ids: MC tables vs hashing

One training setup, in the order Note [order of sharding calls] (modular/compose/fsdp.py) asks for:
tables -> `planners.plan` for this world size -> DLRM with its EBC on `meta` ->
`modular.fuse_optimizer` (row-wise Adagrad, or `--optimizer`, inside backward; it only marks the
EBC on meta) ->
`modular.shard` (each rank allocates only its shards, built fused) -> `modular.apply_fully_shard`
on the two MLP towers -> one `CombinedOptimizer`.
Data is the synthetic Criteo stream (`examples.dlrm.SyntheticCriteo`, seeded per rank and step,
so a resumed run sees exactly the batches an uninterrupted one would) or a Criteo TSV (`--data`).
With `--rebalance-every N` the run measures the pooling factors every N steps, asks
`planners.replan` for a plan near the current one within `--rebalance-budget`, and
`modular.reshard`s to it when the slowest rank gets faster by more than `--rebalance-threshold`
(examples/rebalance.py, Note [rebalancing while training]); `--drift-feature` makes one feature's
bags longer from step `--drift-at` on, so that there is something to rebalance.
`--raw-ids` trains on 64-bit raw ids instead, with torchrec's managed-collision tables and then
with the ids hashed modulo the same rows, and reports both AUCs (examples/raw_ids.py).

# Note [stopping on Ctrl-C]
Ctrl-C reaches every rank (a terminal signals the whole process group; torchrun forwards it). A
rank that raised KeyboardInterrupt at once could leave its peers blocked in a collective, so the
first two SIGINTs only set a flag, which the ranks combine with the per-step loss all-reduce: all
ranks then stop after the same step, never in the middle of a checkpoint save, and exit with
status 130 without saving (the last complete checkpoint stays as it was; saves are atomic). A
third SIGINT raises KeyboardInterrupt as usual.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Optional

if __package__ in (None, ""):  # run as a script: make `examples`, `modular`, `planners` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import modular
import planners
from torchrec.modules.embedding_configs import DataType
from examples.dlrm import (
    DLRM,
    Batch,
    SyntheticCriteo,
    auc,
    concat_batches,
    criteo_table_configs,
    read_criteo_tsv,
)
from examples.parent_death import end_with_parent
from examples.ports import free_port
from examples.raw_ids import train_raw_ids
from examples.rebalance import PoolingMeter, Rebalance, RebalanceSettings, planned_pooling, rebalance

ROWS_CAP = 20_000
DIM = 16
BOTTOM_MLP = (64, DIM)
TOP_MLP = (64, 32)
EVAL_STEP = 1_000_000  # synthetic held-out batches come from steps training never reaches
_STEP_DIR = re.compile(r"^step_(\d{8})$")
# What `--optimizer` takes: every fused optimizer (Note [fused tables] in modular/fused/choice.py).
_TABLE_OPTIMIZERS = (
    "exact_sgd", "exact_adagrad", "exact_rowwise_adagrad",
    "adam", "partial_rowwise_adam", "lamb", "partial_rowwise_lamb",
)  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """What one run does; every rank must get the same value."""

    steps: int = 300
    batch_size: int = 256  # per rank
    # The tables' fused optimizer (modular.fuse_optimizer's names; the planner prices its state)
    # and its learning rate.
    optimizer: str = "exact_rowwise_adagrad"
    lr: float = 0.1
    dense_lr: float = 1e-3  # Adam for the MLP towers
    seed: int = 0
    data: Optional[str] = None  # a Criteo TSV; None: the synthetic stream
    checkpoint_dir: Optional[str] = None
    checkpoint_every: int = 0  # 0: only at the end
    resume: bool = False
    export: Optional[str] = None
    eval_batches: int = 4  # per rank
    device_memory: str = "80GiB"  # what the planner assumes each rank has
    progress: bool = True
    # The next batch's input dist during this step (modular.prefetch). On CPU it pays when each
    # rank has its own cores (the self-launch pins them: +10% examples/s on 2 cores; unpinned it
    # measured 5% slower, docs/benchmarks.md).
    prefetch: bool = True
    # A collective that waits longer fails (naming it) instead of hanging: a rank that died or
    # raised stops its peers within this many seconds (torch's own default is 30 minutes).
    collective_timeout: float = 300.0
    # Row-wise Adagrad on tables the plan cuts into column pieces: the whole row's statistic
    # ("exact", as unsharded) or each piece's own ("per_shard", TorchRec's approximation,
    # cheaper); the planner prices the same choice (Note [fused tables] in modular/fused/choice.py).
    column_wise_statistic: str = "exact"
    # Trains with both MLP towers compiled (modular.apply_compile: FSDP2 keeps dynamo out of a
    # fully sharded module's call) and through torch.compile(model) for the interaction; the
    # sharded EBC runs eagerly behind one graph break (Note [compiling a sharded model] in
    # modular/compose/compile.py). The first step pays the compile.
    compile: bool = False
    # FP16 tables (half the table memory; FP32 optimizer state and pooled outputs) and, with
    # fp16_comms, pooled embeddings and their gradients sent as FP16 (Note [low-precision
    # tables] in modular/kernels/table_dtypes.py, Note [low-precision comms] in modular/comm.py).
    fp16: bool = False
    fp16_comms: bool = False
    # Every `rebalance_every` steps (0: never): measure the pooling factors, replan within
    # `rebalance_budget` of moved weights and optimizer state, reshard when the slowest rank gets
    # `rebalance_threshold` (relative) faster (examples/rebalance.py).
    rebalance_every: int = 0
    rebalance_budget: str = "64MiB"
    rebalance_threshold: float = 0.05
    # Synthetic data only: from step `drift_at` on, feature `drift_feature` has `drift_pooling`
    # ids per bag (every other feature keeps one), a pooling factor that drifts mid-run.
    drift_feature: Optional[str] = None
    drift_pooling: int = 1
    drift_at: int = 0
    # 64-bit raw ids: managed-collision tables against hashing, by AUC (examples/raw_ids.py)
    raw_ids: bool = False

    @property
    def rebalance(self) -> RebalanceSettings:
        return RebalanceSettings(
            every=self.rebalance_every, threshold=self.rebalance_threshold,
            max_moved_bytes=planners.parse_bytes(self.rebalance_budget, "--rebalance-budget"),
        )  # fmt: skip

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ValueError(f"--steps must be >= 0, got {self.steps}")
        if self.batch_size < 1:
            raise ValueError(f"--batch-size must be at least 1, got {self.batch_size}")
        if not self.collective_timeout > 0:
            raise ValueError(f"--collective-timeout must be positive, got {self.collective_timeout}")
        if self.resume and not self.checkpoint_dir:
            raise ValueError("--resume needs --checkpoint-dir (where the last run saved)")
        self.rebalance  # noqa: B018  its checks, now rather than at the first rebalance
        if self.raw_ids:
            other = [flag for flag, on in (("--data", self.data), ("--checkpoint-dir", self.checkpoint_dir),
                     ("--export", self.export), ("--rebalance-every", self.rebalance_every),
                     ("--drift-feature", self.drift_feature), ("--compile", self.compile),
                     ("--fp16", self.fp16), ("--fp16-comms", self.fp16_comms)) if on]  # fmt: skip
            if other:
                raise ValueError(f"--raw-ids trains its own raw-id model on its own stream; drop "
                                 f"{', '.join(other)}")  # fmt: skip
        if self.drift_feature is not None:
            features = [c.feature_names[0] for c in table_configs()]
            if self.drift_feature not in features:
                raise ValueError(f"--drift-feature {self.drift_feature!r} is no feature of the "
                                 f"model; pick one of {features[0]} .. {features[-1]}")  # fmt: skip
            if self.data is not None:
                raise ValueError(f"--drift-feature changes the synthetic stream; drop it with "
                                 f"--data {self.data}")  # fmt: skip
            if self.drift_pooling < 1 or self.drift_at < 0:
                raise ValueError(f"--drift-pooling must be >= 1 id per bag and --drift-at >= 0, "
                                 f"got {self.drift_pooling} and {self.drift_at}")  # fmt: skip


@dataclass(frozen=True)
class TrainResult:
    """What a run did, the same on every rank (losses are means over ranks)."""

    start_step: int
    end_step: int
    losses: tuple[float, ...]  # one per step run, steps start_step..end_step-1
    auc: float
    examples_per_s: float
    interrupted: bool = False
    checkpoint: Optional[str] = None
    rebalances: tuple[Rebalance, ...] = ()  # one per check (--rebalance-every)
    plan: Optional[str] = None  # the plan the model has at the end, as JSON (ShardingPlan.from_json)


def table_configs(fp16: bool = False):
    configs = criteo_table_configs(scale_rows_to=ROWS_CAP, dim=DIM)
    for c in configs if fp16 else ():
        c.data_type = DataType.FP16
    return configs


def build_model(device: str | torch.device, fp16: bool = False) -> DLRM:
    """The example's DLRM; dense towers always on CPU and seeded, tables on `device` (FP16 tables
    with `fp16`)."""
    torch.manual_seed(0)  # the dense init is the same on every rank and in `export` checks
    return DLRM(table_configs(fp16), bottom_mlp=BOTTOM_MLP, top_mlp=TOP_MLP, device=device)


def topology(world_size: int, device_memory: str) -> planners.Topology:
    """What the planner assumes: `world_size` ranks of one host."""
    return planners.Topology(world_size, ranks_per_host=world_size, device_memory=device_memory)


def make_plan(
    model: nn.Module, *, world_size: int, batch_size: int, device_memory: str,
    column_wise_statistic: str = "exact", comm_dtype: str = "fp32",
    optimizer: str = "exact_rowwise_adagrad",
):  # fmt: skip
    """The planner's plan for this model (EBC at `sparse.ebc`) on `world_size` ranks of one host
    (its tables priced in their own dtype with `optimizer`'s state, the output dist in
    `comm_dtype`; every feature at pooling factor 1)."""
    result = planners.plan_with_stats(
        model, topology(world_size, device_memory), batch_size=batch_size,
        column_wise_statistic=column_wise_statistic, comm_dtype=comm_dtype, optimizer=optimizer,
    )
    return result.plan, result.stats


def shard_model(
    model: DLRM, plan, config: TrainConfig, device: torch.device
) -> tuple[DLRM, modular.CombinedOptimizer]:
    """Shards `model` (tables on `meta`) by `plan` and builds its optimizer; collective.

    The order is Note [order of sharding calls] (modular/compose/fsdp.py): the tables' optimizer
    fused into backward first (on `meta` it only marks the EBC), then the tables sharded (each
    rank materialises its shards, fused), then FSDP2 for the dense towers, then the dense
    optimizer over what is left (FSDP's DTensors).
    """
    fused = modular.fuse_optimizer(
        model, config.optimizer, lr=config.lr, eps=1e-8,
        column_wise_statistic=config.column_wise_statistic,
    )  # fmt: skip
    comm_dtype = torch.float16 if config.fp16_comms else None
    model = modular.shard(model, plan, device=device, comm_dtype=comm_dtype)
    towers = (model.dense, model.over)
    for tower in towers:  # built on CPU by DLRM; the tables already live on `device`
        tower.to(device)
    model = modular.apply_fully_shard(model, modules=lambda m: any(m is t for t in towers))
    dense = torch.optim.Adam(modular.local_parameters(model), lr=config.dense_lr)
    return model, modular.CombinedOptimizer({"tables": fused, "dense": dense})


def rank_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ---------------------------------------------------------------------------------------------
# Data


class Data:
    """This rank's training batches by step, and its held-out batch."""

    def __init__(self, config: TrainConfig, rank: int, world: int) -> None:
        rows = [t.num_embeddings for t in table_configs()]
        if config.data is None:
            stream = SyntheticCriteo(
                rows, batch_size=config.batch_size, seed=config.seed, rank=rank, world_size=world
            )
            self._batch_at = stream.batch_at
            if config.drift_feature is not None:
                features = [t.feature_names[0] for t in table_configs()]
                bags = [config.drift_pooling if f == config.drift_feature else 1 for f in features]
                drifted = SyntheticCriteo(rows, batch_size=config.batch_size, seed=config.seed,
                                          rank=rank, world_size=world, multi_hot=bags)  # fmt: skip
                at = config.drift_at
                self._batch_at = lambda step: (drifted if step >= at else stream).batch_at(step)
            self.held_out = concat_batches(
                [self._batch_at(EVAL_STEP + i) for i in range(config.eval_batches)]
            )
            return
        batches = list(read_criteo_tsv(config.data, rows, batch_size=config.batch_size, rank=rank, world_size=world))
        if len(batches) < 2:
            raise ValueError(
                f"{config.data} has fewer than 2 * batch_size * world_size = "
                f"{2 * config.batch_size * world} lines: one window of {config.batch_size * world} "
                f"lines is held out for AUC and at least one must remain to train on; "
                f"lower --batch-size"
            )
        self.held_out = batches[-1]
        self._train = batches[:-1]
        self._batch_at = self._next_in_file

    def _next_in_file(self, step: int) -> Batch:
        return self._train[step % len(self._train)]  # epochs over the file

    def batch_at(self, step: int) -> Batch:
        return self._batch_at(step)


def to_device(batch: Batch, device: torch.device) -> Batch:
    if device.type == "cpu":
        return batch
    return Batch(batch.dense.to(device), batch.sparse.to(device), batch.labels.to(device))


# ---------------------------------------------------------------------------------------------
# Checkpoints: one directory per saved step; each is committed atomically by modular.checkpoint


def latest_checkpoint(checkpoint_dir: str | Path) -> Optional[tuple[int, Path]]:
    """(step, path) of the newest complete checkpoint under `checkpoint_dir`, or None."""
    found = [
        (int(m.group(1)), p)
        for p in Path(checkpoint_dir).glob("step_*")
        if (m := _STEP_DIR.match(p.name)) and (p / "checkpoint.json").is_file()
    ]
    return max(found) if found else None


def save_checkpoint(checkpoint_dir: str, step: int, model: nn.Module, opt) -> Path:
    path = Path(checkpoint_dir) / f"step_{step:08d}"
    modular.checkpoint.save(path, model, opt)
    if dist.get_rank() == 0:  # keep only the newest: `path` is complete, so the rest can go
        for old in Path(checkpoint_dir).glob("step_*"):
            if old.name != path.name and _STEP_DIR.match(old.name):
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return path


# ---------------------------------------------------------------------------------------------
# Training


class _StopFlag:
    """Note [stopping on Ctrl-C]: SIGINT sets a flag the ranks agree on after each step."""

    def __init__(self) -> None:
        self.count = 0
        self._previous = None

    def __enter__(self) -> _StopFlag:
        if threading.current_thread() is threading.main_thread():  # only it may set handlers
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)

    def _handle(self, signum, frame) -> None:
        self.count += 1
        if self.count >= 3:
            raise KeyboardInterrupt


def _progress(enabled: bool, start: int, end: int):
    if not enabled:
        return None
    from tqdm import tqdm

    # On a terminal the bar redraws in place; into a log (CI, nohup) it would add a line per
    # step, so there it writes one every 10 seconds.
    interval = 0.1 if sys.stderr.isatty() else 10.0
    return tqdm(
        total=end - start, initial=0, desc=f"steps {start}..{end}", unit="step", file=sys.stderr,
        mininterval=interval, maxinterval=max(interval, 10.0),
    )


def train(config: TrainConfig) -> TrainResult:
    """Runs `config` on the default process group (already initialised); collective.

    Only rank 0 prints. Returns the same `TrainResult` on every rank.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    device = rank_device()
    say = print if rank == 0 else (lambda *a, **k: None)

    # 1. Plan on a meta model (no memory), for this world size.
    model = build_model("meta", fp16=config.fp16)
    configs = {"sparse.ebc": model.sparse.ebc.embedding_bag_configs()}  # what replan re-prices
    plan, stats = make_plan(
        model, world_size=world, batch_size=config.batch_size, device_memory=config.device_memory,
        column_wise_statistic=config.column_wise_statistic,
        comm_dtype="fp16" if config.fp16_comms else "fp32", optimizer=config.optimizer,
    )  # fmt: skip
    kinds: dict[str, int] = {}
    for placement in plan.modules["sparse.ebc"].values():
        kinds[placement.sharding_type.value] = kinds.get(placement.sharding_type.value, 0) + 1
    say(f"plan for {world} ranks: {', '.join(f'{n} {k}' for k, n in sorted(kinds.items()))}")
    say(stats.format())

    model, opt = shard_model(model, plan, config, device)

    start = 0
    if config.resume:
        found = latest_checkpoint(config.checkpoint_dir)
        if found is None:
            raise FileNotFoundError(
                f"--resume: no complete checkpoint (step_NNNNNNNN/checkpoint.json) under "
                f"{config.checkpoint_dir!r}; run once without --resume first"
            )
        start, path = found
        modular.checkpoint.load(path, model, opt)
        say(f"resumed from {path} (step {start})")
    end = max(start, config.steps)

    forward = model
    if config.compile:  # the towers' forwards inside FSDP's hooks, then what lies between them
        towers = (model.dense, model.over)
        model = modular.apply_compile(model, modules=lambda m: any(m is t for t in towers))
        forward = torch.compile(model)
    data = Data(config, rank, world)
    rebalancing = config.rebalance
    meter = PoolingMeter(model.sparse.feature_names, device) if rebalancing.every else None
    priced = planned_pooling(meter.features if meter else ())
    rebalances: list[Rebalance] = []
    losses: list[float] = []
    examples, seconds, interrupted = 0, 0.0, False
    saved: Optional[Path] = None
    bar = _progress(config.progress and rank == 0 and end > start, start, end)
    with _StopFlag() as stop:
        upcoming = to_device(data.batch_at(start), device) if end > start else None
        for step in range(start, end):
            began = time.perf_counter()
            batch, upcoming = upcoming, None
            if step + 1 < end:
                upcoming = to_device(data.batch_at(step + 1), device)
                if config.prefetch:  # its input dist overlaps this step (modular.prefetch)
                    modular.prefetch(model, upcoming.sparse)
            if meter is not None:
                meter.add(batch.sparse)
            loss = F.binary_cross_entropy_with_logits(forward(batch.dense, batch.sparse), batch.labels)
            opt.zero_grad()
            loss.backward()  # the tables are updated here (fused)
            opt.step()
            # One small all-reduce per step: the loss averaged over ranks, and the stop flag.
            shared = torch.tensor([loss.item(), float(stop.count > 0)], device=device)
            del loss  # its graph holds the tables' kernels, which a reshard would have to keep
            dist.all_reduce(shared)
            losses.append(shared[0].item() / world)
            if step > start:  # the first step pays one-off costs (allocation, warm-up)
                examples += config.batch_size * world
                seconds += time.perf_counter() - began
            if bar is not None:
                bar.set_postfix(  # drawn by update(), at most every mininterval
                    loss=f"{losses[-1]:.4f}", ex_s=f"{examples / max(seconds, 1e-9):,.0f}",
                    refresh=False,
                )
                bar.update(1)
            if shared[1].item() > 0:
                interrupted = True
                end = step + 1
                break
            due = config.checkpoint_every and (step + 1) % config.checkpoint_every == 0
            if config.checkpoint_dir and due and step + 1 < end:
                saved = save_checkpoint(config.checkpoint_dir, step + 1, model, opt)
            if meter is not None and (step + 1) % rebalancing.every == 0 and step + 1 < end:
                # Between two steps, on every rank (Note [rebalancing while training]). The fused
                # table optimizer and the dense Adam (over FSDP's dense parameters only) stay
                # valid; `upcoming`'s prefetched input dist is dropped and runs again in forward.
                plan, report = rebalance(
                    model, plan, configs, topology(world, config.device_memory), step=step + 1,
                    pooling=meter.take(), priced=priced, settings=rebalancing,
                    batch_size=config.batch_size, optimizer=config.optimizer,
                    column_wise_statistic=config.column_wise_statistic,
                    comm_dtype="fp16" if config.fp16_comms else "fp32",
                )  # fmt: skip
                if report.resharded:
                    priced = dict(report.pooling)
                rebalances.append(report)
                say(report.format(world))
    if bar is not None:
        bar.close()
    if interrupted:
        say(f"interrupted after step {end}: stopping without saving; the last checkpoint is intact")
        return TrainResult(start, end, tuple(losses), float("nan"), 0.0, True,
                           str(saved) if saved else None, tuple(rebalances), plan.to_json())  # fmt: skip

    # 3. Held-out AUC over every rank's held-out batch.
    held_out = to_device(data.held_out, device)
    with torch.no_grad():
        logits = model(held_out.dense, held_out.sparse).float()
    gathered = [torch.empty_like(logits) for _ in range(world)]
    labels = [torch.empty_like(held_out.labels) for _ in range(world)]
    dist.all_gather(gathered, logits)
    dist.all_gather(labels, held_out.labels)
    score = auc(torch.cat(gathered).cpu(), torch.cat(labels).cpu())

    if config.checkpoint_dir and end > start:
        saved = save_checkpoint(config.checkpoint_dir, end, model, opt)
        say(f"saved checkpoint {saved}")
    if config.export:
        state = modular.checkpoint.export(model)
        if state is not None:
            Path(config.export).parent.mkdir(parents=True, exist_ok=True)
            torch.save(state, config.export)
            say(f"exported the unsharded state_dict ({len(state)} entries) to {config.export}")
        dist.barrier()

    rate = examples / seconds if seconds else 0.0
    if losses:
        say(f"final: loss {losses[-1]:.4f} (first {losses[0]:.4f}), AUC {score:.4f}, {rate:,.0f} examples/s")
    else:
        say(f"final: no steps run (at step {start}), AUC {score:.4f}")
    return TrainResult(start, end, tuple(losses), score, rate, False, str(saved) if saved else None,
                       tuple(rebalances), plan.to_json())  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Launch: under torchrun (RANK / WORLD_SIZE set) or self-launched CPU ranks


def parse_args(argv: Sequence[str]) -> tuple[TrainConfig, int]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = TrainConfig()
    p.add_argument("--steps", type=int, default=d.steps, help="train until this global step")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="per rank")
    p.add_argument("--optimizer", default=d.optimizer, choices=_TABLE_OPTIMIZERS,
                   help="the tables' fused optimizer (default exact_rowwise_adagrad)")
    p.add_argument("--lr", type=float, default=d.lr, help="the tables' (fused) learning rate")
    p.add_argument("--dense-lr", type=float, default=d.dense_lr, help="MLP towers: Adam")
    p.add_argument("--seed", type=int, default=d.seed, help="the synthetic stream's seed")
    p.add_argument("--data", default=None, help="a Criteo-format TSV (e.g. examples/data/criteo_sample.tsv)")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps; 0: at the end only")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    p.add_argument("--export", default=None, help="write the unsharded state_dict here (torch.save)")
    p.add_argument("--eval-batches", type=int, default=d.eval_batches, help="held-out batches per rank")
    p.add_argument("--device-memory", default=d.device_memory, help="per rank, for the planner")
    p.add_argument("--world-size", type=int, default=1, help="CPU ranks to launch (ignored under torchrun)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--no-prefetch", action="store_true", help="no overlap of the next batch's input dist")
    p.add_argument("--column-wise-statistic", choices=("exact", "per_shard"),
                   default=d.column_wise_statistic,
                   help="row-wise Adagrad on column pieces: the whole row's statistic, or each "
                        "piece's own (TorchRec's approximation)")  # fmt: skip
    p.add_argument("--compile", action="store_true", help="train through torch.compile(model)")
    p.add_argument("--fp16", action="store_true", help="FP16 tables (half their memory)")
    p.add_argument("--fp16-comms", action="store_true",
                   help="send pooled embeddings and their gradients as FP16")
    p.add_argument("--collective-timeout", type=float, default=d.collective_timeout,
                   help="seconds a collective may wait before failing (a dead peer)")
    p.add_argument("--rebalance-every", type=int, default=d.rebalance_every,
                   help="steps between checks of the pooling factors (replan, then reshard if "
                        "it pays); 0: never")  # fmt: skip
    p.add_argument("--rebalance-budget", default=d.rebalance_budget,
                   help="weights and optimizer state that may change rank at one check, e.g. 64MiB")
    p.add_argument("--rebalance-threshold", type=float, default=d.rebalance_threshold,
                   help="reshard only when the slowest rank gets this much faster (0.05: 5%%)")
    p.add_argument("--drift-feature", default=None,
                   help="synthetic data: this feature's bags get --drift-pooling ids from "
                        "--drift-at on (e.g. f_cat_3)")  # fmt: skip
    p.add_argument("--drift-pooling", type=int, default=d.drift_pooling, help="ids per bag after the drift")
    p.add_argument("--drift-at", type=int, default=d.drift_at, help="the step the drift starts at")
    p.add_argument("--raw-ids", action="store_true",
                   help="64-bit raw ids: train managed-collision tables, then the ids hashed "
                        "modulo the same rows, and report both AUCs")  # fmt: skip
    a = p.parse_args(argv)
    config = TrainConfig(
        steps=a.steps, batch_size=a.batch_size, optimizer=a.optimizer, lr=a.lr,
        dense_lr=a.dense_lr, seed=a.seed,
        data=a.data, checkpoint_dir=a.checkpoint_dir, checkpoint_every=a.checkpoint_every,
        resume=a.resume, export=a.export, eval_batches=a.eval_batches,
        device_memory=a.device_memory, progress=not a.no_progress, prefetch=not a.no_prefetch,
        collective_timeout=a.collective_timeout, column_wise_statistic=a.column_wise_statistic,
        compile=a.compile,
        fp16=a.fp16, fp16_comms=a.fp16_comms,
        rebalance_every=a.rebalance_every, rebalance_budget=a.rebalance_budget,
        rebalance_threshold=a.rebalance_threshold, drift_feature=a.drift_feature,
        drift_pooling=a.drift_pooling, drift_at=a.drift_at, raw_ids=a.raw_ids,
    )  # fmt: skip
    return config, a.world_size


def _quiet_known_warnings() -> None:
    # Raised on every step by code outside this example; they say nothing about this run.
    warnings.filterwarnings("ignore", message="Please use DTensor instead", category=FutureWarning)
    # torchrec asks torch.fx whether it is tracing; torch logs a deprecation note once per rank.
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)


def run_rank(config: TrainConfig) -> int:
    """One rank, from the env:// variables torchrun (or `launch`) sets; the exit status."""
    _quiet_known_warnings()
    device_id = None
    if torch.cuda.is_available():
        device_id = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device_id)
        backend = "nccl"
    else:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        backend = "gloo"
    # device_id binds NCCL to this rank's GPU (torch warns at the first barrier without it)
    dist.init_process_group(
        backend, timeout=timedelta(seconds=config.collective_timeout), device_id=device_id
    )
    try:
        if config.raw_ids:
            train_raw_ids(config)
            return 0
        result = train(config)
        return 130 if result.interrupted else 0
    except KeyboardInterrupt:  # a third Ctrl-C (Note [stopping on Ctrl-C])
        return 130
    finally:
        dist.destroy_process_group()


def _pin(rank: int, world_size: int):
    """Pins a launched rank to its own share of the cores (as CPU launchers such as torch's
    run_cpu do): its threads, gloo's included, then use that rank's idle time rather than
    preempting another rank. None (no pinning) with fewer cores than ranks or without affinity."""
    per_rank = (os.cpu_count() or 1) // world_size
    if per_rank == 0 or not hasattr(os, "sched_setaffinity"):
        return None
    cores = set(range(rank * per_rank, (rank + 1) * per_rank))
    return lambda: os.sched_setaffinity(0, cores)


def _before_exec(rank: int, world_size: int):
    """What a launched rank's process runs before this script starts in it: it asks to end when
    the launcher dies, even by SIGKILL (examples/parent_death.py), and pins itself (`_pin`)."""
    end, pin = end_with_parent(), _pin(rank, world_size)

    def before_exec() -> None:
        end()
        if pin is not None:
            pin()

    return before_exec


def launch(argv: Sequence[str], world_size: int) -> int:
    """Starts `world_size` CPU ranks of this script, one process each; the worst exit status."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
               OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")  # fmt: skip
    procs = [
        subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), *argv],
            env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
            preexec_fn=_before_exec(r, world_size),
        )
        for r in range(world_size)
    ]
    try:
        codes = [p.wait() for p in procs]
    except KeyboardInterrupt:  # the ranks got the same SIGINT; give them time to stop together
        deadline = time.monotonic() + 30
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
        return 130
    failed = {r: c for r, c in enumerate(codes) if c != 0}
    if failed:
        print(f"ranks exited with non-zero status: {failed}", file=sys.stderr)
        return 130 if set(failed.values()) == {130} else 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    config, world_size = parse_args(argv)
    if "RANK" in os.environ:  # under torchrun, or one of the ranks `launch` started
        # Ends as any script may: `import modular` frees what destroy_process_group leaves
        # alive before the interpreter exits (Note [exit after destroy_process_group]).
        return run_rank(config)
    if world_size < 1:
        raise SystemExit(f"--world-size must be at least 1, got {world_size}")
    return launch(argv, world_size)


if __name__ == "__main__":
    sys.exit(main())
