"""A sharded EmbeddingCollection computes what the unsharded one does on the global batch.

One rank body per (world size, case) runs a model of two EmbeddingCollections of different dims
and an EBC (tests/modular/sequence_cases.py) for 3 SGD steps, with empty sequences, a rank with
no ids at all, a table shared by two features and a feature feeding two tables, and compares the
outputs (keys, order, values, lengths), every local gradient and the weights after the steps with
the unsharded model on the global batch (the loss averaged over ranks).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import modular
from tests.dist import run_on_ranks
from tests.modular.compare import close, local_blocks
from tests.modular.ebc_cases import CASES
from tests.modular.sequence_cases import (
    seq_global_batch as global_batch, make_seq_model as make_model, seq_plan_for as plan_for,
    seq_rank_batches as rank_batches,
)

STEPS = 3
LR = 0.5


def _loss(outputs, targets, rows_of) -> torch.Tensor:
    """A loss that weighs every output element differently: sum of values x target."""
    seq_a, seq_b, bags = outputs
    total = (bags.values() * targets["bags"][rows_of("bags", None)]).sum()
    for name, out in (("seq_a", seq_a), ("seq_b", seq_b)):
        for key, jt in out.items():
            total = total + (jt.values() * targets[key][rows_of(name, key)]).sum()
    return total


def _parity(case: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    label = f"{case}, rank {rank}/{world}"
    ref = make_model()
    model = copy.deepcopy(ref)
    if modular.shard(model, plan_for(case, world)) is not model:
        raise AssertionError(f"{label}: shard did not return the model")
    for name in ("seq_a", "seq_b"):
        if not isinstance(getattr(model, name), modular.ShardedEmbeddingCollection):
            raise AssertionError(f"{label}: {name} is a {type(getattr(model, name)).__name__}")
    ref_params = dict(ref.named_parameters())
    opt = torch.optim.SGD(modular.local_parameters(model), lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    max_error, compared = 0.0, 0
    for step in range(STEPS):
        batches = rank_batches(world, step)
        mine = batches[rank]
        out = model(mine["seq_a"], mine["seq_b"], mine["bags"])
        whole = {m: global_batch([b[m] for b in batches]) for m in mine}
        expected = ref(whole["seq_a"], whole["seq_b"], whole["bags"])

        def rows_of(module: str, key, local: bool = True):
            """This rank's rows of output `key` of `module` in the global output."""
            if key is None:
                return slice(rank * 3, (rank + 1) * 3) if local else slice(None)
            feature = key.split("@")[0]
            before = sum(int(b[module][feature].lengths().sum()) for b in batches[:rank])
            n = int(mine[module][feature].lengths().sum())
            return slice(before, before + n) if local else slice(None)

        for name, got, want in (("seq_a", out[0], expected[0]), ("seq_b", out[1], expected[1])):
            if list(got) != list(want):
                raise AssertionError(f"{label}: {name} keys {list(got)}, expected {list(want)}")
            for key in want:
                what = f"{label}: step {step} {name}[{key!r}]"
                if not torch.equal(got[key].lengths(), mine[name][key.split('@')[0]].lengths()):
                    raise AssertionError(f"{what}: lengths {got[key].lengths()}")
                max_error = max(max_error, close(got[key].values(), want[key].values()[rows_of(name, key)], what))
                compared += 1
        g = torch.Generator().manual_seed(step)
        targets = {"bags": torch.randn(expected[2].values().shape, generator=g)}
        for exp in expected[:2]:
            for key, jt in exp.items():
                targets[key] = torch.randn(jt.values().shape, generator=g)
        _loss(out, targets, rows_of).backward()
        (_loss(expected, targets, lambda m, k: rows_of(m, k, local=False)) / world).backward()
        for name, param in model.named_parameters():
            for tensor, rows, cols in local_blocks(param):
                what = f"{label}: step {step} grad of {name}[{rows.start}:{rows.stop}, {cols.start}:{cols.stop}]"
                max_error = max(max_error, close(tensor.grad, ref_params[name].grad[rows, cols], what))
                compared += 1
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    for name, param in model.named_parameters():
        for tensor, rows, cols in local_blocks(param):
            what = f"{label}: {name}[{rows.start}:{rows.stop}, {cols.start}:{cols.stop}] after {STEPS} steps"
            max_error = max(max_error, close(tensor.detach(), ref_params[name].detach()[rows, cols], what))
            compared += 1
    return {
        "keys": list(model.state_dict()),
        "ref_keys": list(ref.state_dict()),
        "max_error": max_error,
        "compared": compared,
    }


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_sharded_ec_matches_unsharded(world_size: int) -> None:
    for case in CASES:
        results = run_on_ranks(world_size, _parity, case, timeout=120)
        for rank, r in enumerate(results):
            assert r["keys"] == r["ref_keys"], f"{case}: rank {rank}"
            assert r["max_error"] <= 1e-5
            assert r["compared"] > 3 * 7, f"{case}: rank {rank} compared only {r['compared']}"
