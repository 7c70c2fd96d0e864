"""Checkpoint saves that die or fail at other points than tests/modular/checkpoint/test_checkpoint.py covers
(rank 1 killed after writing its data, before the metadata), and damaged checkpoint directories.

Saves: the victim dies before writing any data, raises an OSError while writing (a full disk),
or rank 0 dies between the two renames of the commit (Note [checkpoint layout]: `load` must then
find the complete previous checkpoint under `<path>.prev-*`). Each time the survivors raise within
the collective timeout and the previous checkpoint loads bit for bit.

Damage: `.metadata` missing, a data file emptied, the manifest emptied, not JSON, without its
file list, or taken from another checkpoint. Each must raise `CheckpointError` on every rank and
leave the model and optimizer as they were.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import modular
from modular.checkpoint._directory import MANIFEST
from tests.dist import run_on_ranks
from tests.faults.helpers import VICTIM, break_victim, check_survivors, check_victim, spawn, survive
from tests.modular import checkpoint_cases as H

TIMEOUT = 90.0


def _model_and_optimizer(seed: int, optimizer: str = "adagrad") -> tuple[H.CheckpointModel, Any]:
    model = H.sharded_checkpoint_model("A", seed=seed)
    params = modular.local_parameters(model)
    if optimizer == "sgd_momentum":
        return model, torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if optimizer == "adam":
        return model, torch.optim.Adam(params, lr=0.01)
    return model, torch.optim.Adagrad(params, lr=0.1)


def _train_and_save(path: str, steps: int = 2) -> dict[str, Any]:
    model, opt = _model_and_optimizer(0)
    H.train_checkpoint_model(model, opt, range(steps))
    modular.checkpoint.save(path, model, opt)
    return H.local_snapshot(model, opt)


def _load(path: str) -> dict[str, Any]:
    model, opt = _model_and_optimizer(1)
    modular.checkpoint.load(path, model, opt)
    return H.local_snapshot(model, opt)


def _save_with_fault(path: str, where: str, how: str):
    """Loads the checkpoint, trains a step and saves again; the victim breaks at `where`."""
    from torch.distributed.checkpoint import FileSystemWriter

    import modular.checkpoint._directory as files

    model, opt = _model_and_optimizer(1)
    modular.checkpoint.load(path, model, opt)
    H.train_checkpoint_model(model, opt, range(2, 3))
    victim = dist.get_rank() == (0 if where == "commit" else VICTIM)
    if victim and where == "write_data":
        def broken_write_data(self, plan, planner):
            if how == "raises":
                raise OSError(28, "No space left on device (injected)")
            break_victim(how, where)

        FileSystemWriter.write_data = broken_write_data
    if victim and where == "commit":  # between `rename path -> prev` and `rename tmp -> path`
        rename = os.rename

        def rename_then_die(src, dst):
            rename(src, dst)
            if ".prev-" in str(dst):
                break_victim("killed", where)

        files.os.rename = rename_then_die
    return survive(lambda: modular.checkpoint.save(path, model, opt))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("where, how", [("write_data", "killed"), ("write_data", "raises"), ("commit", "killed")])
def test_a_save_that_fails_leaves_a_checkpoint_that_loads(tmp_path: Path, where: str, how: str) -> None:
    path = str(tmp_path / "ckpt")
    saved = H.assemble(run_on_ranks(2, _train_and_save, path, timeout=TIMEOUT))
    outcomes = spawn(2, _save_with_fault, path, where, how)
    if how == "raises":
        # DCP gathers every rank's write errors and raises them on each rank as its
        # CheckpointException (a BaseException); modular.checkpoint.save turns that into a
        # CheckpointError naming the checkpoint, on every rank.
        for o in outcomes:
            got = o.result  # an ordinary Exception now: the rank body catches it
            assert got is not None and got.exc_type == "CheckpointError", o
            assert got.message.startswith(f"saving checkpoint '{path}' failed while writing"), got.message[:300]
            assert f"CheckpointException ranks:dict_keys([{VICTIM}])" in got.message, got.message[:300]
            assert "No space left on device (injected)" in got.message, got.message[:300]
            assert "is untouched" in got.message
    else:
        victim = 0 if where == "commit" else VICTIM
        check_victim(outcomes[victim], how)
        survivor = outcomes[1 - victim]
        assert survivor.result is not None and not survivor.timed_out, survivor
        if where != "commit":
            check_survivors(outcomes)
    if where == "commit":  # the crash left no `ckpt`, only the complete previous one beside it
        assert not (tmp_path / "ckpt").exists()
        assert any(p.name.startswith("ckpt.prev-") for p in tmp_path.iterdir())
    loaded = H.assemble(run_on_ranks(2, _load, path, timeout=TIMEOUT))
    H.assert_same(saved, loaded, f"after a save that failed in {where} ({how})")


# -- damaged directories ---------------------------------------------------------------------------


def _load_fails(path: str, optimizer: str = "adagrad") -> tuple[str, str]:
    """Loads a damaged checkpoint; (error type, message), after checking that nothing changed."""
    model, opt = _model_and_optimizer(1, optimizer)
    before = H.local_snapshot(model, opt)
    result = survive(lambda: modular.checkpoint.load(path, model, opt))
    assert result is not None, f"rank {dist.get_rank()}: loading a damaged checkpoint succeeded"
    H.assert_unchanged(before, H.local_snapshot(model, opt), "a failed load")
    return result.exc_type, result.message


def _damage(good: Path, other: Path, target: Path, how: str) -> str:
    """Copies `good` to `target` and damages it; returns what the error must mention."""
    shutil.copytree(good, target)
    manifest = target / MANIFEST
    if how == "metadata_missing":
        (target / ".metadata").unlink()
        return ".metadata' is missing"
    if how == "data_file_empty":
        (target / "__0_0.distcp").write_bytes(b"")
        return "__0_0.distcp' has 0 bytes"
    if how == "manifest_from_another_checkpoint":
        shutil.copy(other / MANIFEST, manifest)
        return f"but {MANIFEST} records"  # a size or a sha256 that differs
    if how == "manifest_empty":
        manifest.write_bytes(b"")
    elif how == "manifest_not_json":
        manifest.write_text('{"format": "modular.checkpoint/1", "files": {')
    elif how == "manifest_without_files":
        data = json.loads(manifest.read_text())
        del data["files"]
        manifest.write_text(json.dumps(data))
    else:
        raise ValueError(how)
    return MANIFEST


DAMAGE = ["metadata_missing", "data_file_empty", "manifest_from_another_checkpoint",
          "manifest_empty", "manifest_not_json", "manifest_without_files"]  # fmt: skip


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("ckpts")
    run_on_ranks(2, _train_and_save, str(root / "good"), 2, timeout=TIMEOUT)
    run_on_ranks(2, _train_and_save, str(root / "other"), 3, timeout=TIMEOUT)
    return root / "good", root / "other"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_checkpoint_fails_to_load_by_name_and_changes_nothing(tmp_path: Path, two_checkpoints, how: str) -> None:
    good, other = two_checkpoints
    target = tmp_path / "ckpt"
    expected = _damage(good, other, target, how)
    errors = run_on_ranks(2, _load_fails, str(target), timeout=TIMEOUT)
    for exc_type, message in errors:
        assert exc_type == "CheckpointError" and expected in message, (exc_type, message)


# -- another optimizer ------------------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("optimizer, missing, extra", [
    ("sgd_momentum", "['dampening', 'momentum', 'nesterov']", "['eps', 'initial_accumulator_value', 'lr_decay']"),
    ("adam", "['amsgrad', 'betas', 'capturable', 'decoupled_weight_decay']", "['initial_accumulator_value', 'lr_decay']"),
])  # fmt: skip
def test_another_torch_optimizer_fails_before_loading(two_checkpoints, optimizer: str, missing: str, extra: str) -> None:
    """Adagrad's checkpoint into SGD or Adam, whose state appears only at their first step: the
    param groups' keys differ, so the load is refused (it used to install Adagrad's groups, and
    SGD's first step raised KeyError 'momentum' inside torch)."""
    good, _ = two_checkpoints
    for exc_type, message in run_on_ranks(2, _load_fails, str(good), optimizer, timeout=TIMEOUT):
        assert exc_type == "CheckpointError", (exc_type, message)
        assert f"lack {missing}" in message and f"have {extra}" in message, message


def _load_with_scheduler(path: str) -> tuple[float, float]:
    model, opt = _model_and_optimizer(1)
    opt.param_groups[0]["lr"] = 0.5
    torch.optim.lr_scheduler.StepLR(opt, step_size=1)  # adds 'initial_lr' to the param groups
    modular.checkpoint.load(path, model, opt)
    return opt.param_groups[0]["lr"], opt.state_dict()["state"][0]["step"].item()


@pytest.mark.timeout(120)
def test_a_param_group_key_of_an_lr_scheduler_is_no_mismatch(two_checkpoints) -> None:
    good, _ = two_checkpoints
    for lr, step in run_on_ranks(2, _load_with_scheduler, str(good), timeout=TIMEOUT):
        assert (lr, step) == (0.1, 2.0)
