"""A model holding an EmbeddingCollection and an EBC (examples/sequential/model.py) under the
rest of the contract: DDP or FSDP2 on the dense tower, clip_grad_norm_, prefetch, and
checkpoints saved at world 2 under one plan, loaded at world 3 under another (fused row-wise
Adagrad state included), each step compared with the unsharded model on the global batch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import modular
from examples.sequential.model import SequentialRecommender, Tower, global_batch, make_batch
from planners.types import ShardingPlan, ShardingType, TablePlacement
from tests.dist import run_on_ranks
from tests.modular.compare import assert_weights_match
from tests.modular.fused_reference import rowwise_adagrad_step

LR, EPS, MAX_NORM = 0.2, 1e-3, 0.05


def _plan(world: int, kind: str) -> ShardingPlan:
    everyone = tuple(range(world))
    if kind == "a":
        seq = {"item": TablePlacement(ShardingType.ROW_WISE), "category": TablePlacement(ShardingType.COLUMN_WISE)}
        user = {"user": TablePlacement(ShardingType.TABLE_WISE, ranks=(world - 1,))}
    else:
        seq = {
            "item": TablePlacement(ShardingType.COLUMN_WISE, ranks=everyone[::-1]),
            "category": TablePlacement(ShardingType.DATA_PARALLEL),
        }
        user = {"user": TablePlacement(ShardingType.ROW_WISE)}
    return ShardingPlan(world_size=world, modules={"seq": seq, "user": user})


def _compose(wrap: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = SequentialRecommender()
    model = modular.shard(copy.deepcopy(ref), _plan(world, "a"))
    if wrap == "ddp":
        modular.apply_ddp(model)
    else:
        modular.apply_fully_shard(model, modules={Tower})
    opt = torch.optim.SGD(modular.local_parameters(model), lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    batches = [[make_batch(step, r) for r in range(world)] for step in range(3)]
    for step in range(3):
        mine = batches[step][rank]
        if step + 1 < 3:  # the next batch's input dist, while this step runs
            nxt = batches[step + 1][rank]
            model.seq.prefetch(nxt.sequences)
            model.user.prefetch(nxt.users)
        model.loss(mine).backward()
        norm = modular.clip_grad_norm_(model, MAX_NORM)
        opt.step()
        opt.zero_grad()
        ref.loss(global_batch(batches[step])).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(norm, ref_norm, atol=1e-5, rtol=1e-5)
        if not float(ref_norm) > MAX_NORM:
            raise AssertionError(f"step {step}: the norm {float(ref_norm)} was not clipped")
        assert_weights_match(model, ref, f"{wrap}, rank {rank}, step {step}")


@pytest.mark.timeout(240)
def test_ddp_fsdp_clipping_and_prefetch_with_an_embedding_collection() -> None:
    for wrap in ("ddp", "fsdp"):
        run_on_ranks(2, _compose, wrap, timeout=120)


class _Reference:
    """The unsharded model: row-wise Adagrad (fused's torch equivalent) on tables, SGD on the rest."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = SequentialRecommender()
        tables = {n for n, _ in self.model.named_parameters() if n.startswith(("seq.", "user."))}
        self.tables = {n: p for n, p in self.model.named_parameters() if n in tables}
        self.row_sums = {n: torch.zeros(p.shape[0]) for n, p in self.tables.items()}
        self.dense = torch.optim.SGD([p for n, p in self.model.named_parameters() if n not in tables], lr=LR)

    def step(self, batches) -> None:
        self.model.loss(global_batch(batches)).backward()
        for n, p in self.tables.items():
            rowwise_adagrad_step(p, p.grad, self.row_sums[n], lr=LR, eps=EPS)
            p.grad = None
        self.dense.step()
        self.dense.zero_grad()


def _fused_fsdp(world_plan: str, path: str, steps: range, load: bool):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(100 if load else 0)  # a resumed model starts from other weights: load replaces them
    model = SequentialRecommender()
    fused = modular.fuse_optimizer(model, "exact_rowwise_adagrad", lr=LR, eps=EPS)
    modular.shard(model, _plan(world, world_plan))
    modular.apply_fully_shard(model, modules={Tower})
    opt = modular.CombinedOptimizer({"tables": fused, "dense": torch.optim.SGD(modular.local_parameters(model), lr=LR)})
    if load:
        modular.checkpoint.load(path, model, opt)
    for step in steps:
        model.loss(make_batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()
    if not load:
        modular.checkpoint.save(path, model, opt)
    return modular.checkpoint.export(model)


@pytest.mark.timeout(240)
def test_checkpoint_at_world_2_resumes_at_world_3_under_another_plan(tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    ref = _Reference()
    saved = run_on_ranks(2, _fused_fsdp, "a", path, range(2), False, timeout=120)[0]
    for step in range(2):
        ref.step([make_batch(step, r) for r in range(2)])
    expected = ref.model.state_dict()
    assert list(saved) == list(expected)
    for k in expected:
        torch.testing.assert_close(saved[k], expected[k], atol=1e-5, rtol=0, msg=lambda m: f"world 2, {k}: {m}")
    resumed = run_on_ranks(3, _fused_fsdp, "b", path, range(2, 4), True, timeout=120)[0]
    for step in range(2, 4):
        ref.step([make_batch(step, r) for r in range(3)])
    expected = ref.model.state_dict()
    for k in expected:
        torch.testing.assert_close(resumed[k], expected[k], atol=1e-5, rtol=0, msg=lambda m: f"world 3, {k}: {m}")
