"""`modular.shard` and a plan with tiered tables: what the tier cannot build is a ShardingError on
every rank naming the table, and the placement's cache fields go through a plan's dict form
(Note [tiered tables])."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

import modular
from planners.types import ShardingPlan, ShardingType, TablePlacement
from tests.dist import expect_errors_on_all_ranks


def _shard_tiered(tier_dir, optimizer, kind, cols=8) -> None:
    world = dist.get_world_size()
    ebc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name="t_sum", num_embeddings=40, embedding_dim=cols, feature_names=["f"]),
        EmbeddingBagConfig(name="t_other", num_embeddings=10, embedding_dim=4, feature_names=["g"]),
    ])  # fmt: skip
    if optimizer is not None:
        modular.fuse_optimizer(ebc, optimizer, lr=0.1)
    ranks = {DP: (), TW: (0,)}.get(kind, tuple(range(world)))
    placements = {
        "t_sum": TablePlacement(kind, ranks, cache_load_factor=0.1),
        "t_other": TablePlacement(ShardingType.DATA_PARALLEL),
    }
    modular.shard(ebc, ShardingPlan(world_size=world, modules={"": placements}), tier_dir=tier_dir)


RW, TW, DP, CW = (ShardingType.ROW_WISE, ShardingType.TABLE_WISE, ShardingType.DATA_PARALLEL,
                  ShardingType.COLUMN_WISE)  # fmt: skip


@pytest.mark.timeout(120)
@pytest.mark.parametrize("with_dir, optimizer, kind, cols, says", [
    (False, "exact_sgd", RW, 8, r"tables t_sum on a tier .* pass modular\.shard\(\.\.\., tier_dir=DIR\)"),
    (True, None, RW, 8, r"tiered table 't_sum': .* trains with a fused optimizer: call modular\.fuse_optimizer"),
    (True, "lamb", CW, 8, r"tiered table 't_sum': its column pieces share whole rows' statistic under lamb, .*; plan it table-wise"),
    (True, "exact_sgd", TW, 6, r"tiered table 't_sum': .* shard width 6 is not a multiple of 4"),
    (True, "exact_sgd", DP, 8, r"tiered table 't_sum': a data-parallel table is a copy on every rank"),
    (True, "exact_rowwise_adagrad", CW, 8, r"tiered table 't_sum': its column pieces share whole rows' statistic"),
])  # fmt: skip
def test_tiered_plan_refused_on_every_rank(with_dir, optimizer, kind, cols, says, tmp_path):
    """What the tier cannot build yet is refused by `shard` on every rank, naming the table."""
    tier_dir = str(tmp_path / "tiers") if with_dir else None
    messages = expect_errors_on_all_ranks(2, _shard_tiered, tier_dir, optimizer, kind, cols, timeout=60)
    assert len(set(messages)) == 1, messages
    assert re.search(says, messages[0]), messages[0]


def _shard_into(tier_dir) -> None:
    _shard_tiered(tier_dir, "exact_sgd", RW)


@pytest.mark.timeout(120)
def test_unwritable_tier_dir_refused_on_every_rank(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    messages = expect_errors_on_all_ranks(2, _shard_into, str(blocker / "tiers"), timeout=60)
    assert all(re.search(r"tier_dir .*/file/tiers' cannot hold the tiered tables' files on rank \d", m) for m in messages), messages


def test_placement_cache_fields_round_trip():
    p = TablePlacement(ShardingType.TABLE_WISE, (1,), cache_load_factor=0.05, cache_policy="lfu")
    assert TablePlacement.from_dict(p.to_dict()) == p
    assert "cache_load_factor" not in TablePlacement(ShardingType.TABLE_WISE, (1,)).to_dict()
    with pytest.raises(modular.PlanError, match="cache_load_factor"):
        TablePlacement(ShardingType.TABLE_WISE, (1,), cache_load_factor=2.0)


def _shard_huge(tier_dir) -> None:
    world = dist.get_world_size()
    ebc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name="t_huge", num_embeddings=2**40, embedding_dim=8, feature_names=["f"]),
    ], device=torch.device("meta"))  # fmt: skip
    modular.fuse_optimizer(ebc, "exact_sgd", lr=0.1)
    placements = {"t_huge": TablePlacement(RW, tuple(range(world)), cache_load_factor=1e-6)}
    modular.shard(ebc, ShardingPlan(world_size=world, modules={"": placements}), tier_dir=tier_dir)


@pytest.mark.timeout(120)
def test_tier_dir_without_room_for_the_stores_refused_on_every_rank(tmp_path):
    """Files that would not fit the disk are refused before one is made (a full disk under a
    mapped file is a SIGBUS at the step that writes it), naming the directory and both sizes."""
    messages = expect_errors_on_all_ranks(2, _shard_huge, str(tmp_path), timeout=60)
    assert all(re.search(r"tier_dir .* on rank \d has [\d.]+ GiB free, and this rank's tiered shards "
                         r"\(t_huge\) need 16384\.0 GiB", m) for m in messages), messages
    assert not list(tmp_path.iterdir())
