"""The planner prices FP16 tables and low-precision comms as `modular.shard` builds them.

Pure part: FP16 tables cost half the weight bytes (state stays FP32), `comm_dtype="fp16"` halves
the output dist's seconds. Gloo part: a table set that fits a (tiny) device in FP16 but not in
FP32 gets a plan from `planners.plan`, which `modular.shard` builds on meta tables (fused
row-wise Adagrad) and trains a step with; each rank's weights and state take exactly the bytes
the planner priced for them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torchrec.modules.embedding_configs import DataType as TorchrecDataType
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import modular
import planners
from planners.cost import CostModel, TableArrays
from planners.types import ShardingPlan, ShardingType
from tests.dist import run_on_ranks

WORLD = 2
ROWS, DIM = (4000, 3000, 2000, 1000), (32, 16, 32, 8)


def _tables(dtype: str) -> list[planners.Table]:
    return [planners.Table(f"t{i}", r, d, features=(f"f{i}",), dtype=dtype) for i, (r, d) in enumerate(zip(ROWS, DIM))]


def test_fp16_tables_and_comms_are_priced_at_half_the_bytes() -> None:
    topo = planners.Topology(WORLD)
    arrays = {dt: TableArrays.of(_tables(dt)) for dt in ("fp32", "fp16")}
    plain, low = CostModel(topo, 64), CostModel(topo, 64, comm_dtype="fp16")
    for kind in (ShardingType.TABLE_WISE, ShardingType.ROW_WISE, ShardingType.COLUMN_WISE):
        rows, cols = arrays["fp32"].rows, arrays["fp32"].dim
        c32, c16 = plain.shard(kind, arrays["fp32"], rows, cols, 1), plain.shard(kind, arrays["fp16"], rows, cols, 1)
        weights32 = rows * cols * 4
        # Only the weights shrink: 2 bytes an element instead of 4; state, buffers stay FP32.
        np.testing.assert_allclose(c32.memory - c16.memory, weights32 / 2)
        q = low.shard(kind, arrays["fp32"], rows, cols, 1)
        np.testing.assert_allclose(q.output_dist, c32.output_dist / 2)
        np.testing.assert_allclose(q.input_dist, c32.input_dist)


def _capacity_where_only_fp16_fits() -> planners.Topology:
    """The smallest device (on a grid of 1.05x steps) whose plan holds the FP16 tables; FP32
    ones must not fit it."""
    memory = 64 * 1024
    while True:
        topo = planners.Topology(WORLD, device_memory=memory)
        try:
            planners.plan(_tables("fp16"), topo, batch_size=4)
            return topo
        except planners.NoPlanError:
            memory = int(memory * 1.05)


def test_a_plan_that_fits_only_in_fp16_is_built_by_shard() -> None:
    topo = _capacity_where_only_fp16_fits()
    with pytest.raises(planners.NoPlanError):
        planners.plan(_tables("fp32"), topo, batch_size=4, auto_tier=False)  # resident
    plan = planners.plan(_tables("fp16"), topo, batch_size=4)
    stats = planners.plan_stats(plan, _tables("fp16"), topo, batch_size=4)
    results = run_on_ranks(WORLD, _build_and_step, plan.to_dict(), timeout=120)
    for r, held in enumerate(results):
        # The planner's per-rank memory holds weights + state + batch buffers; the weights and
        # state alone must be what it priced for them (shard allocates nothing else per row).
        expected = _priced_rows_bytes(plan, r)
        assert held == expected, (r, held, expected)
        assert stats.ranks[r].memory <= stats.ranks[r].capacity


def _priced_rows_bytes(plan, rank: int) -> int:
    """What planners/cost.py prices per row of the shards on `rank`: weights (2 bytes an
    element), row-wise Adagrad state (4 bytes a row), and for a piece of a table cut into
    column pieces the scratch statistic of the exact column-wise statistic (4 bytes a row)."""
    total = 0
    for name, placement in plan.modules[""].items():
        i = int(name[1:])
        shards = placement.shards(num_embeddings=ROWS[i], embedding_dim=DIM[i], world_size=WORLD, table=name)
        pieces = placement.sharding_type is ShardingType.COLUMN_WISE and len(shards) > 1
        for s in shards:
            if s.rank == rank:
                total += s.num_rows * s.num_cols * 2 + s.num_rows * 4 * (2 if pieces else 1)
    return total


def _build_and_step(plan_dict: dict) -> int:
    plan = ShardingPlan.from_dict(plan_dict)
    configs = [
        EmbeddingBagConfig(name=f"t{i}", num_embeddings=r, embedding_dim=d, feature_names=[f"f{i}"],
                           data_type=TorchrecDataType.FP16)
        for i, (r, d) in enumerate(zip(ROWS, DIM))
    ]  # fmt: skip
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    modular.fuse_optimizer(ebc, "exact_rowwise_adagrad", lr=0.1)
    ebc = modular.shard(ebc, plan)
    keys = [f"f{i}" for i in range(len(ROWS))]
    kjt = KeyedJaggedTensor(keys=keys, values=torch.tensor([1, 2, 3, 4, 5, 6, 7, 8]), lengths=torch.tensor([2, 0, 2, 0, 2, 0, 2, 0]))
    ebc(kjt).values().sum().backward()
    held = 0
    for p in ebc.parameters():
        shards = [s.tensor for s in p.local_shards()] if hasattr(p, "local_shards") else [p]
        for t in shards:
            assert t.dtype == torch.float16
            held += t.numel() * t.element_size()
    for states in ebc.fused_tables.states().values():
        for t in states.values():
            assert t.dtype == torch.float32
            held += t.numel() * t.element_size()
    for k in (*ebc._kernels, *ebc._local_kernels):  # column pieces' scratch statistic
        scratch = getattr(k, "_scratch_flat", None)
        held += 0 if scratch is None else scratch.numel() * scratch.element_size()
    return held


# -- the low-precision copies of the output dist (Note [wire copies] in planners/cost.py) --------

WIRE_TABLES = {  # name: (rows, dim, placement)
    "w0": (40, 8, planners.TablePlacement(ShardingType.TABLE_WISE, ranks=(0,))),
    "w1": (50, 16, planners.TablePlacement(ShardingType.ROW_WISE)),
    "w2": (30, 12, planners.TablePlacement(ShardingType.COLUMN_WISE, ranks=(1, 0), sizes=(8, 4))),
    "w3": (20, 4, planners.TablePlacement(ShardingType.DATA_PARALLEL)),
    "w4": (60, 8, planners.TablePlacement(ShardingType.TABLE_WISE, ranks=(1,))),
}
WIRE_BATCH = 3


def test_the_planner_prices_the_fp16_copies_that_shard_makes_and_sends() -> None:
    """Per rank, the planner's extra memory for comm_dtype="fp16" (plan_stats against "fp32")
    equals the FP16 tensors the output dist's all-to-alls send from and receive into (forward
    and backward), and its output-dist seconds / alpha the FP16 bytes the rank sends each peer
    (forward) and receives from it (backward). Exact: both are counts of elements."""
    tables = [planners.Table(n, r, d, features=(f"g{n}",), dtype="fp16") for n, (r, d, _) in WIRE_TABLES.items()]
    plan = ShardingPlan(WORLD, modules={"": {n: p for n, (_, _, p) in WIRE_TABLES.items()}})
    topo = planners.Topology(WORLD)
    low, plain = (planners.plan_stats(plan, tables, topo, batch_size=WIRE_BATCH, comm_dtype=c) for c in ("fp16", "fp32"))
    alpha = CostModel(topo, WIRE_BATCH).alpha
    results = run_on_ranks(WORLD, _count_wire_bytes, plan.to_dict(), timeout=120)
    for r, (held, sent) in enumerate(results):
        assert held > 0
        assert low.ranks[r].memory - plain.ranks[r].memory == held, (r, held)
        assert low.ranks[r].output_dist / alpha == pytest.approx(sent, rel=1e-12), (r, sent)
        assert low.ranks[r].output_dist == pytest.approx(plain.ranks[r].output_dist / 2, rel=1e-12)


def _count_wire_bytes(plan_dict: dict) -> tuple[int, float]:
    import modular.comm

    plan = ShardingPlan.from_dict(plan_dict)
    configs = [
        EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=d, feature_names=[f"g{n}"], data_type=TorchrecDataType.FP16)
        for n, (r, d, _) in WIRE_TABLES.items()
    ]  # fmt: skip
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    modular.fuse_optimizer(ebc, "exact_rowwise_adagrad", lr=0.1)
    ebc = modular.shard(ebc, plan, comm_dtype=torch.float16)
    calls: list[tuple[str, int, int]] = []
    real = modular.comm.all_to_all

    def counting(tensor, **kwargs):
        out = real(tensor, **kwargs)
        if tensor.dtype == torch.float16:
            calls.append((kwargs["what"], tensor.numel(), out.numel()))
        return out

    modular.comm.all_to_all = counting
    try:
        rank = dist.get_rank()
        n = len(WIRE_TABLES)
        lengths = torch.tensor([(rank + s + f) % 3 for f in range(n) for s in range(WIRE_BATCH)])
        values = torch.arange(int(lengths.sum())) % 20
        kjt = KeyedJaggedTensor(keys=[f"g{t}" for t in WIRE_TABLES], values=values, lengths=lengths)
        ebc(kjt).values().float().sum().backward()
    finally:
        modular.comm.all_to_all = real
    assert len(calls) == 2, calls  # one forward, one backward all-to-all, both in FP16
    held = 2 * sum(sent + received for _, sent, received in calls)
    (fwd,) = [c for c in calls if "backward" not in c[0]]
    (bwd,) = [c for c in calls if "backward" in c[0]]
    # Each peer gets an equal split of the forward's input: this rank's columns of its batch.
    sent = 2 * (fwd[1] + bwd[2]) / WORLD
    return held, sent
