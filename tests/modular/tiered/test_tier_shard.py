"""`modular.shard` and a plan with tiered tables: the ShardingError on every rank naming them, and
the placement's cache fields through a plan's dict form (Note [tiered tables])."""

from __future__ import annotations

import re

import pytest
import torch.distributed as dist

import modular
from planners.types import ShardingPlan, ShardingType, TablePlacement
from tests.dist import expect_errors_on_all_ranks
from tests.modular.ebc_cases import make_ebc, placements_for


def _shard_tiered(tier_dir) -> None:
    world = dist.get_world_size()
    ebc = make_ebc(False)
    placements = placements_for("mixed", ebc, world)
    placements["t_sum"] = TablePlacement(ShardingType.ROW_WISE, tuple(range(world)), cache_load_factor=0.1)
    modular.shard(ebc, ShardingPlan(world_size=world, modules={"": placements}), tier_dir=tier_dir)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("with_dir, says", [
    (False, r"tables t_sum on a tier .* pass modular\.shard\(\.\.\., tier_dir=DIR\)"),
    (True, r"tables t_sum on a tier .* which modular\.shard does not build yet"),
])  # fmt: skip
def test_tiered_plan_refused_on_every_rank(with_dir, says, tmp_path):
    messages = expect_errors_on_all_ranks(2, _shard_tiered, str(tmp_path) if with_dir else None, timeout=60)
    assert len(set(messages)) == 1, messages
    assert re.search(says, messages[0]), messages[0]


def test_placement_cache_fields_round_trip():
    p = TablePlacement(ShardingType.TABLE_WISE, (1,), cache_load_factor=0.05, cache_policy="lfu")
    assert TablePlacement.from_dict(p.to_dict()) == p
    assert "cache_load_factor" not in TablePlacement(ShardingType.TABLE_WISE, (1,)).to_dict()
    with pytest.raises(modular.PlanError, match="cache_load_factor"):
        TablePlacement(ShardingType.TABLE_WISE, (1,), cache_load_factor=2.0)
