"""The raw-id mode of examples/train_dlrm.py (`--raw-ids`): 64-bit ids, managed-collision tables.

    python examples/train_dlrm.py --world-size 2 --raw-ids

Production ids (users, items, hashed crosses) are raw 64-bit values from a space that keeps
growing. This mode trains the same small model twice on one synthetic stream of such ids, on
every rank, sharded by the planner's plan:
- **managed collisions**: each table is torchrec's `ManagedCollisionEmbeddingBagCollection`
  with an `MCHManagedCollisionModule` (DistanceLFU eviction, `zch_size` = the table's rows),
  which `planners.plan` and `modular.shard` take as they are (docs/managed_collision.md);
- **hashing**: the raw ids modulo the same row count, into a plain EmbeddingBagCollection;
and reports the held-out AUC of both.

The stream (`RawIdStream`): per feature, ids drawn from a Zipf popularity over `vocab` items
whose ranking slides by `churn` items a step (new items arrive at the top, old ones fade), each
item a splitmix64 hash below 2**62; the label is drawn from sigmoid(sum over features of each
id's latent value), a per-id value from its hash. A table that gives two ids one row (hashing's
collisions) cannot learn both values, so collisions cost AUC; the MC table gives each popular id
its own row and sends the rare rest to its miss slot, whose row learns their mean.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
from torchrec.modules.mc_modules import (
    DistanceLFU_EvictionPolicy, ManagedCollisionCollection, MCHManagedCollisionModule,
)  # fmt: skip

import modular
import planners
from examples.dlrm import auc

__all__ = ["RawIdModel", "RawIdResult", "RawIdStream", "train_raw_ids"]

FEATURES = 4
ROWS = 1_000  # per table: the MC tables' zch_size and the hashed tables' modulus
DIM = 8
ID_SPACE = 2**62  # raw ids lie in [0, 2**62)
EVAL_SALT = 1  # held-out batches come from their own random streams


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = (x + np.uint64(0x9E3779B97F4A7C15)) & np.uint64(0xFFFFFFFFFFFFFFFF)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class RawIdStream:
    """This rank's batches of raw ids by step: (KJT of `FEATURES` features, one id per sample,
    labels [B]); seeded by (seed, rank, step), so every run and every mode sees the same ones."""

    def __init__(self, batch_size: int, *, seed: int, rank: int, vocab: int = 20_000,
                 zipf: float = 1.05, churn: int = 2, scale: float = 2.5) -> None:  # fmt: skip
        self.batch_size, self.seed, self.rank, self.churn, self.scale = batch_size, seed, rank, churn, scale
        weights = 1.0 / np.arange(1, vocab + 1) ** zipf
        self._cdf = np.cumsum(weights) / weights.sum()

    def batch_at(self, step: int, salt: int = 0) -> tuple[KeyedJaggedTensor, torch.Tensor]:
        rng = np.random.default_rng([self.seed, self.rank, step, salt])
        ids, latent = [], np.zeros(self.batch_size)
        for f in range(FEATURES):
            popularity = np.searchsorted(self._cdf, rng.random(self.batch_size))  # 0: the most popular
            item = (popularity + self.churn * step).astype(np.uint64) + np.uint64(f << 40)
            raw = _splitmix64(item)
            ids.append((raw >> np.uint64(2)).astype(np.int64))  # below 2**62
            latent += (_splitmix64(raw) >> np.uint64(11)).astype(np.float64) / 2.0**53 * 2 - 1
        p = 1 / (1 + np.exp(-self.scale * latent))
        labels = torch.tensor(rng.random(self.batch_size) < p, dtype=torch.float32)
        kjt = KeyedJaggedTensor(keys=[f"f_raw_{f}" for f in range(FEATURES)],
                                values=torch.tensor(np.concatenate(ids)),
                                lengths=torch.ones(FEATURES * self.batch_size, dtype=torch.int64))  # fmt: skip
        return kjt, labels


def table_configs() -> list[EmbeddingBagConfig]:
    return [EmbeddingBagConfig(name=f"t_raw_{f}", num_embeddings=ROWS, embedding_dim=DIM,
                               feature_names=[f"f_raw_{f}"]) for f in range(FEATURES)]  # fmt: skip


def managed_collision_tables(tables: list[EmbeddingBagConfig]) -> ManagedCollisionEmbeddingBagCollection:
    """The three lines that turn tables into MC tables (README, docs/managed_collision.md)."""
    mch = {t.name: MCHManagedCollisionModule(zch_size=t.num_embeddings, device=torch.device("cpu"),
                                             eviction_policy=DistanceLFU_EvictionPolicy(), eviction_interval=1)
           for t in tables}  # fmt: skip
    mcc = ManagedCollisionCollection(managed_collision_modules=mch, embedding_configs=tables)
    return ManagedCollisionEmbeddingBagCollection(EmbeddingBagCollection(tables=tables), mcc)


class RawIdModel(nn.Module):
    """Pooled embeddings of the raw-id features -> MLP -> one logit. `managed`: the tables are
    MC tables at `mc` (planned as `mc._embedding_module`); otherwise a plain EBC at `ebc`, fed
    the ids modulo `ROWS`."""

    def __init__(self, managed: bool) -> None:
        super().__init__()
        torch.manual_seed(0)  # every rank (and both modes) starts from the same weights
        tables = table_configs()
        self.managed = managed
        if managed:
            self.mc = managed_collision_tables(tables)
        else:
            self.ebc = EmbeddingBagCollection(tables=tables)
        self.over = nn.Sequential(nn.Linear(FEATURES * DIM, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, raw: KeyedJaggedTensor) -> torch.Tensor:
        if self.managed:
            pooled, _ = self.mc(raw)
        else:
            hashed = KeyedJaggedTensor(keys=raw.keys(), values=raw.values() % ROWS, lengths=raw.lengths())
            pooled = self.ebc(hashed)
        return self.over(pooled.values()).sum(-1)  # [B]: not a view of FSDP's output


@dataclass(frozen=True)
class RawIdResult:
    """Both runs, the same on every rank: held-out AUC, losses (means over ranks), examples/s."""

    mc_auc: float
    hashed_auc: float
    mc_losses: tuple[float, ...]
    hashed_losses: tuple[float, ...]
    mc_rate: float
    hashed_rate: float


def _run(managed: bool, config, stream: RawIdStream,
         say: Callable[..., None]) -> tuple[float, tuple[float, ...], float]:  # fmt: skip
    """Plans, shards, trains and evaluates one mode; collective. (AUC, losses, examples/s)."""
    import time

    world = dist.get_world_size()
    model = RawIdModel(managed)
    result = planners.plan_with_stats(model, planners.Topology(world, ranks_per_host=world,
                                      device_memory=config.device_memory), batch_size=config.batch_size)  # fmt: skip
    name = "managed collisions" if managed else "hashed ids"
    say(f"{name}: plan for {world} ranks:\n{result.stats.summary()}")
    tables = modular.fuse_optimizer(model, config.optimizer, lr=config.lr, eps=1e-8)
    modular.shard(model, result.plan)
    modular.apply_fully_shard(model, modules=lambda m: m is model.over)
    opt = modular.CombinedOptimizer({"tables": tables, "dense": torch.optim.Adam(
        modular.local_parameters(model), lr=config.dense_lr)})  # fmt: skip
    losses, began = [], 0.0
    for step in range(config.steps):
        if step == 1:
            began = time.perf_counter()  # the first step pays one-off costs
        kjt, labels = stream.batch_at(step)
        loss = F.binary_cross_entropy_with_logits(model(kjt), labels)
        opt.zero_grad()
        loss.backward()  # the tables are updated here (fused)
        opt.step()
        shared = loss.detach().clone()
        dist.all_reduce(shared)
        losses.append(shared.item() / world)
    seconds = time.perf_counter() - began if config.steps > 1 else 0.0
    model.eval()  # the MC tables remap without counting the held-out ids or evicting
    logits, labels = [], []
    with torch.no_grad():
        for i in range(config.eval_batches):
            kjt, y = stream.batch_at(config.steps + i, salt=EVAL_SALT)  # the stream right after training
            logits.append(model(kjt))
            labels.append(y)
    mine = torch.stack([torch.cat(logits), torch.cat(labels)])
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    both = torch.cat(every, 1)
    rate = config.batch_size * world * (config.steps - 1) / seconds if seconds else 0.0
    return auc(both[0], both[1]), tuple(losses), rate


def train_raw_ids(config, say: Optional[Callable[..., None]] = None) -> RawIdResult:
    """Trains the MC model and the hashed one on the same raw-id stream and reports both AUCs;
    collective, on the default process group. `config` is train_dlrm's `TrainConfig` (steps,
    batch_size, optimizer, lr, dense_lr, seed, eval_batches, device_memory)."""
    rank = dist.get_rank()
    say = say or (print if rank == 0 else (lambda *a, **k: None))
    stream = RawIdStream(config.batch_size, seed=config.seed, rank=rank)
    mc_auc, mc_losses, mc_rate = _run(True, config, stream, say)
    hashed_auc, hashed_losses, hashed_rate = _run(False, config, stream, say)
    out = RawIdResult(mc_auc, hashed_auc, mc_losses, hashed_losses, mc_rate, hashed_rate)
    for name, a, losses, rate in (("managed collisions", mc_auc, mc_losses, mc_rate),
                                  ("hashed ids", hashed_auc, hashed_losses, hashed_rate)):  # fmt: skip
        last = f"loss {losses[-1]:.4f} (first {losses[0]:.4f}), " if losses else ""
        say(f"raw ids, {name} ({ROWS:_} rows per table): {last}AUC {a:.4f}, {rate:,.0f} examples/s")
    say(f"raw ids: AUC {mc_auc:.4f} with managed collisions, {hashed_auc:.4f} hashing modulo "
        f"{ROWS:_} rows ({mc_auc - hashed_auc:+.4f})")
    return out
