"""`modular.shard` + FSDP2 (`modular.apply_fully_shard`) on a DLRM, against the unsharded model."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

import modular
from modular.compose.fsdp import dense_modules
from tests.dist import run_on_ranks
from tests.modular.compare import ATOL, assert_weights_match
from tests.modular.dlrm_cases import (
    DLRM, DLRM_LR, DLRM_STEPS, MLP, build_dlrm, dlrm_batch, global_dlrm_batch, global_loss, host_plan,
    loss_of, mixed_plan,
)

TIMEOUT = 90.0


def _train_fsdp(*, hsdp: bool = False, clip: float | None = None, **fsdp_kwargs) -> list[tuple[float, ...]]:
    """`DLRM_STEPS` steps of SGD on both sides; returns (sharded loss, reference loss[, norms]) per step."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if hsdp else None
    plan = host_plan() if hsdp else mixed_plan(world)
    s = build_dlrm(plan, lambda m: modular.apply_fully_shard(m, modules={MLP}, mesh=mesh, **fsdp_kwargs))
    opt = torch.optim.SGD(modular.local_parameters(s.model), lr=DLRM_LR)
    ref_opt = torch.optim.SGD(s.ref.parameters(), lr=DLRM_LR)
    curve = []
    for step in range(DLRM_STEPS):
        batches = [dlrm_batch(step, r) for r in range(world)]
        loss = loss_of(s.forward, batches[rank])
        loss.backward()
        ref_loss = loss_of(s.ref, global_dlrm_batch(batches))
        ref_loss.backward()
        point: tuple[float, ...] = (global_loss(loss), ref_loss.item())
        if clip is not None:
            norm = modular.clip_grad_norm_(s.model, clip)
            ref_norm = torch.nn.utils.clip_grad_norm_(s.ref.parameters(), clip)
            point += (norm.item(), ref_norm.item())
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        curve.append(point)
    assert_weights_match(s.model, s.ref, f"rank {rank} after {DLRM_STEPS} steps")
    return curve


def _check_curves(curves: list[list[tuple[float, ...]]]) -> None:
    for rank, curve in enumerate(curves):
        assert curve == curves[0], f"rank {rank} saw another loss curve than rank 0"
    for step, (loss, ref_loss, *norms) in enumerate(curves[0]):
        assert loss == pytest.approx(ref_loss, abs=ATOL), f"step {step}: {loss} vs reference {ref_loss}"
        if norms:
            assert norms[0] == pytest.approx(norms[1], rel=1e-5), f"step {step}: grad norm {norms}"
    assert curves[0][0][1] != pytest.approx(curves[0][-1][1], abs=1e-3), "the reference did not train"


@pytest.mark.parametrize("world", [2, 4])
def test_fully_shard_dense_trains_like_unsharded(world: int) -> None:
    _check_curves(run_on_ranks(world, _train_fsdp, timeout=TIMEOUT))


def test_no_reshard_after_forward_trains_like_unsharded() -> None:
    _check_curves(run_on_ranks(2, _train_fsdp, reshard_after_forward=False, timeout=TIMEOUT))


def test_hsdp_2x2_with_table_row_wise_within_hosts_trains_like_unsharded() -> None:
    curves = run_on_ranks(4, _train_fsdp, hsdp=True, clip=0.05, timeout=TIMEOUT)
    _check_curves(curves)
    assert any(ref_norm > 0.05 for *_, ref_norm in curves[0]), "clipping never engaged"


def _fully_sharded_fqns(selector: str) -> dict[str, object]:
    modules = {
        "mlp": {MLP},
        "nested": {MLP, nn.Linear},
        "has_params": lambda m: any(True for _ in m.parameters(recurse=False)),
    }[selector]
    s = build_dlrm(mixed_plan(dist.get_world_size()), lambda m: modular.apply_fully_shard(m, modules=modules))
    return {
        "fsdp": sorted(n for n, m in s.model.named_modules() if isinstance(m, FSDPModule)),
        "dtensors": sorted(n for n, p in s.model.named_parameters() if isinstance(p, DTensor)),
        "state_dict": list(s.model.state_dict()),
        "ref_state_dict": list(s.ref.state_dict()),
    }


@pytest.mark.parametrize(
    "selector, expected",
    [
        ("mlp", ["", "bottom", "top"]),
        ("nested", ["", "bottom", "bottom.0", "bottom.2", "top", "top.0", "top.2"]),
        # The tables' ShardedTable modules hold parameters too, but are inside a sharded EBC.
        ("has_params", ["", "bottom.0", "bottom.2", "top.0", "top.2"]),
    ],
)
def test_fully_sharded_modules_are_the_picked_ones_plus_the_root(selector: str, expected: list[str]) -> None:
    out = run_on_ranks(2, _fully_sharded_fqns, selector, timeout=TIMEOUT)[0]
    assert out["fsdp"] == expected
    dense = [f"{m}.{i}.{w}" for m in ("bottom", "top") for i in (0, 2) for w in ("bias", "weight")]
    assert out["dtensors"] == dense  # every dense parameter, and no table
    assert out["state_dict"] == out["ref_state_dict"]


def test_dense_modules_follows_modules_order_and_rejects_a_bare_class() -> None:
    model = DLRM()
    picked = dense_modules(model, {nn.Linear, MLP})
    assert picked == [m for m in model.modules() if isinstance(m, (nn.Linear, MLP))]
    with pytest.raises(TypeError, match=r"pass \{MLP\}"):
        dense_modules(model, MLP)  # type: ignore[arg-type]


def _reshard_state(reshard: bool) -> list[bool]:
    s = build_dlrm(mixed_plan(dist.get_world_size()),
              lambda m: modular.apply_fully_shard(m, modules={MLP}, reshard_after_forward=reshard))
    loss = loss_of(s.forward, dlrm_batch(0, dist.get_rank()))
    sharded_after_forward = [isinstance(s.model.bottom[0].weight, DTensor), isinstance(s.model.top[0].weight, DTensor)]
    loss.backward()
    return sharded_after_forward + [isinstance(s.model.bottom[0].weight, DTensor)]


@pytest.mark.parametrize("reshard", [True, False])
def test_reshard_after_forward_reaches_the_dense_modules(reshard: bool) -> None:
    # [bottom sharded after forward, top sharded after forward, bottom sharded after backward]
    assert run_on_ranks(2, _reshard_state, reshard, timeout=TIMEOUT)[0] == [reshard, reshard, True]


def _mixed_precision() -> dict[str, object]:
    world, rank = dist.get_world_size(), dist.get_rank()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    s = build_dlrm(mixed_plan(world), lambda m: modular.apply_fully_shard(m, modules={MLP}, mp_policy=mp))
    seen: dict[str, torch.dtype] = {}

    def record(name: str):
        def hook(module: nn.Module, args: object, out: torch.Tensor) -> None:
            seen.setdefault(name, module.weight.dtype)
        return hook

    for name in ("bottom.0", "top.0"):
        s.model.get_submodule(name).register_forward_hook(record(name))
    opt = torch.optim.SGD(modular.local_parameters(s.model), lr=DLRM_LR)
    ref_opt = torch.optim.SGD(s.ref.parameters(), lr=DLRM_LR)
    curve = []
    for step in range(3):
        batches = [dlrm_batch(step, r) for r in range(world)]
        loss = loss_of(s.forward, batches[rank])
        loss.backward()
        ref_loss = loss_of(s.ref, global_dlrm_batch(batches))
        ref_loss.backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        curve.append((global_loss(loss), ref_loss.item()))
    return {
        "compute": seen,
        "params": sorted({str(p.dtype) for p in modular.local_parameters(s.model)}),
        "curve": curve,
    }


def test_mixed_precision_policy_reaches_the_dense_modules_and_trains() -> None:
    out = run_on_ranks(2, _mixed_precision, timeout=TIMEOUT)[0]
    assert out["compute"] == {"bottom.0": torch.bfloat16, "top.0": torch.bfloat16}
    assert out["params"] == ["torch.float32"]  # sharded master weights and tables stay fp32
    for loss, ref_loss in out["curve"]:  # bf16 compute: close to the fp32 reference, not exact
        assert loss == pytest.approx(ref_loss, abs=2e-2)
