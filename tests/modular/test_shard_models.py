"""`modular.shard` on whole models: nested EBCs next to a dense part, meta-device EBCs, and KJTs
whose features come in another order. Each compares against the unsharded model in the same rank
body (see tests/modular/ebc_cases.py).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import modular
from planners.types import ShardingPlan, ShardingType, TablePlacement
from tests.dist import run_on_ranks
from tests.modular.compare import close, gather_table, local_blocks
from tests.modular.ebc_cases import (
    BATCH, features_of, global_batch, make_batch, make_ebc, placements_for, plan_for, rank_batches, reorder,
    unweighted_tables,
)

TIMEOUT_S = 90


# -- two EBCs and a dense part ---------------------------------------------------------------------


def _output_dim(ebc: EmbeddingBagCollection) -> int:
    return sum(c.embedding_dim * len(c.feature_names) for c in ebc.embedding_bag_configs())


class _Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.sparse = nn.Module()
        self.sparse.ebc = make_ebc(False, seed=1)  # FQN "tower.sparse.ebc"
        self.mlp = nn.Linear(_output_dim(self.sparse.ebc), 4)


class _Model(nn.Module):
    """A planned EBC nested two levels down, a planned weighted EBC at the top, an EBC the plan
    leaves alone, and dense layers over all of their outputs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tower = _Tower()
        self.wide = make_ebc(True, seed=2)
        self.unplanned = EmbeddingBagCollection(tables=[dataclasses.replace(unweighted_tables()[1], name="u_t", feature_names=["u_f"])])
        self.head = nn.Linear(4 + _output_dim(self.wide) + _output_dim(self.unplanned), 1)

    def forward(self, deep: KeyedJaggedTensor, wide: KeyedJaggedTensor, extra: KeyedJaggedTensor) -> torch.Tensor:
        hidden = torch.relu(self.tower.mlp(self.tower.sparse.ebc(deep).values()))
        return self.head(torch.cat([hidden, self.wide(wide).values(), self.unplanned(extra).values()], dim=1))


def _model_batches(model: _Model, world: int, step: int) -> list[tuple[KeyedJaggedTensor, ...]]:
    deep = rank_batches(model.tower.sparse.ebc, world, step)
    wide = rank_batches(model.wide, world, step + 10)
    extra = [make_batch(model.unplanned, seed=100 * step + r) for r in range(world)]
    return list(zip(deep, wide, extra))


def _dense_names(model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_parameters() if not n.startswith(("tower.sparse.ebc.", "wide."))]


def _two_ebcs_and_dense() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = _Model()
    model = copy.deepcopy(ref)
    dense_before = {n: p for n, p in model.named_parameters() if n in _dense_names(model)}
    dense_values = {n: p.detach().clone() for n, p in dense_before.items()}
    unplanned = model.unplanned
    plan = ShardingPlan(
        world_size=world,
        modules={
            "tower.sparse.ebc": placements_for("mixed", model.tower.sparse.ebc, world),
            "wide": placements_for("row_wise", model.wide, world),
        },
    )
    if modular.shard(model, plan) is not model:
        raise AssertionError("shard(model, plan) did not return the model")

    # Only the planned EBCs changed; the dense part is the same parameters with the same values.
    sharded = dict(modular.sharded_modules(model))
    if sorted(sharded) != ["tower.sparse.ebc", "wide"]:
        raise AssertionError(f"sharded modules are {sorted(sharded)}")
    if model.unplanned is not unplanned or type(unplanned) is not EmbeddingBagCollection:
        raise AssertionError("the unplanned EBC was replaced")
    params = dict(model.named_parameters())
    for name, before in dense_before.items():
        if params[name] is not before:
            raise AssertionError(f"dense parameter {name} was replaced")
        close(params[name].detach(), dense_values[name], f"dense parameter {name} after shard")
    tables = {n for n, p in params.items() if n.startswith(("tower.sparse.ebc.", "wide."))}
    ignored = modular.ignored_params(model)
    if {id(p) for p in ignored} != {id(params[n]) for n in tables}:
        raise AssertionError("ignored_params is not exactly the planned EBCs' tables")
    local = {id(p) for p in modular.local_parameters(model)}
    if not {id(p) for n, p in params.items() if n not in tables} <= local:
        raise AssertionError("local_parameters lacks a dense or unplanned parameter")

    # Two training steps; the dense gradients are averaged by hand, as DDP would.
    ref_params = dict(ref.named_parameters())
    opt = torch.optim.SGD(modular.local_parameters(model), lr=0.3)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.3)
    mine = slice(rank * BATCH, (rank + 1) * BATCH)
    for step in range(2):
        batches = _model_batches(ref, world, step)
        out = model(*batches[rank])
        expected = ref(*(global_batch([b[i] for b in batches]) for i in range(3)))
        close(out, expected[mine], f"rank {rank}: step {step} model output")
        (out.square().sum()).backward()
        (expected.square().sum() / world).backward()
        for name in _dense_names(model):
            grad = params[name].grad
            dist.all_reduce(grad)
            grad.div_(world)
        for name, param in params.items():
            if name not in tables:
                close(param.grad, ref_params[name].grad, f"rank {rank}: step {step} grad of {name}")
                continue
            for tensor, rows, cols in local_blocks(param):
                close(tensor.grad, ref_params[name].grad[rows, cols], f"rank {rank}: step {step} grad of {name}")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for i, (name, param) in enumerate(params.items()):
        full = gather_table(param, dst=i % world) if isinstance(param, ShardedTensor) else param.detach()
        if full is not None:
            close(full, ref_params[name].detach(), f"rank {rank}: {name} after 2 steps")
    return {
        "parameter_names": list(params),
        "state_dict_keys": list(model.state_dict()),
        "ref_parameter_names": list(ref_params),
        "ref_state_dict_keys": list(ref.state_dict()),
    }


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_two_ebcs_one_nested_next_to_a_dense_part(world_size: int) -> None:
    results = run_on_ranks(world_size, _two_ebcs_and_dense, timeout=TIMEOUT_S)
    for rank, r in enumerate(results):
        assert r["parameter_names"] == r["ref_parameter_names"] == results[0]["parameter_names"], rank
        assert r["state_dict_keys"] == r["ref_state_dict_keys"] == results[0]["state_dict_keys"], rank
    names = results[0]["parameter_names"]
    assert "tower.sparse.ebc.embedding_bags.t_sum.weight" in names and "wide.embedding_bags.w_x.weight" in names
    assert "unplanned.embedding_bags.u_t.weight" in names and "tower.mlp.weight" in names


# -- meta device -----------------------------------------------------------------------------------

LOW, HIGH = 0.25, 0.75  # 't_sum' init bounds; the other tables keep torchrec's +-sqrt(1/rows)


def _meta_tables() -> list:
    tables = unweighted_tables()
    tables[0] = dataclasses.replace(tables[0], weight_init_min=LOW, weight_init_max=HIGH, init_fn=None)
    return tables


def _meta_ebc() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234 + rank)  # data-parallel copies must agree even when the ranks' RNGs do not
    tables = _meta_tables()
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    placements = placements_for("mixed", ebc, world)
    placements["t_small"] = TablePlacement(ShardingType.DATA_PARALLEL)
    modular.shard(ebc, ShardingPlan(world_size=world, modules={"": placements}))
    copies, full = {}, {}
    for i, ((name, param), cfg) in enumerate(zip(ebc.named_parameters(), tables)):
        low, high = cfg.get_weight_init_min(), cfg.get_weight_init_max()
        for tensor, rows, cols in local_blocks(param):
            block = tensor.detach()
            if block.is_meta or block.numel() == 0:
                raise AssertionError(f"rank {rank}: {name}[{rows}, {cols}] is {block}")
            if not bool(((block >= low) & (block <= high) & (block != 0)).all()):
                raise AssertionError(f"rank {rank}: {name}[{rows}, {cols}] has values outside [{low}, {high}] or zeros: {block}")
            if float(block.std()) < (high - low) / 10:
                raise AssertionError(f"rank {rank}: {name}[{rows}, {cols}] is not spread over its init range: {block}")
        if not isinstance(param, ShardedTensor):
            copies[name] = param.detach().clone()
        table = gather_table(param, dst=0)
        if rank == 0:
            full[name] = table
    # The sharded model computes what an unsharded EBC holding the gathered tables computes.
    objects = [full]
    dist.broadcast_object_list(objects, src=0)
    ref = EmbeddingBagCollection(tables=unweighted_tables())
    ref.load_state_dict(objects[0])
    batches = rank_batches(ref, world, step=0)
    with torch.no_grad():  # inference: no rank runs a backward
        out = ebc(batches[rank]).values()
    close(out, ref(global_batch(batches)).values()[rank * BATCH : (rank + 1) * BATCH], f"rank {rank}: forward of the meta-initialised EBC")
    return copies


def _meta_shard_values() -> dict[str, list[float]]:
    torch.manual_seed(1234)  # the same seed on every rank, as SPMD training scripts do
    ebc = EmbeddingBagCollection(tables=unweighted_tables(), device=torch.device("meta"))
    modular.shard(ebc, plan_for("row_wise", ebc, dist.get_world_size()))
    return {
        name: [v for tensor, _, _ in local_blocks(param) for v in tensor.detach().flatten().tolist()]
        for name, param in ebc.named_parameters()
    }


@pytest.mark.timeout(120)
def test_meta_shards_on_different_ranks_are_drawn_independently() -> None:
    # Ranks seeded alike must not draw one stream for every shard (Note [shard init]).
    values = run_on_ranks(2, _meta_shard_values, timeout=TIMEOUT_S)
    for name in values[0]:
        assert len(values[0][name]) > 10 and len(values[1][name]) > 10, name
        shared = set(values[0][name]) & set(values[1][name])
        assert not shared, f"{name}: ranks 0 and 1 hold {len(shared)} identical initial values"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_meta_device_ebc_is_initialised_on_each_rank(world_size: int) -> None:
    copies = run_on_ranks(world_size, _meta_ebc, timeout=TIMEOUT_S)
    data_parallel = ["embedding_bags.t_small.weight"]
    for rank in range(world_size):
        assert list(copies[rank]) == data_parallel
        for name in data_parallel:
            torch.testing.assert_close(copies[rank][name], copies[0][name], atol=0, rtol=0)


# -- KJT feature order -----------------------------------------------------------------------------


def _features_in_another_order(case: str) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    checked = 0
    for weighted in (False, True):
        ref = make_ebc(weighted)
        ebc = modular.shard(copy.deepcopy(ref), plan_for(case, ref, world))
        keys = features_of(ref)
        orders = [keys[::-1], keys[1:] + keys[:1], keys]  # each rank its own order
        for step in range(2):
            batches = rank_batches(ref, world, step)
            mine = reorder(batches[rank], orders[(rank + step) % len(orders)])
            if step == 0 and rank == 0 and mine.keys() == keys:
                raise AssertionError("rank 0 should see a reordered batch at step 0")
            out = ebc(mine)
            expected = ref(global_batch(batches))
            if out.keys() != expected.keys():
                raise AssertionError(f"rank {rank}: output keys {out.keys()}, expected {expected.keys()}")
            close(out.values(), expected.values()[rank * BATCH : (rank + 1) * BATCH], f"rank {rank}: features in order {mine.keys()}")
            out.values().sum().backward()
            checked += 1
    return checked


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["mixed", "data_parallel"])
def test_kjt_features_in_another_order(case: str) -> None:
    assert run_on_ranks(3, _features_in_another_order, case, timeout=TIMEOUT_S) == [4, 4, 4]


# -- a process group that is not the world ---------------------------------------------------------

GROUP = [1, 2]  # of a world of 3: group rank 0 is global rank 1


def _shard_over_a_subgroup() -> str:
    group = dist.new_group(ranks=GROUP)
    if dist.get_rank() not in GROUP:
        with pytest.raises(modular.ShardingError, match=r"rank 0 is not in the process group given to modular\.shard"):
            modular.shard(make_ebc(False), plan_for("mixed", make_ebc(False), len(GROUP)), process_group=group)
        return "not in the group"
    rank, world = dist.get_rank(group), len(GROUP)
    for weighted in (False, True):
        ref = make_ebc(weighted)
        ebc = modular.shard(copy.deepcopy(ref), plan_for("mixed", ref, world), process_group=group)
        ref_params = dict(ref.named_parameters())
        batches = rank_batches(ref, world, step=1)
        out = ebc(batches[rank]).values()
        expected = ref(global_batch(batches)).values()
        close(out, expected[rank * BATCH : (rank + 1) * BATCH], f"group rank {rank}: forward")
        out.sum().backward()
        (expected.sum() / world).backward()
        for name, param in ebc.named_parameters():
            for tensor, rows, cols in local_blocks(param):
                close(tensor.grad, ref_params[name].grad[rows, cols], f"group rank {rank}: grad of {name}")
        # Export to global rank 2 (group rank 1): shards travel between global ranks.
        full = modular.checkpoint.export(ebc, rank=GROUP[1])
        if dist.get_rank() == GROUP[1]:
            want = ref.state_dict()
            assert full.keys() == want.keys()
            for key, value in want.items():
                torch.testing.assert_close(full[key], value, atol=0, rtol=0, msg=key)
        else:
            assert full is None
    return "checked"


@pytest.mark.timeout(120)
def test_shard_over_a_subgroup() -> None:
    # ShardedTensor placements name global ranks, not ranks of the group.
    assert run_on_ranks(3, _shard_over_a_subgroup, timeout=TIMEOUT_S) == ["not in the group", "checked", "checked"]
