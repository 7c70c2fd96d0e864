"""A tiered model's checkpoint (Note [tiered tables]): saved from the stores at world 2, loaded
into a resident plan and into another tiered plan at world 3, exactly; `export` and
`load_unsharded` read and write the stores; training goes on from what was loaded."""

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
from tests.modular.tiered.test_tiered_training import _locals, batch, make_ebc, placements

STEPS = 3


def _model(plan: str, tiered: bool, tier_dir: str):
    world = dist.get_world_size()
    ebc = make_ebc()
    opt = modular.fuse_optimizer(ebc, "exact_rowwise_adagrad", lr=0.05, eps=1e-3)
    places = placements(plan, world)
    if tiered:
        places = {n: dataclasses.replace(p, cache_load_factor=0.05) for n, p in places.items()}
    model = modular.shard(ebc, ShardingPlan(world_size=world, modules={"": places}), tier_dir=tier_dir)
    return model, opt


def _train(model, opt, first: int, steps: int) -> list[torch.Tensor]:
    outs = []
    for step in range(first, first + steps):
        out = model(batch(step, dist.get_rank())).values()
        (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(step))).sum().backward()
        opt.step()
        outs.append(out.detach())
    return outs


def _save(path: str, tier_dir: str):
    """World 2: a tiered row-wise model trains, is saved mid-cache (dirty rows in it), exported."""
    model, opt = _model("rw", True, tier_dir)
    _train(model, opt, 0, STEPS)
    modular.checkpoint.save(path, model, opt)
    full = modular.checkpoint.export(model)
    del model, opt
    gc.collect()  # sharded modules hold reference cycles; their stores go with them
    return full


def _load(path: str, tier_dir: str, unsharded: dict):
    """World 3: a resident and a tiered table-row-wise model load the checkpoint, and
    a third tiered model loads the export; all three export what was saved and train alike."""
    resident, ropt = _model("twrw", False, tier_dir)
    tiered, topt = _model("twrw", True, tier_dir)
    modular.checkpoint.load(path, resident, ropt)
    modular.checkpoint.load(path, tiered, topt)
    exports = [modular.checkpoint.export(m) for m in (resident, tiered)]
    a, b = _train(resident, ropt, STEPS, STEPS), _train(tiered, topt, STEPS, STEPS)
    assert all(torch.equal(x, y) for x, y in zip(a, b)), "tiered and resident differ after the load"
    again, _ = _model("rw", True, tier_dir)
    modular.checkpoint.load_unsharded(again, unsharded)
    exports.append(modular.checkpoint.export(again))
    rstate, tstate = ropt.state_dict()["state"], topt.state_dict()["state"]
    after = [modular.checkpoint.export(m) for m in (resident, tiered)]
    del resident, tiered, again, ropt, topt
    gc.collect()
    return exports, after, {n: sorted(s) for n, s in rstate.items()} == {n: sorted(s) for n, s in tstate.items()}


@pytest.mark.timeout(300)
def test_tiered_checkpoint_into_resident_and_tiered_plans_at_another_world_size(tmp_path):
    path, tiers = str(tmp_path / "ckpt"), str(tmp_path / "tiers")
    saved = run_on_ranks(2, _save, path, tiers, timeout=120)[0]
    assert saved is not None and set(saved) == {"embedding_bags.t_a.weight", "embedding_bags.t_b.weight", "embedding_bags.t_c.weight"}
    results = run_on_ranks(3, _load, path, tiers, saved, timeout=200)
    exports, after, same_state_keys = results[0]
    for got in exports:  # resident load, tiered load, tiered load_unsharded
        assert set(got) == set(saved)
        for name, value in saved.items():
            assert torch.equal(got[name], value), name
    assert all(torch.equal(after[0][n], after[1][n]) for n in saved), "trained differently after the load"
    assert any(not torch.equal(after[0][n], saved[n]) for n in saved), "nothing trained after the load"
    assert same_state_keys
    gc.collect()
    assert not [f for f in os.listdir(tiers) if not f.startswith(".")], "stores outlive their models"
