"""A batch size per rank with the dense part under DDP and under FSDP2 (docs/batch_per_rank.md,
"How gradients combine"): a DLRM whose tables `modular.shard` places on every sharding kind and
whose MLPs `modular.apply_ddp` or `modular.apply_fully_shard` wraps, each rank on its own batch
size (one rank's is 0 in one step), trained against the one-process model whose loss is the mean
over ranks of each rank's mean loss. Plain SGD on both sides, so a gradient averaged per sample
instead of per rank (or not averaged) would show in the weights."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import modular
from tests.dist import run_on_ranks
from tests.modular.compare import ATOL, assert_weights_match
from tests.modular.dlrm_cases import DLRM_LR, MLP, Batch, build_dlrm, dlrm_batch, global_dlrm_batch, mixed_plan

TIMEOUT = 120.0
STEPS = 4
# Batch sizes per step and rank: unequal everywhere, and rank 1 has none in step 2.
SIZES = ((3, 6, 2), (5, 1, 4), (2, 0, 7), (4, 7, 1))


def _rank_loss(model, batch: Batch) -> torch.Tensor:
    """A rank's mean loss; 0 for an empty batch (torch's mean of nothing is NaN)."""
    logits = model(batch.dense, batch.sparse).float()
    loss = F.binary_cross_entropy_with_logits(logits, batch.labels, reduction="sum")
    return loss / max(len(batch.labels), 1)


def _train(wrapper: str) -> list[tuple[float, float]]:
    world, rank = dist.get_world_size(), dist.get_rank()
    wrap = {
        "ddp": lambda m: modular.apply_ddp(m),
        "fsdp": lambda m: modular.apply_fully_shard(m, modules={MLP}),
    }[wrapper]
    s = build_dlrm(mixed_plan(world), wrap)
    opt = torch.optim.SGD(modular.local_parameters(s.model), lr=DLRM_LR)
    ref_opt = torch.optim.SGD(s.ref.parameters(), lr=DLRM_LR)
    curve = []
    for step in range(STEPS):
        batches = [dlrm_batch(step, r, SIZES[step][r]) for r in range(world)]
        loss = _rank_loss(s.forward, batches[rank])
        loss.backward()
        # The reference: one forward over the global batch, its per-sample losses averaged
        # within each rank's slice, then over ranks (the objective DDP and FSDP2 optimise).
        whole = global_dlrm_batch(batches)
        per_sample = F.binary_cross_entropy_with_logits(
            s.ref(whole.dense, whole.sparse).float(), whole.labels, reduction="none"
        )
        slices = per_sample.split([len(b.labels) for b in batches])
        ref_loss = sum(p.sum() / max(len(p), 1) for p in slices) / world
        ref_loss.backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        curve.append((mean.item() / world, ref_loss.item()))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    assert_weights_match(s.model, s.ref, f"{wrapper}, rank {rank}/{world} after {STEPS} steps")
    return curve


@pytest.mark.parametrize("world,wrapper", [(3, "ddp"), (2, "fsdp")])
def test_dense_part_averages_rank_means_with_a_batch_size_per_rank(world: int, wrapper: str) -> None:
    curves = run_on_ranks(world, _train, wrapper, timeout=TIMEOUT)
    for step, (loss, ref_loss) in enumerate(curves[0]):
        assert loss == pytest.approx(ref_loss, abs=ATOL), f"{wrapper} step {step}: {loss} vs {ref_loss}"
    assert curves[0][0][1] != pytest.approx(curves[0][-1][1], abs=1e-3), "the reference did not train"
