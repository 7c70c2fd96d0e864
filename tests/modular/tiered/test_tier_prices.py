"""The planner's prices of tiered tables come true (Note [pricing tiered tables] in
planners/tier_cost.py): on 2 gloo ranks, tables that `planners.plan` tiers are built by
`modular.shard(tier_dir=)`, and each rank holds exactly the caches (their slots' rows and fused
state) and bookkeeping that `planners.plan_stats` prices as its `cache`, and stores of exactly
its `tier_bytes`; each table's cache rows are `tier_stats`'."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

import modular
import planners
from modular.tiered import TieredKernel
from tests.dist import run_on_ranks

WORLD, BATCH = 2, 32
SPECS = [(4_000, 32, "row_wise", 0.05, "lru"), (3_000, 16, "table_wise", 0.1, "lfu"), (500, 8, "table_wise", None, "lru")]
OPTIMIZERS = ("sgd", "rowwise_adagrad", "adagrad", "adam")


def _plan(optimizer: str) -> tuple[planners.ShardingPlan, planners.PlanStats]:
    tables = [planners.Table(f"t{i}", rows, dim, features=(f"f{i}",), pooling_factor=4.0)
              for i, (rows, dim, *_) in enumerate(SPECS)]  # fmt: skip
    cons = {f"t{i}": planners.TableConstraint(sharding_types=(kind,), cache_load_factor=factor,
                                              cache_policy=policy)
            for i, (_, _, kind, factor, policy) in enumerate(SPECS)}  # fmt: skip
    topology = planners.Topology(WORLD, device_memory="1GiB")
    plan = planners.plan(tables, topology, batch_size=BATCH, optimizer=optimizer, constraints=cons)
    stats = planners.plan_stats(plan, tables, topology, batch_size=BATCH, optimizer=optimizer,
                                constraints=cons)  # fmt: skip
    return plan, stats


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _measure(tier_dir: str) -> dict[str, tuple[int, int, dict[str, int]]]:
    """This rank's (cache bytes, store bytes, cache rows by table) under each optimizer."""
    out = {}
    for optimizer in OPTIMIZERS:
        plan, _ = _plan(optimizer)  # each rank plans again: plans are deterministic
        ebc = EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name=f"t{i}", num_embeddings=rows, embedding_dim=dim, feature_names=[f"f{i}"])
            for i, (rows, dim, *_) in enumerate(SPECS)])  # fmt: skip
        modular.fuse_optimizer(ebc, planners.Optimizer.parse(optimizer).fused_name, lr=0.01)
        modular.shard(ebc, plan, tier_dir=f"{tier_dir}/{optimizer}")
        cache = store = 0
        for k in ebc._sharded.shards.kernels:
            if not isinstance(k, TieredKernel):
                continue
            cache += sum(_nbytes(v) for v in k.inner.views)
            cache += sum(_nbytes(x) for per in k.inner.states for x in per.values() if x.dim() > 0)
            cache += sum(_nbytes(getattr(m, n)) for m in k.maps
                         for n in ("slot_of", "id_of", "used", "count", "dirty", "pinned", "ahead"))  # fmt: skip
            store += sum(_nbytes(s.weights) + sum(_nbytes(x) for x in s.states.values()) for s in k.stores)
        rows = {t: c["cache_rows"] for t, c in modular.tier_stats(ebc).items()}
        out[optimizer] = (cache, store, rows)
        del ebc
    dist.barrier()
    return out


@pytest.mark.timeout(180)
def test_each_ranks_caches_bookkeeping_and_stores_are_priced_exactly(tmp_path):
    measured = run_on_ranks(WORLD, _measure, str(tmp_path / "tiers"), timeout=150)
    for optimizer in OPTIMIZERS:
        plan, stats = _plan(optimizer)
        assert plan.placement("", "t0").cache_load_factor == 0.05
        for r in stats.ranks:
            cache, store, rows = measured[r.rank][optimizer]
            assert cache > 0 and store > 0, (optimizer, r.rank)
            assert (cache, store) == (r.cache, r.tier_bytes), (optimizer, r.rank)
            priced = {t.name: sum(s.cache_rows for s in t.shards if s.rank == r.rank)
                      for t in stats.tables if t.cache_load_factor is not None}  # fmt: skip
            assert rows == {n: c for n, c in priced.items() if c}, (optimizer, r.rank)
