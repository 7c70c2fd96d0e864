"""Issue 46: managed-collision tables in a model as a user writes it (on `meta` or materialised):
two torchrec MC-EBCs (three raw-id tables, three policies, intervals 1-3) under a dense tower,
planned by `planners.plan`, the tower under DDP (`modular.apply_ddp`) or FSDP2
(`modular.apply_fully_shard`), then the tables moved by `modular.reshard` mid-run. Against
torchrec's unsharded model fed the global batch: the remapped ids, the collision state, the
loss, the gradients and every trained weight, step by step (Note [sharded managed collisions]
in modular/mc/sharded_mch.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
from torchrec.modules.mc_modules import ManagedCollisionCollection, MCHManagedCollisionModule
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import modular
import planners
from planners.types import ShardingPlan
from tests.dist import run_on_ranks
from tests.modular.compare import assert_grads_match, assert_weights_match
from tests.modular.ebc_cases import global_batch, placements_for
from tests.modular.mc.beside_reference import assert_remapped_slice, step_batches
from tests.modular.mc.test_split_state import HASH, POLICIES

# table -> (features, policy, eviction interval, zch_size), per MC-EBC
SPECS = {"mc": {"t_a": (["fa1", "fa2"], "distance_lfu", 1, 50), "t_b": (["fb"], "lru", 2, 24)},
         "mc2": {"t_c": (["fc"], "lfu", 3, 36)}}  # fmt: skip
DIM, LR, STEPS = 4, 0.3, 12


class Dense(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4 * DIM, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _mc(specs: dict, device: str = "cpu") -> ManagedCollisionEmbeddingBagCollection:
    tables = [EmbeddingBagConfig(name=t, num_embeddings=z, embedding_dim=DIM, feature_names=f)
              for t, (f, _, _, z) in specs.items()]  # fmt: skip
    mcc = ManagedCollisionCollection(managed_collision_modules={
        t: MCHManagedCollisionModule(zch_size=z, device=torch.device(device), eviction_policy=POLICIES[p](),
                                     eviction_interval=i, input_hash_size=HASH)
        for t, (_, p, i, z) in specs.items()}, embedding_configs=tables)  # fmt: skip
    return ManagedCollisionEmbeddingBagCollection(EmbeddingBagCollection(tables=tables, device=torch.device(device)), mcc,
                                                  return_remapped_features=True)  # fmt: skip


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mc, self.mc2, self.dense = _mc(SPECS["mc"]), _mc(SPECS["mc2"]), Dense()

    def forward(self, a: KeyedJaggedTensor, c: KeyedJaggedTensor):
        pooled, remapped = self.mc(a)
        pooled2, remapped2 = self.mc2(c)
        return self.dense(torch.cat([pooled.values(), pooled2.values()], 1)).view(-1), remapped, remapped2


def _batch(step: int, rank: int, keys: list[str]) -> KeyedJaggedTensor:
    """4 samples; Zipf ids over a drifting space, so that most intervals evict."""
    rng = np.random.default_rng([step, rank, len(keys)])
    lengths = rng.integers(0, 4, 4 * len(keys))
    ids = (rng.zipf(1.3, int(lengths.sum())) + 6 * step) % 3000 * 1_000_003 % HASH
    return KeyedJaggedTensor(keys=keys, values=torch.tensor(ids, dtype=torch.int64),
                             lengths=torch.tensor(lengths, dtype=torch.int64))  # fmt: skip


def _batches(step: int, rank: int) -> tuple[KeyedJaggedTensor, KeyedJaggedTensor]:
    return _batch(step, rank, ["fa1", "fa2", "fb"]), _batch(step, rank, ["fc"])


def _moved(model: nn.Module, world: int) -> ShardingPlan:
    """Another plan for both MC-EBCs' tables, for `reshard`."""
    return ShardingPlan(world_size=world, modules={
        "mc._embedding_module": placements_for("column_wise", model.mc._embedding_module, world),
        "mc2._embedding_module": placements_for("row_wise", model.mc2._embedding_module, world)})  # fmt: skip


def _same_collisions(model: nn.Module, ref: nn.Module, label: str) -> None:
    for name in ("mc", "mc2"):
        mine = getattr(model, name)._managed_collision_collection.state_dict()
        theirs = getattr(ref, name)._managed_collision_collection.state_dict()
        differ = [k for k in theirs if not torch.equal(mine[k], theirs[k])]
        assert not differ, f"{label}: {name}'s collision state differs in {differ}"


def _held(ref: nn.Module) -> set[tuple[str, int]]:
    out = set()
    for name in ("mc", "mc2"):
        for key, value in getattr(ref, name)._managed_collision_collection.state_dict().items():
            if key.endswith("_mch_sorted_raw_ids"):
                out |= {(key, int(x)) for x in value if x < torch.iinfo(torch.int64).max}
    return out


def _train(dense: str) -> tuple[list[float], int]:
    world, rank = dist.get_world_size(), dist.get_rank()
    ref, model = Model(), Model()
    plan = planners.plan(Model(), planners.Topology(world, device_memory="1GiB"), batch_size=4)
    assert sorted(plan.modules) == ["mc._embedding_module", "mc2._embedding_module"], plan.modules
    modular.shard(model, plan)
    if dense == "ddp":
        modular.apply_ddp(model)
    else:
        modular.apply_fully_shard(model, modules={Dense})
    opt = torch.optim.SGD(modular.local_parameters(model), lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    losses, evicting, held = [], 0, set()
    for step in range(STEPS):
        if step == STEPS // 2:  # the tables move; the collision state stays where it is
            modular.reshard(model, _moved(model, world))
            _same_collisions(model, ref, f"{dense} rank {rank}: resharded")
            opt = torch.optim.SGD(modular.local_parameters(model), lr=LR)
        batches = [_batches(step, r) for r in range(world)]
        size = [b[0].stride() for b in batches]
        before = sum(size[:rank])
        target = torch.randn(sum(size), generator=torch.Generator().manual_seed(step))
        out, remapped, remapped2 = model(*batches[rank])
        ref_out, ref_remapped, ref_remapped2 = ref(global_batch([b[0] for b in batches]), global_batch([b[1] for b in batches]))
        label = f"{dense} rank {rank} step {step}"
        torch.testing.assert_close(out, ref_out[before : before + size[rank]], rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{label}: outputs: {m}")  # fmt: skip
        for got, want in ((remapped, ref_remapped), (remapped2, ref_remapped2)):
            assert_remapped_slice(got, want, before, label)
        # every rank's loss is its samples' share of the global mean
        loss = ((out - target[before : before + size[rank]]) ** 2).sum() / sum(size)
        ref_loss = ((ref_out - target) ** 2).sum() / sum(size)
        (loss * world).backward()  # the dense part averages gradients over ranks
        ref_loss.backward()
        assert_grads_match(model, ref, label)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        _same_collisions(model, ref, label)
        losses.append(ref_loss.item())
        evicting += bool(held - _held(ref))  # a raw id a table held is gone: an eviction
        held = _held(ref)
    assert_weights_match(model, ref, f"{dense} rank {rank}: trained")
    return losses, evicting


@pytest.mark.parametrize("dense", ["ddp", "fsdp"])
def test_two_mc_ebcs_under_a_ddp_or_fsdp_tower_plan_train_and_reshard_as_the_unsharded_model(dense) -> None:
    (losses, evicting), other = run_on_ranks(2, _train, dense, timeout=180)
    assert other[0] == losses
    assert losses[-1] != losses[0], "the reference did not train"
    assert evicting >= STEPS // 2, f"only {evicting} of {STEPS} steps evicted"


def _on_meta() -> None:
    """An MC-EBC built on `meta` (tables and collision modules): planned, sharded, then trained
    beside torchrec's materialised module given the shards' initial weights."""
    world, rank = dist.get_world_size(), dist.get_rank()
    with torch.device("meta"):
        model = nn.Module()
        model.mc = _mc(SPECS["mc"], device="meta")
    modular.shard(model, planners.plan(model, planners.Topology(world, device_memory="1GiB"), batch_size=4))
    ref = nn.Module()
    ref.mc = _mc(SPECS["mc"])
    exported = [modular.checkpoint.export(model, rank=0)]
    dist.broadcast_object_list(exported, src=0)
    ref.load_state_dict(exported[0], strict=True)  # the collision state too: torchrec's empty one
    params = list(modular.local_parameters(model))
    opt = torch.optim.SGD(params, lr=LR) if params else None  # a rank may hold no table
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for step in range(STEPS // 2):
        batches, size, before = step_batches(lambda s, r: _batches(s, r)[0], step, world, rank)
        pooled, remapped = model.mc(batches[rank])
        ref_pooled, ref_remapped = ref.mc(global_batch(batches))
        label = f"meta rank {rank} step {step}"
        torch.testing.assert_close(pooled.values(), ref_pooled.values()[before : before + size[rank]],
                                   rtol=1e-4, atol=1e-5, msg=lambda m: f"{label}: outputs: {m}")  # fmt: skip
        probe = torch.randn(sum(size), pooled.values().shape[1], generator=torch.Generator().manual_seed(step))
        (pooled.values() * probe[before : before + size[rank]]).sum().backward()
        ((ref_pooled.values() * probe).sum() / world).backward()
        for o in (opt, ref_opt) if opt is not None else (ref_opt,):
            o.step()
            o.zero_grad()
        differ = [k for k, v in ref.mc._managed_collision_collection.state_dict().items()
                  if not torch.equal(model.mc._managed_collision_collection.state_dict()[k], v)]  # fmt: skip
        assert not differ, f"{label}: collision state differs in {differ}"
    assert_weights_match(model, ref, f"meta rank {rank}: trained")


def test_an_mc_model_built_on_meta_plans_shards_and_trains_as_torchrecs_module() -> None:
    run_on_ranks(2, _on_meta, timeout=180)
