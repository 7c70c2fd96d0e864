"""`modular.shard` on EmbeddingCollections: bad batches refused on every rank before any kernel,
plans naming modules that are not collections, and tables on the meta device."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import modular
from planners.types import ShardingPlan, ShardingType, TablePlacement
from tests.dist import expect_errors_on_all_ranks, run_on_ranks
from tests.modular.compare import close, gather_table, local_blocks
from tests.modular.sequence_cases import (
    seq_global_batch as global_batch, make_seq_model as make_model, seq_placements_for as placements_for,
    seq_plan_for as plan_for, seq_rank_batches as rank_batches, seq_a_tables,
)

TIMEOUT_S = 90
BAD_RANK = 1


def _bad_batch(problem: str, case: str) -> list[str]:
    """Rank BAD_RANK feeds a bad batch to seq_a; every rank's error, then a good step's check."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = make_model()
    model = modular.shard(copy.deepcopy(ref), plan_for(case, world))
    batch = rank_batches(world, step=1)[rank]["seq_a"]
    if rank == BAD_RANK:
        jts = batch.to_dict()
        if problem == "id_too_big":  # 'item' feeds s_big (29 rows) and s_mid (13 rows)
            jts["item"] = type(jts["item"])(values=torch.tensor([3, 13]), lengths=torch.tensor([0, 1, 1]))
        elif problem == "unknown_feature":
            jts["zzz"] = jts.pop("cat")
        batch = KeyedJaggedTensor.from_jt_dict(jts)
    try:
        model.seq_a(batch)
    except modular.InputError as e:
        message = str(e)
    else:
        raise AssertionError(f"rank {rank}: a bad batch ({problem} on rank {BAD_RANK}) did not raise")
    # Nothing is left half-sent: the next good batch gives the right answer on every rank.
    batches = rank_batches(world, step=2)
    got = model.seq_a(batches[rank]["seq_a"])
    want = ref.seq_a(global_batch([b["seq_a"] for b in batches]))
    before = sum(int(b["seq_a"]["hist"].lengths().sum()) for b in batches[:rank])
    n = int(batches[rank]["seq_a"]["hist"].lengths().sum())
    close(got["hist"].values(), want["hist"].values()[before : before + n], f"rank {rank}: good batch after a bad one")
    return message


@pytest.mark.timeout(120)
def test_bad_batches_raise_on_every_rank_naming_feature_and_table() -> None:
    for case in ("mixed", "data_parallel", "table_wise"):
        messages = run_on_ranks(3, _bad_batch, "id_too_big", case, timeout=TIMEOUT_S)
        assert "feature 'item' of module 'seq_a' has id 13, outside table 's_big', 's_mid' (valid ids are 0 to 12)" in messages[BAD_RANK], messages
        for rank, m in enumerate(messages):
            if rank != BAD_RANK:
                assert m.startswith(f"rank {BAD_RANK} rejected its batch for module 'seq_a' (ids out of range in feature 'item')"), m
    messages = run_on_ranks(2, _bad_batch, "unknown_feature", "row_wise", timeout=TIMEOUT_S)
    assert "feature 'cat' (table 's_small') is missing" in messages[BAD_RANK]
    assert "features ['zzz'] are not read by any table of this module" in messages[BAD_RANK]
    assert messages[0].startswith("rank 1 rejected its batch for module 'seq_a' (missing or repeated features")


def _plan_names_a_linear() -> None:
    model = make_model()
    model.seq_a = torch.nn.Linear(2, 2)
    modular.shard(model, plan_for("row_wise", dist.get_world_size()))


@pytest.mark.timeout(120)
def test_a_plan_naming_no_collection_lists_the_collections() -> None:
    messages = expect_errors_on_all_ranks(2, _plan_names_a_linear, timeout=TIMEOUT_S)
    for m in messages:
        assert "module 'seq_a', which is a Linear, not an EmbeddingBagCollection or EmbeddingCollection" in m, m
        assert "its EmbeddingCollections ['seq_b']" in m, m


LOW, HIGH = 0.25, 0.75


def _meta_ec() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234 + rank)  # data-parallel copies must agree even when the ranks' RNGs do not
    tables = [dataclasses.replace(t, init_fn=lambda w: torch.nn.init.uniform_(w, LOW, HIGH)) for t in seq_a_tables()]
    ec = EmbeddingCollection(tables=tables, device=torch.device("meta"))
    placements = placements_for("mixed", tables, world)
    placements["s_small"] = TablePlacement(ShardingType.DATA_PARALLEL)
    modular.shard(ec, ShardingPlan(world_size=world, modules={"": placements}))
    full = {}
    for i, (name, param) in enumerate(ec.named_parameters()):
        for tensor, rows, cols in local_blocks(param):
            block = tensor.detach()
            if block.is_meta or not bool(((block >= LOW) & (block <= HIGH)).all()) or float(block.std()) < 0.02:
                raise AssertionError(f"rank {rank}: {name}[{rows}, {cols}] is not drawn from its init_fn: {block}")
        table = gather_table(param, dst=0)
        if rank == 0:
            full[name] = table
    objects = [full]
    dist.broadcast_object_list(objects, src=0)
    ref = EmbeddingCollection(tables=seq_a_tables())
    ref.load_state_dict(objects[0])
    batches = [b["seq_a"] for b in rank_batches(world, step=0)]
    with torch.no_grad():
        got = ec(batches[rank])
    want = ref(global_batch(batches))
    for key in want:
        before = sum(int(b[key.split("@")[0]].lengths().sum()) for b in batches[:rank])
        n = int(batches[rank][key.split("@")[0]].lengths().sum())
        close(got[key].values(), want[key].values()[before : before + n], f"rank {rank}: {key} of the meta-initialised EC")
    if not any(isinstance(p, ShardedTensor) for p in ec.parameters()):
        raise AssertionError("no table was sharded")


@pytest.mark.timeout(120)
def test_meta_device_ec_is_initialised_on_each_rank() -> None:
    run_on_ranks(3, _meta_ec, timeout=TIMEOUT_S)


def _need_indices() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = EmbeddingCollection(tables=seq_a_tables(), need_indices=True)
    ec = modular.shard(copy.deepcopy(ref), ShardingPlan(world_size=world, modules={"": placements_for("mixed", seq_a_tables(), world)}))
    batch = rank_batches(world, step=1)[rank]["seq_a"]
    got, want = ec(batch), ref(batch)
    for key in want:
        if not torch.equal(got[key].weights(), want[key].weights()):
            raise AssertionError(f"rank {rank}: {key}: ids {got[key].weights()}, expected {want[key].weights()}")


@pytest.mark.timeout(120)
def test_need_indices_returns_each_features_ids_as_the_unsharded_ec_does() -> None:
    run_on_ranks(2, _need_indices, timeout=TIMEOUT_S)


def _load_unsharded_then_export() -> None:
    world = dist.get_world_size()
    model = modular.shard(make_model(), plan_for("mixed", world))
    other = make_model(seed=7)  # another model's weights, as a single-process state_dict
    modular.checkpoint.load_unsharded(model, other.state_dict())
    exported = modular.checkpoint.export(model)
    if dist.get_rank() == 0:
        expected = other.state_dict()
        if list(exported) != list(expected):
            raise AssertionError(f"export keys {list(exported)} != {list(expected)}")
        for key in expected:
            torch.testing.assert_close(exported[key], expected[key], atol=0, rtol=0, msg=lambda m: f"{key}: {m}")


@pytest.mark.timeout(120)
def test_load_unsharded_and_export_round_trip_through_every_placement() -> None:
    run_on_ranks(3, _load_unsharded_then_export, timeout=TIMEOUT_S)
