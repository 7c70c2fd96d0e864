"""`modular.shard` + DDP (`modular.apply_ddp`) on a DLRM, against the unsharded model."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed._composable import replicate
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

import modular
from tests.dist import run_on_ranks
from tests.modular.compare import ATOL, assert_grads_match, assert_weights_match
from tests.modular.dlrm_cases import (
    DLRM_LR, DLRM_STEPS, build_dlrm, dlrm_batch, global_dlrm_batch, global_loss, loss_of, mixed_plan,
)

TIMEOUT = 90.0


def _train_ddp() -> dict[str, object]:
    world, rank = dist.get_world_size(), dist.get_rank()
    s = build_dlrm(mixed_plan(world), modular.apply_ddp)
    ddp = s.forward
    assert ddp is s.model, "apply_ddp works in place and returns the model it was given"
    reduced: list[int] = []

    def counting_allreduce(state, bucket):  # no annotations: DDP checks them, and they are strings here
        reduced.append(bucket.buffer().numel())
        return allreduce_hook(None, bucket)

    ddp.register_comm_hook(None, counting_allreduce)
    opt = torch.optim.SGD(modular.local_parameters(s.model), lr=DLRM_LR)
    ref_opt = torch.optim.SGD(s.ref.parameters(), lr=DLRM_LR)
    curve = []
    for step in range(DLRM_STEPS):
        batches = [dlrm_batch(step, r) for r in range(world)]
        loss = loss_of(ddp, batches[rank])
        loss.backward()
        ref_loss = loss_of(s.ref, global_dlrm_batch(batches))
        ref_loss.backward()
        if step == 0:  # data-parallel tables included: a second reduction would change nothing
            assert_grads_match(s.model, s.ref, f"rank {rank}, step 0")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        curve.append((global_loss(loss), ref_loss.item()))
    assert_weights_match(s.model, s.ref, f"rank {rank} after {DLRM_STEPS} steps")
    dense = {n: p.numel() for n, p in s.model.named_parameters() if not n.startswith("sparse.")}
    return {
        "curve": curve,
        "ddp_params": sorted(n for n, p in s.model.named_parameters() if any(p is q for q in replicate.state(ddp)._param_list)),
        "dense_params": sorted(dense),
        "reduced_per_step": sum(reduced) / DLRM_STEPS,
        "dense_numel": sum(dense.values()),
    }


@pytest.mark.parametrize("world", [2, 4])
def test_ddp_dense_trains_like_unsharded_and_never_reduces_a_table(world: int) -> None:
    outs = run_on_ranks(world, _train_ddp, timeout=TIMEOUT)
    out = outs[0]
    for rank, other in enumerate(outs):
        assert other["curve"] == out["curve"], f"rank {rank} saw another loss curve than rank 0"
    for step, (loss, ref_loss) in enumerate(out["curve"]):
        assert loss == pytest.approx(ref_loss, abs=ATOL), f"step {step}: {loss} vs reference {ref_loss}"
    assert out["curve"][0][1] != pytest.approx(out["curve"][-1][1], abs=1e-3), "the reference did not train"
    # DDP holds exactly the dense parameters and all-reduces exactly their elements each step.
    assert out["ddp_params"] == out["dense_params"]
    assert out["reduced_per_step"] == out["dense_numel"]
