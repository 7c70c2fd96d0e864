"""Receive buffers kept across steps (Note [kept receive buffers]) are reused only when nothing
else holds them: an output or gradient a caller keeps is never overwritten by a later step."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import modular
from modular.comm import KeptBuffers
from planners.types import ShardingPlan, ShardingType, TablePlacement
from tests.dist import run_on_ranks
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from tests.modular.compare import close
from tests.modular.ebc_cases import BATCH, global_batch, make_ebc, plan_for, rank_batches, unweighted_tables


def test_a_buffer_is_handed_out_again_only_once_released() -> None:
    buffers = KeptBuffers()
    like = torch.zeros(1, dtype=torch.int64)
    first = buffers.empty("ids", 100, like)
    held = buffers.empty("ids", 100, like)  # `first` is still alive: a new buffer
    assert first.untyped_storage().data_ptr() != held.untyped_storage().data_ptr()
    ptr = held.untyped_storage().data_ptr()
    del first, held
    again = buffers.empty("ids", 90, like)  # released, and large enough: the kept one
    assert again.untyped_storage().data_ptr() == ptr and again.numel() == 90
    view = again[10:20]
    del again
    assert buffers.empty("ids", 90, like).untyped_storage().data_ptr() != ptr  # a view holds it
    del view
    assert buffers.empty("ids", 90, like.float()).dtype == torch.float32  # dtype is respected


def _keep_outputs(case: str) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = make_ebc(False)
    if case == "all_on_last_rank":  # one source, columns in order: the output is the buffer
        torch.manual_seed(0)
        ref = EmbeddingBagCollection(tables=unweighted_tables()[:1])
    ebc = copy.deepcopy(ref)
    if case == "all_on_last_rank":
        names = [c.name for c in ebc.embedding_bag_configs()]
        plan = ShardingPlan(world_size=world, modules={"": {
            n: TablePlacement(ShardingType.TABLE_WISE, ranks=(world - 1,)) for n in names}})
    else:
        plan = plan_for(case, ebc, world)
    modular.shard(ebc, plan)
    if case == "all_on_last_rank":
        assert ebc._sharded.part.arrival._map(BATCH)[2], "expected the output to alias the receive buffer"
    kept, grads = [], []
    for step in range(3):
        batches = rank_batches(ref, world, step)
        out = ebc(batches[rank]).values()
        out.register_hook(lambda g: grads.append((g, g.clone())))
        out.sum().backward()
        kept.append((out, out.detach().clone(), ref(global_batch(batches)).values()))
    mine = slice(rank * BATCH, (rank + 1) * BATCH)
    for step, (out, copy_, expected) in enumerate(kept):
        assert torch.equal(out, copy_), f"{case}: step {step}'s output was overwritten"
        close(out, expected[mine], f"{case}: step {step}'s output")
    for g, copy_ in grads:
        assert torch.equal(g, copy_), f"{case}: a kept gradient was overwritten"
    return len(kept)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["all_on_last_rank", "table_wise", "row_wise", "mixed"])
def test_outputs_a_caller_keeps_are_never_overwritten(case: str) -> None:
    assert run_on_ranks(2, _keep_outputs, case, timeout=100) == [3, 3]
