"""Fused optimizers on FP16 tables (Note [low-precision tables] in modular/kernels/table_dtypes.py).

fbgemm's CPU kernels (and the torch emulation) compute each update in FP32 from the widened row;
row-wise Adagrad rounds the new row to nearest FP16 once, exact SGD and Adagrad round the step
to FP16 first (deterministic rounding: fbgemm's CPU kernels ignore stochastic_rounding); the
state stays FP32. The reference does the same with torch: an FP32 copy of the table holding the
FP16 values, stepped by the torch equivalent of each optimizer (tests/modular/fused/test_fused.py's
`_Reference`) and rounded that way after each step.
The two differ only in the order of FP32 additions (the gradient sums), which can move a value
across a rounding boundary: so every weight must be within 2 FP16 ulps of the reference
(|d| <= 4u|w|) and at least 99% of them bit-identical (all are, on fbgemm-gpu-cpu 1.8.0); the FP32 state within 1e-3 relative.
Data-parallel copies (fbgemm's replay and the emulation) must be bit-identical on every rank.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torchrec.modules.embedding_configs import DataType
from torchrec.modules.embedding_modules import EmbeddingBagCollection

import modular
from planners.types import ShardingPlan
from tests.dist import run_on_ranks
from tests.modular.compare import local_blocks
from tests.modular.ebc_cases import CASES, global_batch, make_batch, placements_for
from tests.modular.fused_reference import (
    FUSED_EPS as EPS, FUSED_LR as LR, FusedReference as _Reference, fused_tables as _tables,
)
from tests.modular.kernels.test_low_precision import fp32_mirror

STEPS = 3
U16 = 2.0**-11


def _fp16_ebc() -> EmbeddingBagCollection:
    """test_fused's tables (widths 8 and 16 on fbgemm's fused kernel, 5 and 7 emulated), FP16."""
    torch.manual_seed(0)
    tables = _tables()
    for t in tables:
        t.data_type = DataType.FP16
    return EmbeddingBagCollection(tables=tables)


def _fused_fp16(optimizers: tuple[str, ...], cases: tuple[str, ...]) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    same, total = 0, 0
    for optimizer in optimizers:
        for case in cases:
            label = f"{optimizer}, {case}, rank {rank}/{world}"
            ebc = _fp16_ebc()
            ref = _Reference(fp32_mirror(ebc), optimizer)
            plan = ShardingPlan(world_size=world, modules={"": placements_for(case, ebc, world)})
            opt = modular.fuse_optimizer(ebc, optimizer, lr=LR, eps=EPS)
            model = modular.shard(ebc, plan)
            for step in range(STEPS):
                batches = [make_batch(ebc, seed=1000 * step + r) for r in range(world)]
                out = model(batches[rank]).values()
                expected = ref.ebc(global_batch(batches)).values()
                mine = slice(rank * out.shape[0], (rank + 1) * out.shape[0])
                target = torch.randn(expected.shape, generator=torch.Generator().manual_seed(step))
                (out * target[mine]).sum().backward()
                ((expected * target).sum() / world).backward()
                opt.step()
                before = [p.detach().clone() for p in ref.ebc.parameters()]
                ref.step()
                with torch.no_grad():  # the reference rounds as fbgemm's CPU kernels do
                    for p, b in zip(ref.ebc.parameters(), before):
                        step = p - b
                        if optimizer != "exact_rowwise_adagrad":
                            step = step.half().float()
                        p.copy_((b + step).half().float())
            state = opt.state_dict()["state"]
            for name, p in model.named_parameters():
                full = dict(ref.ebc.named_parameters())[name].detach()
                for tensor, rows, cols in local_blocks(p):
                    if tensor.dtype != torch.float16:
                        raise AssertionError(f"{label}: {name} became {tensor.dtype}")
                    want = full[rows, cols]
                    diff = (tensor.float() - want).abs()
                    if not bool((diff <= 4 * U16 * want.abs() + 1e-7).all()):
                        raise AssertionError(f"{label}: {name} is {diff.max():.3g} off the rounded reference")
                    same += int((diff == 0).sum())
                    total += diff.numel()
                want_state = ref.state(name)
                if want_state is None:
                    continue
                got = next(iter(state[name].values()))
                for t, rows, cols in local_blocks(got) if got.dim() == 2 else [(got, None, None)]:
                    if t.dtype != torch.float32:
                        raise AssertionError(f"{label}: state of {name} is {t.dtype}, want FP32")
                got_local = got if not hasattr(got, "local_shards") else None
                if got_local is not None:  # data-parallel copies: the whole state here
                    torch.testing.assert_close(got_local, want_state, rtol=1e-3, atol=1e-6, msg=lambda m: f"{label}: {m}")
                if not hasattr(p, "local_shards") and world > 1:  # a data-parallel copy: the same bits everywhere
                    copies = [torch.empty_like(p) for _ in range(world)]
                    dist.all_gather(copies, p.detach().contiguous())
                    if not all(torch.equal(c.view(torch.int16), copies[0].view(torch.int16)) for c in copies):
                        raise AssertionError(f"{label}: data-parallel copies of {name} differ between ranks")
    return {"same": same, "total": total}


@pytest.mark.parametrize("world", [1, 3])
def test_fused_fp16_tables_match_a_reference_that_rounds_to_nearest(world: int) -> None:
    cases = CASES if world > 1 else ("table_wise",)
    results = run_on_ranks(world, _fused_fp16, ("exact_sgd", "exact_adagrad", "exact_rowwise_adagrad"), cases, timeout=300)
    same = sum(r["same"] for r in results)
    total = sum(r["total"] for r in results)
    assert total > 0 and same >= 0.99 * total, f"only {same} of {total} weights bit-identical"
