"""`modular.clip_grad_norm_`, `local_parameters` and the optimizer guard on a sharded DLRM."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor

import modular
from modular.kernels.views import ShardView
from tests.dist import run_on_ranks
from tests.modular.compare import assert_grads_match, full_value
from tests.modular.dlrm_cases import MLP, build_dlrm, dlrm_batch, global_dlrm_batch, loss_of, mixed_plan

TIMEOUT = 90.0
WRAPS = {
    "fsdp": lambda m: modular.apply_fully_shard(m, modules={MLP}),
    "ddp": modular.apply_ddp,
}


def _backward_both(wrap: str):
    world, rank = dist.get_world_size(), dist.get_rank()
    s = build_dlrm(mixed_plan(world), WRAPS[wrap])
    batches = [dlrm_batch(0, r) for r in range(world)]
    loss_of(s.forward, batches[rank]).backward()
    loss_of(s.ref, global_dlrm_batch(batches)).backward()
    return s


def _clip(wrap: str, norm_type: float) -> tuple[float, float, float]:
    s = _backward_both(wrap)
    ref_grads = [p.grad for p in s.ref.parameters()]
    max_norm = 0.3 * torch.nn.utils.get_total_norm(ref_grads, norm_type).item()  # so that it clips
    total = modular.clip_grad_norm_(s.model, max_norm, norm_type)
    ref_total = torch.nn.utils.clip_grad_norm_(s.ref.parameters(), max_norm, norm_type)
    assert_grads_match(s.model, s.ref, f"rank {dist.get_rank()}: clipped to {max_norm}")
    return total.item(), ref_total.item(), max_norm


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("wrap, world", [("fsdp", 2), ("fsdp", 4), ("ddp", 2)])
def test_clip_grad_norm_matches_torch_on_the_unsharded_model(wrap: str, world: int, norm_type: float) -> None:
    out = run_on_ranks(world, _clip, wrap, norm_type, timeout=TIMEOUT)
    assert all(o[0] == out[0][0] for o in out), f"ranks disagree on the total norm: {out}"
    total, ref_total, max_norm = out[0]
    assert total == pytest.approx(ref_total, rel=1e-6)
    assert ref_total > max_norm  # the gradients were clipped, and matched after clipping


def _clip_with_fused_tables() -> dict[str, object]:
    world, rank = dist.get_world_size(), dist.get_rank()
    fuse = lambda m: modular.fuse_optimizer(m, "exact_sgd", lr=0.1)  # noqa: E731 (before shard)
    s = build_dlrm(mixed_plan(world), WRAPS["fsdp"], before_shard=fuse)
    batches = [dlrm_batch(0, r) for r in range(world)]
    loss_of(s.model, batches[rank]).backward()
    loss_of(s.ref, global_dlrm_batch(batches)).backward()
    dense = {n: p for n, p in s.ref.named_parameters() if not n.startswith("sparse.")}
    total = modular.clip_grad_norm_(s.model, 0.01)
    ref_total = torch.nn.utils.clip_grad_norm_(dense.values(), 0.01)
    for name, p in s.model.named_parameters():
        if name in dense:
            torch.testing.assert_close(p.grad.full_tensor(), dense[name].grad, atol=1e-6, rtol=0)
    table_grads = []
    for p in s.model.sparse.parameters():
        tensors = [sh.tensor for sh in p.local_shards()] if isinstance(p, ShardedTensor) else [p]
        table_grads.extend(t.grad for t in tensors)
    return {
        "total": total.item(),
        "ref_total": ref_total.item(),
        "table_grads": [g is None for g in table_grads],
        "local_parameters": sorted({type(p).__name__ for p in modular.local_parameters(s.model)}),
    }


def test_fused_tables_are_neither_counted_nor_clipped_nor_handed_to_the_optimizer() -> None:
    out = run_on_ranks(2, _clip_with_fused_tables, timeout=TIMEOUT)[0]
    assert out["total"] == pytest.approx(out["ref_total"], rel=1e-6)  # the dense gradients' norm
    assert out["table_grads"] and all(out["table_grads"])
    assert out["local_parameters"] == ["DTensor"]  # FSDP's dense parameters only


def _local_parameters_and_guard() -> dict[str, object]:
    world, rank = dist.get_world_size(), dist.get_rank()
    s = build_dlrm(mixed_plan(world), WRAPS["fsdp"])
    mine = modular.local_parameters(s.model)
    expected = []
    for _, p in s.model.named_parameters():
        expected.extend([sh.tensor for sh in p.local_shards()] if isinstance(p, ShardedTensor) else [p])
    ignored = modular.ignored_params(s.model)

    # The mistake: a torch optimizer over model.parameters() holds the ShardedTensor wrappers.
    before = [full_value(p).clone() for p in s.model.parameters()]
    opt = torch.optim.SGD([p for p in s.model.parameters() if p.requires_grad], lr=0.5)
    loss_of(s.forward, dlrm_batch(0, rank)).backward()
    with pytest.raises(TypeError) as raised:
        opt.step()
    after = [full_value(p) for p in s.model.parameters()]

    # The hook remembers an optimizer it checked; a sharded table added later is still caught.
    good = torch.optim.SGD(mine, lr=0.0)
    loss_of(s.forward, dlrm_batch(1, rank)).backward()
    good.step()
    good.add_param_group({"params": [p for p in s.model.sparse.parameters() if isinstance(p, ShardedTensor)][:1]})
    with pytest.raises(TypeError, match="param group 1, parameter 0 is a ShardedTensor"):
        good.step()
    return {
        "same_as_named_order": len(mine) == len(expected) and all(a is b for a, b in zip(mine, expected)),
        "kinds": sorted({type(p).__name__ for p in mine}),
        "any_sharded_tensor": any(isinstance(p, ShardedTensor) for p in mine),
        "ignored_are_tables": {id(p) for p in ignored} == {id(p) for p in s.model.sparse.parameters()},
        "unchanged": all(torch.equal(a, b) for a, b in zip(before, after)),
        "error": str(raised.value),
    }


def test_local_parameters_and_the_loud_error_for_sharded_tensors_in_an_optimizer() -> None:
    out = run_on_ranks(2, _local_parameters_and_guard, timeout=TIMEOUT)[0]
    assert out["same_as_named_order"]
    assert out["kinds"] == sorted({DTensor.__name__, ShardView.__name__})
    assert not out["any_sharded_tensor"]
    assert out["ignored_are_tables"]
    assert out["unchanged"], "the optimizer updated something before raising"
    assert "is a ShardedTensor of size (23, 8)" in out["error"]
    assert "modular.local_parameters(model)" in out["error"]


def test_norm_type_must_be_positive() -> None:
    with pytest.raises(ValueError, match="norm_type must be a positive number or inf, got 0"):
        modular.clip_grad_norm_(nn.Linear(2, 2), 1.0, 0)
