"""Issue 46, first step: torchrec's managed-collision modules meet planners.plan and
modular.shard (Note [managed collisions are not sharded yet] in modular/managed_collisions.py).

The silently wrong case the issue found: sharding only an MC-EBC's inner EBC, after which each
rank's collision module remaps only its own batch and one raw id maps to different rows on
different ranks. It must be refused on every rank, naming both modules, before anything is
sharded; the planner plans the MC tables as tables of zch_size rows and skips the collision
collection; a plain EBC beside the MC-EBC still shards."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
from torchrec.modules.mc_modules import (
    DistanceLFU_EvictionPolicy, ManagedCollisionCollection, MCHManagedCollisionModule,
)  # fmt: skip
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import modular
import planners
from modular.errors import ShardingError
from planners.types import ShardingPlan, ShardingType, TablePlacement
from tests.dist import run_on_ranks

ZCH = 100


class Model(nn.Module):
    """An MC-EBC of one raw-id table (zch_size 100) beside a plain EBC."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        tables = [EmbeddingBagConfig(name="t_raw", num_embeddings=ZCH, embedding_dim=8, feature_names=["f_raw"])]
        mcc = ManagedCollisionCollection(
            managed_collision_modules={"t_raw": MCHManagedCollisionModule(
                zch_size=ZCH, device=torch.device("cpu"), eviction_policy=DistanceLFU_EvictionPolicy(),
                eviction_interval=1, input_hash_size=2**40)},
            embedding_configs=tables,
        )  # fmt: skip
        self.mc = ManagedCollisionEmbeddingBagCollection(EmbeddingBagCollection(tables=tables), mcc,
                                                         return_remapped_features=False)  # fmt: skip
        self.ebc = EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name="t_item", num_embeddings=40, embedding_dim=8, feature_names=["f_item"])])  # fmt: skip


def test_the_planner_plans_mc_tables_as_zch_size_tables_and_skips_the_collision_collection() -> None:
    tables = planners.tables_from_model(Model())
    assert sorted(tables) == ["ebc", "mc._embedding_module"]
    (raw,) = tables["mc._embedding_module"]
    assert (raw.name, raw.num_embeddings, raw.sequence) == ("t_raw", ZCH, False)
    plan = planners.plan(Model(), planners.Topology(2, device_memory="1GiB"), batch_size=8)
    assert sorted(plan.modules) == ["ebc", "mc._embedding_module"]


def _shard_refused(fqn: str) -> str:
    model = Model()
    world = dist.get_world_size()
    modules = {fqn: {"t_raw": TablePlacement(ShardingType.ROW_WISE, ranks=tuple(range(world)))}}
    if fqn.endswith("_managed_collision_collection"):
        modules = {fqn: {"t_raw": TablePlacement(ShardingType.TABLE_WISE, ranks=(0,))}}
    modules["ebc"] = {"t_item": TablePlacement(ShardingType.TABLE_WISE, ranks=(1,))}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ShardingError) as e:
        modular.shard(model, ShardingPlan(world_size=world, modules=modules))
    after = model.state_dict()
    assert type(model.ebc) is EmbeddingBagCollection, "nothing is sharded before the refusal"
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    return str(e.value)


def _plain_ebc_beside_shards() -> float:
    model = Model()
    world = dist.get_world_size()
    modular.shard(model, ShardingPlan(world_size=world, modules={
        "ebc": {"t_item": TablePlacement(ShardingType.ROW_WISE, ranks=tuple(range(world)))}}))  # fmt: skip
    kjt = KeyedJaggedTensor(keys=["f_item"], values=torch.tensor([1, 2, 39]), lengths=torch.tensor([2, 1]))
    return float(model.ebc(kjt).values().sum())


@pytest.mark.parametrize("fqn", ["mc._embedding_module", "mc._managed_collision_collection"])
def test_sharding_an_mc_module_is_refused_on_every_rank_naming_both_modules(fqn: str) -> None:
    messages = run_on_ranks(2, _shard_refused, fqn, timeout=60)
    assert messages[0] == messages[1]
    for words in ("'mc._embedding_module'", "'mc._managed_collision_collection'",
                  "ManagedCollisionEmbeddingBagCollection", "different rows on different ranks"):  # fmt: skip
        assert words in messages[0], messages[0]


def test_a_plain_ebc_beside_an_mc_module_still_shards() -> None:
    sums = run_on_ranks(2, _plain_ebc_beside_shards, timeout=60)
    ref = Model().ebc
    kjt = KeyedJaggedTensor(keys=["f_item"], values=torch.tensor([1, 2, 39]), lengths=torch.tensor([2, 1]))
    assert sums[0] == pytest.approx(float(ref(kjt).values().sum().detach()), rel=1e-6)
