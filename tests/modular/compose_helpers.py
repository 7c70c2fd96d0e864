"""A small DLRM, its plans and batches, and the unsharded reference, for the composition tests.

Every rank builds the same seeded `DLRM`, deep-copies it as the reference, then shards the copy's
tables with `modular.shard` and its dense MLPs with FSDP2 or DDP. The reference trains in the same
process on the *global* batch (every rank's batch, concatenated in rank order) with BCE averaged
over it, which equals the mean over ranks of the per-rank mean BCE (equal batch sizes): the
objective of Note [grad scaling across ranks]. Both sides use plain SGD, whose update is
proportional to the gradient, so a gradient scaled wrongly (reduced twice, or not averaged) shows.
"""

from __future__ import annotations

import copy
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import modular
from planners.types import ShardingPlan, ShardingType, TablePlacement

ATOL = 1e-5
BATCH = 4
DIM = 8
DENSE_IN = 4
LR = 0.5
STEPS = 5
FEATURES = ("f_user", "f_item", "f_cat", "f_ctx")


def table_configs() -> list[EmbeddingBagConfig]:
    rows = {"t_user": 23, "t_item": 13, "t_cat": 11, "t_ctx": 7}
    pooling = {"t_user": PoolingType.SUM, "t_item": PoolingType.MEAN}
    return [
        EmbeddingBagConfig(
            name=t, num_embeddings=n, embedding_dim=DIM, feature_names=[f"f_{t[2:]}"],
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
        n = len(FEATURES) + 1
        self.bottom = MLP(DENSE_IN, [16, DIM], relu_last=True)
        self.sparse = EmbeddingBagCollection(tables=table_configs())
        self.top = MLP(DIM + n * (n - 1) // 2, [16, 1], relu_last=False)

    def forward(self, dense: torch.Tensor, kjt: KeyedJaggedTensor) -> torch.Tensor:
        d = self.bottom(dense)
        kt = self.sparse(kjt)
        e = torch.stack([kt[f] for f in FEATURES], dim=1)
        x = torch.cat([d.unsqueeze(1), e], dim=1)  # under mixed precision: bf16 and fp32 -> fp32
        z = torch.bmm(x, x.transpose(1, 2))
        i, j = torch.triu_indices(x.shape[1], x.shape[1], offset=1)
        return self.top(torch.cat([d, z[:, i, j]], dim=1)).squeeze(-1)


class Batch(NamedTuple):
    dense: torch.Tensor
    sparse: KeyedJaggedTensor
    labels: torch.Tensor


def make_batch(step: int, rank: int) -> Batch:
    g = torch.Generator().manual_seed(1000 * step + rank)
    rows = {f"f_{c.name[2:]}": c.num_embeddings for c in table_configs()}
    lengths = [torch.randint(0, 4, (BATCH,), generator=g) for _ in FEATURES]
    values = [torch.randint(0, rows[f], (int(n.sum()),), generator=g) for f, n in zip(FEATURES, lengths)]
    return Batch(
        dense=torch.randn(BATCH, DENSE_IN, generator=g),
        sparse=KeyedJaggedTensor(keys=list(FEATURES), values=torch.cat(values), lengths=torch.cat(lengths)),
        labels=torch.randint(0, 2, (BATCH,), generator=g).float(),
    )


def global_batch(batches: list[Batch]) -> Batch:
    """Every rank's batch, concatenated in rank order (what the reference trains on)."""
    lengths, values = [], []
    for f in FEATURES:
        for b in batches:
            lengths.append(b.sparse[f].lengths())
            values.append(b.sparse[f].values())
    return Batch(
        dense=torch.cat([b.dense for b in batches]),
        sparse=KeyedJaggedTensor(keys=list(FEATURES), values=torch.cat(values), lengths=torch.cat(lengths)),
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


class Setup(NamedTuple):
    model: nn.Module  # sharded in place: what local_parameters / clip_grad_norm_ take
    forward: nn.Module  # what to call: the model, or its DDP wrapper
    ref: DLRM


def build(plan: ShardingPlan, wrap: Callable[[nn.Module], nn.Module]) -> Setup:
    """A seeded DLRM and its reference copy; the copy's tables sharded by `plan`, then `wrap`ped."""
    torch.manual_seed(0)
    ref = DLRM()
    model = modular.shard(copy.deepcopy(ref), plan)
    wrapped = wrap(model)
    return Setup(model=model, forward=wrapped, ref=ref)


def global_loss(loss: torch.Tensor) -> float:
    """The mean over ranks of the per-rank losses: the objective of both sides."""
    t = loss.detach().clone()
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def full_value(p: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank: gathers ShardedTensors and DTensors (collective)."""
    if isinstance(p, DTensor):
        return p.full_tensor()
    if isinstance(p, ShardedTensor):
        full = torch.zeros(p.size())
        for s in p.local_shards():
            (r, c), (nr, nc) = s.metadata.shard_offsets, s.metadata.shard_sizes
            full[r : r + nr, c : c + nc] = s.tensor.detach()
        dist.all_reduce(full)  # shards are disjoint: the sum assembles the table
        return full
    return p.detach()


def assert_weights_match(model: nn.Module, ref: nn.Module, what: str) -> None:
    refs = dict(ref.named_parameters())
    names = [n for n, _ in model.named_parameters()]
    assert names == list(refs), f"{what}: parameter names {names} != reference {list(refs)}"
    for name, p in model.named_parameters():
        torch.testing.assert_close(
            full_value(p), refs[name].detach(), atol=ATOL, rtol=0, msg=lambda m: f"{what}: {name}: {m}"
        )


def assert_grads_match(model: nn.Module, ref: nn.Module, what: str) -> None:
    """Each rank's gradients against the matching slice of the reference's (collective for DTensors)."""
    refs = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        expected = refs[name].grad
        if isinstance(p, ShardedTensor):
            for s in p.local_shards():
                (r, c), (nr, nc) = s.metadata.shard_offsets, s.metadata.shard_sizes
                got = s.tensor.grad
                torch.testing.assert_close(got, expected[r : r + nr, c : c + nc], atol=ATOL, rtol=0,
                                           msg=lambda m: f"{what}: grad of {name} at ({r}, {c}): {m}")
        else:
            got = p.grad.full_tensor() if isinstance(p, DTensor) else p.grad
            torch.testing.assert_close(got, expected, atol=ATOL, rtol=0, msg=lambda m: f"{what}: grad of {name}: {m}")
