"""modular.checkpoint: resharding save/load, resumed training, export/import, and safety.

Every test saves from one pool of gloo ranks and loads in another (possibly of another size)
through `tmp_path`; snapshots are assembled into full tensors in this process
(`assemble` in tests/modular/checkpoint_cases.py) and compared with `torch.equal`.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

import modular
from modular.checkpoint import CheckpointError
from modular.checkpoint._directory import MANIFEST, sha256_of
from tests.dist import run_on_ranks, spawn_ranks
from tests.modular import checkpoint_cases as H

TIMEOUT = 90.0


FUSED = {  # name -> (fused kind, column_wise_statistic); the dense layer takes Adam beside them
    "fused": ("exact_rowwise_adagrad", "exact"),
    "fused_sgd": ("exact_sgd", "exact"),
    "fused_per_shard": ("exact_rowwise_adagrad", "per_shard"),
}


def _model(kind: str, seed: int, optimizer: str, fsdp: bool = False, **table_kwargs: Any) -> tuple[H.CheckpointModel, Any]:
    """The model built with `seed`, its tables fused first if `optimizer` is fused, sharded by
    plan `kind` (Note [order of sharding calls]), and its optimizer."""
    model = H.build_checkpoint_model(seed, **table_kwargs)
    fused = None
    if optimizer in FUSED:
        fused_kind, statistic = FUSED[optimizer]
        fused = modular.fuse_optimizer(model, fused_kind, lr=0.1, column_wise_statistic=statistic)
    H.shard_checkpoint_model(model, kind)
    if fsdp:  # the dense layer's params become DTensors sharded over the ranks
        modular.apply_fully_shard(model, modules={torch.nn.Linear})
    if optimizer == "adagrad":
        return model, torch.optim.Adagrad(modular.local_parameters(model), lr=0.1)
    if optimizer == "adam":
        return model, torch.optim.Adam(modular.local_parameters(model), lr=0.01)
    if fused is not None:
        dense = torch.optim.Adam(modular.local_parameters(model), lr=0.01)
        return model, modular.CombinedOptimizer({"tables": fused, "dense": dense})
    raise ValueError(optimizer)


def _train_and_save(path: str, kind: str, optimizer: str, steps: int = 2, fsdp: bool = False) -> dict[str, Any]:
    model, opt = _model(kind, 0, optimizer, fsdp)
    H.train_checkpoint_model(model, opt, range(steps))
    modular.checkpoint.save(path, model, opt)
    return H.local_snapshot(model, opt)


def _load_and_snapshot(path: str, kind: str, optimizer: str, fsdp: bool = False) -> dict[str, Any]:
    model, opt = _model(kind, 1, optimizer, fsdp)  # other weights than the saved ones, until loaded
    modular.checkpoint.load(path, model, opt)
    return H.local_snapshot(model, opt)


# t0 and t3 swap between data-parallel and row-wise from A to B; every table changes type in each.
RESHARD = [
    pytest.param(2, "A", 3, "B", "adagrad", id="2A->3B"),
    pytest.param(3, "B", 2, "A", "adagrad", id="3B->2A"),
    pytest.param(2, "C", 1, "A", "adagrad", id="2C->1A"),
    pytest.param(4, "A", 2, "C", "adagrad", id="4A->2C"),
    pytest.param(2, "A", 3, "B", "fused", id="2A->3B-fused"),
]


@pytest.mark.parametrize("save_world, save_kind, load_world, load_kind, optimizer", RESHARD)
def test_reshard_restores_weights_optimizer_state_and_outputs(
    tmp_path: Path, save_world: int, save_kind: str, load_world: int, load_kind: str, optimizer: str
) -> None:
    path = str(tmp_path / "ckpt")
    saved = H.assemble(run_on_ranks(save_world, _train_and_save, path, save_kind, optimizer, timeout=TIMEOUT))
    loaded = H.assemble(run_on_ranks(load_world, _load_and_snapshot, path, load_kind, optimizer, timeout=TIMEOUT))
    assert any(k.startswith("optim.") and k.endswith((".sum", ".row_sum")) for k in saved)
    H.assert_same(saved, loaded, f"world {save_world} plan {save_kind} -> world {load_world} plan {load_kind}")


@pytest.mark.parametrize("load_world, load_fsdp", [(3, True), (1, False)], ids=["fsdp3", "plain1"])
def test_fsdp_dense_params_reshard(tmp_path: Path, load_world: int, load_fsdp: bool) -> None:
    """FSDP2 DTensor params and their Adam state load into FSDP at another size, or into plain."""
    path = str(tmp_path / "ckpt")
    saved = H.assemble(run_on_ranks(2, _train_and_save, path, "A", "adam", fsdp=True, timeout=TIMEOUT))
    loaded = H.assemble(run_on_ranks(load_world, _load_and_snapshot, path, "B", "adam", fsdp=load_fsdp, timeout=TIMEOUT))
    assert "optim.state.dense.weight.exp_avg" in saved
    H.assert_same(saved, loaded, f"FSDP world 2 -> world {load_world}")


def _uninterrupted(path: str) -> list[float]:
    model, opt = _model("A", 0, "adam")
    losses = H.train_checkpoint_model(model, opt, range(2))
    modular.checkpoint.save(path, model, opt)
    return losses + H.train_checkpoint_model(model, opt, range(2, 5))


def _resumed(path: str, kind: str) -> list[float]:
    model, opt = _model(kind, 1, "adam")  # Adam's state is created lazily: load must create it
    modular.checkpoint.load(path, model, opt)
    return H.train_checkpoint_model(model, opt, range(2, 5))


def test_resumed_training_has_the_same_losses(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    reference = run_on_ranks(2, _uninterrupted, path, timeout=TIMEOUT)[0]
    same_plan = run_on_ranks(2, _resumed, path, "A", timeout=TIMEOUT)[0]
    assert same_plan == reference[2:], (same_plan, reference)
    # On a new plan and world size the pooled sums run in another order: equal to rounding.
    replanned = run_on_ranks(3, _resumed, path, "B", timeout=TIMEOUT)[0]
    torch.testing.assert_close(replanned, reference[2:], rtol=1e-5, atol=0)
    assert reference[4] < reference[0]  # it trained


def _export(kind: str, fsdp: bool) -> Any:
    import torch.distributed as dist

    model, opt = _model(kind, 0, "adagrad", fsdp)
    H.train_checkpoint_model(model, opt, range(1))
    sd = modular.checkpoint.export(model)
    sharded_out = H.eval_outputs(model)
    if dist.get_rank() != 0:
        return sd
    single = H.build_checkpoint_model(seed=3)
    single.load_state_dict(sd, strict=True)
    assert all(type(v) is torch.Tensor and v.device.type == "cpu" for v in sd.values())
    with torch.no_grad():
        single_out = single.ebc(H.checkpoint_global_batch(99, max_ids=1)).values()
    assert torch.equal(single_out, sharded_out), (single_out - sharded_out).abs().max()
    return {k: v.clone() for k, v in sd.items()}


@pytest.mark.parametrize("world, kind, fsdp", [(3, "A", False), (2, "B", True)], ids=["3A", "2B-fsdp"])
def test_export_loads_strictly_into_the_single_process_model(world: int, kind: str, fsdp: bool) -> None:
    results = run_on_ranks(world, _export, kind, fsdp, timeout=TIMEOUT)
    assert results[0] is not None and all(r is None for r in results[1:])
    assert sorted(results[0]) == sorted(H.build_checkpoint_model(seed=0).state_dict())


def _load_unsharded(file: str, kind: str) -> dict[str, Any]:
    model = H.sharded_checkpoint_model(kind, seed=1)
    modular.checkpoint.load_unsharded(model, file)
    return H.local_snapshot(model)


def test_load_unsharded_initialises_every_plan(tmp_path: Path) -> None:
    single = H.build_checkpoint_model(seed=7)
    file = tmp_path / "single.pt"
    torch.save(single.state_dict(), file)
    with torch.no_grad():
        expected_out = single.ebc(H.checkpoint_global_batch(99, max_ids=1)).values()
    for world, kind in [(3, "C"), (2, "A")]:
        got = H.assemble(run_on_ranks(world, _load_unsharded, str(file), kind, timeout=TIMEOUT))
        assert torch.equal(got.pop("outputs"), expected_out)
        H.assert_same({f"model.{k}": v for k, v in single.state_dict().items()}, got, f"world {world} plan {kind}")


# -- safety ------------------------------------------------------------------------------------


def _save_and_die(path: str) -> None:
    """Loads the checkpoint, trains a step, and saves again; rank 1 dies in the middle of writing."""
    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemWriter

    model, opt = _model("A", 1, "adagrad")
    modular.checkpoint.load(path, model, opt)
    H.train_checkpoint_model(model, opt, range(2, 3))
    if dist.get_rank() == 1:
        write_data = FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            write_data(self, plan, planner).wait()
            os.kill(os.getpid(), signal.SIGKILL)  # data files written, metadata not yet

        FileSystemWriter.write_data = write_then_die
    modular.checkpoint.save(path, model, opt)


def test_interrupted_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    saved = H.assemble(run_on_ranks(2, _train_and_save, path, "A", "adagrad", timeout=TIMEOUT))
    outcomes = spawn_ranks(2, _save_and_die, path, timeout=60, collective_timeout=10)
    assert outcomes[1].exitcode == -signal.SIGKILL, outcomes[1]
    assert outcomes[0].error is not None or outcomes[0].timed_out, outcomes[0]
    leftovers = [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert leftovers and any(p.name.startswith("__1_") for p in (tmp_path / leftovers[0]).iterdir())
    loaded = H.assemble(run_on_ranks(2, _load_and_snapshot, path, "B", "adagrad", timeout=TIMEOUT))
    H.assert_same(saved, loaded, "after the interrupted save")
    # The next successful save replaces it and clears the half-written directory.
    run_on_ranks(2, _train_and_save, path, "B", "adagrad", timeout=TIMEOUT)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def _load_expecting_error(path: str, kind: str, table_kwargs: dict[str, Any], optimizer: str = "adagrad") -> str:
    """Loads into a model that may not match; returns the error after checking nothing changed."""
    model, opt = _model(kind, 1, optimizer, **table_kwargs)
    before = H.local_snapshot(model, opt)
    with pytest.raises(CheckpointError) as info:
        modular.checkpoint.load(path, model, opt)
    after = H.local_snapshot(model, opt)
    H.assert_unchanged(before, after, "a failed load")
    return str(info.value)


def test_mismatched_tables_fail_before_loading(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    run_on_ranks(2, _train_and_save, path, "A", "adagrad", timeout=TIMEOUT)
    messages = run_on_ranks(3, _load_expecting_error, path, "B", {"t1_rows": 8}, timeout=TIMEOUT)
    assert "table 't1' (ebc.embedding_bags.t1.weight)" in messages[0]
    assert "shape (7, 6), the model (8, 6)" in messages[0]
    assert "nothing was loaded" in messages[0]
    messages = run_on_ranks(2, _load_expecting_error, path, "A", {"t3_name": "t9"}, timeout=TIMEOUT)
    assert "table 't9' (ebc.embedding_bags.t9.weight): missing from the checkpoint" in messages[0]
    assert "holds table 't3' (ebc.embedding_bags.t3.weight), which the model does not have" in messages[0]


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/modular-checkpoint-pwned",))


def _rewrite_manifest_entry(directory: Path, name: str) -> None:
    manifest = json.loads((directory / MANIFEST).read_text())
    manifest["files"][name] = sha256_of(directory / name)
    (directory / MANIFEST).write_text(json.dumps(manifest))


def test_corrupted_or_malicious_files_fail_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    run_on_ranks(2, _train_and_save, str(path), "A", "adagrad", timeout=TIMEOUT)
    truncated, flipped, evil = (tmp_path / n for n in ("truncated", "flipped", "evil"))
    for d in (truncated, flipped, evil):
        shutil.copytree(path, d)
    data = truncated / "__1_0.distcp"
    data.write_bytes(data.read_bytes()[:-100])
    data = flipped / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    # A `.metadata` that would run a command if unpickled, with a manifest that vouches for it.
    (evil / ".metadata").write_bytes(pickle.dumps(_Evil()))
    _rewrite_manifest_entry(evil, ".metadata")
    marker = Path("/tmp/modular-checkpoint-pwned")
    marker.unlink(missing_ok=True)

    messages = run_on_ranks(2, _load_expecting_error, str(truncated), "A", {}, timeout=TIMEOUT)
    assert "__1_0.distcp" in messages[0] and "truncated" in messages[0], messages[0]
    assert all("__1_0.distcp" in m for m in messages), messages  # every rank raises, naming it
    messages = run_on_ranks(2, _load_expecting_error, str(flipped), "A", {}, timeout=TIMEOUT)
    assert "__0_0.distcp" in messages[0] and "corrupted" in messages[0], messages[0]
    with pytest.raises(Exception, match="posix.system|refusing to unpickle"):
        run_on_ranks(2, _load_and_snapshot, str(evil), "A", "adagrad", timeout=TIMEOUT)
    assert not marker.exists()


def test_a_fused_optimizer_of_another_kind_fails_before_loading(tmp_path: Path) -> None:
    """Fused row-wise Adagrad state loaded with fused SGD: refused before the weights are copied."""
    path = str(tmp_path / "ckpt")
    run_on_ranks(2, _train_and_save, path, "A", "fused", 1, timeout=TIMEOUT)
    messages = run_on_ranks(2, _load_expecting_error, path, "A", {}, "fused_sgd", timeout=TIMEOUT)
    for message in messages:
        assert "optimizer 'tables' (FusedOptimizer)" in message, message
        assert "the fused tables of module 'ebc'" in message, message
        assert "fused 'exact_rowwise_adagrad'" in message and "fused 'exact_sgd'" in message, message
        assert "nothing was loaded" in message, message


def test_per_shard_column_statistics_round_trip_and_refuse_the_other_layout(tmp_path: Path) -> None:
    """Per-piece row statistics (column_wise_statistic="per_shard") come back exactly under the
    plan they were saved with; exact ones, or another cut of the table, are refused by name
    before anything is read (Note [fused tables])."""
    per_shard, exact = str(tmp_path / "per_shard"), str(tmp_path / "exact")
    saved = H.assemble(run_on_ranks(2, _train_and_save, per_shard, "A", "fused_per_shard", timeout=TIMEOUT))
    # Plan A cuts t2 into 3 column pieces (two on rank 0): one column of statistics each.
    assert saved["optim.tables.state.ebc.embedding_bags.t2.weight.row_sum"].shape == (9, 3)
    loaded = H.assemble(run_on_ranks(2, _load_and_snapshot, per_shard, "A", "fused_per_shard", timeout=TIMEOUT))
    H.assert_same(saved, loaded, "per_shard, world 2 plan A -> the same")
    messages = run_on_ranks(2, _load_expecting_error, per_shard, "A", {}, "fused", timeout=TIMEOUT)
    for message in messages:
        assert "optimizer state 'row_sum' of table 't2' (ebc.embedding_bags.t2.weight) has shape (9, 3)" in message, message
        assert "fuse with column_wise_statistic='per_shard'" in message and "nothing was loaded" in message, message
    run_on_ranks(2, _train_and_save, exact, "A", "fused", 1, timeout=TIMEOUT)
    messages = run_on_ranks(2, _load_expecting_error, exact, "A", {}, "fused_per_shard", timeout=TIMEOUT)
    for message in messages:
        assert "optimizer state 'row_sum' of table 't2' (ebc.embedding_bags.t2.weight) has shape (9,)" in message, message
        assert "fuse with column_wise_statistic='exact', or shard the table without cutting" in message, message
    # Plan B cuts t1 into 2 pieces (saved whole, table-wise) and leaves t2 whole (saved in 3).
    message = run_on_ranks(2, _load_expecting_error, per_shard, "B", {}, "fused_per_shard", timeout=TIMEOUT)[0]
    assert "table 't1' (ebc.embedding_bags.t1.weight) has shape (7,)" in message, message
    assert "table 't2' (ebc.embedding_bags.t2.weight) has shape (9, 3)" in message, message
    assert "shard the table into 3 column pieces, as when it was saved" in message, message


def _save_over(root: str) -> list[str]:
    """Saves onto a directory and a file that are not checkpoints (refused), then into an empty
    directory twice (a new checkpoint, then one that replaces it)."""
    model = H.sharded_checkpoint_model("A", seed=0)
    messages = []
    for target in ("runs", "notes.txt"):
        with pytest.raises(CheckpointError) as info:
            modular.checkpoint.save(os.path.join(root, target), model)
        messages.append(str(info.value))
    for _ in range(2):
        modular.checkpoint.save(os.path.join(root, "empty"), model)
    return messages


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else b"<dir>" for p in sorted(root.rglob("*"))}


def test_save_refuses_a_path_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    """A checkpoint root holding the user's files (or a file) is refused before anything is
    written, on every rank; it used to be swapped out and deleted by the commit."""
    (tmp_path / "runs" / "step_00000100").mkdir(parents=True)
    (tmp_path / "runs" / "step_00000100" / "weights.bin").write_bytes(b"step 100")
    (tmp_path / "runs" / "metrics.csv").write_text("step,loss\n100,0.5\n")
    (tmp_path / "notes.txt").write_text("a file the user saved\n")
    (tmp_path / "empty").mkdir()
    before = _tree(tmp_path)
    messages = run_on_ranks(2, _save_over, str(tmp_path), timeout=TIMEOUT)
    for runs, notes in messages:
        assert f"to {str(tmp_path / 'runs')!r}: it exists and is not a modular checkpoint" in runs, runs
        assert f"to {str(tmp_path / 'notes.txt')!r}: it is a file" in notes, notes
        assert "nothing was written" in runs and "nothing was written" in notes
    after = _tree(tmp_path)
    assert {k: v for k, v in after.items() if not k.startswith("empty")} == {
        k: v for k, v in before.items() if k != "empty"
    }
    assert (tmp_path / "empty" / MANIFEST).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "notes.txt", "runs"]


def _export_to(rank: int) -> str:
    model = H.sharded_checkpoint_model("A", seed=0)
    with pytest.raises(CheckpointError) as info:
        modular.checkpoint.export(model, rank=rank)
    return str(info.value)


def _export_outside_the_group() -> str:
    """A model sharded over global ranks [1, 2] of 3, exported to rank 0, which holds none of it."""
    import torch.distributed as dist
    from planners.types import ShardingPlan

    group = dist.new_group(ranks=[1, 2])
    if dist.get_rank() == 0:
        return "not in the group"
    plan = ShardingPlan(world_size=2, modules={"ebc": H.checkpoint_placements("A", 2)})
    model = modular.shard(H.build_checkpoint_model(0), plan, process_group=group)
    with pytest.raises(CheckpointError) as info:
        modular.checkpoint.export(model, rank=0)
    return str(info.value)


def test_export_to_a_rank_that_cannot_receive_fails_on_every_rank() -> None:
    """It used to send shards to a rank that never receives: every rank hung in the store."""
    for rank in (2, -1):
        for message in run_on_ranks(2, _export_to, rank, timeout=30):
            assert f"export(model, rank={rank})" in message and "world size 2" in message, message
    outcome = run_on_ranks(3, _export_outside_the_group, timeout=30)
    assert outcome[0] == "not in the group"
    for message in outcome[1:]:
        assert "rank 0 is not in the process group of module 'ebc' (global ranks [1, 2])" in message, message


def _load_unsharded_fails(files: list[str]) -> list[str]:
    model = H.sharded_checkpoint_model("A", seed=1)
    before = H.local_snapshot(model)
    messages = []
    for file in files:
        with pytest.raises(CheckpointError) as info:
            modular.checkpoint.load_unsharded(model, file)
        messages.append(str(info.value))
    H.assert_unchanged(before, H.local_snapshot(model), "a failed load_unsharded")
    return messages


def test_load_unsharded_names_a_damaged_file_and_a_value_that_is_not_a_tensor(tmp_path: Path) -> None:
    state = H.build_checkpoint_model(seed=7).state_dict()
    good, truncated, listed = (tmp_path / n for n in ("good.pt", "truncated.pt", "listed.pt"))
    torch.save(state, good)
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    torch.save({**state, "ebc.embedding_bags.t1.weight": state["ebc.embedding_bags.t1.weight"].tolist()}, listed)
    checkpoint = tmp_path / "step_100"  # what a user may pass by mistake: a sharded checkpoint
    checkpoint.mkdir()
    (checkpoint / "checkpoint.json").write_text("{}")
    files = [str(truncated), str(listed), str(checkpoint)]
    for damaged, listed_message, directory in run_on_ranks(2, _load_unsharded_fails, files, timeout=TIMEOUT):
        assert directory.endswith("it is a checkpoint directory: load it with modular.checkpoint.load; nothing was loaded"), directory
        assert f"cannot read {str(truncated)!r}" in damaged, damaged
        assert f"{str(listed)!r}" in listed_message, listed_message
        assert "table 't1' (ebc.embedding_bags.t1.weight): the state dict holds a list, not a tensor" in listed_message
