"""The Adam family's state through modular.checkpoint (Note [fused Adam and LAMB]): moments and
the step count saved under plan-independent keys load at another world size and plan bit for bit
(2 -> 3 ranks; row-wise -> column-wise, data-parallel -> row-wise, ...), and training after the
load equals training without one; `export` and `load_unsharded` carry the tables as they do for
the other fused optimizers (the weights; optimizer state goes through `save`/`load`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import modular
from tests.dist import run_on_ranks
from tests.modular import checkpoint_cases as H
from tests.modular.adam_reference import ADAM_BETAS, ADAM_EPS, ADAM_FAMILY, ADAM_LR
from tests.modular.fused.test_fused_adam import whole

TIMEOUT = 90.0


def _model(kind: str, plan: str, seed: int) -> tuple[H.CheckpointModel, Any]:
    model = H.build_checkpoint_model(seed)
    fused = modular.fuse_optimizer(model, kind, lr=ADAM_LR, betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=0.01)
    H.shard_checkpoint_model(model, plan)
    dense = torch.optim.Adam(modular.local_parameters(model), lr=0.01)
    return model, modular.CombinedOptimizer({"tables": fused, "dense": dense})


def _full_state(model: H.CheckpointModel, opt: Any) -> dict[str, torch.Tensor]:
    """Every weight and fused state entry in full (collective), by key."""
    out = {f"model.{n}": whole(p) for n, p in model.named_parameters()}
    for fqn, states in opt.optimizers["tables"].state_dict()["state"].items():
        for name, value in states.items():
            out[f"{fqn}.{name}"] = value.clone() if name == "step" else whole(value)
    return out


def _save(path: str, kind: str, plan: str) -> tuple[dict[str, torch.Tensor], list[float]]:
    model, opt = _model(kind, plan, 0)
    H.train_checkpoint_model(model, opt, range(2))
    modular.checkpoint.save(path, model, opt)
    saved = _full_state(model, opt)
    return saved, H.train_checkpoint_model(model, opt, range(2, 4))


def _load(path: str, kind: str, plan: str) -> tuple[dict[str, torch.Tensor], list[float]]:
    model, opt = _model(kind, plan, 1)  # other weights than the saved ones, until loaded
    modular.checkpoint.load(path, model, opt)
    loaded = _full_state(model, opt)
    return loaded, H.train_checkpoint_model(model, opt, range(2, 4))


# Plan A -> B moves t3 data-parallel -> row-wise (and t0 back), t1 table-wise -> column-wise;
# B -> C moves t3 row-wise -> column-wise and t1 column-wise -> data-parallel.
@pytest.mark.timeout(200)
@pytest.mark.parametrize("save_plan, load_plan", [("A", "B"), ("B", "C")])
def test_moments_and_step_reshard_bit_for_bit_and_training_resumes(tmp_path: Path, save_plan: str, load_plan: str) -> None:
    for kind in ADAM_FAMILY:
        path = str(tmp_path / f"{kind}-{save_plan}")
        saved, uninterrupted = run_on_ranks(2, _save, path, kind, save_plan, timeout=TIMEOUT)[0]
        loaded, resumed = run_on_ranks(3, _load, path, kind, load_plan, timeout=TIMEOUT)[0]
        assert sorted(saved) == sorted(loaded), kind
        assert int(saved["ebc.embedding_bags.t3.weight.step"]) == 2, saved["ebc.embedding_bags.t3.weight.step"]
        for key, value in saved.items():
            assert torch.equal(value, loaded[key]), (
                f"{kind}, plan {save_plan} -> {load_plan}: {key} differs by up to "
                f"{(value - loaded[key]).abs().max().item()} (shape {tuple(value.shape)})"
            )
        # Another plan and world size pool in another order: equal to rounding.
        torch.testing.assert_close(resumed, uninterrupted, rtol=1e-5, atol=0)


def _export_and_load_unsharded(path: str) -> dict[str, torch.Tensor]:
    model, opt = _model("partial_rowwise_lamb", "A", 0)
    H.train_checkpoint_model(model, opt, range(2))
    sd = modular.checkpoint.export(model, rank=0)
    if dist.get_rank() == 0:
        torch.save(sd, path)
    dist.barrier()
    other, _ = _model("partial_rowwise_lamb", "C", 1)
    modular.checkpoint.load_unsharded(other, path)
    exported = {f"model.{k}": v.float() for k, v in torch.load(path).items()}
    got = {f"model.{n}": whole(p) for n, p in other.named_parameters()}
    trained = {f"model.{n}": whole(p) for n, p in model.named_parameters()}
    return {"exported": exported, "loaded": got, "trained": trained}


@pytest.mark.timeout(120)
def test_export_and_load_unsharded_carry_the_trained_tables(tmp_path: Path) -> None:
    result = run_on_ranks(2, _export_and_load_unsharded, str(tmp_path / "single.pt"), timeout=TIMEOUT)[0]
    assert sorted(result["exported"]) == sorted(result["trained"]) == sorted(
        f"model.{n}" for n, _ in H.build_checkpoint_model(0).named_parameters()
    )
    for key, value in result["trained"].items():
        assert torch.equal(result["exported"][key], value), key
        assert torch.equal(result["loaded"][key], value), key


def _load_into_another_kind(path: str, kind: str) -> str:
    model, opt = _model(kind, "A", 1)
    before = _full_state(model, opt)
    with pytest.raises(modular.CheckpointError) as info:
        modular.checkpoint.load(path, model, opt)
    after = _full_state(model, opt)
    for key, value in before.items():  # all or nothing: a refused load changed nothing
        assert torch.equal(value, after[key]), key
    return str(info.value)


@pytest.mark.timeout(120)
def test_state_of_another_adam_kind_is_refused_naming_both(tmp_path: Path) -> None:
    # Adam's and LAMB's state have the same names and shapes: the saved kind tells them apart.
    path = str(tmp_path / "adam")
    run_on_ranks(2, _save, path, "adam", "A", timeout=TIMEOUT)
    for message in run_on_ranks(2, _load_into_another_kind, path, "lamb", timeout=TIMEOUT):
        assert "the state is for fused 'adam' but this optimizer is 'lamb'; fuse with 'adam'" in message, message
        assert "nothing was loaded" in message, message
    # partial_rowwise keeps one second moment per row: the shapes differ, named per table.
    message = run_on_ranks(2, _load_into_another_kind, path, "partial_rowwise_adam", timeout=TIMEOUT)[0]
    assert "optimizer state 'exp_avg_sq' of table 't0' (ebc.embedding_bags.t0.weight) has shape (11, 4), one value per weight: adam or lamb, but this optimizer keeps (11,); fuse with 'adam' or 'lamb' to load it" in message, message
