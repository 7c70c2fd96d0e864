"""The step path holds no per-table or per-feature Python (issue 29).

Real models have hundreds to thousands of features, and on a GPU every microsecond of host work
per feature is lost throughput. Wall-clock slopes per feature are measured in `benchmarks/`
(docs/benchmarks.md); this test pins the property they rest on, without timing anything: the
Python a training step runs inside `modular` (function calls and calls into C, counted with
`sys.setprofile` on the rank's main thread) is the same for a model of 15 tables as for one of 60.
A loop over tables or features anywhere on the step path (input checks, routing, kernels, output
dist, fused updates, the optimizer hook) adds at least 45 events and fails it.

The step is forward, backward and the optimizer's step. A torch optimizer itself loops over its
parameters, one or more per table when the tables are unfused (`ShardView.grad` is read once per
parameter by it); that loop is the user's optimizer's, so events in modular/kernels/views.py are
left out of the count and the check of the rest still covers `modular`'s optimizer hook.
"""

from __future__ import annotations

import collections
import os
import sys

import pytest
import torch
import torch.distributed as dist
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import modular
from planners.types import ShardingPlan, ShardingType, TablePlacement
from tests.dist import run_on_ranks

_MODULAR = os.path.dirname(os.path.abspath(modular.__file__)) + os.sep
_OPTIMIZER_READS = os.path.join(_MODULAR, "kernels", "views.py")
KINDS = ("table_wise", "row_wise", "column_wise", "data_parallel", "table_row_wise")
# Table i is of kind KINDS[i % 5] in the mixed plan, and MEAN when (i // 5) % 3 == 2 (unweighted):
# 15 tables hold every combination once, 60 four times, so both models take the same branches and
# build the same kernel groups, and only the number of tables differs.
SIZES = (15, 60)


def _ebc(tables: int, weighted: bool) -> EmbeddingBagCollection:
    torch.manual_seed(0)
    configs = [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=8, num_embeddings=40, feature_names=[f"f{i}"],
            pooling=PoolingType.MEAN if (i // len(KINDS)) % 3 == 2 and not weighted else PoolingType.SUM,
        )
        for i in range(tables)
    ]  # fmt: skip
    return EmbeddingBagCollection(tables=configs, is_weighted=weighted)


def _ec(tables: int) -> EmbeddingCollection:
    torch.manual_seed(0)
    configs = [
        EmbeddingConfig(name=f"t{i}", embedding_dim=8, num_embeddings=40, feature_names=[f"f{i}"])
        for i in range(tables)
    ]  # fmt: skip
    return EmbeddingCollection(tables=configs)


def _plan(kind: str, tables: int, world: int) -> ShardingPlan:
    placements = {}
    for i in range(tables):
        k = ShardingType.parse(KINDS[i % len(KINDS)] if kind == "mixed" else kind)
        if k is ShardingType.TABLE_WISE:
            placements[f"t{i}"] = TablePlacement(k, ranks=(i % world,))
        elif k is ShardingType.DATA_PARALLEL:
            placements[f"t{i}"] = TablePlacement(k)
        else:
            placements[f"t{i}"] = TablePlacement(k, ranks=tuple(range(world)))
    return ShardingPlan(world_size=world, modules={"": placements})


def _batch(tables: int, rank: int, weighted: bool) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(rank)
    lengths = torch.randint(1, 4, (tables * 5,), generator=g)  # no empty bag: one branch per step
    values = torch.randint(0, 40, (int(lengths.sum()),), generator=g)
    weights = torch.rand(values.numel(), generator=g) if weighted else None
    return KeyedJaggedTensor(
        keys=[f"f{i}" for i in range(tables)], values=values, lengths=lengths, weights=weights
    )


def _events_per_step(
    kind: str, optimizer: str, weighted: bool, prefetch: bool, statistic: str, sequences: bool = False
) -> dict[int, collections.Counter[str]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for tables in SIZES:
        model = _ec(tables) if sequences else _ebc(tables, weighted)
        if optimizer == "fused":
            opt = modular.fuse_optimizer(
                model, "exact_rowwise_adagrad", lr=0.1, column_wise_statistic=statistic
            )
        modular.shard(model, _plan(kind, tables, world))
        if optimizer != "fused":
            opt = torch.optim.SGD(modular.local_parameters(model), lr=0.1)
        kjt = _batch(tables, rank, weighted)

        def step() -> None:
            if prefetch:
                modular.prefetch(model, kjt)
            opt.zero_grad()
            out = model(kjt)
            # an EC's output is a dict of JaggedTensors, one per feature: the user's loop
            values = torch.cat([jt.values() for jt in out.values()]) if sequences else out.values()
            values.sum().backward()
            opt.step()

        for _ in range(3):  # kept buffers and caches reach their sizes for this batch
            step()
        events: collections.Counter[str] = collections.Counter()

        def profile(frame, event, arg) -> None:
            name = frame.f_code.co_filename
            if event in ("call", "c_call") and name.startswith(_MODULAR) and name != _OPTIMIZER_READS:
                events[f"{os.path.relpath(name, _MODULAR)}:{frame.f_code.co_name}"] += 1

        sys.setprofile(profile)
        try:
            step()
        finally:
            sys.setprofile(None)
        out[tables] = events
    return out


def _assert_flat(counts) -> None:
    """Each rank's events per step at SIZES[0] and SIZES[1] tables differ by fewer than one
    per added table (a loop over tables adds at least that)."""
    for rank, by_tables in enumerate(counts):
        few, many = by_tables[SIZES[0]], by_tables[SIZES[1]]
        assert sum(few.values()) > 50, f"rank {rank}: the profile saw almost nothing ({few})"
        changed = {k: (few[k], many[k]) for k in set(few) | set(many) if many[k] != few[k]}
        moved = sum(abs(b - a) for a, b in changed.values())
        assert moved < SIZES[1] - SIZES[0], (
            f"rank {rank}: {sum(few.values())} Python events in a step of {SIZES[0]} tables, "
            f"{sum(many.values())} of {SIZES[1]}; changed ({SIZES[0]} tables, {SIZES[1]}): {changed}"
        )


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "kind, optimizer, weighted, prefetch, statistic",
    [
        ("table_wise", "fused", False, False, "exact"),
        ("row_wise", "fused", True, False, "exact"),
        ("column_wise", "fused", False, False, "per_shard"),
        ("mixed", "fused", False, False, "exact"),
        ("column_wise", "fused", False, False, "exact"),  # the exact row statistic's two passes
        ("data_parallel", "fused", False, False, "exact"),  # data-parallel copies replay the global batch
        ("mixed", "fused", True, True, "per_shard"),
        ("mixed", "dense", False, True, "exact"),
        ("data_parallel", "dense", True, False, "exact"),
    ],
)
def test_step_python_does_not_grow_with_tables(
    kind: str, optimizer: str, weighted: bool, prefetch: bool, statistic: str
) -> None:
    """A loop over tables adds at least one event per table, SIZES[1] - SIZES[0] in all; the
    two models may still take a data-dependent branch differently (an arrival map that happens
    to be the identity, a kernel's replay-or-reduce choice), a few events either way."""
    counts = run_on_ranks(
        2, _events_per_step, kind, optimizer, weighted, prefetch, statistic, timeout=180
    )
    _assert_flat(counts)


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "kind, optimizer, prefetch",
    [
        ("table_wise", "fused", False),
        ("row_wise", "fused", False),
        ("column_wise", "fused", False),
        ("data_parallel", "fused", False),  # data-parallel copies pad every route to the agreed bags
        ("table_row_wise", "fused", True),
        ("mixed", "fused", False),
        ("mixed", "dense", True),
    ],
)
def test_sequence_step_python_does_not_grow_with_tables(kind: str, optimizer: str, prefetch: bool) -> None:
    """The same for a sharded EmbeddingCollection (Notes [placing rows without a loop over
    routes] and [gathering rows without a loop over routes]). Building the output's dict of one
    JaggedTensor per feature is torchrec's, outside `modular`, and not counted; the per-route
    loops this replaced added about 20 events per table."""
    counts = run_on_ranks(
        2, _events_per_step, kind, optimizer, False, prefetch, "exact", True, timeout=180
    )
    _assert_flat(counts)
