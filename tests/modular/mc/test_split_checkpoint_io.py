"""A split collision table goes through `modular.checkpoint` split: each rank writes and reads its
range, no rank gathers the whole table (`export` gathers it on its destination only; Note [a
collision table in a checkpoint] in modular/mc/table_state.py). What is written is torchrec's layout (plain DCP reads it into
torchrec's unsharded module), a checkpoint of the whole table (as saved before the split) still
loads, and a table that breaks torchrec's invariants is refused on every rank with nothing
changed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader

import modular
from modular.mc.table_state import SAVE, TableState
from tests.dist import run_on_ranks
from tests.modular.compare import full_value
from tests.modular.mc.beside_reference import assert_same_collision_state, shard_mc, train_beside_reference
from tests.modular.mc.test_split_state import _batch, _model

SPECS = {"t_a": ("distance_lfu", 2, 300), "t_b": ("lfu", 1, 120)}
LR = 0.5
MODULES = "mc._managed_collision_collection._managed_collision_modules"


def _sharded(kind: str) -> nn.Module:
    return shard_mc(_model(SPECS), kind)


def _train(model, ref: nn.Module, steps: range) -> None:
    world, rank = (dist.get_world_size(), dist.get_rank()) if model is not None else (2, 0)
    params = list(modular.local_parameters(model)) if model is not None else []
    opt = torch.optim.SGD(params, lr=LR) if params else None  # a rank may hold no table
    train_beside_reference(model, ref, opt, torch.optim.SGD(ref.parameters(), lr=LR), batch_of=_batch,
                           width=12, world=world, rank=rank, steps=steps)  # fmt: skip


def _reference() -> nn.Module:
    """torchrec's module after the first phase (6 steps at world 2), resumed from its state_dict."""
    ref = _model(SPECS)
    _train(None, ref, range(6))
    fresh = _model(SPECS)
    fresh.load_state_dict(ref.state_dict())
    return fresh


def _no_gather(monkeypatch) -> None:
    def refuse(self):
        raise AssertionError(f"table {self._name!r}: the whole collision table was gathered")

    monkeypatch.setattr(TableState, "_whole", refuse)


def _save(paths: dict[str, str]) -> None:
    model = _sharded("row_wise")
    ref = _model(SPECS)
    _train(model, ref, range(6))  # exact beside torchrec (asserted below after each save)
    with pytest.MonkeyPatch.context() as mp:
        _no_gather(mp)
        modular.checkpoint.save(paths["split"], model)
    with pytest.MonkeyPatch.context() as mp:  # as saved before the split: the whole table, once
        mp.setattr(TableState, "_split", lambda self, mode: self._whole() if mode == SAVE else None)
        modular.checkpoint.save(paths["whole"], model)
    assert_same_collision_state(model, ref, f"rank {dist.get_rank()}: after saving")
    with pytest.MonkeyPatch.context() as mp:  # export gathers on its destination only
        _no_gather(mp)
        exported = modular.checkpoint.export(model)
        other = _sharded("column_wise")
        modular.checkpoint.load_unsharded(other, ref.state_dict())
    assert_same_collision_state(other, ref, f"rank {dist.get_rank()}: load_unsharded")
    if exported is not None:  # torchrec's unsharded module loads it, strict
        unsharded = _model(SPECS)
        unsharded.load_state_dict(exported, strict=True)
        assert_same_collision_state(unsharded, ref, "exported")
    if dist.get_rank() == 0:
        torch.save(ref.mc._managed_collision_collection.state_dict(), paths["reference"])


def _load(paths: dict[str, str], which: str) -> None:
    model = _sharded("table_wise")
    with pytest.MonkeyPatch.context() as mp:
        _no_gather(mp)
        modular.checkpoint.load(paths[which], model)
    ref = _reference()
    label = f"{which} checkpoint, rank {dist.get_rank()} of {dist.get_world_size()}"
    assert_same_collision_state(model, ref, f"{label}: loaded")
    _train(model, ref, range(6, 10))  # continues as torchrec resumed from its state_dict
    assert_same_collision_state(model, ref, f"{label}: trained on")
    for table in SPECS:
        torch.testing.assert_close(full_value(model.mc._embedding_module.embedding_bags[table].weight),
                                   ref.mc._embedding_module.embedding_bags[table].weight.detach(),
                                   rtol=1e-4, atol=1e-5)  # fmt: skip


def test_each_rank_writes_and_reads_its_range_of_the_table_in_torchrecs_layout(tmp_path) -> None:
    paths = {k: str(tmp_path / k) for k in ("split", "whole", "reference")}
    run_on_ranks(2, _save, paths, timeout=180)
    reader = FileSystemReader(paths["split"])
    metadata = reader.read_metadata().state_dict_metadata
    reference = torch.load(paths["reference"])
    for table, (_, _, zch) in SPECS.items():
        for key in reference:
            if not key.startswith(f"_managed_collision_modules.{table}._mch_"):
                continue
            chunks = metadata[f"model.mc._managed_collision_collection.{key}"].chunks
            # one range per rank, each within 1.1x of its share: no rank wrote the whole table
            ranges = sorted((c.offsets[0], c.sizes[0]) for c in chunks)
            assert len(ranges) == 2 and ranges[0][0] == 0 and ranges[1][0] == ranges[0][1], (key, ranges)
            assert sum(n for _, n in ranges) == zch and all(n <= 1.1 * zch / 2 for _, n in ranges), (key, ranges)
    # plain DCP, no process group, reads it into torchrec's unsharded module: torchrec's layout
    unsharded = _model(SPECS).mc._managed_collision_collection
    state = {f"model.mc._managed_collision_collection.{k}": v for k, v in unsharded.state_dict().items()}
    dcp.load(state, storage_reader=reader, no_dist=True)
    for key, value in reference.items():
        assert torch.equal(state[f"model.mc._managed_collision_collection.{key}"], value), key
    run_on_ranks(3, _load, paths, "split", timeout=180)
    run_on_ranks(3, _load, paths, "whole", timeout=180)


def _refused(path: str) -> None:
    rank = dist.get_rank()
    model = _sharded("row_wise")
    _train(model, _model(SPECS), range(4))
    modular.checkpoint.save(path + "-good", model)
    module = model.get_submodule(f"{MODULES}.t_a")
    shard = module._shard
    other = _sharded("row_wise")  # a load that fails leaves the model as it was
    modular.checkpoint.load(path + "-good", other)
    if rank == 0:  # an entry of rank 0's moved into one of rank 1's slots: two ranks now mismatch
        slots = shard.slots
        slots[0] += 1
    modular.checkpoint.save(path + "-bad", model)
    before = {k: v.clone() for k, v in other.mc._managed_collision_collection.state_dict().items()}
    weights = [full_value(other.mc._embedding_module.embedding_bags[t].weight).clone() for t in SPECS]
    with pytest.raises(modular.CheckpointError, match=r"managed-collision table 't_a' in checkpoint .*-bad"):
        modular.checkpoint.load(path + "-bad", other)
    after = other.mc._managed_collision_collection.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), f"rank {rank}: the collision state changed"
    for t, w in zip(SPECS, weights):
        assert torch.equal(full_value(other.mc._embedding_module.embedding_bags[t].weight), w), t


def test_a_table_that_breaks_torchrecs_invariants_is_refused_on_every_rank_and_nothing_changes(tmp_path) -> None:
    run_on_ranks(2, _refused, str(Path(tmp_path) / "ckpt"), timeout=180)


class _Failing(nn.Module):
    """A model whose own load_state_dict fails after loading what it was given."""

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        super().load_state_dict(state_dict, strict=strict)
        raise RuntimeError("the model's override failed after loading")


def _put_back(path: str) -> None:
    rank = dist.get_rank()
    model = _sharded("row_wise")
    _train(model, _model(SPECS), range(4))
    modular.checkpoint.save(path, model)  # a checkpoint of these 4 steps
    other = _model(SPECS)
    _train(None, other, range(7))  # an unsharded state 7 steps in: another collision table
    _train(model, _model(SPECS), range(4, 6))  # the live state, 6 steps in
    model.__class__ = _Failing
    before = {k: v.clone() for k, v in model.mc._managed_collision_collection.state_dict().items()}
    for load in (lambda: modular.checkpoint.load(path, model), lambda: modular.checkpoint.load_unsharded(model, other.state_dict())):
        with pytest.raises(modular.CheckpointError, match="override failed after loading"):
            load()
        after = model.mc._managed_collision_collection.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before), f"rank {rank}: the collision state changed"


def test_a_load_that_fails_later_puts_the_collision_table_back(tmp_path) -> None:
    run_on_ranks(2, _put_back, str(Path(tmp_path) / "ckpt"), timeout=180)


TINY = {"t_a": ("distance_lfu", 1, 3), "t_b": ("lru", 2, 2)}  # 2 and 1 usable slots: some ranks hold none


def _tiny(path: str, save: bool) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    model, ref = shard_mc(_model(TINY), "table_wise"), _model(TINY)
    if save:  # train, beside torchrec, with ranks that hold no slot, and save
        params = list(modular.local_parameters(model))
        opt = torch.optim.SGD(params, lr=LR) if params else None
        train_beside_reference(model, ref, opt, torch.optim.SGD(ref.parameters(), lr=LR), batch_of=_batch,
                               width=12, world=world, rank=rank, steps=range(6))  # fmt: skip
        assert_same_collision_state(model, ref, f"rank {rank}: trained at world 3")
        modular.checkpoint.save(path, model)
        if rank == 0:
            torch.save(ref.state_dict(), path + ".reference")
        return
    modular.checkpoint.load(path, model)
    ref.load_state_dict(torch.load(path + ".reference"))
    assert_same_collision_state(model, ref, f"rank {rank}: loaded at world {world}")


def test_tables_of_fewer_slots_than_ranks_train_and_move_through_a_checkpoint(tmp_path) -> None:
    path = str(Path(tmp_path) / "ckpt")
    run_on_ranks(3, _tiny, path, True, timeout=180)
    run_on_ranks(2, _tiny, path, False, timeout=180)
    run_on_ranks(3, _tiny, path, False, timeout=180)  # a rank reads no position of the 2-slot table
