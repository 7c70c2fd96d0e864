"""`modular.reshard` in and out of tiers (Note [tiered tables]): a tiered row-wise model moved to
tiered table-row-wise, then to resident table-wise, then back to tiered row-wise, against a
resident model moved alike: what each exports after every move, and its training after it."""

from __future__ import annotations

import dataclasses
import gc
import os

import pytest
import torch
import torch.distributed as dist

import modular
from planners.types import ShardingPlan
from tests.dist import run_on_ranks
from tests.modular.tiered.test_tiered_checkpoint import _model, _train
from tests.modular.tiered.test_tiered_training import placements

MOVES = (("twrw", True), ("tw", False), ("rw", True))


def _plan(kind: str, tiered: bool) -> ShardingPlan:
    places = placements(kind, dist.get_world_size())
    if tiered:
        places = {n: dataclasses.replace(p, cache_load_factor=0.05) for n, p in places.items()}
    return ShardingPlan(world_size=dist.get_world_size(), modules={"": places})


def _reshard(tier_dir: str) -> None:
    tiered, topt = _model("rw", True, tier_dir)
    resident, ropt = _model("rw", False, tier_dir)
    step = 0
    for kind, tier in MOVES:
        a, b = _train(resident, ropt, step, 2), _train(tiered, topt, step, 2)
        assert all(torch.equal(x, y) for x, y in zip(a, b)), f"before {kind}: trained apart"
        step += 2
        modular.reshard(tiered, _plan(kind, tier))
        modular.reshard(resident, _plan(kind, False))
        ours, theirs = modular.checkpoint.export(tiered), modular.checkpoint.export(resident)
        if ours is not None:
            assert all(torch.equal(ours[n], theirs[n]) for n in theirs), f"after {kind}: tables differ"
    a, b = _train(resident, ropt, step, 2), _train(tiered, topt, step, 2)
    assert all(torch.equal(x, y) for x, y in zip(a, b)), "after the last move: trained apart"
    del tiered, resident, topt, ropt, a, b
    gc.collect()


@pytest.mark.timeout(200)
def test_reshard_in_and_out_of_tiers(tmp_path):
    run_on_ranks(2, _reshard, str(tmp_path), timeout=180)
    assert not os.listdir(tmp_path), "stores outlive their models"


def _unshard(tier_dir: str) -> None:
    """`modular.unshard` reads a tiered table through its stores (dirty cached rows first) and
    writes an edit back into them, which the next lookup reads, as on a resident model."""
    tiered, topt = _model("rw", True, tier_dir)
    resident, ropt = _model("rw", False, tier_dir)
    _train(tiered, topt, 0, 2), _train(resident, ropt, 0, 2)
    name = "embedding_bags.t_a.weight"
    with modular.unshard(resident, writeback=False) as full:
        expected = full[name].clone()
    for model in (tiered, resident):
        with modular.unshard(model) as full:
            assert torch.equal(full[name], expected)
            full[name][:100] += 1.0  # rows the next batches look up (their ids are skewed low)
    a, b = _train(resident, ropt, 2, 2), _train(tiered, topt, 2, 2)
    assert all(torch.equal(x, y) for x, y in zip(a, b)), "the edit reached one model only"
    del tiered, resident, topt, ropt
    gc.collect()


@pytest.mark.timeout(200)
def test_unshard_reads_and_writes_the_stores(tmp_path):
    run_on_ranks(2, _unshard, str(tmp_path), timeout=180)
    assert not os.listdir(tmp_path)
