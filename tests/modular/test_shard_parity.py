"""A sharded EBC computes what the unsharded one does on the global batch, for every sharding type.

One rank body per (world size, case) checks, for an unweighted EBC (SUM and MEAN tables, a table
shared by two features, a feature feeding two tables) and a weighted one, over 3 SGD steps with
empty bags: the forward output, every local gradient, the weights after the steps, `gather()` of
every table, and the state_dict / named_parameters keys. See tests/modular/ebc_cases.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import modular
from tests.dist import run_on_ranks
from tests.modular.compare import close, gather_table, local_blocks
from tests.modular.ebc_cases import BATCH, CASES, global_batch, make_ebc, plan_for, rank_batches

STEPS = 3
LR = 0.5


def _parity(case: str) -> dict[bool, dict]:
    rank, world = dist.get_rank(), dist.get_world_size()
    report = {}
    for weighted in (False, True):
        label = f"{case}, {'weighted' if weighted else 'unweighted'}, rank {rank}/{world}"
        ref = make_ebc(weighted)
        ebc = copy.deepcopy(ref)
        if modular.shard(ebc, plan_for(case, ebc, world)) is not ebc:
            raise AssertionError(f"{label}: shard(ebc, plan) did not return the EBC itself")
        if not isinstance(ebc, modular.ShardedEmbeddingBagCollection):
            raise AssertionError(f"{label}: the EBC is a {type(ebc).__name__} after sharding")
        ref_params = dict(ref.named_parameters())
        initial = {name: p.detach().clone() for name, p in ref_params.items()}
        local = modular.local_parameters(ebc)  # empty on a rank that holds no table
        opt = torch.optim.SGD(local, lr=LR) if local else None
        ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
        mine = slice(rank * BATCH, (rank + 1) * BATCH)
        max_error, compared = 0.0, 0
        for step in range(STEPS):
            batches = rank_batches(ref, world, step)
            out = ebc(batches[rank])
            expected = ref(global_batch(batches))
            if (out.keys(), out.length_per_key()) != (expected.keys(), expected.length_per_key()):
                raise AssertionError(
                    f"{label}: output keys {out.keys()} {out.length_per_key()}, expected "
                    f"{expected.keys()} {expected.length_per_key()}"
                )
            max_error = max(max_error, close(out.values(), expected.values()[mine], f"{label}: step {step} forward"))
            compared += 1
            target = torch.randn(expected.values().shape, generator=torch.Generator().manual_seed(step))
            (out.values() * target[mine]).sum().backward()
            ((expected.values() * target).sum() / world).backward()
            for name, param in ebc.named_parameters():
                for tensor, rows, cols in local_blocks(param):
                    what = f"{label}: step {step} grad of {name}[{rows.start}:{rows.stop}, {cols.start}:{cols.stop}]"
                    max_error = max(max_error, close(tensor.grad, ref_params[name].grad[rows, cols], what))
                    compared += 1
            if opt is not None:
                opt.step()
                opt.zero_grad()
            ref_opt.step()
            ref_opt.zero_grad()

        shards, gathered = {}, []
        for i, (name, param) in enumerate(ebc.named_parameters()):
            blocks = local_blocks(param)
            for tensor, rows, cols in blocks:
                what = f"{label}: {name}[{rows.start}:{rows.stop}, {cols.start}:{cols.stop}] after {STEPS} steps"
                max_error = max(max_error, close(tensor.detach(), ref_params[name].detach()[rows, cols], what))
                compared += 1
            shards[name] = sorted((r.start, r.stop, c.start, c.stop) for _, r, c in blocks)
            full = gather_table(param, dst=i % world)
            if full is not None:
                max_error = max(max_error, close(full, ref_params[name].detach(), f"{label}: gather() of {name}"))
                gathered.append(name)
        report[weighted] = {
            "state_dict_keys": list(ebc.state_dict()),
            "parameter_names": [name for name, _ in ebc.named_parameters()],
            "ref_state_dict_keys": list(ref.state_dict()),
            "shards": shards,
            "gathered": gathered,
            "max_error": max_error,
            "compared": compared,
            "moved": min(float((p.detach() - initial[n]).abs().max()) for n, p in ref_params.items()),
        }
    return report


def _expected_shards(case: str, weighted: bool, world: int) -> list[dict[str, list[tuple[int, int, int, int]]]]:
    """Per rank, the (row_start, row_stop, col_start, col_stop) blocks the plan puts there
    (data-parallel tables: one full copy on every rank)."""
    ebc = make_ebc(weighted, device=torch.device("meta"))
    plan = plan_for(case, ebc, world)
    per_rank: list[dict] = [{} for _ in range(world)]
    for cfg in ebc.embedding_bag_configs():
        name = f"embedding_bags.{cfg.name}.weight"
        for rank in range(world):
            per_rank[rank][name] = []
        placement = plan.placement("", cfg.name)
        specs = placement.shards(num_embeddings=cfg.num_embeddings, embedding_dim=cfg.embedding_dim, world_size=world)
        for s in specs:
            block = (s.row_offset, s.row_offset + s.num_rows, s.col_offset, s.col_offset + s.num_cols)
            per_rank[s.rank][name].append(block)
    for shards in per_rank:
        for name in shards:
            shards[name].sort()
    return per_rank


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_sharded_ebc_matches_unsharded(world_size: int, case: str) -> None:
    results = run_on_ranks(world_size, _parity, case, timeout=120)
    for weighted in (False, True):
        ref = make_ebc(weighted, device=torch.device("meta"))
        expected_keys = list(ref.state_dict())
        expected_names = [name for name, _ in ref.named_parameters()]
        expected_shards = _expected_shards(case, weighted, world_size)
        gathered = []
        for rank, by_type in enumerate(results):
            r = by_type[weighted]
            assert r["state_dict_keys"] == r["ref_state_dict_keys"] == expected_keys, f"rank {rank}"
            assert r["parameter_names"] == expected_names, f"rank {rank}"
            assert r["shards"] == expected_shards[rank], f"rank {rank} holds other shards than the plan says"
            assert r["max_error"] <= 1e-5
            # forward per step, a grad per local block per step, each block's weights, gathers
            blocks = sum(len(b) for b in r["shards"].values())
            assert r["compared"] == STEPS + STEPS * blocks + blocks
            assert r["moved"] > 1e-3  # every table trained, so comparing weights means something
            gathered += r["gathered"]
        assert sorted(gathered) == sorted(expected_names)
