"""A small DLRM for the composition tests (`build_dlrm`).

Every rank builds the same seeded `DLRM`, deep-copies it as the reference, then shards the copy's
tables with `modular.shard` and its dense MLPs with FSDP2 or DDP. The reference trains in the same
process on the global batch (`global_dlrm_batch`) with BCE averaged over it, which equals the mean
over ranks of the per-rank mean BCE (equal batch sizes): the objective of Note [grad scaling across
ranks]. Both sides use plain SGD, whose update is proportional to the gradient, so a gradient
scaled wrongly (reduced twice, or not averaged) shows.

A model whose tables are fused calls `modular.fuse_optimizer` before `modular.shard` (Note [order
of sharding calls]): `build_dlrm(..., before_shard=...)`. The comparisons (`assert_weights_match`,
`assert_grads_match`) are in tests/modular/compare.py.
"""

from __future__ import annotations

import copy
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import modular
from planners.types import ShardingPlan, ShardingType, TablePlacement
from tests.modular.ebc_cases import global_batch

DLRM_BATCH = 4
DLRM_DIM = 8
DLRM_DENSE_IN = 4
DLRM_LR = 0.5
DLRM_STEPS = 5
DLRM_FEATURES = ("f_user", "f_item", "f_cat", "f_ctx")


def dlrm_tables() -> list[EmbeddingBagConfig]:
    rows = {"t_user": 23, "t_item": 13, "t_cat": 11, "t_ctx": 7}
    pooling = {"t_user": PoolingType.SUM, "t_item": PoolingType.MEAN}
    return [
        EmbeddingBagConfig(
            name=t, num_embeddings=n, embedding_dim=DLRM_DIM, feature_names=[f"f_{t[2:]}"],
            pooling=pooling.get(t, PoolingType.SUM),
        )
        for t, n in rows.items()
    ]


class MLP(nn.Sequential):
    """Linear layers with ReLU between them (and after the last one if `relu_last`)."""

    def __init__(self, in_features: int, sizes: list[int], *, relu_last: bool) -> None:
        layers: list[nn.Module] = []
        for i, out in enumerate(sizes):
            layers.append(nn.Linear(in_features, out))
            if relu_last or i < len(sizes) - 1:
                layers.append(nn.ReLU())
            in_features = out
        super().__init__(*layers)


class DLRM(nn.Module):
    """dense -> bottom MLP; sparse -> EBC; pairwise dot interaction; top MLP -> one logit."""

    def __init__(self) -> None:
        super().__init__()
        n = len(DLRM_FEATURES) + 1
        self.bottom = MLP(DLRM_DENSE_IN, [16, DLRM_DIM], relu_last=True)
        self.sparse = EmbeddingBagCollection(tables=dlrm_tables())
        self.top = MLP(DLRM_DIM + n * (n - 1) // 2, [16, 1], relu_last=False)

    def forward(self, dense: torch.Tensor, kjt: KeyedJaggedTensor) -> torch.Tensor:
        d = self.bottom(dense)
        kt = self.sparse(kjt)
        e = torch.stack([kt[f] for f in DLRM_FEATURES], dim=1)
        x = torch.cat([d.unsqueeze(1), e], dim=1)  # under mixed precision: bf16 and fp32 -> fp32
        z = torch.bmm(x, x.transpose(1, 2))
        i, j = torch.triu_indices(x.shape[1], x.shape[1], offset=1)
        return self.top(torch.cat([d, z[:, i, j]], dim=1)).squeeze(-1)


class Batch(NamedTuple):
    dense: torch.Tensor
    sparse: KeyedJaggedTensor
    labels: torch.Tensor


def dlrm_batch(step: int, rank: int, size: int = DLRM_BATCH) -> Batch:
    g = torch.Generator().manual_seed(1000 * step + rank)
    rows = {f"f_{c.name[2:]}": c.num_embeddings for c in dlrm_tables()}
    lengths = [torch.randint(0, 4, (size,), generator=g) for _ in DLRM_FEATURES]
    values = [torch.randint(0, rows[f], (int(n.sum()),), generator=g) for f, n in zip(DLRM_FEATURES, lengths)]
    return Batch(
        dense=torch.randn(size, DLRM_DENSE_IN, generator=g),
        sparse=KeyedJaggedTensor(keys=list(DLRM_FEATURES), values=torch.cat(values), lengths=torch.cat(lengths)),
        labels=torch.randint(0, 2, (size,), generator=g).float(),
    )


def global_dlrm_batch(batches: list[Batch]) -> Batch:
    """Every rank's batch, concatenated in rank order (what the reference trains on)."""
    return Batch(
        dense=torch.cat([b.dense for b in batches]),
        sparse=global_batch([b.sparse for b in batches]),
        labels=torch.cat([b.labels for b in batches]),
    )


def loss_of(model: nn.Module, batch: Batch) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(model(batch.dense, batch.sparse).float(), batch.labels)


def mixed_plan(world: int) -> ShardingPlan:
    """Row-, table-, column-wise and data-parallel tables."""
    every = tuple(range(world))
    return ShardingPlan(world_size=world, modules={"sparse": {
        "t_user": TablePlacement(ShardingType.ROW_WISE, ranks=every),
        "t_item": TablePlacement(ShardingType.TABLE_WISE, ranks=(world - 1,)),
        "t_cat": TablePlacement(ShardingType.COLUMN_WISE, ranks=every),
        "t_ctx": TablePlacement(ShardingType.DATA_PARALLEL),
    }})


def host_plan() -> ShardingPlan:
    """4 ranks, 2 per host: table-row-wise tables within host 0 and within host 1."""
    return ShardingPlan(world_size=4, ranks_per_host=2, modules={"sparse": {
        "t_user": TablePlacement(ShardingType.TABLE_ROW_WISE, ranks=(0, 1)),
        "t_item": TablePlacement(ShardingType.TABLE_ROW_WISE, ranks=(2, 3)),
        "t_cat": TablePlacement(ShardingType.TABLE_WISE, ranks=(1,)),
        "t_ctx": TablePlacement(ShardingType.DATA_PARALLEL),
    }})


class DLRMSetup(NamedTuple):
    model: nn.Module  # sharded in place: what local_parameters / clip_grad_norm_ take
    forward: nn.Module  # what to call: the model, or its DDP wrapper
    ref: DLRM


def build_dlrm(
    plan: ShardingPlan,
    wrap: Callable[[nn.Module], nn.Module],
    before_shard: Callable[[nn.Module], object] | None = None,
    tier_dir: str | None = None,
) -> DLRMSetup:
    """A seeded DLRM and its reference copy; the copy's tables sharded by `plan`, then `wrap`ped.
    `before_shard` runs on the copy first (e.g. `modular.fuse_optimizer`, which must precede
    `modular.shard`: Note [order of sharding calls])."""
    torch.manual_seed(0)
    ref = DLRM()
    model = copy.deepcopy(ref)
    if before_shard is not None:
        before_shard(model)
    modular.shard(model, plan, tier_dir=tier_dir)
    wrapped = wrap(model)
    return DLRMSetup(model=model, forward=wrapped, ref=ref)


def global_loss(loss: torch.Tensor) -> float:
    """The mean over ranks of the per-rank losses: the objective of both sides."""
    t = loss.detach().clone()
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()
