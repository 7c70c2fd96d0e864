"""A split collision state through DCP checkpoints from world 2 to 3 to 1 under three plans, and
`export` / `load_unsharded` with torchrec's unsharded module's state_dict (Note [sharded managed
collisions] in modular/mc/sharded_mch.py). The reference is torchrec's unsharded module fed the
global batch and resumed from its own state_dict at each checkpoint (torchrec keeps its
eviction history in non-persistent buffers, so that is what a resume means for it too)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import modular
from tests.dist import run_on_ranks
from tests.modular.compare import full_value
from tests.modular.mc.beside_reference import assert_same_collision_state, shard_mc, train_beside_reference
from tests.modular.mc.test_split_state import _batch, _model

SPECS = {"t_a": ("distance_lfu", 3, 30), "t_b": ("lru", 1, 20)}
PHASES = [(2, "row_wise", range(0, 6)), (3, "table_wise", range(6, 12)), (1, "column_wise", range(12, 18))]
LR = 0.5


def _reference(upto: int) -> nn.Module:
    """torchrec's module through the phases before `upto`, resumed from its state_dict at each."""
    ref = _model(SPECS)
    for world, _, steps in PHASES[:upto]:
        _train(None, ref, world, 0, steps)
        fresh = _model(SPECS)
        fresh.load_state_dict(ref.state_dict())
        ref = fresh
    return ref


def _train(model, ref: nn.Module, world: int, rank: int, steps: range) -> None:
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    params = list(modular.local_parameters(model)) if model is not None else []
    opt = torch.optim.SGD(params, lr=LR) if params else None
    train_beside_reference(model, ref, opt, ref_opt, batch_of=_batch, width=12, world=world,
                           rank=rank, steps=steps)  # fmt: skip


def _sharded(kind: str) -> nn.Module:
    return shard_mc(_model(SPECS), kind)


def _same(model: nn.Module, ref: nn.Module, label: str) -> None:
    assert_same_collision_state(model, ref, label)
    for table in SPECS:
        got = full_value(model.mc._embedding_module.embedding_bags[table].weight)
        torch.testing.assert_close(got, ref.mc._embedding_module.embedding_bags[table].weight.detach(),
                                   rtol=1e-4, atol=1e-5, msg=lambda m: f"{label}: table {table}: {m}")  # fmt: skip


def _phase(index: int, load_from: str, save_to: str) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    _, kind, steps = PHASES[index]
    model = _sharded(kind)
    if load_from:
        modular.checkpoint.load(load_from, model)
        _same(model, _reference(index), f"phase {index} rank {rank}: loaded")
    ref = _reference(index)
    _train(model, ref, world, rank, steps)
    _same(model, ref, f"phase {index} rank {rank}: trained")
    modular.checkpoint.save(save_to, model)
    exported = modular.checkpoint.export(model)
    if exported is not None:  # torchrec's unsharded module loads it, strict, and holds ref's state
        unsharded = _model(SPECS)
        unsharded.load_state_dict(exported, strict=True)
        _same(unsharded, ref, f"phase {index}: exported")
    other = _sharded("data_parallel")
    modular.checkpoint.load_unsharded(other, ref.state_dict())
    _same(other, ref, f"phase {index} rank {rank}: load_unsharded")


def test_the_split_state_moves_through_checkpoints_from_world_2_to_3_to_1(tmp_path) -> None:
    paths = [str(tmp_path / f"ckpt{i}") for i in range(3)]
    for i, (world, _, _) in enumerate(PHASES):
        run_on_ranks(world, _phase, i, paths[i - 1] if i else "", paths[i], timeout=180)
