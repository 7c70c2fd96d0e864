"""Issue 48: a seeded fuzz of faults one or every rank hits, at world 2.

`make_cases(seed, n)` draws malformed batches (a tensor that is not 1-D, a wrong dtype, a negative
length, too few ids; on one rank or on every rank, EBC or weighted EBC), options that differ
between the ranks (`CASES` of test_fail_together_options.py; reshard's, prefetch's and load's of
test_fail_together_calls.py) and checkpoint faults; every case
must raise the same error class on every rank, in bounded time, with the model and optimizer
state bit-for-bit unchanged (each body checks it). The suite runs a few seeds' worth; a longer
sweep: `python scripts/fault_fuzz.py --cases 200 --seed 1`.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.distributed as dist
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import modular
from tests.dist import run_on_ranks
from tests.faults.state import rejected
from tests.faults.test_fail_together import two_d
from tests.faults.test_fail_together_calls import (
    LOAD, PREFETCH, _load_with_other_options, _prefetch_with_other_modules,
    _reshard_after_weight_decay_on_one_rank,
)
from tests.faults.test_fail_together_options import CASES as OPTION_CASES, _shard_with_other_options
from tests.faults.test_fail_together_saves import _save_fails
from tests.modular.ebc_cases import CASES as PLANS, make_batch, make_ebc, plan_for

TIMEOUT_S = 90
FAST_S = 10.0  # far below the pool's collective timeout (60 s): a rank that waited for it fails
BATCH_FAULTS = ("values_2d", "lengths_2d", "weights_2d", "float_ids", "negative_length", "too_few_ids")
EXPECTED = {"batch": "InputError", "options": "ShardingError", "checkpoint": "CheckpointError"}
# The other calls' options (test_fail_together_calls.py): fault -> (body, its argument, error class)
CALLS = {
    "reshard_weight_decay": (_reshard_after_weight_decay_on_one_rank, None, "ShardingError"),
    **{f"prefetch_{c}": (_prefetch_with_other_modules, c, "ShardingError") for c in PREFETCH},
    **{f"load_{c}": (_load_with_other_options, c, "CheckpointError") for c in LOAD},
}


def make_cases(seed: int, n: int) -> list[dict]:
    """`n` cases drawn from `seed`: mostly batches (cheap), some options and checkpoints."""
    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        kind = rng.choices(["batch", "options", "checkpoint", "call"], weights=[6, 2, 1, 2])[0]
        if kind == "batch":
            fault = rng.choice(BATCH_FAULTS)
            cases.append({
                "kind": kind, "fault": fault, "plan": rng.choice(PLANS),
                "ranks": rng.choice([[0], [1], [0, 1]]), "seed": rng.randrange(1000),
                "weighted": fault == "weights_2d" or rng.random() < 0.3,
            })  # fmt: skip
        elif kind == "options":
            cases.append({"kind": kind, "fault": rng.choice(sorted(OPTION_CASES))})
        elif kind == "call":
            cases.append({"kind": kind, "fault": rng.choice(sorted(CALLS))})
        else:
            cases.append({"kind": kind, "fault": rng.choice(["under_a_file", "hash_fails"])})
    return cases


def _corrupt(kjt: KeyedJaggedTensor, fault: str) -> KeyedJaggedTensor:
    if fault.endswith("_2d"):
        return two_d(kjt, fault[: -len("_2d")])
    values, lengths, weights = kjt.values(), kjt.lengths().clone(), kjt.weights_or_none()
    if fault == "float_ids":
        values = values.float()
    elif fault == "negative_length":
        lengths[0] = -1
    elif fault == "too_few_ids":
        lengths[-1] += 3
    return KeyedJaggedTensor(keys=kjt.keys(), values=values, lengths=lengths, weights=weights)


def _bad_batch(case: dict) -> tuple[str, str, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = make_ebc(case["weighted"])
    ebc = modular.shard(copy.deepcopy(ref), plan_for(case["plan"], ref, world))
    opt = torch.optim.Adagrad(modular.local_parameters(ebc), lr=0.1)
    ebc(make_batch(ref, seed=case["seed"] + rank)).values().pow(2).sum().backward()
    opt.step()
    batch = make_batch(ref, seed=case["seed"] + 7 + rank)
    if rank in case["ranks"]:
        batch = _corrupt(batch, case["fault"])
    return rejected(ebc, opt, batch, f"rank {rank}: {case}")


def run_case(case: dict) -> list[tuple[str, str, float]]:
    """Runs `case` on a pooled world of 2; each rank's (error class, message, seconds)."""
    if case["kind"] == "batch":
        return run_on_ranks(2, _bad_batch, case, timeout=TIMEOUT_S)
    if case["kind"] == "options":
        sharding = "column_wise" if case["fault"] == "column_wise_statistic" else "mixed"
        return run_on_ranks(2, _shard_with_other_options, case["fault"], sharding, timeout=TIMEOUT_S)
    if case["kind"] == "call":
        body, arg, _ = CALLS[case["fault"]]
        args = () if arg is None else (arg,)
        return [got[:3] for got in run_on_ranks(2, body, *args, timeout=TIMEOUT_S)]
    return [got[:3] for got in run_on_ranks(2, _save_fails, case["fault"], timeout=TIMEOUT_S)]


def check_case(case: dict, got: list[tuple[str, str, float]]) -> None:
    for rank, (kind, message, seconds) in enumerate(got):
        expected = CALLS[case["fault"]][2] if case["kind"] == "call" else EXPECTED[case["kind"]]
        assert kind == expected, (case, rank, kind, message)
        assert seconds < FAST_S, (case, rank, seconds, message)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed", [0, 1])
def test_fuzzed_faults_fail_together(seed: int) -> None:
    for case in make_cases(seed, 4):
        check_case(case, run_case(case))
