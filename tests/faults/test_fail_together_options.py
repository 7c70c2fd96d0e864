"""Issue 48, options: `shard` agrees on every option that changes what a collective does.

Two ranks that shard the same plan with another tensor type, fused optimizer kind, fused on one
rank only, another column-wise statistic or comm dtype raise `ShardingError` on every rank at once,
naming the option, the ranks and their values, before any shard is built: the model and its state
are bit-for-bit what they were (Note [agreeing on options] in modular/agreed_options.py).
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
import torch.distributed as dist
from torchrec.modules.embedding_modules import EmbeddingBagCollection

import modular
from tests.dist import run_on_ranks
from tests.faults.helpers import VICTIM
from tests.faults.state import assert_unchanged, snapshot
from tests.modular.ebc_cases import make_ebc, plan_for, unweighted_tables

TIMEOUT_S = 90
FAST_S = 10.0  # far below the pool's collective timeout (60 s)


def wide_ebc() -> EmbeddingBagCollection:
    """The EBC cases' tables at a width fbgemm's fused kernels take."""
    torch.manual_seed(0)
    return EmbeddingBagCollection(tables=[dataclasses.replace(c, embedding_dim=8) for c in unweighted_tables()])


# option -> (rank VICTIM's call, the other ranks' call, the named option, VICTIM's value, the others')
# A call: (fuse_optimizer kwargs or None, shard kwargs).
ROW = {"optimizer": "exact_rowwise_adagrad", "lr": 0.1}
CASES = {
    "tensor_type": ((None, {"tensor_type": "dtensor"}), (None, {}), "tensor_type", "dtensor", "sharded_tensor"),
    "fused_kind": (({**ROW}, {}), ({"optimizer": "exact_sgd", "lr": 0.1}, {}), "fused optimizer of module ''", "exact_rowwise_adagrad", "exact_sgd"),
    "fused_one_rank": (({**ROW}, {}), (None, {}), "fused optimizer of module ''", "exact_rowwise_adagrad", "none (not fused)"),
    "weight_decay": (({**ROW, "weight_decay": 0.01}, {}), ({**ROW}, {}), "fused hyper-parameters set of module ''", "eps, lr, weight_decay", "eps, lr"),
    "column_wise_statistic": (({**ROW, "column_wise_statistic": "per_shard"}, {}), ({**ROW}, {}), "column_wise_statistic of module ''", "per_shard", "exact"),
    "comm_dtype": ((None, {"comm_dtype": torch.float16}), (None, {}), "comm_dtype of module ''", "torch.float16", "None"),
    "output_dtype": ((None, {"output_dtype": torch.float16}), (None, {}), "output_dtype of module ''", "torch.float16", "torch.float32"),
}


def _shard_with_other_options(case: str, sharding: str) -> tuple[str, str, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    mine, others, *_ = CASES[case]
    fuse, options = mine if rank == VICTIM else others
    model = wide_ebc()
    if fuse is not None:
        fuse = dict(fuse)
        modular.fuse_optimizer(model, fuse.pop("optimizer"), **fuse)
    before = snapshot(model)
    start = time.monotonic()
    try:
        modular.shard(model, plan_for(sharding, make_ebc(False), world), **options)
    except Exception as e:  # the error under test
        got = (type(e).__name__, str(e), time.monotonic() - start)
    else:
        raise AssertionError(f"rank {rank}: {case} differed and shard returned")
    assert_unchanged(before, snapshot(model), f"rank {rank}")
    return got


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", sorted(CASES))
def test_options_that_differ_raise_sharding_error_on_every_rank_naming_them(case: str) -> None:
    *_, option, victim_value, other_value = CASES[case]
    sharding = "column_wise" if case == "column_wise_statistic" else "mixed"
    got = run_on_ranks(2, _shard_with_other_options, case, sharding, timeout=TIMEOUT_S)
    assert got[0][1] == got[1][1], got
    for rank, (kind, message, seconds) in enumerate(got):
        assert kind == "ShardingError" and seconds < FAST_S, (rank, kind, seconds, message)
        assert message.startswith("ranks disagree on options of modular.shard that change what its collectives do ("), message
        others = [r for r in range(2) if r != VICTIM]
        assert f"{option}: ranks [{VICTIM}] {victim_value!r}, ranks {others} {other_value!r}" in message or (
            f"{option}: ranks {others} {other_value!r}, ranks [{VICTIM}] {victim_value!r}" in message
        ), message
