"""Fused optimizers on sharded EmbeddingCollections: 3 steps equal the unsharded model trained
with the torch equivalent, for every placement (dim-8 tables take fbgemm's fused kernel, whole or
in 4-column pieces with their row statistics exchanged; dim-5 ones and odd pieces the emulation;
data-parallel ones fbgemm's replay of the gathered batch), beside a fused EBC."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import modular
from tests.dist import run_on_ranks
from tests.modular.compare import close, local_blocks
from tests.modular.ebc_cases import CASES
from tests.modular.fused_reference import FUSED_EPS as EPS, FUSED_LR as LR, FusedReference
from tests.modular.sequence_cases import (
    seq_global_batch as global_batch, make_seq_model as make_model, seq_plan_for as plan_for,
    seq_rank_batches as rank_batches,
)

OPTIMIZERS = ("exact_sgd", "exact_adagrad", "exact_rowwise_adagrad")
STEPS = 3


def _seq_loss(rows: torch.Tensor) -> torch.Tensor:
    """A loss that weighs the elements of a sequence output differently."""
    pattern = 0.1 * (1 + torch.arange(rows.numel()).view_as(rows) % 3)
    return (rows * pattern).sum() + rows.square().sum()


def _rows_per_rank(batches, feature: str) -> list[slice]:
    """Each rank's rows of `feature`'s output in the global batch's output."""
    out, at = [], 0
    for b in batches:
        n = int(b[feature].lengths().sum())
        out.append(slice(at, at + n))
        at += n
    return out


def _train(case: str) -> dict[str, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    errors = {}
    for kind in OPTIMIZERS:
        label = f"{case}, {kind}, rank {rank}/{world}"
        ref = make_model()
        model = copy.deepcopy(ref)
        modular.fuse_optimizer(model, kind, lr=LR, eps=EPS)  # before shard: the one order
        modular.shard(model, plan_for(case, world))
        if modular.local_parameters(model):
            raise AssertionError(f"{label}: fused tables handed to a torch optimizer")
        reference = FusedReference(ref, kind)
        worst = 0.0
        for step in range(STEPS):
            batches = rank_batches(world, step)
            mine = batches[rank]
            whole = {m: global_batch([b[m] for b in batches]) for m in mine}
            out = model(mine["seq_a"], mine["seq_b"], mine["bags"])
            expected = ref(whole["seq_a"], whole["seq_b"], whole["bags"])
            # Each rank's loss on its own rows; the reference's is their mean over ranks.
            loss = out[2].values().square().sum()
            ref_loss = expected[2].values().square().sum() / world
            for name, got, want in (("seq_a", out[0], expected[0]), ("seq_b", out[1], expected[1])):
                for key in want:
                    rows = _rows_per_rank([b[name] for b in batches], key.split("@")[0])
                    worst = max(worst, close(got[key].values(), want[key].values()[rows[rank]], f"{label}: step {step} forward of {key}"))
                    loss = loss + _seq_loss(got[key].values())
                    ref_loss = ref_loss + sum(_seq_loss(want[key].values()[r]) for r in rows) / world
            loss.backward()
            ref_loss.backward()
            reference.step()
        params = dict(ref.named_parameters())
        for name, param in model.named_parameters():
            for tensor, rows, cols in local_blocks(param):
                what = f"{label}: {name}[{rows.start}:{rows.stop}, {cols.start}:{cols.stop}] after {STEPS} steps"
                worst = max(worst, close(tensor.detach(), params[name].detach()[rows, cols], what))
        errors[kind] = worst
    return errors


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 3])
def test_fused_sequence_training_matches_the_reference(world_size: int) -> None:
    for case in CASES:
        for rank, errors in enumerate(run_on_ranks(world_size, _train, case, timeout=150)):
            assert set(errors) == set(OPTIMIZERS), (case, rank)
            assert max(errors.values()) <= 1e-5, (case, rank, errors)
