"""The checkpoint model (`CheckpointModel`; tests/modular/checkpoint/test_checkpoint.py and its kin).

One EBC (`ebc`) of four tables, one feature each, under a dense `Linear`. Three plan kinds place
every table differently, so switching kinds moves each table between sharding types, e.g. 't0'
row-wise -> data-parallel and 't3' data-parallel -> row-wise from "A" to "B":

    kind  t0 (11 x 4)  t1 (7 x 6)         t2 (9 x 8)               t3 (13 x 6)
    A     row_wise     table_wise (last)  column_wise (0, 0, ...)  data_parallel
    B     data_par.    column_wise        table_row_wise           row_wise
    C     table_row    data_parallel      table_wise (0)           column_wise

Column-wise 't2' under "A" puts two column shards on rank 0, so one table has two local shards.
Snapshots are plain CPU tensors keyed by name, assembled in the pytest process from what each
rank returns, so runs at different world sizes can be compared with `torch.equal`.

A model whose tables are fused calls `modular.fuse_optimizer` before `modular.shard` (Note [order
of sharding calls]): `shard_checkpoint_model` on a model fused first.

# Note [exact outputs across plans]
Row-wise tables pool partial sums per shard and add them on arrival, so with several ids per bag
a different plan sums in a different order and may differ in the last bit. The checkpoint
model's eval batch has at most one id per bag: every pooled value is then one row (plus exact
zeros, or divided by 1), and the EBC's outputs must be bitwise equal under every plan and world
size.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import modular
from modular.checkpoint._entries import optimizer_state
from planners.types import ShardingPlan, ShardingType, TablePlacement

GLOBAL_BATCH = 12  # divides by 1, 2, 3 and 4
CHECKPOINT_FEATURES = ["f0", "f1", "f2", "f3"]


def checkpoint_tables(*, t1_rows: int = 7, t3_name: str = "t3") -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name="t0", num_embeddings=11, embedding_dim=4, feature_names=["f0"]),
        EmbeddingBagConfig(
            name="t1", num_embeddings=t1_rows, embedding_dim=6, feature_names=["f1"],
            pooling=PoolingType.MEAN,
        ),
        EmbeddingBagConfig(
            name="t2", num_embeddings=9, embedding_dim=8, feature_names=["f2"],
            pooling=PoolingType.MEAN,
        ),
        EmbeddingBagConfig(name=t3_name, num_embeddings=13, embedding_dim=6, feature_names=["f3"]),
    ]


class CheckpointModel(nn.Module):
    def __init__(self, configs: list[EmbeddingBagConfig]) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(tables=configs)
        self.dense = nn.Linear(sum(c.embedding_dim for c in configs), 1)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.dense(self.ebc(kjt).values())


def build_checkpoint_model(seed: int, **table_kwargs: Any) -> CheckpointModel:
    torch.manual_seed(seed)
    return CheckpointModel(checkpoint_tables(**table_kwargs))


def checkpoint_placements(kind: str, world: int, names: Optional[list[str]] = None) -> dict[str, TablePlacement]:
    ranks = tuple(range(world))
    by_kind = {
        "A": [
            TablePlacement(ShardingType.ROW_WISE),
            TablePlacement(ShardingType.TABLE_WISE, ranks=(world - 1,)),
            TablePlacement(ShardingType.COLUMN_WISE, ranks=(0,) + ranks),
            TablePlacement(ShardingType.DATA_PARALLEL),
        ],
        "B": [
            TablePlacement(ShardingType.DATA_PARALLEL),
            TablePlacement(ShardingType.COLUMN_WISE),
            TablePlacement(ShardingType.TABLE_ROW_WISE, ranks=ranks),
            TablePlacement(ShardingType.ROW_WISE),
        ],
        "C": [
            TablePlacement(ShardingType.TABLE_ROW_WISE, ranks=ranks),
            TablePlacement(ShardingType.DATA_PARALLEL),
            TablePlacement(ShardingType.TABLE_WISE, ranks=(0,)),
            TablePlacement(ShardingType.COLUMN_WISE),
        ],
    }
    return dict(zip(names or ["t0", "t1", "t2", "t3"], by_kind[kind]))


def shard_checkpoint_model(model: CheckpointModel, kind: str) -> CheckpointModel:
    """`model` sharded in place by plan `kind` over the default group (fuse it first, if at all)."""
    names = [c.name for c in model.ebc.embedding_bag_configs()]
    plan = ShardingPlan(world_size=dist.get_world_size(), modules={"ebc": checkpoint_placements(kind, dist.get_world_size(), names)})
    return modular.shard(model, plan)


def sharded_checkpoint_model(kind: str, *, seed: int, **table_kwargs: Any) -> CheckpointModel:
    """The model built with `seed`, sharded by plan `kind` over the default group."""
    return shard_checkpoint_model(build_checkpoint_model(seed, **table_kwargs), kind)


def checkpoint_batch(step: int, rank: int, world: int, *, max_ids: int = 3) -> KeyedJaggedTensor:
    """This rank's slice of the global batch of `step` (same global batch at any world size)."""
    g = torch.Generator().manual_seed(1000 + step)
    rows = {"f0": 11, "f1": 7, "f2": 9, "f3": 13}
    lengths = {f: torch.randint(0, max_ids + 1, (GLOBAL_BATCH,), generator=g) for f in CHECKPOINT_FEATURES}
    ids = {f: torch.randint(0, rows[f], (int(lengths[f].sum()),), generator=g) for f in CHECKPOINT_FEATURES}
    per_rank = GLOBAL_BATCH // world
    lo, hi = rank * per_rank, (rank + 1) * per_rank
    out_lengths, out_values = [], []
    for f in CHECKPOINT_FEATURES:
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths[f].cumsum(0)])
        out_lengths.append(lengths[f][lo:hi])
        out_values.append(ids[f][offsets[lo] : offsets[hi]])
    return KeyedJaggedTensor(keys=CHECKPOINT_FEATURES, values=torch.cat(out_values), lengths=torch.cat(out_lengths))


def checkpoint_global_batch(step: int, *, max_ids: int = 3) -> KeyedJaggedTensor:
    return checkpoint_batch(step, 0, 1, max_ids=max_ids)


def eval_outputs(model: CheckpointModel) -> torch.Tensor:
    """The EBC's pooled outputs on the eval batch, for the whole global batch (every rank): at most
    one id per bag, so equal bit for bit under every plan (Note [exact outputs across plans])."""
    rank, world = dist.get_rank(), dist.get_world_size()
    with torch.no_grad():
        local = model.ebc(checkpoint_batch(99, rank, world, max_ids=1)).values()
    pieces = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(pieces, local.contiguous())
    return torch.cat(pieces)


def train_checkpoint_model(model: CheckpointModel, optimizer: Any, steps: range) -> list[float]:
    """Mean-squared-error steps on the global batches of `steps`; the global loss of each."""
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in steps:
        kjt = checkpoint_batch(step, rank, world)
        target = torch.linspace(-1, 1, GLOBAL_BATCH).view(-1, 1)
        per_rank = GLOBAL_BATCH // world
        loss = ((model(kjt) - target[rank * per_rank : (rank + 1) * per_rank]) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        for p in model.dense.parameters():  # a replicated dense layer: average like DDP
            if type(p) is nn.Parameter:
                dist.all_reduce(p.grad)
                p.grad.div_(world)
        optimizer.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def state_pieces(value: Any) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """(offsets, tensor) of the parts of a state entry this rank holds."""
    if isinstance(value, ShardedTensor):
        return [(tuple(s.metadata.shard_offsets), s.tensor.detach().clone()) for s in value.local_shards()]
    if hasattr(value, "full_tensor"):  # DTensor
        return [((0,) * value.dim(), value.full_tensor().detach().clone())]
    return [((0,) * value.dim(), value.detach().clone())]


def local_snapshot(model: nn.Module, optimizer: Any = None) -> dict[str, Any]:
    """What this rank holds of the weights, optimizer state and outputs (see `assemble`)."""
    out: dict[str, Any] = {"outputs": eval_outputs(model)}
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    if optimizer is not None:
        state.update(optimizer_state(model, optimizer))
    out["pieces"] = {k: state_pieces(v) for k, v in state.items() if isinstance(v, (torch.Tensor, ShardedTensor))}
    out["shapes"] = {k: tuple(v.size()) for k, v in state.items() if isinstance(v, (torch.Tensor, ShardedTensor))}
    return out


def assemble(per_rank: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Full tensors from every rank's pieces; overlapping pieces (data-parallel copies, 2D
    replicas) must agree exactly."""
    full: dict[str, torch.Tensor] = {}
    covered: dict[str, torch.Tensor] = {}
    for snap in per_rank:
        for key, parts in snap["pieces"].items():
            shape = snap["shapes"][key]
            if key not in full:
                full[key] = torch.full(shape, float("nan"), dtype=parts[0][1].dtype if parts else torch.float32)
                covered[key] = torch.zeros(shape, dtype=torch.bool)
            for offsets, t in parts:
                region = tuple(slice(o, o + n) for o, n in zip(offsets, t.shape))
                seen = covered[key][region]
                if seen.any() and not torch.equal(full[key][region][seen], t.to(full[key].dtype)[seen]):
                    raise AssertionError(f"replicas of {key} differ between ranks")
                full[key][region] = t.to(full[key].dtype)
                covered[key][region] = True
    missing = [k for k, c in covered.items() if not c.all()]
    if missing:
        raise AssertionError(f"no rank holds all of {missing}")
    full["outputs"] = per_rank[0]["outputs"]
    return full


def assert_same(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(before) == sorted(after), f"{what}: keys {sorted(before)} != {sorted(after)}"
    for key in before:
        assert torch.equal(before[key], after[key]), (
            f"{what}: {key} differs; max |diff| {(before[key] - after[key]).abs().max().item()}"
        )


def assert_unchanged(before: dict[str, Any], after: dict[str, Any], what: str) -> None:
    """One rank's `local_snapshot`s hold the same pieces, bit for bit."""
    assert torch.equal(before["outputs"], after["outputs"]), f"{what}: outputs changed"
    assert sorted(before["pieces"]) == sorted(after["pieces"]), what
    for key, parts in before["pieces"].items():
        for (o1, t1), (o2, t2) in zip(parts, after["pieces"][key], strict=True):
            assert o1 == o2 and torch.equal(t1, t2), f"{what}: {key} at {o1} changed"
