"""Checkpoints of FP16 tables keep each table's dtype (Note [low-precision tables]).

The checkpoint model (tests/modular/checkpoint_cases.py) with 't0', 't1' and 't3' in FP16 and 't2' in
FP32, fused row-wise Adagrad on the tables (FP32 state) and Adam on the dense layer: saved from 2
ranks under plan "A", loaded on 3 under plan "B" (every table changes sharding type), exported to
one process and loaded with `load_unsharded`. A checkpoint of another dtype than the model's
loads only with `convert_dtypes=True`, otherwise every rank raises naming the table.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torchrec.modules.embedding_configs import DataType

import modular
from planners.types import ShardingPlan
from tests.dist import expect_errors_on_all_ranks, run_on_ranks
from tests.modular import checkpoint_cases as H

TIMEOUT = 120.0
FP16_TABLES = ("t0", "t1", "t3")


def _build(seed: int, fp16: tuple[str, ...] = FP16_TABLES) -> H.CheckpointModel:
    torch.manual_seed(seed)
    configs = H.checkpoint_tables()
    for c in configs:
        if c.name in fp16:
            c.data_type = DataType.FP16
    return H.CheckpointModel(configs)


def _sharded(kind: str, seed: int, fp16: tuple[str, ...] = FP16_TABLES) -> tuple[H.CheckpointModel, Any]:
    model = _build(seed, fp16)
    fused = modular.fuse_optimizer(model, "exact_rowwise_adagrad", lr=0.1)
    world = dist.get_world_size()
    modular.shard(model, ShardingPlan(world_size=world, modules={"ebc": H.checkpoint_placements(kind, world)}))
    dense = torch.optim.Adam(modular.local_parameters(model), lr=0.01)
    return model, modular.CombinedOptimizer({"tables": fused, "dense": dense})


def _train_and_save(path: str) -> dict[str, Any]:
    model, opt = _sharded("A", seed=0)
    H.train_checkpoint_model(model, opt, range(2))
    modular.checkpoint.save(path, model, opt)
    return H.local_snapshot(model, opt)


def _load(path: str, kind: str, fp16: tuple[str, ...], convert: bool) -> dict[str, Any]:
    model, opt = _sharded(kind, seed=1, fp16=fp16)
    modular.checkpoint.load(path, model, opt, **({"convert_dtypes": True} if convert else {}))
    return H.local_snapshot(model, opt)


def _export() -> Any:
    model, opt = _sharded("B", seed=2)
    sd = modular.checkpoint.export(model)
    if dist.get_rank() != 0:
        return None
    single = _build(seed=3)
    single.load_state_dict(sd, strict=True)
    return {k: v.clone() for k, v in sd.items()}


def _load_unsharded(file: str, convert: bool) -> dict[str, Any]:
    model, _ = _sharded("C", seed=1)
    modular.checkpoint.load_unsharded(model, file, **({"convert_dtypes": True} if convert else {}))
    return H.local_snapshot(model)


def _dtypes(per_rank: list[dict[str, Any]]) -> dict[str, torch.dtype]:
    """The dtype of each table's pieces, on every rank that holds one (they must agree)."""
    out: dict[str, set] = {}
    for snap in per_rank:
        for key, parts in snap["pieces"].items():
            if key.startswith("model.ebc."):
                out.setdefault(key, set()).update(t.dtype for _, t in parts)
    assert all(len(d) == 1 for d in out.values()), out
    return {k: d.pop() for k, d in out.items()}


def _assembled(per_rank: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """H.assemble, with each table in the dtype its pieces have (a rank holding none of a table
    would otherwise set it to FP32)."""
    dtypes = _dtypes(per_rank)
    return {k: v.to(dtypes[k]) if k in dtypes else v for k, v in H.assemble(per_rank).items()}


def test_fp16_checkpoints_keep_dtypes_across_plans_and_world_sizes(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    raw = run_on_ranks(2, _train_and_save, path, timeout=TIMEOUT)
    saved = _assembled(raw)
    want = {f"model.ebc.embedding_bags.{t}.weight": torch.float16 if t in FP16_TABLES else torch.float32
            for t in ("t0", "t1", "t2", "t3")}
    assert _dtypes(raw) == want
    assert all(v.dtype == torch.float32 for k, v in saved.items() if k.endswith(".row_sum"))
    raw = run_on_ranks(3, _load, path, "B", FP16_TABLES, False, timeout=TIMEOUT)
    loaded = _assembled(raw)
    assert _dtypes(raw) == want
    H.assert_same(saved, loaded, "world 2 plan A -> world 3 plan B")

    # Into FP32 tables: refused, naming the first FP16 table, unless converted.
    for message in expect_errors_on_all_ranks(2, _load, path, "B", (), False, timeout=TIMEOUT):
        assert "embedding_bags.t0.weight" in message and "float16" in message and "convert_dtypes=True" in message, message
    raw = run_on_ranks(2, _load, path, "B", (), True, timeout=TIMEOUT)
    converted = _assembled(raw)
    assert set(_dtypes(raw).values()) == {torch.float32}
    for key, value in saved.items():
        if key.startswith("model.ebc."):
            assert torch.equal(converted[key], value.float()), key  # FP16 -> FP32 is exact


def test_fp16_export_and_load_unsharded_keep_dtypes(tmp_path: Path) -> None:
    sd = run_on_ranks(2, _export, timeout=TIMEOUT)[0]
    assert sd["ebc.embedding_bags.t0.weight"].dtype == torch.float16
    assert sd["ebc.embedding_bags.t2.weight"].dtype == torch.float32
    file = tmp_path / "single.pt"
    torch.save(sd, file)
    got = _assembled(run_on_ranks(3, _load_unsharded, str(file), False, timeout=TIMEOUT))
    H.assert_same({f"model.{k}": v for k, v in sd.items()}, {k: v for k, v in got.items() if k != "outputs"}, "load_unsharded")
    # An FP32 state dict into the FP16 tables: refused unless converted (then rounded to FP16).
    fp32 = tmp_path / "fp32.pt"
    torch.save({k: v.float() if v.is_floating_point() else v for k, v in _build(seed=4).state_dict().items()}, fp32)
    for message in expect_errors_on_all_ranks(2, _load_unsharded, str(fp32), False, timeout=TIMEOUT):
        assert "embedding_bags.t0.weight" in message and "convert_dtypes=True" in message, message
    got = _assembled(run_on_ranks(2, _load_unsharded, str(fp32), True, timeout=TIMEOUT))
    source = torch.load(fp32)
    assert got["model.ebc.embedding_bags.t0.weight"].dtype == torch.float16
    assert torch.equal(got["model.ebc.embedding_bags.t0.weight"], source["ebc.embedding_bags.t0.weight"].half())
