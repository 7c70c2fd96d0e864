"""CUDA: FP16 and BF16 tables (fbgemm's CUDA kernels take both; stochastic rounding on).

Skipped where torch sees no CUDA device; `MODULAR_GPU_TEST_DEVICE=cpu` runs the FP16 bodies on
CPU gloo ranks (BF16 has no fbgemm CPU kernels), as tests/gpu/test_cuda.py explains. Not yet run
on a GPU: written in a session without one (issue 25); run it with `python -m pytest tests/gpu`.

Each body trains every plan with fused exact SGD and row-wise Adagrad (fbgemm's default
stochastic rounding, which its CUDA kernels apply to FP16/BF16 updates) next to the same model in
FP32 starting from the same (rounded) weights, and checks:
- step 0's outputs equal the FP32 model's (fbgemm pools in FP32 from the same values; ATOL 1e-4
  as the other GPU tests);
- the global loss tracks FP32 within 16 units of roundoff of its scale, |L - L32| <= 16 u *
  sum |out32 * target| (u = 2**-11 for FP16, 2**-8 for BF16): stochastic rounding keeps each
  update unbiased, so 5 steps drift by a few u, not by the step's size;
- data-parallel copies are bit-identical on every rank (off CPU they take the torch emulation,
  which rounds to nearest from the same values on every rank).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torchrec.modules.embedding_configs import DataType

import modular
from planners.types import ShardingPlan
from tests.gpu.test_cuda import DEVICE_KIND, WORLDS, _ebc, run_spawned
from tests.modular.ebc_cases import CASES, make_batch, placements_for

pytestmark = pytest.mark.skipif(
    DEVICE_KIND == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device"
)

STEPS, LR = 5, 0.1
ROUNDOFF = {"fp16": 2.0**-11, "bf16": 2.0**-8}
DTYPES = {"fp16": (DataType.FP16, torch.float16), "bf16": (DataType.BF16, torch.bfloat16)}


def _model(device: torch.device, data_type, dtype, seed_weights: dict, plan, optimizer: str):
    ebc = _ebc()
    for c in ebc.embedding_bag_configs():
        c.data_type = data_type
    low = type(ebc)(tables=ebc.embedding_bag_configs(), device=device)
    with torch.no_grad():
        for name, bag in low.embedding_bags.items():
            bag.weight.copy_(seed_weights[name].to(dtype))
    modular.fuse_optimizer(low, optimizer, lr=LR, eps=1e-3)
    return modular.shard(low, plan, device=device)


def _tracks_fp32(device: torch.device, dtype_name: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    data_type, dtype = DTYPES[dtype_name]
    u = ROUNDOFF[dtype_name]
    worst = 0.0
    for optimizer in ("exact_sgd", "exact_rowwise_adagrad"):
        for case in CASES:
            label = f"{dtype_name}, {optimizer}, {case}, rank {rank}/{world}"
            ref = _ebc()
            weights = {n: b.weight.detach().to(dtype).float() for n, b in ref.embedding_bags.items()}
            plan = ShardingPlan(world_size=world, modules={"": placements_for(case, ref, world)})
            low = _model(device, data_type, dtype, weights, plan, optimizer)
            high = _model(device, DataType.FP32, torch.float32, weights, plan, optimizer)
            for step in range(STEPS):
                kjt = make_batch(ref, seed=1000 * step + rank).to(device)
                out, out32 = low(kjt).values(), high(kjt).values()
                if step == 0:
                    torch.testing.assert_close(out, out32, atol=1e-4, rtol=0, msg=lambda m: f"{label}: {m}")
                target = torch.randn(out.shape, generator=torch.Generator().manual_seed(step)).to(device)
                loss, loss32 = (out * target).sum(), (out32 * target).sum()
                loss.backward()
                loss32.backward()
                totals = torch.stack([loss.detach(), loss32.detach(), (out32 * target).abs().sum().detach()])
                dist.all_reduce(totals)
                gap, scale = float((totals[0] - totals[1]).abs()), float(totals[2])
                if gap > 16 * u * scale + 1e-6:
                    raise AssertionError(f"{label}: step {step} loss {float(totals[0]):.6g} vs FP32 "
                                         f"{float(totals[1]):.6g}: gap {gap:.3g} > 16u x {scale:.3g}")
                worst = max(worst, gap / max(scale, 1e-12))
            for name, p in low.named_parameters():
                if hasattr(p, "local_shards") or world == 1:
                    continue
                copies = [torch.empty_like(p) for _ in range(world)]
                dist.all_gather(copies, p.detach().contiguous())
                if not all(torch.equal(c.view(torch.int16), copies[0].view(torch.int16)) for c in copies):
                    raise AssertionError(f"{label}: data-parallel copies of {name} differ between ranks")
    return {"worst relative loss gap": worst}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("dtype_name", ["fp16", "bf16"])
def test_low_precision_tables_track_fp32_on_the_device(world: int, dtype_name: str) -> None:
    if dtype_name == "bf16" and DEVICE_KIND != "cuda":
        pytest.skip("fbgemm's CPU kernels have no BF16 (shard refuses it: test_low_precision.py)")
    run_spawned(world, _tracks_fp32, dtype_name)
