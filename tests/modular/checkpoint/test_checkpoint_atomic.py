"""No half-loaded model (Note [all or nothing] in modular/checkpoint/_apply.py).

The model is written the way torchrec's `TwoTowerRetrieval` is: it overrides
`load_state_dict(self, state_dict, strict=True)` without torch's `assign`, which
`set_model_state_dict` passes (it used to raise a raw TypeError after the tables were written).
It is saved with `modular.checkpoint.save` and exported, then loaded with `load` and
`load_unsharded` under another plan at another world size: every value equals the source bit for
bit, and the outputs equal the unsharded model's. Then every kind of failure, before or while
writing, must raise `CheckpointError` on every rank with every weight and the optimizer state as
they were before the call, compared bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import modular
from modular.checkpoint import CheckpointError
from modular.checkpoint._entries import optimizer_state
from planners.types import ShardingPlan, ShardingType, TablePlacement
from tests.dist import run_on_ranks
from tests.modular.checkpoint_cases import assemble, assert_same, assert_unchanged, state_pieces

TIMEOUT = 90.0
BATCH = 3


class TwoTower(nn.Module):
    """Query and candidate tables in one EBC (and, `with_ec`, a history EC), a projection and two
    buffers; `load_state_dict` overridden as in torchrec's examples/retrieval TwoTowerRetrieval."""

    def __init__(self, *, with_ec: bool, item_table: str = "t_item", temperature_rows: int = 1) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name="t_user", num_embeddings=13, embedding_dim=8, feature_names=["f_user"]),
            EmbeddingBagConfig(name=item_table, num_embeddings=11, embedding_dim=4, feature_names=["f_item"]),
        ])  # fmt: skip
        self.ec = None
        if with_ec:
            self.ec = EmbeddingCollection(tables=[
                EmbeddingConfig(name="s_hist", num_embeddings=17, embedding_dim=8, feature_names=["f_hist"]),
            ])  # fmt: skip
        self.proj = nn.Linear(12, 4)
        self.register_buffer("scale", torch.randn(4))
        self.register_buffer("temperature", torch.full((temperature_rows,), 2.0))

    def forward(self, bags: KeyedJaggedTensor, seq: Optional[KeyedJaggedTensor] = None) -> torch.Tensor:
        x = self.proj(self.ebc(bags).values()) * self.scale / self.temperature.mean()
        if self.ec is None:
            return x.flatten()
        return torch.cat([x.flatten(), self.ec(seq)["f_hist"].values().flatten()])

    def load_state_dict(self, state_dict, strict: bool = True):  # torchrec's signature: no `assign`
        return super().load_state_dict(state_dict, strict)


class RaisingTwoTower(TwoTower):
    """Loads what it is given, then raises on the last rank only: the other ranks' loads went in."""

    def load_state_dict(self, state_dict, strict: bool = True):
        result = super().load_state_dict(state_dict, strict)
        if dist.get_rank() == dist.get_world_size() - 1:
            raise RuntimeError("the candidate index could not be rebuilt")
        return result


class RenamingTwoTower(TwoTower):
    """Loads everything under other names: nothing it is given goes in, and it says so."""

    def load_state_dict(self, state_dict, strict: bool = True):
        return super().load_state_dict({f"tower.{k}": v for k, v in state_dict.items()}, strict)


class PickyAdam(torch.optim.Adam):
    """Refuses, on the last rank, state saved after a step: it fails after the fused tables'
    state (the optimizer part before it) went in, and accepts its own state back."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if dist.get_rank() == dist.get_world_size() - 1 and state_dict["state"]:
            raise ValueError("PickyAdam takes no state saved after a step")


MODELS = {"plain": TwoTower, "raising": RaisingTwoTower, "renaming": RenamingTwoTower}


def _plan(kind: str, world: int, with_ec: bool, item_table: str = "t_item") -> ShardingPlan:
    last = world - 1
    if kind == "save":
        ebc = {"t_user": TablePlacement(ShardingType.ROW_WISE),
               item_table: TablePlacement(ShardingType.TABLE_WISE, ranks=(last,))}  # fmt: skip
        ec = {"s_hist": TablePlacement(ShardingType.COLUMN_WISE, ranks=(last, 0))}
    else:  # every table changes type; t_item becomes data-parallel, loaded with the dense entries
        ebc = {"t_user": TablePlacement(ShardingType.COLUMN_WISE, ranks=(0, last)),
               item_table: TablePlacement(ShardingType.DATA_PARALLEL)}  # fmt: skip
        ec = {"s_hist": TablePlacement(ShardingType.ROW_WISE)}
    return ShardingPlan(world_size=world, modules={"ebc": ebc, **({"ec": ec} if with_ec else {})})


def _build(
    seed: int, plan: str, *, with_ec: bool, model: str = "plain", dense_opt: type = torch.optim.Adam,
    **model_kwargs: Any,
) -> tuple[TwoTower, Any]:
    """The model built with `seed`, its tables fused with row-wise Adagrad, sharded by `plan` over
    the default group; the optimizer: the fused tables' beside `dense_opt` for the rest."""
    torch.manual_seed(seed)
    tower = MODELS[model](with_ec=with_ec, **model_kwargs)
    tables = modular.fuse_optimizer(tower, "exact_rowwise_adagrad", lr=0.1)
    item = model_kwargs.get("item_table", "t_item")
    modular.shard(tower, _plan(plan, dist.get_world_size(), with_ec, item))
    dense = dense_opt(modular.local_parameters(tower), lr=0.01)
    return tower, modular.CombinedOptimizer({"tables": tables, "dense": dense})


def _batches(with_ec: bool) -> tuple[KeyedJaggedTensor, Optional[KeyedJaggedTensor]]:
    """The same batch on every rank, so that replicated weights stay equal without averaging."""
    bags = KeyedJaggedTensor(
        keys=["f_user", "f_item"], values=torch.tensor([1, 12, 5, 0, 10, 3, 7]),
        lengths=torch.tensor([2, 0, 1, 1, 2, 1]),
    )  # fmt: skip
    seq = KeyedJaggedTensor(keys=["f_hist"], values=torch.tensor([16, 2, 9, 9, 0]), lengths=torch.tensor([1, 3, 1]))
    return bags, seq if with_ec else None


def _snapshot(model: TwoTower, optimizer: Any = None) -> dict[str, Any]:
    """This rank's pieces of every weight (and optimizer state), and the outputs on the batch."""
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    if optimizer is not None:
        state.update(optimizer_state(model, optimizer))
    state = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}  # not param groups
    with torch.no_grad():
        outputs = model(*_batches(model.ec is not None))
    return {
        "outputs": outputs,
        "pieces": {k: state_pieces(v) for k, v in state.items()},
        "shapes": {k: tuple(v.size()) for k, v in state.items()},
    }


def _train_save_export(path: str, file: str, with_ec: bool) -> dict[str, Any]:
    model, opt = _build(0, "save", with_ec=with_ec)
    loss = model(*_batches(with_ec)).square().sum()
    loss.backward()
    opt.step()
    modular.checkpoint.save(path, model, opt)
    sd = modular.checkpoint.export(model)
    if sd is not None:
        torch.save(sd, file)
    return _snapshot(model, opt)


def _load_both_ways(path: str, file: str, with_ec: bool) -> list[dict[str, Any]]:
    """Snapshots after `load`, `load_unsharded`, and `load_unsharded` given `torch.compile(model)`
    (whose state_dict keys have `_orig_mod.`, which FQNs leave out)."""
    model, opt = _build(1, "load", with_ec=with_ec)  # other weights until loaded
    modular.checkpoint.load(path, model, opt)
    snapshots = [_snapshot(model, opt)]
    model, _ = _build(2, "load", with_ec=with_ec)
    modular.checkpoint.load_unsharded(model, file)
    snapshots.append(_snapshot(model))
    model, _ = _build(3, "load", with_ec=with_ec)
    modular.checkpoint.load_unsharded(torch.compile(model), file)
    return snapshots + [_snapshot(model)]


def _save(tmp_path: Path, world: int, with_ec: bool) -> tuple[str, str, dict[str, torch.Tensor]]:
    path, file = str(tmp_path / "ckpt"), str(tmp_path / "exported.pt")
    source = assemble(run_on_ranks(world, _train_save_export, path, file, with_ec, timeout=TIMEOUT))
    return path, file, source


@pytest.mark.timeout(240)
@pytest.mark.parametrize("with_ec, save_world, load_world", [(False, 2, 3), (True, 3, 2)], ids=["ebc-2to3", "ec-3to2"])
def test_an_override_without_assign_loads_bit_for_bit(tmp_path: Path, with_ec: bool, save_world: int, load_world: int) -> None:
    path, file, source = _save(tmp_path, save_world, with_ec)
    exported = torch.load(file, weights_only=True)
    assert any(k.startswith("optim.tables.state.") for k in source) and "optim.dense.state.proj.weight.exp_avg" in source
    assert_same({k: v for k, v in source.items() if k.startswith("model.")}, {f"model.{k}": v for k, v in exported.items()}, "export")
    per_rank = run_on_ranks(load_world, _load_both_ways, path, file, with_ec, timeout=TIMEOUT)
    loaded, unsharded, compiled = (assemble([p[i] for p in per_rank]) for i in range(3))
    outputs = source.pop("outputs")
    assert_same(source, {k: v for k, v in loaded.items() if k != "outputs"}, f"load at world {load_world}")
    model_source = {k: v for k, v in source.items() if k.startswith("model.")}
    for what, got in [("load_unsharded", unsharded), ("load_unsharded(torch.compile(model))", compiled)]:
        assert_same(model_source, {k: v for k, v in got.items() if k != "outputs"}, f"{what} at world {load_world}")
    reference = TwoTower(with_ec=with_ec)
    reference.load_state_dict(exported, strict=True)
    with torch.no_grad():
        expected = reference(*_batches(with_ec))
    torch.testing.assert_close(outputs, expected, rtol=1e-6, atol=1e-6)
    for rank, snapshots in enumerate(per_rank):
        for got in snapshots:
            torch.testing.assert_close(got["outputs"], expected, rtol=1e-6, atol=1e-6, msg=f"rank {rank}")


# -- failures: nothing changes, anywhere ---------------------------------------------------------


def _failures(path: str, files: dict[str, str]) -> dict[str, str]:
    """Each failing call on a fresh model; its message, after checking that this rank's weights,
    optimizer state and outputs are what they were before it, bit for bit."""
    calls = {
        "load: a dense key of another shape": (
            {"temperature_rows": 2}, lambda m, o: modular.checkpoint.load(path, m, o)),
        "load: a table missing from the checkpoint": (
            {"item_table": "t_thing"}, lambda m, o: modular.checkpoint.load(path, m, o)),
        "load: the override raises midway": (
            {"model": "raising"}, lambda m, o: modular.checkpoint.load(path, m, o)),
        "load: an optimizer part raises after another loaded": (
            {"dense_opt": PickyAdam}, lambda m, o: modular.checkpoint.load(path, m, o)),
        "load_unsharded: a dense key of another shape": (
            {}, lambda m, o: modular.checkpoint.load_unsharded(m, files["wrong_shape"])),
        "load_unsharded: a table missing from the file": (
            {}, lambda m, o: modular.checkpoint.load_unsharded(m, files["missing_table"])),
        "load_unsharded: the override raises midway": (
            {"model": "raising"}, lambda m, o: modular.checkpoint.load_unsharded(m, files["good"])),
        "load_unsharded: the override loads nothing": (
            {"model": "renaming"}, lambda m, o: modular.checkpoint.load_unsharded(m, files["good"])),
    }  # fmt: skip
    messages = {}
    for what, (kwargs, call) in calls.items():
        model, opt = _build(1, "load", with_ec=False, **kwargs)
        before = _snapshot(model, opt)
        with pytest.raises(CheckpointError) as info:
            call(model, opt)
        assert_unchanged(before, _snapshot(model, opt), f"rank {dist.get_rank()}, {what}")
        messages[what] = str(info.value)
    return messages


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, str]]:
    """A checkpoint of the EBC model saved at world 2, its export, and two damaged copies."""
    root = tmp_path_factory.mktemp("atomic")
    path, file, _ = _save(root, 2, with_ec=False)
    state = torch.load(file, weights_only=True)
    files = {"good": file, "wrong_shape": str(root / "wrong_shape.pt"), "missing_table": str(root / "missing_table.pt")}
    torch.save({**state, "proj.weight": torch.zeros(4, 13)}, files["wrong_shape"])
    torch.save({k: v for k, v in state.items() if k != "ebc.embedding_bags.t_user.weight"}, files["missing_table"])
    return path, files


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 3])
def test_every_failure_raises_on_every_rank_and_changes_nothing(saved: tuple[str, dict[str, str]], world: int) -> None:
    path, files = saved
    last = world - 1
    expected = {  # what each rank's message must say (the failing rank, or the others about it)
        "load: a dense key of another shape": ["'temperature': the checkpoint holds shape (1,), the model (2,)"],
        "load: a table missing from the checkpoint": [
            "table 't_thing' (ebc.embedding_bags.t_thing.weight): missing from the checkpoint",
            "holds table 't_item' (ebc.embedding_bags.t_item.weight), which the model does not have",
        ],
        "load: the override raises midway": [
            f"failed on rank {last} in RaisingTwoTower.load_state_dict: RuntimeError: the candidate index",
            "nothing was loaded",
        ],
        "load: an optimizer part raises after another loaded": [
            f"failed on rank {last} in optimizer 'dense' (PickyAdam).load_state_dict: ValueError",
            "nothing was loaded",
        ],
        "load_unsharded: a dense key of another shape": ["'proj.weight': the state dict holds shape (4, 13), the model (4, 12)"],
        "load_unsharded: a table missing from the file": [
            "table 't_user' (ebc.embedding_bags.t_user.weight): missing from the state dict",
        ],
        "load_unsharded: the override raises midway": [
            f"{files['good']!r} failed on rank {last} in RaisingTwoTower.load_state_dict: RuntimeError",
            "put back the weights",
        ],
        "load_unsharded: the override loads nothing": [
            "RenamingTwoTower.load_state_dict: it left 5 of the 5 entries it was given unloaded "
            "('ebc.embedding_bags.t_item.weight', 'proj.bias', 'proj.weight', 'scale', 'temperature')",
            "and it reported keys the model does not have ('tower.ebc.embedding_bags.t_item.weight', ",
        ],
    }  # fmt: skip
    for rank, messages in enumerate(run_on_ranks(world, _failures, path, files, timeout=TIMEOUT)):
        assert sorted(messages) == sorted(expected)
        for what, parts in expected.items():
            for part in parts:
                assert part in messages[what], f"rank {rank}, {what}: {messages[what]}"
            assert "nothing was loaded" in messages[what], f"rank {rank}, {what}: {messages[what]}"
            if rank != last and "raise" in what:
                assert messages[what].startswith(f"rank {last} failed, so every rank stops"), messages[what]
