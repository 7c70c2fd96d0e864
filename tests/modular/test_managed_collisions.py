"""Issue 46: torchrec's managed-collision modules under modular (Note [managed collisions over
the global batch] in modular/managed_collisions.py).

A model holding torchrec's `ManagedCollisionEmbeddingBagCollection` (one raw-id table of
zch_size 40, fed a Zipf stream with churn so that most intervals evict) beside a plain EBC, its
MC table sharded under every plan, against torchrec's unsharded module fed the global batch:
the remapped ids, the outputs and the trained weights, step by step, at worlds 2 and 3, with
LRU, LFU and DistanceLFU eviction, eviction_interval 1 and 3, fused and unfused."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
from torchrec.modules.mc_modules import (
    DistanceLFU_EvictionPolicy, LFU_EvictionPolicy, LRU_EvictionPolicy, ManagedCollisionCollection,
    MCHManagedCollisionModule,
)  # fmt: skip
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import modular
import planners
from modular.errors import InputError, ShardingError
from planners.types import ShardingPlan, ShardingType, TablePlacement
from tests.dist import run_on_ranks
from tests.modular.compare import backward_and_step, full_value
from tests.modular.ebc_cases import global_batch, placements_for
from tests.modular.mc.beside_reference import step_batches, train_beside_reference

ZCH = 40
HASH = 2**40
STEPS = 20
LR = 0.5
POLICIES = {"lru": LRU_EvictionPolicy, "lfu": LFU_EvictionPolicy, "distance_lfu": DistanceLFU_EvictionPolicy}


def _tables() -> list[EmbeddingBagConfig]:
    return [EmbeddingBagConfig(name="t_raw", num_embeddings=ZCH, embedding_dim=8, feature_names=["f_raw", "f_raw2"])]


class Model(nn.Module):
    """An MC-EBC of one raw-id table (two features) beside a plain EBC."""

    def __init__(self, policy: str = "distance_lfu", interval: int = 1) -> None:
        super().__init__()
        torch.manual_seed(0)
        tables = _tables()
        mcc = ManagedCollisionCollection(
            managed_collision_modules={"t_raw": MCHManagedCollisionModule(
                zch_size=ZCH, device=torch.device("cpu"), eviction_policy=POLICIES[policy](),
                eviction_interval=interval, input_hash_size=HASH)},
            embedding_configs=tables,
        )  # fmt: skip
        self.mc = ManagedCollisionEmbeddingBagCollection(EmbeddingBagCollection(tables=tables), mcc,
                                                         return_remapped_features=True)  # fmt: skip
        self.ebc = EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name="t_item", num_embeddings=30, embedding_dim=8, feature_names=["f_item"])])  # fmt: skip


def _raw_batch(step: int, rank: int) -> KeyedJaggedTensor:
    """Zipf ids over a space that drifts (churn), 2-5 samples per rank, 0-3 ids per bag."""
    rng = np.random.default_rng([step, rank])
    size = int(rng.integers(2, 6))
    lengths = rng.integers(0, 4, 2 * size)
    ids = (rng.zipf(1.3, int(lengths.sum())) + 7 * step) % 5000 * 1_000_003 % HASH
    return KeyedJaggedTensor(keys=["f_raw", "f_raw2"], values=torch.tensor(ids, dtype=torch.int64),
                             lengths=torch.tensor(lengths, dtype=torch.int64))  # fmt: skip


def _train(world_kind: str, policy: str, interval: int, fused: bool) -> int:
    world, rank = dist.get_world_size(), dist.get_rank()
    ref = Model(policy, interval)
    model = copy.deepcopy(ref)
    placements = placements_for(world_kind, ref.mc._embedding_module, world)
    plan = ShardingPlan(world_size=world, modules={
        "mc._embedding_module": placements,
        "ebc": {"t_item": TablePlacement(ShardingType.TABLE_WISE, ranks=(world - 1,))}})  # fmt: skip
    if fused:
        modular.fuse_optimizer(model, "exact_sgd", lr=LR)
    modular.shard(model, plan)
    params = [] if fused else list(modular.local_parameters(model))
    opt = torch.optim.SGD(params, lr=LR) if params else None  # a rank may hold no table
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    label = f"{world_kind} {policy} interval {interval} fused={fused}, rank {rank}/{world}"
    evictions, seen = 0, set()
    for step in range(STEPS):
        batches, strides, before = step_batches(_raw_batch, step, world, rank)
        pooled, remapped = model.mc(batches[rank])
        ref_pooled, ref_remapped = ref.mc(global_batch(batches))
        # this rank's remapped ids are its slice of the global batch's
        for key in ("f_raw", "f_raw2"):
            want, got = ref_remapped[key], remapped[key]
            lengths = want.lengths()
            start = int(lengths[:before].sum())
            assert torch.equal(got.lengths(), lengths[before: before + strides[rank]]), f"{label} step {step}: {key} lengths"
            assert torch.equal(got.values(), want.values()[start: start + int(got.lengths().sum())]), f"{label} step {step}: {key} remapped ids"
        torch.testing.assert_close(pooled.values(), ref_pooled.values()[before: before + strides[rank]],
                                   rtol=1e-4, atol=1e-5, msg=lambda m: f"{label} step {step}: outputs: {m}")  # fmt: skip
        g = torch.Generator().manual_seed(step)
        probe = torch.randn(sum(strides), 16, generator=g)
        backward_and_step(((pooled.values() * probe[before: before + strides[rank]]).sum(),
                           (ref_pooled.values() * probe).sum() / world), (opt, ref_opt))
        held = set(_raw_ids(ref))
        evictions += bool(seen - held)  # a raw id the table held is gone: evicted this step
        seen = held
    got = full_value(model.mc._embedding_module.embedding_bags["t_raw"].weight)
    torch.testing.assert_close(got, ref.mc._embedding_module.embedding_bags["t_raw"].weight.detach(),
                               rtol=1e-4, atol=1e-5, msg=lambda m: f"{label}: trained table: {m}")  # fmt: skip
    # the collision state is the unsharded module's, under torchrec's keys, split across ranks
    # (Note [sharded managed collisions]): this rank holds only its slots
    shard = model.mc._managed_collision_collection._managed_collision_modules["t_raw"]._shard
    assert shard.raw.numel() <= -(-(ZCH - 1) // world), f"{label}: {shard.raw.numel()} slots held"
    mine = {k: v for k, v in model.mc._managed_collision_collection.state_dict().items()}
    theirs = ref.mc._managed_collision_collection.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine), f"{label}: collision state"
    return evictions


def _raw_ids(model: Model) -> list[int]:
    raw = model.mc._managed_collision_collection.state_dict()["_managed_collision_modules.t_raw._mch_sorted_raw_ids"]
    return [int(x) for x in raw if x < torch.iinfo(torch.int64).max]


CASES_2 = [("row_wise", "distance_lfu", 1, False), ("table_wise", "lru", 3, False),
           ("column_wise", "lfu", 1, True), ("data_parallel", "lru", 1, False),
           ("table_row_wise", "lfu", 3, False), ("row_wise", "lru", 3, True)]  # fmt: skip
CASES_3 = [("row_wise", "lru", 1, True), ("column_wise", "distance_lfu", 3, False),
           ("table_wise", "lfu", 1, False)]  # fmt: skip


def _cases(cases: list) -> list[int]:
    return [_train(*c) for c in cases]


@pytest.mark.parametrize("world,cases", [(2, CASES_2), (3, CASES_3)])
def test_a_sharded_mc_table_remaps_and_trains_as_the_unsharded_module_on_the_global_batch(world, cases) -> None:
    evicting = run_on_ranks(world, _cases, cases, timeout=240)[0]
    intervals = [STEPS // c[2] for c in cases]
    assert all(2 * e > n for e, n in zip(evicting, intervals)), f"evictions in most intervals: {evicting} of {intervals}"


def test_the_planner_plans_mc_tables_as_zch_size_tables_and_skips_the_collision_collection() -> None:
    tables = planners.tables_from_model(Model())
    assert sorted(tables) == ["ebc", "mc._embedding_module"]
    (raw,) = tables["mc._embedding_module"]
    assert (raw.name, raw.num_embeddings, raw.sequence) == ("t_raw", ZCH, False)
    plan = planners.plan(Model(), planners.Topology(2, device_memory="1GiB"), batch_size=8)
    assert sorted(plan.modules) == ["ebc", "mc._embedding_module"]


def _refusals() -> list[str]:
    world, rank = dist.get_world_size(), dist.get_rank()
    out = []
    model = Model()
    with pytest.raises(ShardingError) as e:
        modular.shard(model, ShardingPlan(world_size=world, modules={
            "mc._managed_collision_collection": {"t_raw": TablePlacement(ShardingType.TABLE_WISE, ranks=(0,))}}))  # fmt: skip
    assert type(model.mc._embedding_module) is EmbeddingBagCollection
    out.append(str(e.value))
    modular.shard(model, ShardingPlan(world_size=world, modules={
        "mc._embedding_module": placements_for("row_wise", model.mc._embedding_module, world)}))  # fmt: skip
    model.mc(_raw_batch(0, rank))  # an interval done: the next evicting call folds its ids into the check
    module = model.mc._managed_collision_collection._managed_collision_modules["t_raw"]
    folds = dict(module._folds)
    state = copy.deepcopy(model.mc._managed_collision_collection.state_dict())
    bad = _raw_batch(0, rank)
    if rank == 1:  # only rank 1's batch holds the bad id; every rank raises
        bad = KeyedJaggedTensor(keys=bad.keys(), values=torch.cat([bad.values(), torch.tensor([HASH + 5])]),
                                lengths=torch.cat([bad.lengths()[:-1], bad.lengths()[-1:] + 1]))  # fmt: skip
    with pytest.raises(InputError) as e:
        model.mc(bad)
    out.append(str(e.value))
    after = model.mc._managed_collision_collection.state_dict()
    assert all(torch.equal(state[k], after[k]) for k in state), "no state changed"
    assert module._folds == folds and module._folded is None, "no interval counted, no rows kept"
    model.mc(_raw_batch(1, rank))  # and the next good batch trains, its ids in the check
    assert module._folds["folded"] + module._folds["overflow"] == folds["folded"] + folds["overflow"] + 1
    return out


def test_bad_plans_and_bad_ids_are_refused_on_every_rank() -> None:
    messages = run_on_ranks(2, _refusals, timeout=60)
    assert messages[0] == messages[1]
    plan_error, id_error = messages[0]
    assert "'mc._managed_collision_collection'" in plan_error and "'mc._embedding_module'" in plan_error
    assert "'f_raw2'" in id_error and "rank 1" in id_error and "input_hash_size" in id_error


def _prefetches() -> str:
    world, rank = dist.get_world_size(), dist.get_rank()
    model = Model()
    modular.shard(model, ShardingPlan(world_size=world, modules={
        "mc._embedding_module": placements_for("row_wise", model.mc._embedding_module, world),
        "ebc": {"t_item": TablePlacement(ShardingType.TABLE_WISE, ranks=(0,))}}))  # fmt: skip
    raw = _raw_batch(0, rank)
    with pytest.raises(ShardingError) as e:  # its input is the remapped ids, known in forward only
        modular.prefetch(model, raw, modules=["mc._embedding_module"])
    items = KeyedJaggedTensor(keys=["f_item"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 2]))
    modular.prefetch(model, items, modules=["ebc"])  # the plain collection beside it still prefetches
    torch.testing.assert_close(model.ebc(items).values().shape, (2, 8))
    return str(e.value)


def test_prefetching_an_mc_tables_collection_is_refused_on_every_rank() -> None:
    messages = run_on_ranks(2, _prefetches, timeout=60)
    assert messages[0] == messages[1]
    assert "'mc._embedding_module'" in messages[0] and "managed-collision module 'mc'" in messages[0]
    assert "['ebc']" in messages[0]


# -- a checkpoint across world sizes and plans -------------------------------------------------------


def _steps(model: Model, ref: Model, opt, ref_opt, world: int, rank: int, steps: range) -> None:
    train_beside_reference(model, ref, opt, ref_opt, batch_of=_raw_batch, width=16, world=world,
                           rank=rank, steps=steps)  # fmt: skip


def _sharded(kind: str) -> tuple[Model, object]:
    world = dist.get_world_size()
    model = Model("lru", 1)
    modular.shard(model, ShardingPlan(world_size=world, modules={
        "mc._embedding_module": placements_for(kind, model.mc._embedding_module, world)}))  # fmt: skip
    params = list(modular.local_parameters(model))
    return model, torch.optim.SGD(params, lr=LR) if params else None


def _save(path: str) -> None:
    model, opt = _sharded("row_wise")
    ref = Model("lru", 1)
    _steps(model, ref, opt, torch.optim.SGD(ref.parameters(), lr=LR), 2, dist.get_rank(), range(6))
    modular.checkpoint.save(path, model)


def _resume(path: str) -> None:
    """torchrec keeps an MCH module's eviction history in non-persistent buffers, sized at its
    first training call after construction (or load), so its own state_dict does not resume a
    run bit for bit. What we hold to: after the load, the state is the saved run's, and training
    goes on exactly as torchrec's unsharded module resumed from that run's state_dict."""
    world, rank = dist.get_world_size(), dist.get_rank()
    model, opt = _sharded("table_wise")
    modular.checkpoint.load(path, model)
    saved = Model("lru", 1)
    _steps(None, saved, None, torch.optim.SGD(saved.parameters(), lr=LR), 2, rank, range(6))
    mine = model.mc._managed_collision_collection.state_dict()
    theirs = saved.mc._managed_collision_collection.state_dict()
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs), f"rank {rank}: loaded collision state"
    ref = Model("lru", 1)
    ref.load_state_dict(saved.state_dict())  # torchrec's own resume
    _steps(model, ref, opt, torch.optim.SGD(ref.parameters(), lr=LR), world, rank, range(6, 12))
    mine, theirs = model.mc._managed_collision_collection.state_dict(), ref.mc._managed_collision_collection.state_dict()
    differ = [k for k in theirs if not torch.equal(mine[k], theirs[k])]
    assert not differ, f"rank {rank}: collision state differs in {differ}"
    got = full_value(model.mc._embedding_module.embedding_bags["t_raw"].weight)
    torch.testing.assert_close(got, ref.mc._embedding_module.embedding_bags["t_raw"].weight.detach(),
                               rtol=1e-4, atol=1e-5)  # fmt: skip


def test_a_checkpoint_moves_the_collision_state_from_world_2_to_world_3_and_training_goes_on(tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    run_on_ranks(2, _save, path, timeout=120)
    run_on_ranks(3, _resume, path, timeout=120)


# -- the EmbeddingCollection kind -------------------------------------------------------------------


def _ec_model() -> nn.Module:
    from torchrec.modules.embedding_configs import EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingCollection
    from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingCollection

    torch.manual_seed(0)
    tables = [EmbeddingConfig(name="t_raw", num_embeddings=ZCH, embedding_dim=8, feature_names=["f_raw", "f_raw2"])]
    mcc = ManagedCollisionCollection(
        managed_collision_modules={"t_raw": MCHManagedCollisionModule(
            zch_size=ZCH, device=torch.device("cpu"), eviction_policy=LFU_EvictionPolicy(),
            eviction_interval=2, input_hash_size=HASH)},
        embedding_configs=tables,
    )  # fmt: skip
    model = nn.Module()
    model.mc = ManagedCollisionEmbeddingCollection(EmbeddingCollection(tables=tables), mcc,
                                                   return_remapped_features=True)  # fmt: skip
    return model


def _train_ec(kind: str) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    ref = _ec_model()
    model = copy.deepcopy(ref)
    every = tuple(range(world))
    placement = {"row_wise": TablePlacement(ShardingType.ROW_WISE, ranks=every),
                 "table_wise": TablePlacement(ShardingType.TABLE_WISE, ranks=(world - 1,)),
                 "column_wise": TablePlacement(ShardingType.COLUMN_WISE, ranks=every)}[kind]  # fmt: skip
    modular.shard(model, ShardingPlan(world_size=world, modules={"mc._embedding_module": {"t_raw": placement}}))
    params = list(modular.local_parameters(model))
    opt = torch.optim.SGD(params, lr=LR) if params else None
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for step in range(10):
        batches, strides, before = step_batches(_raw_batch, step, world, rank)
        out, remapped = model.mc(batches[rank])
        ref_out, ref_remapped = ref.mc(global_batch(batches))
        loss, ref_loss = 0.0, 0.0
        for key in ("f_raw", "f_raw2"):
            lengths = ref_remapped[key].lengths()
            start, count = int(lengths[:before].sum()), int(lengths[before: before + strides[rank]].sum())
            assert torch.equal(remapped[key].values(), ref_remapped[key].values()[start: start + count]), f"{kind} step {step}: {key}"
            torch.testing.assert_close(out[key].values(), ref_out[key].values()[start: start + count], rtol=1e-4, atol=1e-5)
            w = torch.randn(ref_out[key].values().shape, generator=torch.Generator().manual_seed(step))
            loss = loss + (out[key].values() * w[start: start + count]).sum()
            ref_loss = ref_loss + (ref_out[key].values() * w).sum() / world
        backward_and_step((loss, ref_loss), (opt, ref_opt))
    got = full_value(model.mc._embedding_module.embeddings["t_raw"].weight)
    torch.testing.assert_close(got, ref.mc._embedding_module.embeddings["t_raw"].weight.detach(), rtol=1e-4, atol=1e-5)


def _ecs() -> None:
    for kind in ("row_wise", "table_wise", "column_wise"):
        _train_ec(kind)


def test_a_sharded_mc_embedding_collection_trains_as_the_unsharded_module() -> None:
    run_on_ranks(2, _ecs, timeout=120)
