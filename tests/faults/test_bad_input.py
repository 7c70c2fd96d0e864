"""Bad batches the id/feature/weight tests of tests/modular/test_shard_errors.py do not cover.

One rank feeds a batch with a wrong dtype, lengths that disagree with the values, weights that
disagree with the ids or require grad on it only, or no samples at all, in module order or with its features
shuffled (the shuffle runs fbgemm's permutation, which trusts lengths and values: before the
structure check it corrupted the heap).
That rank gets the detailed error, its peers an error naming it, and the next good batch is right.
"""

from __future__ import annotations

import copy
import dataclasses
import re

import pytest
import torch
import torch.distributed as dist
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import modular
from tests.dist import run_on_ranks
from tests.faults.helpers import VICTIM
from tests.modular.compare import close
from tests.modular.ebc_cases import (
    BATCH, CASES, global_batch, make_batch, make_ebc, plan_for, rank_batches, weighted_tables,
)

TIMEOUT_S = 60


def _corrupt(kjt: KeyedJaggedTensor, problem: str, shuffled: bool) -> KeyedJaggedTensor:
    if shuffled:  # same ids, features in reverse order
        kjt = KeyedJaggedTensor.from_jt_dict({k: kjt[k] for k in reversed(kjt.keys())})
    values, lengths, weights = kjt.values(), kjt.lengths().clone(), kjt.weights_or_none()
    if problem == "float_ids":
        values = values.float()
    elif problem == "int16_ids":
        values = values.short()
    elif problem == "float64_weights":
        weights = weights.double()
    elif problem == "too_few_ids":  # the last 2 ids are gone, their lengths are not
        values = values[:-2]
        weights = None if weights is None else weights[:-2]
    elif problem == "too_many_lengths":
        lengths[-1] += 1000
    elif problem == "negative_length":  # 'f_c' sample 1 (unshuffled: bag 2 * BATCH + 1)
        lengths[kjt.keys().index("f_c") * BATCH + 1] = -1
    elif problem == "too_few_weights":
        weights = weights[:-1]
    elif problem == "ids_on_meta":  # another device than the module's (no GPU here)
        values = values.to("meta")
    elif problem == "weights_on_meta":  # ids and lengths right, weights elsewhere
        weights = weights.to("meta")
    elif problem == "weights_require_grad":  # as when a dense layer computes them
        weights = weights.detach().clone().requires_grad_()
    else:
        raise ValueError(problem)
    return KeyedJaggedTensor(keys=kjt.keys(), values=values, lengths=lengths, weights=weights)


def _bad_batch(problem: str, shuffled: bool) -> str:
    rank, world = dist.get_rank(), dist.get_world_size()
    weighted = "weights" in problem
    ref = make_ebc(weighted)
    ebc = modular.shard(copy.deepcopy(ref), plan_for("mixed", ref, world))
    batch = make_batch(ref, seed=rank, empty=False)
    if rank == VICTIM:
        batch = _corrupt(batch, problem, shuffled)
    try:
        ebc(batch)
    except modular.InputError as e:
        message = str(e)
    else:
        raise AssertionError(f"rank {rank}: a batch with {problem} on rank {VICTIM} was accepted")
    batches = rank_batches(ref, world, step=1)
    got = ebc(batches[rank]).values()
    close(got, ref(global_batch(batches)).values()[rank * BATCH : (rank + 1) * BATCH], f"rank {rank}: the next good batch")
    return message


# Note [learned per-sample weights]: weights that require grad on some ranks only
LEARNABLE_WEIGHTS = (
    r"per-sample weights for module '' require grad on ranks \[1\] but not on ranks \[0\]: in a "
    r"step, every rank's weights must require grad \(learned, e.g. by a PositionWeightedModule\) "
    r"or none's \(pass weights\.detach\(\) on every rank\)"
)
# problem -> (the victim's message, what its peers are told)
OWN_AND_PEER = {
    "float_ids": (r"ids and lengths for module '' must be int32 or int64, got values torch\.float32 and lengths torch\.int64", "a wrong dtype"),
    "int16_ids": (r"must be int32 or int64, got values torch\.int16", "a wrong dtype"),
    "float64_weights": (r"per-sample weights for module '' are torch\.float64, but its tables take per-sample weights in torch\.float32 \(float32, or", "a wrong dtype"),
    "too_few_ids": (r"module '': lengths sum to (\d+) but there are (\d+) ids; lengths must count the ids of each bag", "lengths that do not match the values"),
    "too_many_lengths": (r"module '': lengths sum to \d+ but there are \d+ ids", "lengths that do not match the values"),
    "negative_length": (r"feature 'f_c' \(table 't_mean'\) of module '' has length -1 for sample 1; lengths must count the ids of each bag", "lengths that do not match the values in feature 'f_c'"),
    "ids_on_meta": (r"module '' is on cpu but its ids are on meta and its lengths on cpu; move the batch with kjt\.to\('cpu'\)", "a batch on another device than the module"),
    "weights_on_meta": (r"module '' is on cpu but its ids are on cpu and its lengths on cpu, its per-sample weights on meta; move the batch", "a batch on another device than the module"),
    "too_few_weights": (r"module '': (\d+) per-sample weights for (\d+) ids; a batch with weights needs one weight per id", "bad per-sample weights"),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shuffled", [False, True], ids=["in_order", "shuffled"])
@pytest.mark.parametrize("problem", sorted(OWN_AND_PEER))
def test_bad_batch_on_one_rank_names_the_problem_there_and_stops_its_peers(problem: str, shuffled: bool) -> None:
    messages = run_on_ranks(3, _bad_batch, problem, shuffled, timeout=TIMEOUT_S)
    own, peer = OWN_AND_PEER[problem]
    match = re.search(own, messages[VICTIM])
    assert match, messages[VICTIM]
    if problem in ("too_few_ids", "too_few_weights"):
        assert int(match.group(1)) != int(match.group(2)), messages[VICTIM]
    for rank, message in enumerate(messages):
        if rank != VICTIM:
            assert message.startswith(f"rank {VICTIM} rejected its batch for module '' ({peer}"), message


def _learnable_weights_under_every_plan() -> dict[str, str]:
    """Weights that require grad on rank VICTIM only, under every sharding type, with dense
    kernels and fused ones (fbgemm's, at width 8): the forward raises on every rank from input
    dist, so no lookup ran, and the next good batch is right. (Weights that require grad on
    every rank train: tests/modular/pooled/test_learned_weights.py.)"""
    rank, world = dist.get_rank(), dist.get_world_size()
    messages = {}
    for kernel in ("dense", "fused"):
        ref = make_ebc(True)
        if kernel == "fused":  # the same tables at a width fbgemm's fused kernel takes
            torch.manual_seed(0)
            tables = [dataclasses.replace(c, embedding_dim=8) for c in weighted_tables()]
            ref = EmbeddingBagCollection(tables=tables, is_weighted=True)
        for case in CASES:
            ebc = copy.deepcopy(ref)
            if kernel == "fused":  # before shard (Note [order of sharding calls])
                modular.fuse_optimizer(ebc, "exact_sgd", lr=0.1)
            modular.shard(ebc, plan_for(case, ref, world))
            batch = make_batch(ref, seed=rank)
            if rank == VICTIM:
                batch = _corrupt(batch, "weights_require_grad", shuffled=False)
            try:
                ebc(batch)
            except modular.InputError as e:
                messages[f"{case}, {kernel}"] = str(e)
            else:
                raise AssertionError(f"rank {rank}: {case}, {kernel}: learnable weights on rank {VICTIM} were accepted")
            batches = rank_batches(ref, world, step=1)
            mine = slice(rank * BATCH, (rank + 1) * BATCH)
            close(ebc(batches[rank]).values(), ref(global_batch(batches)).values()[mine], f"rank {rank}: {case}, {kernel}: the next good batch")
    return messages


@pytest.mark.timeout(120)
def test_weights_that_require_grad_on_one_rank_only_are_refused_on_every_rank_under_every_plan_and_kernel() -> None:
    # Their gradients would travel in a collective of backward that the other rank never runs.
    messages = run_on_ranks(2, _learnable_weights_under_every_plan, timeout=TIMEOUT_S)
    for rank in range(2):
        assert len(messages[rank]) == 2 * len(CASES), messages[rank]
        for where, message in messages[rank].items():
            assert re.fullmatch(LEARNABLE_WEIGHTS, message), (rank, where, message)
