"""Ranks that disagree on the model are stopped by `modular.shard`, on every rank, by name.

tests/modular/test_shard_errors.py covers ranks given different *plans* (the digest check) and
plans that are wrong the same way on every rank. Here the plan is the same but one rank's model
differs (table shape, features, pooling, weighting), and then plans that only one rank cannot
resolve: that rank raises before the digest collective, and its peers must not be left in it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch.distributed as dist
from torchrec.modules.embedding_configs import PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection

import modular
from planners.types import ShardingPlan, ShardingType, TablePlacement
from tests.dist import expect_errors_on_all_ranks
from tests.faults.helpers import COLLECTIVE_TIMEOUT_S, MARGIN_S, VICTIM, spawn, survive
from tests.modular.ebc_cases import make_ebc, placements_for, unweighted_tables

TIMEOUT_S = 60

CHANGES = {
    "num_embeddings": {"num_embeddings": 14},
    "embedding_dim": {"embedding_dim": 6},
    "feature_names": {"feature_names": ["f_b", "f_a"]},
    "pooling": {"pooling": PoolingType.MEAN},
}


def _model_differs_on_one_rank(change: str) -> None:
    world = dist.get_world_size()
    configs = unweighted_tables()
    if dist.get_rank() == VICTIM:  # 't_sum' is row-wise under the default (even) split
        configs[0] = dataclasses.replace(configs[0], **CHANGES[change])
    ebc = EmbeddingBagCollection(tables=configs)
    placements = placements_for("row_wise", make_ebc(False), world)
    modular.shard(ebc, ShardingPlan(world_size=world, modules={"": placements}))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("change", sorted(CHANGES))
def test_one_rank_with_other_tables_raises_on_every_rank(change: str) -> None:
    messages = expect_errors_on_all_ranks(3, _model_differs_on_one_rank, change, timeout=TIMEOUT_S)
    assert len(set(messages)) == 1, messages
    assert messages[0].startswith("ranks disagree on the plan or on the tables of the planned modules ("), messages[0]
    assert f"ranks [{VICTIM}] hold" in messages[0] and "ranks [0, 2] hold" in messages[0], messages[0]


def _weighting_differs_on_one_rank() -> None:
    world = dist.get_world_size()
    # SUM tables only: a weighted EBC with a MEAN table is refused on its own (modular/tables/weights.py).
    tables = [dataclasses.replace(c, pooling=PoolingType.SUM) for c in unweighted_tables()]
    ebc = EmbeddingBagCollection(tables=tables, is_weighted=dist.get_rank() == VICTIM)
    modular.shard(ebc, ShardingPlan(world_size=world, modules={"": placements_for("mixed", make_ebc(False), world)}))


@pytest.mark.timeout(120)
def test_one_rank_weighted_raises_on_every_rank() -> None:
    messages = expect_errors_on_all_ranks(2, _weighting_differs_on_one_rank, timeout=TIMEOUT_S)
    assert len(set(messages)) == 1 and messages[0].startswith("ranks disagree on the plan"), messages


# -- a plan that only one rank cannot resolve ----------------------------------------------------

LOCAL_ONLY = {
    # rank VICTIM's plan is for a bigger world: it raises before any collective
    "world_size": "the plan is for 3 ranks but the process group has 2",
    # rank VICTIM's plan names a module its model does not have
    "module": "the plan names module 'tower'",
    # rank VICTIM's 't_sum' has 14 rows, so the plan's explicit row sizes (13) do not fit it
    "row_sizes": "row_wise shards of 't_sum' (14 rows)",
}


def _plan_fails_on_one_rank_only(problem: str):
    rank, world = dist.get_rank(), dist.get_world_size()
    configs = unweighted_tables()
    victim = rank == VICTIM
    if victim and problem == "row_sizes":
        configs[0] = dataclasses.replace(configs[0], num_embeddings=14)
    ebc = EmbeddingBagCollection(tables=configs)
    placements = placements_for("row_wise", make_ebc(False), world)
    placements["t_sum"] = TablePlacement(ShardingType.ROW_WISE, ranks=(0, 1), sizes=(7, 6))
    modules = {"tower" if victim and problem == "module" else "": placements}
    plan_world = world + 1 if victim and problem == "world_size" else world
    if plan_world > world:
        modules = {"": {**placements, "t_big": TablePlacement(ShardingType.TABLE_WISE, ranks=(world,))}}
    plan = ShardingPlan(world_size=plan_world, modules=modules)
    return survive(lambda: modular.shard(ebc, plan))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("problem", sorted(LOCAL_ONLY))
def test_a_plan_only_one_rank_rejects_does_not_hang_its_peers(problem: str) -> None:
    outcomes = spawn(2, _plan_fails_on_one_rank_only, problem)
    bad, peer = outcomes[VICTIM].result, outcomes[0].result
    assert bad is not None and bad.exc_type == "ShardingError" and LOCAL_ONLY[problem] in bad.message, bad
    assert peer is not None and not outcomes[0].timed_out, outcomes[0]
    assert peer.seconds < COLLECTIVE_TIMEOUT_S + MARGIN_S, peer
    # A clear error on every rank at shard time: the peer learns the victim's message in the
    # plan agreement (Note [agreeing on the plan]) instead of waiting for a timeout.
    assert peer.exc_type == "ShardingError" and f"rank {VICTIM}" in peer.message, peer
    assert LOCAL_ONLY[problem] in peer.message, peer
    assert peer.seconds < COLLECTIVE_TIMEOUT_S / 2, f"the peer waited {peer.seconds:.1f} s: a timeout, not the agreement"
