"""DTensor tables (Note [table tensor types]) in checkpoints and composition: DCP checkpoints move
between ShardedTensor and DTensor tables across plans and world sizes bit for bit (fused state
included), export / load_unsharded work, FSDP2 and clipping compose, and nothing in the DTensor
form's life prints the ShardedTensor deprecation warning."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import modular
from modular.checkpoint._entries import optimizer_state
from modular.tables.forms import is_sharded, local_pieces
from planners.types import ShardingPlan
from tests.dist import run_on_ranks
from tests.modular import checkpoint_cases as H

TIMEOUT = 90.0


def _model(
    kind: str, seed: int, tensor_type: str, optimizer: str, fsdp: bool = False, ddp: bool = False
) -> tuple[H.CheckpointModel, Any]:
    model = H.build_checkpoint_model(seed)
    fused = None
    if optimizer == "fused":  # fused before shard (Note [order of sharding calls])
        fused = modular.fuse_optimizer(model, "exact_rowwise_adagrad", lr=0.1)
    world = dist.get_world_size()
    plan = ShardingPlan(world_size=world, modules={"ebc": H.checkpoint_placements(kind, world)})
    modular.shard(model, plan, tensor_type=tensor_type)
    if fsdp:
        modular.apply_fully_shard(model, modules={torch.nn.Linear})
    if ddp:
        modular.apply_ddp(model)
    if fused is None:
        return model, torch.optim.Adagrad(modular.local_parameters(model), lr=0.1)
    dense = torch.optim.Adam(modular.local_parameters(model), lr=0.01)
    return model, modular.CombinedOptimizer({"tables": fused, "dense": dense})


def _pieces(value: Any) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    if is_sharded(value):
        return [(p.offsets, p.tensor.detach().clone()) for p in local_pieces(value)]
    if isinstance(value, DTensor):  # FSDP2
        return [((0,) * value.dim(), value.full_tensor().detach().clone())]
    return [((0,) * value.dim(), value.detach().clone())]


def _snapshot(model: H.CheckpointModel, optimizer: Any) -> dict[str, Any]:
    """H.local_snapshot for either form: each entry's local pieces and global shape."""
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    state.update(optimizer_state(model, optimizer))
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    return {
        "outputs": H.eval_outputs(model),
        "pieces": {k: _pieces(v) for k, v in tensors.items()},
        "shapes": {k: tuple(v.size()) for k, v in tensors.items()},
        "types": {k: type(v).__name__ for k, v in tensors.items() if is_sharded(v)},
    }


def _train_and_save(path: str, kind: str, tensor_type: str, optimizer: str) -> dict[str, Any]:
    model, opt = _model(kind, 0, tensor_type, optimizer)
    H.train_checkpoint_model(model, opt, range(2))
    modular.checkpoint.save(path, model, opt)
    return _snapshot(model, opt)


def _load(path: str, kind: str, tensor_type: str, optimizer: str) -> dict[str, Any]:
    model, opt = _model(kind, 1, tensor_type, optimizer)
    modular.checkpoint.load(path, model, opt)
    return _snapshot(model, opt)


CROSS = [
    pytest.param(2, "A", "sharded_tensor", 3, "B", "dtensor", "adagrad", id="2A-st->3B-dt"),
    pytest.param(3, "B", "dtensor", 2, "A", "sharded_tensor", "adagrad", id="3B-dt->2A-st"),
    pytest.param(2, "C", "dtensor", 3, "A", "dtensor", "adagrad", id="2C-dt->3A-dt"),
    pytest.param(2, "A", "sharded_tensor", 3, "B", "dtensor", "fused", id="2A-st->3B-dt-fused"),
    pytest.param(3, "B", "dtensor", 2, "C", "sharded_tensor", "fused", id="3B-dt->2C-st-fused"),
]


@pytest.mark.parametrize("save_world, save_kind, save_type, load_world, load_kind, load_type, optimizer", CROSS)
def test_checkpoints_cross_load_between_forms_plans_and_world_sizes(
    tmp_path: Path, save_world: int, save_kind: str, save_type: str, load_world: int, load_kind: str,
    load_type: str, optimizer: str,
) -> None:
    path = str(tmp_path / "ckpt")
    saved_per_rank = run_on_ranks(save_world, _train_and_save, path, save_kind, save_type, optimizer, timeout=TIMEOUT)
    loaded_per_rank = run_on_ranks(load_world, _load, path, load_kind, load_type, optimizer, timeout=TIMEOUT)
    want = "DTensor" if load_type == "dtensor" else "ShardedTensor"
    types = {t for snap in loaded_per_rank for t in snap["types"].values()}
    assert types == {want}, types
    saved, loaded = H.assemble(saved_per_rank), H.assemble(loaded_per_rank)
    H.assert_same(saved, loaded, f"{save_type} -> {load_type}")


def _export_and_reload(kind: str, file: str) -> dict[str, Any]:
    model, opt = _model(kind, 0, "dtensor", "adagrad")
    H.train_checkpoint_model(model, opt, range(1))
    sd = modular.checkpoint.export(model)
    out = H.eval_outputs(model)
    if dist.get_rank() == 0:
        single = H.build_checkpoint_model(seed=3)
        single.load_state_dict(sd, strict=True)
        with torch.no_grad():
            assert torch.equal(single.ebc(H.checkpoint_global_batch(99, max_ids=1)).values(), out)
        torch.save(sd, file)
    dist.barrier()
    other, other_opt = _model("B", 5, "dtensor", "adagrad")
    modular.checkpoint.load_unsharded(other, file)
    assert torch.equal(H.eval_outputs(other), out)
    return {} if sd is None else {k: v.clone() for k, v in sd.items()}


@pytest.mark.parametrize("world", [2, 3])
def test_export_and_load_unsharded_with_dtensor_tables(tmp_path: Path, world: int) -> None:
    results = run_on_ranks(world, _export_and_reload, "A", str(tmp_path / "single.pt"), timeout=TIMEOUT)
    assert sorted(results[0]) == sorted(H.build_checkpoint_model(seed=0).state_dict())


def _compose_and_stay_quiet(path: str) -> dict[str, Any]:
    """FSDP2 on the dense layer, clipping, unshard and a checkpoint round trip of a DTensor-table
    model; the clipped norm equals the ShardedTensor form's. Returns the deprecation warnings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        norms = {}
        for tensor_type, wrap in [("dtensor", "fsdp"), ("dtensor", "ddp"), ("sharded_tensor", "fsdp")]:
            if tensor_type == "sharded_tensor":
                deprecated = [str(w.message) for w in caught if "DTensor instead" in str(w.message)]
            model, opt = _model("A", 0, tensor_type, "adagrad", fsdp=wrap == "fsdp", ddp=wrap == "ddp")
            if wrap == "fsdp":
                assert all(type(p) is DTensor for p in model.dense.parameters())  # FSDP2's
            H.train_checkpoint_model(model, opt, range(1))  # its mean of DDP's averaged grads is a no-op
            kjt = H.checkpoint_batch(5, dist.get_rank(), dist.get_world_size())
            model(kjt).sum().backward()
            norms[f"{tensor_type}/{wrap}"] = float(modular.clip_grad_norm_(model, 0.5))
            opt.step()
            if (tensor_type, wrap) == ("dtensor", "fsdp"):
                with modular.unshard(model, rank0_only=True):
                    pass
                modular.checkpoint.save(path, model, opt)
                modular.checkpoint.load(path, model, opt)
                modular.checkpoint.export(model)
    return {"deprecated": deprecated, "norms": norms}


def test_dtensor_tables_compose_and_print_no_deprecation_warning(tmp_path: Path) -> None:
    results = run_on_ranks(2, _compose_and_stay_quiet, str(tmp_path / "ckpt"), timeout=TIMEOUT)
    for rank, r in enumerate(results):
        assert r["deprecated"] == [], f"rank {rank}: {r['deprecated'][:3]}"
        st = r["norms"]["sharded_tensor/fsdp"]
        assert r["norms"]["dtensor/fsdp"] == pytest.approx(st, rel=1e-6), r["norms"]
        assert r["norms"]["dtensor/ddp"] == pytest.approx(st, rel=1e-5), r["norms"]
