"""FP16 tables in sharded EmbeddingCollections (Note [low-precision sequences] in
modular/sequence/sequence_part.py, Note [low-precision tables] in modular/kernels/table_dtypes.py).

Two ECs of the sequence cases (tests/modular/sequence_cases.py), every table FP16 but 'v' (so one module
holds both dtypes), sharded by each placement on 2 ranks, against the unsharded model:
- outputs: torchrec's unsharded FP16 EC returns the table's FP16 rows widened to FP32; ours must
  return the same dtype and the same bits (a sequence row is a row, not a sum: no rounding);
- unfused, torch SGD: each table's FP16 `.grad` is an FP32 sum of the rows' FP16 gradients rounded
  once, so against an FP32 mirror of the model (same weights, same FP16-valued output gradients)
  |g16 - g32| <= u * |g32| + 1e-7 (u = 2**-11, FP16's unit roundoff); after 3 steps each weight is
  within 2 FP16 ulps (|d| <= 4u|w| + 1e-7) of the mirror stepped with round16(w - lr * round16(g)),
  the two differing only in the order of FP32 additions;
- fused (each optimizer): weights FP16 and within 2 ulps of the mirror trained with the torch
  equivalent and rounded as fbgemm's CPU kernels round (test_low_precision_fused.py), state FP32;
- a checkpoint saved and loaded under another plan keeps each table's dtype and its bits.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torchrec.modules.embedding_configs import DataType
from torchrec.modules.embedding_modules import EmbeddingCollection

import modular
from planners.types import ShardingPlan
from tests.dist import run_on_ranks
from tests.modular.compare import local_blocks
from tests.modular.ebc_cases import CASES
from tests.modular.fused_reference import FUSED_EPS, FUSED_LR, FusedReference
from tests.modular.sequence_cases import (
    seq_a_tables, seq_b_tables, seq_global_batch, seq_placements_for, seq_rank_batches,
)

U16 = 2.0**-11
STEPS, LR = 3, 0.5
OPTIMIZERS = ("exact_sgd", "exact_adagrad", "exact_rowwise_adagrad")


class _Sequences(nn.Module):
    def __init__(self, fp16: bool) -> None:
        super().__init__()
        a, b = seq_a_tables(), seq_b_tables()
        for t in (*a, *b):
            if fp16 and t.name != "v":
                t.data_type = DataType.FP16
        self.seq_a = EmbeddingCollection(tables=a)
        self.seq_b = EmbeddingCollection(tables=b)

    def forward(self, a, b):
        return {**self.seq_a(a), **{f"b.{k}": v for k, v in self.seq_b(b).items()}}


def _models(seed: int = 0) -> tuple[_Sequences, _Sequences]:
    """The FP16 model and its FP32 mirror (the same, FP16-valued, weights)."""
    torch.manual_seed(seed)
    model, mirror = _Sequences(True), _Sequences(False)
    with torch.no_grad():
        for (name, p), q in zip(model.named_parameters(), mirror.parameters()):
            q.copy_(p.float())
    return model, mirror


def _plan(case: str, world: int) -> ShardingPlan:
    return ShardingPlan(
        world_size=world,
        modules={
            "seq_a": seq_placements_for(case, seq_a_tables(), world),
            "seq_b": seq_placements_for(case, seq_b_tables(), world),
        },
    )


def _targets(out: dict, step: int) -> dict:
    """FP16-valued loss weights for every output row (the same on the FP16 and FP32 sides)."""
    g = torch.Generator().manual_seed(step)
    return {k: torch.randn(jt.values().shape, generator=g).half().float() for k, jt in sorted(out.items())}


def _within_ulps(got: torch.Tensor, want: torch.Tensor, ulps: float, what: str) -> None:
    diff = (got.float() - want.float()).abs()
    if not bool((diff <= 2 * ulps * U16 * want.float().abs() + 1e-7).all()):
        raise AssertionError(f"{what}: {diff.max():.3g} off ({ulps} ulps allowed)")


def _step(step: int, rank: int, world: int, model, ref_fp16, mirror) -> None:
    """One forward/backward on this rank's batch and on the global one (FP16 and FP32 models):
    our rows are torchrec's FP16 rows, bit for bit, while the weights are the same (step 0)."""
    batches = seq_rank_batches(world, step)
    mine = batches[rank]
    out = model(mine["seq_a"], mine["seq_b"])
    whole = [seq_global_batch([b[m] for b in batches]) for m in ("seq_a", "seq_b")]
    want16, want32 = ref_fp16(*whole), mirror(*whole)
    targets = _targets(want32, step)
    loss, ref_loss = torch.zeros(()), torch.zeros(())
    for key, jt in want16.items():
        module, feature = ("seq_b", key[2:]) if key.startswith("b.") else ("seq_a", key)
        n = [int(b[module][feature.split("@")[0]].lengths().sum()) for b in batches]
        got = out[key].values()
        if got.dtype != jt.values().dtype:
            raise AssertionError(f"rank {rank}: rows of {key} are {got.dtype}, torchrec's {jt.values().dtype}")
        if step == 0 and not torch.equal(got, jt.values().split(n)[rank]):
            raise AssertionError(f"rank {rank}: rows of {key} differ from torchrec's")
        # Later steps: the weights trained apart from torchrec's (the mirror's are within ulps).
        _within_ulps(got, want32[key].values().split(n)[rank], 2, f"rank {rank}: step {step} rows of {key}")
        t = targets[key].split(n)
        loss = loss + (got.float() * t[rank]).sum()
        ref_loss = ref_loss + (want32[key].values() * targets[key]).sum() / world
    loss.backward()
    ref_loss.backward()


def _unfused(case: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    model, mirror = _models()
    ref_fp16 = copy.deepcopy(model)
    modular.shard(model, _plan(case, world))
    opt = torch.optim.SGD(modular.local_parameters(model), lr=LR)
    for step in range(STEPS):
        _step(step, rank, world, model, ref_fp16, mirror)
        want = dict(mirror.named_parameters())
        for name, p in model.named_parameters():
            for tensor, rows, cols in local_blocks(p):
                g32 = want[name].grad[rows, cols]
                if tensor.dtype != torch.float16 and not name.endswith("v.weight"):
                    raise AssertionError(f"{case}: {name} is {tensor.dtype}")
                grad = tensor.grad if tensor.grad is not None else torch.zeros_like(tensor)
                if not bool(((grad.float() - g32).abs() <= U16 * g32.abs() + 1e-7).all()):
                    raise AssertionError(f"{case}, rank {rank}: step {step} grad of {name} beyond one rounding")
        opt.step()
        opt.zero_grad()
        with torch.no_grad():  # the mirror steps as torch SGD steps an FP16 table
            for name, q in mirror.named_parameters():
                fp16 = not name.endswith("v.weight")
                g = q.grad.half().float() if fp16 else q.grad
                q.sub_(LR * g)
                if fp16:
                    q.copy_(q.half().float())
                q.grad = None
    want = dict(mirror.named_parameters())
    for name, p in model.named_parameters():
        for tensor, rows, cols in local_blocks(p):
            _within_ulps(tensor.detach(), want[name].detach()[rows, cols], 2, f"{case}, rank {rank}: {name} after {STEPS} steps")


def _fused(case: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for kind in OPTIMIZERS:
        model, mirror = _models()
        ref_fp16 = copy.deepcopy(model)
        reference = FusedReference(mirror, kind)
        opt = modular.fuse_optimizer(model, kind, lr=FUSED_LR, eps=FUSED_EPS)
        modular.shard(model, _plan(case, world))
        for step in range(STEPS):
            _step(step, rank, world, model, ref_fp16, mirror)
            opt.step()
            before = {n: p.detach().clone() for n, p in mirror.named_parameters()}
            reference.step()
            with torch.no_grad():  # rounded as fbgemm's CPU kernels round (Note [low-precision tables])
                for n, p in mirror.named_parameters():
                    if n.endswith("v.weight"):
                        continue
                    delta = p - before[n]
                    if kind != "exact_rowwise_adagrad":
                        delta = delta.half().float()
                    p.copy_((before[n] + delta).half().float())
        want = dict(mirror.named_parameters())
        state = opt.state_dict()["state"]
        for name, p in model.named_parameters():
            for tensor, rows, cols in local_blocks(p):
                if tensor.dtype != (torch.float32 if name.endswith("v.weight") else torch.float16):
                    raise AssertionError(f"{kind}, {case}: {name} became {tensor.dtype}")
                _within_ulps(tensor.detach(), want[name].detach()[rows, cols], 2, f"{kind}, {case}, rank {rank}: {name}")
            for value in state.get(name, {}).values():
                for t, _, _ in local_blocks(value) if value.dim() == 2 else [(value, None, None)]:
                    pieces = [s.tensor for s in t.local_shards()] if hasattr(t, "local_shards") else [t]
                    if any(s.dtype != torch.float32 for s in pieces):
                        raise AssertionError(f"{kind}, {case}: state of {name} is not FP32")


def _checkpoint(path: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    model, _ = _models()
    modular.shard(model, _plan("mixed", world))
    modular.checkpoint.save(path, model)
    other, _ = _models(seed=1)
    modular.shard(other, _plan("row_wise", world))
    modular.checkpoint.load(path, other)
    whole = _models()[0]
    for name, p in other.named_parameters():
        for tensor, rows, cols in local_blocks(p):
            want = dict(whole.named_parameters())[name].detach()[rows, cols]
            if tensor.dtype != want.dtype or not torch.equal(tensor.detach(), want):
                raise AssertionError(f"rank {rank}: {name} ({tensor.dtype}) lost its dtype or bits in a checkpoint")


@pytest.mark.timeout(300)
def test_fp16_sequences_match_torchrec_and_train_within_one_rounding() -> None:
    for case in CASES:
        run_on_ranks(2, _unfused, case, timeout=120)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["table_wise", "column_wise", "mixed"])
def test_fused_fp16_sequences_keep_fp32_state(case: str) -> None:
    run_on_ranks(2, _fused, case, timeout=200)


@pytest.mark.timeout(200)
def test_fp16_sequence_checkpoints_keep_dtype(tmp_path) -> None:
    run_on_ranks(2, _checkpoint, str(tmp_path / "ckpt"), timeout=120)


@pytest.mark.parametrize("data_type", [DataType.BF16, DataType.INT8])
def test_other_data_types_are_refused_naming_the_table(data_type: DataType) -> None:
    """torchrec's EC holds every non-FP32 table as FP16 weights: a BF16 config is not a BF16 table."""
    tables = seq_b_tables()
    tables[1].data_type = data_type
    model = nn.ModuleDict({"seq": EmbeddingCollection(tables=tables)})
    with pytest.raises(modular.ShardingError, match=rf"table 'v' of module 'seq' has data type {data_type.name}; .*use DataType.FP16 or DataType.FP32"):
        modular.fuse_optimizer(model, "exact_sgd", lr=0.1)
