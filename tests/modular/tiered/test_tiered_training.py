"""Tiered tables sharded by `modular.shard(..., tier_dir=)` train bit for bit like the same tables
resident (Note [tiered tables]): two models of one seed and plan, one with cache_load_factor,
side by side on the same Zipf batches at worlds 2 and 3; outputs every step, then weights and
fused state through `state_dict()`. Prefetched steps miss nothing; `tier_stats` counts."""

from __future__ import annotations

import dataclasses
import gc
import os

import pytest
import torch
import torch.distributed as dist
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import modular
from planners.types import ShardingPlan, ShardingType, TablePlacement
from tests.dist import run_on_ranks

TABLES = (("t_a", 4000, 8, ("f1", "f2")), ("t_b", 2400, 16, ("f3",)), ("t_c", 1600, 24, ("f4",)))
FEATURES = ["f1", "f2", "f3", "f4"]
BATCH, STEPS = 4, 6
TW, RW, CW, TWRW = (ShardingType.TABLE_WISE, ShardingType.ROW_WISE, ShardingType.COLUMN_WISE,
                    ShardingType.TABLE_ROW_WISE)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Case:
    plan: str
    optimizer: str
    factor: float
    policy: str = "lru"
    prefetch: bool = False
    resident: tuple[str, ...] = ()  # tables left resident beside the tiered ones
    statistic: str = "exact"  # row-wise Adagrad's over column pieces


def make_ebc() -> EmbeddingBagCollection:
    torch.manual_seed(3)
    configs = [
        EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=d, feature_names=list(f),
                           pooling=PoolingType.MEAN if n == "t_b" else PoolingType.SUM)
        for n, r, d, f in TABLES
    ]  # fmt: skip
    return EmbeddingBagCollection(tables=configs)


def placements(kind: str, world: int) -> dict[str, TablePlacement]:
    every = tuple(range(world))
    if kind == "tw":
        return {"t_a": TablePlacement(TW, (world - 1,)), "t_b": TablePlacement(TW, (0,)),
                "t_c": TablePlacement(TW, (1 % world,))}  # fmt: skip
    if kind == "rw":
        return {n: TablePlacement(RW) for n, *_ in TABLES}
    if kind == "cw":
        return {"t_a": TablePlacement(TW, (0,)), "t_b": TablePlacement(RW), "t_c": TablePlacement(CW)}
    if kind == "twrw":
        return {n: TablePlacement(TWRW, every) for n, *_ in TABLES}
    raise ValueError(kind)


def batch(step: int, rank: int) -> KeyedJaggedTensor:
    """Zipf-like ids (many repeats, a long tail), 0-3 per bag."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    rows = {f: r for _, r, _, fs in TABLES for f in fs}
    lengths = torch.randint(0, 4, (len(FEATURES) * BATCH,), generator=gen)
    bound = torch.tensor([rows[f] for f in FEATURES]).repeat_interleave(BATCH).repeat_interleave(lengths)
    ids = (torch.rand(int(lengths.sum()), generator=gen) ** 4 * bound).long()
    return KeyedJaggedTensor.from_lengths_sync(FEATURES, ids, lengths)


def _build(case: Case, world: int, tier_dir):
    ebc = make_ebc()
    extra = {"column_wise_statistic": case.statistic} if case.statistic != "exact" else {}
    opt = modular.fuse_optimizer(ebc, case.optimizer, lr=0.05, eps=1e-3, **extra)
    places = placements(case.plan, world)
    if tier_dir is not None:
        places = {
            n: p if n in case.resident
            else dataclasses.replace(p, cache_load_factor=case.factor, cache_policy=case.policy)
            for n, p in places.items()
        }  # fmt: skip
    model = modular.shard(ebc, ShardingPlan(world_size=world, modules={"": places}), tier_dir=tier_dir)
    return model, opt


def _locals(value) -> list[torch.Tensor]:
    return [s.tensor for s in value.local_shards()] if hasattr(value, "local_shards") else [value]


def _compare(case: Case, tier_dir: str) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    resident, ropt = _build(case, world, None)
    tiered, topt = _build(case, world, os.path.join(tier_dir, f"w{world}"))
    misses, fetched, stats = [], 0, {}
    batches = [batch(step, rank) for step in range(STEPS)]  # a prefetched KJT is used as is
    if case.prefetch:
        modular.prefetch(tiered, batches[0])
    for step in range(STEPS):
        kjt = batches[step]
        if case.prefetch and step + 1 < STEPS:
            modular.prefetch(tiered, batches[step + 1])
        a = resident(batch(step, rank)).values()
        b = tiered(kjt).values()
        if case.prefetch:
            assert id(kjt) not in tiered._prefetcher._pending, "the step did not take its prefetch"
        assert torch.equal(a, b), f"{case} step {step}: outputs differ"
        stats = modular.tier_stats(tiered)
        misses.append(sum(s["misses"] for s in stats.values()))
        fetched += sum(s["rows_fetched"] for s in stats.values())
        widths = {n: d for n, _, d, _ in TABLES}
        for table, s in stats.items():  # a row moves with its state: (cols + state) x 4 bytes
            cols = widths[table] if case.plan != "cw" or table != "t_c" else widths[table] // world
            state = {"exact_sgd": 0, "exact_adagrad": cols, "exact_rowwise_adagrad": 1, "adam": 2 * cols,
                     "lamb": 2 * cols}.get(case.optimizer, cols + 1)  # partial_rowwise: cols + 1
            assert s["bytes_fetched"] == s["rows_fetched"] * 4 * (cols + state), (table, s)
            if not case.prefetch:  # a row moves only for a miss
                assert s["rows_fetched"] == s["misses"], (table, s)
        target = torch.randn(a.shape, generator=torch.Generator().manual_seed(step))
        (a * target).sum().backward()
        (b * target).sum().backward()
        ropt.step()
        topt.step()
    for (name, x), (other, y) in zip(resident.state_dict().items(), tiered.state_dict().items()):
        assert name == other
        assert all(torch.equal(u, v) for u, v in zip(_locals(x), _locals(y))), f"{case} {name} differs"
    rstate, tstate = ropt.state_dict()["state"], topt.state_dict()["state"]
    assert rstate.keys() == tstate.keys()
    for name in rstate:
        for key in rstate[name]:
            pairs = zip(_locals(rstate[name][key]), _locals(tstate[name][key]))
            assert all(torch.equal(u, v) for u, v in pairs), f"{case} {name} state {key} differs"
    return {"misses": misses, "fetched": fetched, "tables": sorted(stats)}


def _cases(cases: list[Case], tier_dir: str) -> list[dict]:
    out = [_compare(c, tier_dir) for c in cases]
    gc.collect()  # sharded modules hold reference cycles; their stores go with them
    return out


CASES = [
    Case("tw", "exact_sgd", 0.01),
    Case("rw", "exact_adagrad", 0.1, "lfu"),
    Case("cw", "exact_rowwise_adagrad", 0.02, statistic="per_shard"),
    Case("twrw", "exact_rowwise_adagrad", 1.0),
    Case("rw", "exact_rowwise_adagrad", 0.05, prefetch=True),
    Case("cw", "exact_sgd", 0.05, "lfu", prefetch=True, resident=("t_b",)),
    Case("rw", "adam", 0.02),
    Case("tw", "partial_rowwise_adam", 0.1, "lfu"),
    Case("twrw", "lamb", 0.05, prefetch=True),
    Case("cw", "partial_rowwise_lamb", 0.05, resident=("t_c",)),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_tiered_training_equals_resident(world, tmp_path):
    results = run_on_ranks(world, _cases, CASES, str(tmp_path), timeout=280)
    for case in CASES:  # every table this rank holds a tiered shard of, counted
        held = set().union(*(r[CASES.index(case)]["tables"] for r in results))
        assert held == {n for n, *_ in TABLES} - set(case.resident), (case, held)
    for case, *ranks in zip(CASES, *results):
        fetched = sum(got["fetched"] for got in ranks)
        assert fetched > 0, case  # rows came from the stores
        if case.prefetch:  # the first batch was prefetched before any step: nothing missed
            assert all(sum(got["misses"]) == 0 for got in ranks), (case, ranks)
        elif case.factor < 1:
            assert sum(sum(got["misses"]) for got in ranks) > 0, case
    assert not os.listdir(tmp_path / f"w{world}"), "the stores' files outlive their models"
