"""The one helper module of the `modular` tests: small models, plans, batches and comparisons.

Three models, each with its own batches (nothing below builds the same thing twice), and two
references the fast paths are held to:

- EBC cases (most runtime tests of `modular.shard`): every rank body builds the same unsharded
  EBC (seeded, `make_ebc`), keeps a deep copy as the reference, shards the other, and compares the
  two on the *global* batch: the rank-ordered concatenation of every rank's local batch
  (`global_batch`). Gradients follow Note [grad scaling across ranks]: the reference loss is the
  mean over ranks of the per-rank losses. Table shapes are chosen so that no row count and no
  embedding dim divides evenly by 2, 3 or 4.
- A small DLRM for the composition tests (`build_dlrm`): every rank builds the same seeded `DLRM`,
  deep-copies it as the reference, then shards the copy's tables with `modular.shard` and its
  dense MLPs with FSDP2 or DDP. The reference trains in the same process on the global batch
  (`global_dlrm_batch`) with BCE averaged over it, which equals the mean over ranks of the
  per-rank mean BCE (equal batch sizes): the objective of Note [grad scaling across ranks]. Both
  sides use plain SGD, whose update is proportional to the gradient, so a gradient scaled wrongly
  (reduced twice, or not averaged) shows.
- The checkpoint model (`CheckpointModel`, tests/modular/test_checkpoint.py): one EBC (`ebc`) of
  four tables, one feature each, under a dense `Linear`. Three plan kinds place every table
  differently, so switching kinds moves each table between sharding types, e.g. 't0' row-wise ->
  data-parallel and 't3' data-parallel -> row-wise from "A" to "B":

    kind  t0 (11 x 4)  t1 (7 x 6)         t2 (9 x 8)               t3 (13 x 6)
    A     row_wise     table_wise (last)  column_wise (0, 0, ...)  data_parallel
    B     data_par.    column_wise        table_row_wise           row_wise
    C     table_row    data_parallel      table_wise (0)           column_wise

  Column-wise 't2' under "A" puts two column shards on rank 0, so one table has two local shards.
  Snapshots are plain CPU tensors keyed by name, assembled in the pytest process from what each
  rank returns, so runs at different world sizes can be compared with `torch.equal`.

- The fused optimizers' tests (test_fused.py, and the fuzzing and GPU tests): `fused_ebc`
  (`fused_tables`: the EBC cases' tables at widths fbgemm takes and ones it cannot) trained
  against `FusedReference`, the same EBC under the torch equivalent of each fused optimizer.

- The router's specification (test_router.py, benchmarks/router.py): `ReferenceRouter`, the
  previous per-id router (a searchsorted over (slot, row) keys and a stable sort by route), kept
  as what the fast `Router` must equal bit for bit (`routers`, `assert_same_routes`).

A model whose tables are fused calls `modular.fuse_optimizer` before `modular.shard` (Note [order
of sharding calls]): `build_dlrm(..., before_shard=...)`, or `shard_checkpoint_model` on a model
fused first.

# Note [exact outputs across plans]
Row-wise tables pool partial sums per shard and add them on arrival, so with several ids per bag
a different plan sums in a different order and may differ in the last bit. The checkpoint
model's eval batch has at most one id per bag: every pooled value is then one row (plus exact
zeros, or divided by 1), and the EBC's outputs must be bitwise equal under every plan and world
size.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Any, Callable, Iterator, NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import modular
from modular.checkpoint._state import optimizer_state
from modular.routing.checks import Problem, Rejection
from modular.routing.router import Routed, Router
from modular.tables.layout import ROW_SPLIT, Layout, build_layout
from modular.tables.weights import table_infos
from planners.types import ShardingPlan, ShardingType, TablePlacement, even_split

# -- EBC cases: tables and plans -------------------------------------------------------------------

ATOL = 1e-5
BATCH = 3
CASES = ("data_parallel", "table_wise", "row_wise", "column_wise", "table_row_wise", "mixed")

SUM, MEAN = PoolingType.SUM, PoolingType.MEAN


def unweighted_tables() -> list[EmbeddingBagConfig]:
    """SUM and MEAN tables; 't_sum' is shared by two features, and 'f_a' also feeds 't_small'."""
    return [
        EmbeddingBagConfig(name="t_sum", num_embeddings=13, embedding_dim=5, feature_names=["f_a", "f_b"], pooling=SUM),
        EmbeddingBagConfig(name="t_mean", num_embeddings=11, embedding_dim=7, feature_names=["f_c"], pooling=MEAN),
        EmbeddingBagConfig(name="t_small", num_embeddings=7, embedding_dim=5, feature_names=["f_d", "f_a"], pooling=MEAN),
        EmbeddingBagConfig(name="t_big", num_embeddings=29, embedding_dim=7, feature_names=["f_e"], pooling=SUM),
    ]


def weighted_tables() -> list[EmbeddingBagConfig]:
    """Per-sample weighted tables (SUM only, as in torchrec); 'w_x' is shared by two features."""
    return [
        EmbeddingBagConfig(name="w_x", num_embeddings=17, embedding_dim=7, feature_names=["g_a", "g_b"], pooling=SUM),
        EmbeddingBagConfig(name="w_y", num_embeddings=5, embedding_dim=5, feature_names=["g_c"], pooling=SUM),
        EmbeddingBagConfig(name="w_z", num_embeddings=23, embedding_dim=7, feature_names=["g_d", "g_a"], pooling=SUM),
    ]


def make_ebc(weighted: bool, *, seed: int = 0, device: torch.device | None = None) -> EmbeddingBagCollection:
    torch.manual_seed(seed)
    tables = weighted_tables() if weighted else unweighted_tables()
    return EmbeddingBagCollection(tables=tables, is_weighted=weighted, device=device)


def features_of(ebc: EmbeddingBagCollection) -> list[str]:
    """The KJT keys the EBC reads, in first-use order."""
    out: list[str] = []
    for cfg in ebc.embedding_bag_configs():
        out += [f for f in cfg.feature_names if f not in out]
    return out


def id_bounds(ebc: EmbeddingBagCollection) -> dict[str, int]:
    """The number of valid ids of each feature: the row count of the smallest table it feeds."""
    bounds: dict[str, int] = {}
    for cfg in ebc.embedding_bag_configs():
        for f in cfg.feature_names:
            bounds[f] = min(bounds.get(f, cfg.num_embeddings), cfg.num_embeddings)
    return bounds


def plan_for(case: str, ebc: EmbeddingBagCollection, world: int, module: str = "") -> ShardingPlan:
    """Every table of `ebc` under one sharding type, or the `mixed` plan."""
    return ShardingPlan(world_size=world, modules={module: placements_for(case, ebc, world)})


def placements_for(case: str, ebc: EmbeddingBagCollection, world: int) -> dict[str, TablePlacement]:
    names = [cfg.name for cfg in ebc.embedding_bag_configs()]
    everyone = tuple(range(world))
    if case == "data_parallel":
        return {n: TablePlacement(ShardingType.DATA_PARALLEL) for n in names}
    if case == "table_wise":  # spread over ranks, starting at the last one
        return {n: TablePlacement(ShardingType.TABLE_WISE, ranks=((world - 1 + i) % world,)) for i, n in enumerate(names)}
    if case == "row_wise":
        return {n: TablePlacement(ShardingType.ROW_WISE) for n in names}
    if case == "column_wise":
        return {n: TablePlacement(ShardingType.COLUMN_WISE) for n in names}
    if case == "table_row_wise":
        return {n: TablePlacement(ShardingType.TABLE_ROW_WISE, ranks=everyone) for n in names}
    if case == "mixed":
        return _mixed(ebc, world)
    raise ValueError(f"unknown case {case!r}")


def _mixed(ebc: EmbeddingBagCollection, world: int) -> dict[str, TablePlacement]:
    """One table per type, with ranks out of order, explicit sizes and a rank holding two shards."""
    everyone = tuple(range(world))
    backwards = everyone[::-1]
    rows = {cfg.name: cfg.num_embeddings for cfg in ebc.embedding_bag_configs()}
    if ebc.is_weighted():
        return {
            "w_x": TablePlacement(ShardingType.DATA_PARALLEL),
            # Not on rank 0 (for world > 1): a rank with no shard of a row-wise table.
            "w_y": TablePlacement(ShardingType.ROW_WISE, ranks=backwards[: max(1, world - 1)]),
            # world + 1 column shards: the last rank holds two of them.
            "w_z": TablePlacement(ShardingType.COLUMN_WISE, ranks=(world - 1, *everyone)),
        }
    # Row shards smaller first (the reverse of even_split), given explicitly.
    sizes = tuple(sorted(even_split(rows["t_big"], world)))
    return {
        "t_sum": TablePlacement(ShardingType.ROW_WISE, ranks=backwards),
        "t_mean": TablePlacement(ShardingType.COLUMN_WISE),
        "t_small": TablePlacement(ShardingType.TABLE_WISE, ranks=(world - 1,)),
        "t_big": TablePlacement(ShardingType.TABLE_ROW_WISE, ranks=everyone, sizes=sizes),
    }


# -- EBC cases: batches ---------------------------------------------------------------------------


def make_batch(
    ebc: EmbeddingBagCollection,
    *,
    seed: int,
    batch_size: int = BATCH,
    keys: list[str] | None = None,
    empty_feature: str | None = None,
    empty: bool = False,
) -> KeyedJaggedTensor:
    """A random batch with 0-3 ids per bag; the first bag of every feature is empty.

    `empty_feature` has no ids at all in this batch, and with `empty` no feature has any.
    Weighted EBCs get weights in [0.5, 1.5).
    """
    g = torch.Generator().manual_seed(seed)
    keys = keys or features_of(ebc)
    bounds = id_bounds(ebc)
    lengths, values = [], []
    for f in keys:
        n = torch.randint(0, 4, (batch_size,), generator=g)
        n[0] = 0
        if empty or f == empty_feature:
            n.zero_()
        lengths.append(n)
        values.append(torch.randint(0, bounds[f], (int(n.sum()),), generator=g))
    all_values = torch.cat(values)
    weights = torch.rand(all_values.numel(), generator=g) + 0.5 if ebc.is_weighted() else None
    return KeyedJaggedTensor(keys=keys, values=all_values, lengths=torch.cat(lengths), weights=weights)


def rank_batches(ebc: EmbeddingBagCollection, world: int, step: int, **kwargs) -> list[KeyedJaggedTensor]:
    """Every rank's local batch for one step (each rank can build all of them: they are seeded).

    At step 0, rank 0 has no ids at all for its last feature; at step 2 the last rank of a world
    of 2 or more has no ids at all.
    """
    return [
        make_batch(
            ebc,
            seed=1000 * step + r,
            empty_feature=features_of(ebc)[-1] if (step, r) == (0, 0) else None,
            empty=world > 1 and (step, r) == (2, world - 1),
            **kwargs,
        )
        for r in range(world)
    ]


def global_batch(batches: list[KeyedJaggedTensor]) -> KeyedJaggedTensor:
    """The rank-ordered concatenation of the ranks' batches, feature by feature."""
    keys = batches[0].keys()
    lengths, values, weights = [], [], []
    for k in keys:
        for kjt in batches:
            jt = kjt[k]
            lengths.append(jt.lengths())
            values.append(jt.values())
            if kjt.weights_or_none() is not None:
                weights.append(jt.weights())
    return KeyedJaggedTensor(
        keys=keys,
        values=torch.cat(values),
        lengths=torch.cat(lengths),
        weights=torch.cat(weights) if weights else None,
    )


def reorder(kjt: KeyedJaggedTensor, keys: list[str]) -> KeyedJaggedTensor:
    """The same batch with its features in another order."""
    jts = kjt.to_dict()
    weighted = kjt.weights_or_none() is not None
    return KeyedJaggedTensor(
        keys=keys,
        values=torch.cat([jts[k].values() for k in keys]),
        lengths=torch.cat([jts[k].lengths() for k in keys]),
        weights=torch.cat([jts[k].weights() for k in keys]) if weighted else None,
    )


# -- comparing ------------------------------------------------------------------------------------


def close(actual: torch.Tensor | None, expected: torch.Tensor, what: str) -> float:
    """assert_close at ATOL (fp32), with `what` in the message; returns the max abs difference."""
    if actual is None:
        raise AssertionError(f"{what}: got None, expected a tensor of shape {tuple(expected.shape)}")
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0, msg=lambda m: f"{what}: {m}")
    return float((actual - expected).detach().abs().max()) if expected.numel() else 0.0


def state_error(got: torch.Tensor, want: torch.Tensor, what: str, compare: Callable[..., float] = close) -> float:
    """`compare`s one optimizer state entry (a ShardedTensor's local shards, or a plain tensor)
    with the unsharded model's state `want`; returns the largest difference."""
    if not isinstance(got, ShardedTensor):
        return compare(got, want, what)
    worst = 0.0
    for s in got.local_shards():
        where = tuple(slice(o, o + n) for o, n in zip(s.metadata.shard_offsets, s.metadata.shard_sizes))
        worst = max(worst, compare(s.tensor, want[where], what))
    return worst


def local_blocks(param: torch.Tensor) -> list[tuple[torch.Tensor, slice, slice]]:
    """(tensor, rows, cols) of each piece of a table this rank holds: shards, or a full replica."""
    if isinstance(param, ShardedTensor):
        out = []
        for s in param.local_shards():
            (r0, c0), (nr, nc) = s.metadata.shard_offsets, s.metadata.shard_sizes
            out.append((s.tensor, slice(r0, r0 + nr), slice(c0, c0 + nc)))
        return out
    rows, cols = param.shape
    return [(param, slice(0, rows), slice(0, cols))]


def gather_table(param: torch.Tensor, dst: int) -> torch.Tensor | None:
    """The full table on rank `dst` (None elsewhere); a replica is returned as it is."""
    if not isinstance(param, ShardedTensor):
        return param.detach().clone() if dist.get_rank() == dst else None
    full = torch.empty(tuple(param.size())) if dist.get_rank() == dst else None
    param.gather(dst, full)
    return full


# -- collectives off ------------------------------------------------------------------------------

_COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "monitored_barrier",
)


class CollectiveCalled(RuntimeError):
    """Raised by `no_collectives` when code under it starts a collective."""


@contextlib.contextmanager
def no_collectives(allow: tuple[str, ...] = ()) -> Iterator[None]:
    """Makes every torch.distributed collective but those in `allow` raise `CollectiveCalled`.

    Used to prove that an error is raised before any collective it could hang in (or, with
    `allow`, after only the collectives every rank is known to join).
    """
    import torch.distributed.distributed_c10d as c10d

    saved: list[tuple[object, str, Callable]] = []

    def refuse(name: str) -> Callable:
        def call(*args, **kwargs):
            raise CollectiveCalled(f"collective {name} was called")

        return call

    for module in (dist, c10d):
        for name in _COLLECTIVES:
            if hasattr(module, name) and name not in allow:
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, refuse(name))
    try:
        yield
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)


# -- a small DLRM, for the composition tests ------------------------------------------------------

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


def dlrm_batch(step: int, rank: int) -> Batch:
    g = torch.Generator().manual_seed(1000 * step + rank)
    rows = {f"f_{c.name[2:]}": c.num_embeddings for c in dlrm_tables()}
    lengths = [torch.randint(0, 4, (DLRM_BATCH,), generator=g) for _ in DLRM_FEATURES]
    values = [torch.randint(0, rows[f], (int(n.sum()),), generator=g) for f, n in zip(DLRM_FEATURES, lengths)]
    return Batch(
        dense=torch.randn(DLRM_BATCH, DLRM_DENSE_IN, generator=g),
        sparse=KeyedJaggedTensor(keys=list(DLRM_FEATURES), values=torch.cat(values), lengths=torch.cat(lengths)),
        labels=torch.randint(0, 2, (DLRM_BATCH,), generator=g).float(),
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
) -> DLRMSetup:
    """A seeded DLRM and its reference copy; the copy's tables sharded by `plan`, then `wrap`ped.
    `before_shard` runs on the copy first (e.g. `modular.fuse_optimizer`, which must precede
    `modular.shard`: Note [order of sharding calls])."""
    torch.manual_seed(0)
    ref = DLRM()
    model = copy.deepcopy(ref)
    if before_shard is not None:
        before_shard(model)
    modular.shard(model, plan)
    wrapped = wrap(model)
    return DLRMSetup(model=model, forward=wrapped, ref=ref)


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
        for t, rows, cols in local_blocks(p):
            full[rows, cols] = t.detach()
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
            for t, rows, cols in local_blocks(p):
                torch.testing.assert_close(t.grad, expected[rows, cols], atol=ATOL, rtol=0,
                                           msg=lambda m: f"{what}: grad of {name} at ({rows.start}, {cols.start}): {m}")
        else:
            got = p.grad.full_tensor() if isinstance(p, DTensor) else p.grad
            torch.testing.assert_close(got, expected, atol=ATOL, rtol=0, msg=lambda m: f"{what}: grad of {name}: {m}")


# -- the checkpoint model -------------------------------------------------------------------------

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
    """The EBC's pooled outputs on the eval batch, for the whole global batch (every rank)."""
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
    """Full tensors from every rank's pieces; overlapping pieces (replicas) must agree exactly."""
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


# -- fused optimizers: the tables and the torch reference -----------------------------------------

FUSED_LR, FUSED_EPS, FUSED_STEPS = 0.3, 1e-3, 5


def fused_tables() -> list[EmbeddingBagConfig]:
    """`unweighted_tables` at widths fbgemm's fused kernel takes (8, 16) and ones it cannot (7, 5),
    so both kernels of Note [fused tables] are compared against the same reference."""
    return [dataclasses.replace(c, embedding_dim=d) for c, d in zip(unweighted_tables(), (8, 7, 5, 16))]


def fused_ebc(weighted: bool = False) -> EmbeddingBagCollection:
    torch.manual_seed(0)
    if not weighted:
        return EmbeddingBagCollection(tables=fused_tables())
    # Per-sample weights take SUM pooling only (as in torchrec): the same tables, summed, with
    # widths that fbgemm's kernels take whole and in column halves (8 and 16: a kernel group
    # with one odd width is emulated as a whole, which the unweighted tables cover).
    tables = [
        EmbeddingBagConfig(name=c.name, num_embeddings=c.num_embeddings, embedding_dim=dim,
                           feature_names=c.feature_names)
        for c, dim in zip(fused_tables(), (8, 16, 8, 16))
    ]  # fmt: skip
    return EmbeddingBagCollection(tables=tables, is_weighted=True)


class FusedReference:
    """The unsharded EBC trained with the torch equivalent of each fused optimizer.

    `pieces`: per weight FQN, the (first, end) columns of each column piece that keeps its own
    row-wise Adagrad (column_wise_statistic="per_shard"): each piece is trained as a table of its
    own, whose gradient is its columns' slice of the table's; other tables are one piece.
    """

    def __init__(
        self,
        ebc: EmbeddingBagCollection,
        optimizer: str,
        weight_decay: float = 0.0,
        device: torch.device | None = None,
        pieces: dict[str, list[tuple[int, int]]] | None = None,
    ) -> None:
        self.ebc = ebc
        self.kind = optimizer
        self.weight_decay = weight_decay
        self.lr = FUSED_LR
        params = list(ebc.parameters())
        if optimizer == "exact_sgd":
            self.opt = torch.optim.SGD(params, lr=FUSED_LR)
        elif optimizer == "exact_adagrad":
            self.opt = torch.optim.Adagrad(params, lr=FUSED_LR, eps=FUSED_EPS)
        else:
            self.opt = None
            named = dict(ebc.named_parameters())
            self.pieces = {n: (pieces or {}).get(n, [(0, p.shape[1])]) for n, p in named.items()}
            self.row_sums = {
                n: torch.zeros(p.shape[0], len(self.pieces[n]), device=device)
                for n, p in named.items()
            }

    @torch.no_grad()
    def step(self) -> None:
        if self.opt is not None:
            self.opt.step()
            self.opt.zero_grad()
            return
        for name, p in self.ebc.named_parameters():  # row-wise Adagrad, written out
            g = p.grad
            touched = (g != 0).any(1, keepdim=True)
            g = g + self.weight_decay * p * touched  # fbgemm's L2 mode: rows the step touched
            for i, (lo, hi) in enumerate(self.pieces[name]):
                piece = g[:, lo:hi]
                self.row_sums[name][:, i] += (piece * piece).mean(1)
                p[:, lo:hi] -= self.lr * piece / (self.row_sums[name][:, i].sqrt() + FUSED_EPS)[:, None]
            p.grad = None

    def state(self, name: str) -> torch.Tensor | None:
        if self.kind == "exact_sgd":
            return None
        if self.kind == "exact_adagrad":
            return self.opt.state[dict(self.ebc.named_parameters())[name]]["sum"]
        return self.row_sums[name] if len(self.pieces[name]) > 1 else self.row_sums[name][:, 0]


def own_pieces(plan: ShardingPlan, ebc: EmbeddingBagCollection) -> dict[str, list[tuple[int, int]]]:
    """The column ranges of every table the plan cuts into column pieces, by weight FQN."""
    out = {}
    world = plan.world_size
    for c in ebc.embedding_bag_configs():
        placement = plan.modules[""][c.name]
        specs = placement.shards(num_embeddings=c.num_embeddings, embedding_dim=c.embedding_dim, world_size=world)
        if placement.sharding_type is ShardingType.COLUMN_WISE and len(specs) > 1:
            out[f"embedding_bags.{c.name}.weight"] = sorted((s.col_offset, s.col_offset + s.num_cols) for s in specs)
    return out


# -- the router's specification -------------------------------------------------------------------

_SLOT_SHIFT = 40  # ids are < 2**40, so (slot << 40) + id orders by slot, then id


class ReferenceRouter:
    """The per-id router: each id is copied once per slot of its feature, its route found by a
    searchsorted over (slot << 40) + row keys, and the ids stably sorted by route."""

    def __init__(self, layout: Layout, *, module: str, is_weighted: bool, device: torch.device):
        self.module = module
        self.is_weighted = is_weighted
        self.features = layout.features
        self.num_routes = len(layout.routes)
        self.routes_per_rank = layout.routes_per_rank()
        # The checks' tables and bounds are shared with Router (its structure checks too).
        self._structure = Router(layout, module=module, is_weighted=is_weighted, device=device)
        self.feature_tables = self._structure.feature_tables
        self.id_bound = self._structure.id_bound


        # Each id of feature f is copied into one slot per (output, column shard); a slot holds
        # one route, or all row-split routes of an output, told apart by the id's row.
        slots: dict[tuple, int] = {}
        slot_feature: list[int] = []
        keys, key_route, row_offset = [], [], []
        for i, r in enumerate(layout.routes):
            row_split = layout.placements[layout.table_index(r.table)].sharding_type in ROW_SPLIT
            slot_key = (r.output,) if row_split else (r.output, r.shard_index)
            if slot_key not in slots:
                slots[slot_key] = len(slots)
                slot_feature.append(r.feature)
            keys.append((slots[slot_key] << _SLOT_SHIFT) + r.shard.row_offset)
            key_route.append(i)
            row_offset.append(r.shard.row_offset)
        # Slots are renumbered so that a feature's slots are consecutive.
        order = sorted(range(len(slot_feature)), key=lambda s: (slot_feature[s], s))
        renumber = {old: new for new, old in enumerate(order)}
        keys = [
            (renumber[k >> _SLOT_SHIFT] << _SLOT_SHIFT) + (k & ((1 << _SLOT_SHIFT) - 1)) for k in keys
        ]
        by_key = sorted(zip(keys, key_route))
        nf = len(layout.features)
        copies = [0] * nf
        for f in slot_feature:
            copies[f] += 1
        first_slot = [0] * nf
        for f in range(1, nf):
            first_slot[f] = first_slot[f - 1] + copies[f - 1]
        as_long = dict(dtype=torch.int64, device=device)
        self.copies = torch.tensor(copies, **as_long)
        self.first_slot = torch.tensor(first_slot, **as_long)
        self.boundary_keys = torch.tensor([k for k, _ in by_key], **as_long)
        self.boundary_route = torch.tensor([r for _, r in by_key], **as_long)
        self.route_row_offset = torch.tensor(row_offset, **as_long)
        self.single_copy = all(c == 1 for c in copies)
        ends = [0]
        for n in self.routes_per_rank:
            ends.append(ends[-1] + n)
        self.rank_route_ends = torch.tensor(ends, **as_long)

    def check(self, kjt: KeyedJaggedTensor) -> Optional[Rejection]:
        """Finds the first problem in a batch whose features are already in order."""
        # Dtypes and lengths are checked by the same code on both sides (no fast path there).
        rejection = self._structure._check_structure(kjt)
        if rejection is not None:
            return rejection
        values, lengths, weights = kjt.values(), kjt.lengths(), kjt.weights_or_none()
        if values.numel() == 0:
            return None
        fidx = self.feature_of_values(lengths, kjt.stride())
        bad = (values < 0) | (values >= self.id_bound[fidx])
        if bool(bad.any()):
            pos = int(bad.nonzero()[0, 0])
            f = int(fidx[pos])
            tables = ", ".join(repr(t) for t in self.feature_tables[f])
            return Rejection(
                Problem.ID_RANGE,
                f,
                f"feature {self.features[f]!r} of module {self.module!r} has id "
                f"{int(values[pos])}, outside table {tables} (valid ids are 0 to "
                f"{int(self.id_bound[f]) - 1}); {int(bad.sum())} ids are out of range",
            )
        if self.is_weighted and weights is not None:
            bad = ~torch.isfinite(weights)
            if bool(bad.any()):
                pos = int(bad.nonzero()[0, 0])
                f = int(fidx[pos])
                tables = ", ".join(repr(t) for t in self.feature_tables[f])
                return Rejection(
                    Problem.WEIGHTS,
                    f,
                    f"feature {self.features[f]!r} (table {tables}) of module {self.module!r} "
                    f"has a non-finite per-sample weight ({float(weights[pos])}); "
                    f"{int(bad.sum())} weights are NaN or inf",
                )
        return None

    def feature_of_values(self, lengths: torch.Tensor, batch_size: int) -> torch.Tensor:
        nf = len(self.features)
        per_feature = lengths.view(nf, batch_size).sum(1)
        return torch.repeat_interleave(
            torch.arange(nf, device=lengths.device), per_feature, output_size=int(per_feature.sum())
        )

    # -- routing ----------------------------------------------------------------------------

    def route(self, kjt: KeyedJaggedTensor) -> Routed:
        """Copies each id into its routes, shifted to the shard's first row, ordered by route."""
        values = kjt.values().long()
        lengths = kjt.lengths().long()
        weights = kjt.weights() if self.is_weighted else None
        batch = kjt.stride()
        num_bags = lengths.numel()
        bag = torch.repeat_interleave(
            torch.arange(num_bags, device=values.device), lengths, output_size=values.numel()
        )
        fidx = torch.div(bag, batch, rounding_mode="floor")
        sample = bag - fidx * batch
        if self.single_copy:
            slot = self.first_slot[fidx]
            src = None
        else:
            copies = self.copies[fidx]
            total = int(copies.sum())
            src = torch.repeat_interleave(
                torch.arange(values.numel(), device=values.device), copies, output_size=total
            )
            start = torch.cumsum(copies, 0) - copies
            within = torch.arange(total, device=values.device) - torch.repeat_interleave(
                start, copies, output_size=total
            )
            slot = self.first_slot[fidx[src]] + within
            values, sample = values[src], sample[src]
            if weights is not None:
                weights = weights[src]
        key = (slot << _SLOT_SHIFT) + values
        route = self.boundary_route[torch.searchsorted(self.boundary_keys, key, right=True) - 1]
        ids = values - self.route_row_offset[route]
        # A stable sort of int16 keys is a few times faster on CPU than of int64 ones (a radix
        # sort: 3.5 vs 14-20 ms for 163,840 ids), and route numbers are small.
        narrow = torch.int16 if self.num_routes <= torch.iinfo(torch.int16).max else torch.int32
        order = torch.argsort(route.to(narrow), stable=True)
        route_lengths = torch.bincount(
            route * batch + sample, minlength=self.num_routes * batch
        )
        per_route = route_lengths.view(self.num_routes, batch).sum(1)
        cumulative = torch.cat([per_route.new_zeros(1), torch.cumsum(per_route, 0)])
        return Routed(
            lengths=route_lengths,
            values=ids[order],
            weights=None if weights is None else weights[order],
            counts=torch.diff(cumulative[self.rank_route_ends]),
        )


def routers(
    configs: list[EmbeddingBagConfig],
    placements: dict[str, TablePlacement],
    world: int,
    weighted: bool,
) -> tuple[Router, ReferenceRouter]:
    """The router of `configs` under `placements` on rank 0 of `world`, and its reference."""
    # the tables as sharding reads them (unweighted here: the router takes `weighted` itself)
    tables = table_infos(EmbeddingBagCollection(tables=configs, device=torch.device("meta")), "m")
    shards = tuple(
        placements[t.name].shards(
            num_embeddings=t.num_embeddings, embedding_dim=t.embedding_dim, world_size=world,
            table=t.name,
        )
        for t in tables
    )  # fmt: skip
    layout = build_layout(
        tables, tuple(placements[t.name] for t in tables), shards, world_size=world, rank=0
    )
    kwargs = dict(module="m", is_weighted=weighted, device=torch.device("cpu"))
    return Router(layout, **kwargs), ReferenceRouter(layout, **kwargs)


def assert_same_routes(got: Routed, want: Routed) -> None:
    """The fast router's output equals the reference's, bit for bit."""
    assert got.values_per_rank == want.values_per_rank
    for name in ("lengths", "values", "weights"):
        a, b = getattr(got, name), getattr(want, name)
        if b is None:
            assert a is None, name
            continue
        assert a is not None, name
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape, b.shape)
        # Bit for bit (weights included: NaN-free, compared as raw bits).
        if a.is_floating_point():
            a, b = a.view(torch.int32), b.view(torch.int32)
        assert torch.equal(a, b), name


# -- sequence cases: EmbeddingCollections beside an EBC (test_sequence_*.py) ------------------

def seq_a_tables() -> list[EmbeddingConfig]:
    return [
        EmbeddingConfig(name="s_big", num_embeddings=29, embedding_dim=5, feature_names=["item", "hist"]),
        EmbeddingConfig(name="s_mid", num_embeddings=13, embedding_dim=5, feature_names=["item"]),
        EmbeddingConfig(name="s_small", num_embeddings=7, embedding_dim=5, feature_names=["cat"]),
    ]


def seq_b_tables() -> list[EmbeddingConfig]:
    return [
        EmbeddingConfig(name="u", num_embeddings=11, embedding_dim=8, feature_names=["user_seq"]),
        EmbeddingConfig(name="v", num_embeddings=17, embedding_dim=8, feature_names=["v_seq"]),
    ]


def bag_tables() -> list[EmbeddingBagConfig]:
    return [EmbeddingBagConfig(name="b", num_embeddings=9, embedding_dim=4, feature_names=["dense_id"])]


class SeqModel(nn.Module):
    """Two EmbeddingCollections and an EBC, their outputs into one loss-ready tensor."""

    def __init__(self, device: torch.device | None = None) -> None:
        super().__init__()
        self.seq_a = EmbeddingCollection(tables=seq_a_tables(), device=device)
        self.seq_b = EmbeddingCollection(tables=seq_b_tables(), device=device)
        self.bags = EmbeddingBagCollection(tables=bag_tables(), device=device)

    def forward(self, a: KeyedJaggedTensor, b: KeyedJaggedTensor, c: KeyedJaggedTensor):
        return self.seq_a(a), self.seq_b(b), self.bags(c)


def make_seq_model(*, seed: int = 0, device: torch.device | None = None) -> SeqModel:
    torch.manual_seed(seed)
    return SeqModel(device)


SEQ_FEATURES = {"seq_a": ["item", "hist", "cat"], "seq_b": ["user_seq", "v_seq"], "bags": ["dense_id"]}
SEQ_BOUNDS = {"item": 13, "hist": 29, "cat": 7, "user_seq": 11, "v_seq": 17, "dense_id": 9}


def seq_placements_for(case: str, tables: list, world: int) -> dict[str, TablePlacement]:
    names = [t.name for t in tables]
    everyone = tuple(range(world))
    if case == "data_parallel":
        return {n: TablePlacement(ShardingType.DATA_PARALLEL) for n in names}
    if case == "table_wise":
        return {n: TablePlacement(ShardingType.TABLE_WISE, ranks=((world - 1 + i) % world,)) for i, n in enumerate(names)}
    if case == "row_wise":
        return {n: TablePlacement(ShardingType.ROW_WISE) for n in names}
    if case == "column_wise":
        return {n: TablePlacement(ShardingType.COLUMN_WISE) for n in names}
    if case == "table_row_wise":
        return {n: TablePlacement(ShardingType.TABLE_ROW_WISE, ranks=everyone) for n in names}
    if case == "mixed":
        backwards = everyone[::-1]
        kinds = [
            TablePlacement(ShardingType.ROW_WISE, ranks=backwards),
            # world + 1 column pieces: the last rank holds two, one of them 1 column wide
            TablePlacement(ShardingType.COLUMN_WISE, ranks=(world - 1, *everyone)),
            TablePlacement(ShardingType.TABLE_WISE, ranks=(world - 1,)),
            TablePlacement(ShardingType.DATA_PARALLEL),
        ]
        out = {}
        for i, t in enumerate(tables):
            p = kinds[i % len(kinds)]
            if i == 0 and world > 1:  # row shards smaller first, given explicitly
                sizes = tuple(sorted(even_split(t.num_embeddings, world)))
                p = TablePlacement(ShardingType.TABLE_ROW_WISE, ranks=everyone, sizes=sizes)
            out[t.name] = p
        return out
    raise ValueError(f"unknown case {case!r}")


def seq_plan_for(case: str, world: int) -> ShardingPlan:
    return ShardingPlan(
        world_size=world,
        modules={
            "seq_a": seq_placements_for(case, seq_a_tables(), world),
            "seq_b": _seq_mixed_b(world) if case == "mixed" else seq_placements_for(case, seq_b_tables(), world),
            "bags": {"b": TablePlacement(ShardingType.ROW_WISE)},
        },
    )


def _seq_mixed_b(world: int) -> dict[str, TablePlacement]:
    """A data-parallel table beside column pieces (world + 1 of them, the last rank two)."""
    return {
        "u": TablePlacement(ShardingType.COLUMN_WISE, ranks=(world - 1, *range(world))),
        "v": TablePlacement(ShardingType.DATA_PARALLEL),
    }


def seq_make_batch(keys: list[str], *, seed: int, empty_feature: str | None = None, empty: bool = False) -> KeyedJaggedTensor:
    """Sequences of 0-4 ids; the first of every feature is empty (an empty sequence)."""
    g = torch.Generator().manual_seed(seed)
    lengths, values = [], []
    for f in keys:
        n = torch.randint(0, 5, (BATCH,), generator=g)
        n[0] = 0
        if empty or f == empty_feature:
            n.zero_()
        lengths.append(n)
        values.append(torch.randint(0, SEQ_BOUNDS[f], (int(n.sum()),), generator=g))
    return KeyedJaggedTensor(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))


def seq_rank_batches(world: int, step: int) -> list[dict[str, KeyedJaggedTensor]]:
    """Every rank's batches (per module) for one step. At step 0 rank 0 has no 'cat' ids at all;
    at step 2 the last rank of a world of 2 or more has no ids at all."""
    out = []
    for r in range(world):
        empty = world > 1 and (step, r) == (2, world - 1)
        out.append(
            {
                m: seq_make_batch(
                    keys, seed=1000 * step + 10 * r + i,
                    empty_feature="cat" if (step, r) == (0, 0) else None, empty=empty,
                )
                for i, (m, keys) in enumerate(SEQ_FEATURES.items())
            }
        )
    return out


def seq_global_batch(batches: list[KeyedJaggedTensor]) -> KeyedJaggedTensor:
    keys = batches[0].keys()
    lengths, values = [], []
    for k in keys:
        for kjt in batches:
            lengths.append(kjt[k].lengths())
            values.append(kjt[k].values())
    return KeyedJaggedTensor(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))
