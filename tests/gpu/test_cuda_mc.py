"""CUDA: torchrec's managed-collision modules on a GPU rank, sharded by modular (issue 46; Note
[collision state on a GPU rank] in modular/mc/devices.py), equal torchrec's unsharded module on
the same GPU fed the global batch.

Skipped where torch sees no CUDA device. Written in a session without one and not yet run on a
GPU; `bash scripts/gpu/run.sh mc` runs it. `MODULAR_GPU_TEST_DEVICE=cpu` runs the same bodies on
CPU gloo ranks (about 30 s), to check this file on a machine with no GPU.

Each world size (1 and 2) runs in fresh spawned ranks (tests/gpu/test_cuda.py's `run_spawned`:
NCCL with one GPU per rank where there are enough GPUs, else gloo with every rank on GPU 0, so
that the collision state's collectives run both on the CUDA device and through the host). Per
case an MC-EBC (or MC-EC) of one raw-id table on the device, DistanceLFU, eviction_interval 1,
a Zipf stream with churn so that most steps evict: the remapped ids (on the input's device and
dtype), the evicted slots, the outputs every step, then the trained weights and the collision
state_dict under torchrec's keys.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.modules.mc_embedding_modules import (
    ManagedCollisionEmbeddingBagCollection, ManagedCollisionEmbeddingCollection,
)  # fmt: skip
from torchrec.modules.mc_modules import (
    DistanceLFU_EvictionPolicy, LFU_EvictionPolicy, ManagedCollisionCollection, MCHManagedCollisionModule,
    dynamic_threshold_filter,
)  # fmt: skip

import modular
from planners.types import ShardingPlan, ShardingType, TablePlacement
from tests.gpu.test_cuda import DEVICE_KIND, run_spawned
from tests.modular.compare import backward_and_step, local_blocks
from tests.modular.ebc_cases import global_batch
from tests.modular.test_managed_collisions import HASH, LR, ZCH, _raw_batch

pytestmark = pytest.mark.skipif(
    DEVICE_KIND == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device"
)
ATOL, STEPS = 1e-5, 8
# (kind, plan, fused, replicated: a threshold filter, which modular does not split, so torchrec's
# module on the device remaps the gathered global batch: Note [managed collisions over the global batch])
CASES = [("ebc", "row_wise", True, False), ("ebc", "table_wise", False, False), ("ec", "row_wise", False, False),
         ("ebc", "row_wise", False, True)]  # fmt: skip


def _model(kind: str, device: torch.device, replicated: bool = False) -> nn.Module:
    torch.manual_seed(0)
    config = EmbeddingBagConfig if kind == "ebc" else EmbeddingConfig
    tables = [config(name="t_raw", num_embeddings=ZCH, embedding_dim=8, feature_names=["f_raw", "f_raw2"])]
    mcc = ManagedCollisionCollection(
        managed_collision_modules={"t_raw": MCHManagedCollisionModule(
            zch_size=ZCH, device=device, eviction_policy=LFU_EvictionPolicy(threshold_filtering_func=lambda counts: (
                dynamic_threshold_filter(counts, threshold_skew_multiplier=0.5))) if replicated else DistanceLFU_EvictionPolicy(),
            eviction_interval=1, input_hash_size=HASH)},
        embedding_configs=tables,
    )  # fmt: skip
    model = nn.Module()
    if kind == "ebc":
        inner = EmbeddingBagCollection(tables=tables, device=device)
        model.mc = ManagedCollisionEmbeddingBagCollection(inner, mcc, return_remapped_features=True)
    else:
        inner = EmbeddingCollection(tables=tables, device=device)
        model.mc = ManagedCollisionEmbeddingCollection(inner, mcc, return_remapped_features=True)
    return model


def _outputs(out, kind: str) -> dict[str, torch.Tensor]:
    if kind == "ebc":
        return {"pooled": out.values()}
    return {key: out[key].values() for key in ("f_raw", "f_raw2")}


def _case(device: torch.device, kind: str, plan_kind: str, fused: bool, replicated: bool) -> int:
    world, rank = dist.get_world_size(), dist.get_rank()
    ref = _model(kind, device, replicated)
    model = copy.deepcopy(ref)
    placement = {"row_wise": TablePlacement(ShardingType.ROW_WISE, ranks=tuple(range(world))),
                 "table_wise": TablePlacement(ShardingType.TABLE_WISE, ranks=(world - 1,))}[plan_kind]  # fmt: skip
    if fused:  # fused before shard (Note [order of sharding calls])
        modular.fuse_optimizer(model, "exact_sgd", lr=LR)
    modular.shard(model, ShardingPlan(world_size=world, modules={"mc._embedding_module": {"t_raw": placement}}),
                  device=device)  # fmt: skip
    params = [] if fused else list(modular.local_parameters(model))
    opt = torch.optim.SGD(params, lr=LR) if params else None
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    mine_mch = model.mc._managed_collision_collection._managed_collision_modules["t_raw"]
    ref_mch = ref.mc._managed_collision_collection._managed_collision_modules["t_raw"]
    assert (type(mine_mch).__name__ == "ShardedMCHModule") != replicated, f"{kind}: {type(mine_mch).__name__}"
    label, evicting = f"{kind} {plan_kind} fused={fused} replicated={replicated}, rank {rank}/{world} on {device}", 0
    for step in range(STEPS):
        batches = [_raw_batch(step, r) for r in range(world)]
        strides = [b.stride() for b in batches]
        before = sum(strides[:rank])
        ref_evicted = ref_mch._evicted_emb_indices
        out, remapped = model.mc(batches[rank].to(device))
        ref_out, ref_remapped = ref.mc(global_batch(batches).to(device))
        loss, ref_loss = 0.0, 0.0
        for key in ("f_raw", "f_raw2"):
            got, want = remapped[key].values(), ref_remapped[key].values()
            assert got.device == device and got.dtype == torch.int64, f"{label} step {step}: {key} on {got.device} {got.dtype}"
            lengths = ref_remapped[key].lengths()
            start, count = int(lengths[:before].sum()), int(lengths[before: before + strides[rank]].sum())
            assert torch.equal(got, want[start: start + count]), f"{label} step {step}: {key} remapped ids"
        if ref_mch._evicted_emb_indices is not ref_evicted:  # torchrec evicted this step
            evicting += 1
            a, b = mine_mch._evicted_emb_indices.cpu().sort()[0], ref_mch._evicted_emb_indices.cpu().sort()[0]
            assert torch.equal(a, b), f"{label} step {step}: evicted slots {a.tolist()}, torchrec's {b.tolist()}"
        for name, got in _outputs(out, kind).items():
            want = _outputs(ref_out, kind)[name]
            if kind == "ebc":
                want, weight = want[before: before + strides[rank]], torch.randn(
                    sum(strides), want.shape[1], generator=torch.Generator().manual_seed(step)).to(device)
                mine_w = weight[before: before + strides[rank]]
            else:
                lengths = ref_remapped[name].lengths()
                start = int(lengths[:before].sum())
                weight = torch.randn(want.shape, generator=torch.Generator().manual_seed(step)).to(device)
                want, mine_w = want[start: start + got.shape[0]], weight[start: start + got.shape[0]]
            assert got.device == device, f"{label} step {step}: {name} output on {got.device}"
            torch.testing.assert_close(got, want, rtol=0, atol=ATOL, msg=lambda m: f"{label} step {step}: {name}: {m}")
            loss = loss + (got * mine_w).sum()
            ref_loss = ref_loss + (_outputs(ref_out, kind)[name] * weight).sum() / world
        backward_and_step((loss, ref_loss), (opt, ref_opt))
    inner, ref_inner = model.mc._embedding_module, ref.mc._embedding_module
    tables, ref_tables = (inner.embedding_bags, ref_inner.embedding_bags) if kind == "ebc" else (inner.embeddings, ref_inner.embeddings)
    want = ref_tables["t_raw"].weight.detach()
    for tensor, rows, cols in local_blocks(tables["t_raw"].weight):
        assert tensor.device == device, f"{label}: a shard on {tensor.device}"
        torch.testing.assert_close(tensor.detach(), want[rows, cols], rtol=0, atol=ATOL, msg=lambda m: f"{label}: weights: {m}")
    mine = model.mc._managed_collision_collection.state_dict()  # collective: the whole table
    theirs = ref.mc._managed_collision_collection.state_dict()
    assert mine.keys() == theirs.keys(), f"{label}: state keys {sorted(mine)} vs {sorted(theirs)}"
    for key in mine:
        assert torch.equal(mine[key].cpu(), theirs[key].cpu()), f"{label}: collision state {key}"
    return evicting


def _cases(device: torch.device, kind: str) -> list[int]:
    return [_case(device, *c) for c in CASES if c[0] == kind]


# The EC apart: its inner EC runs fbgemm's sequence kernel on CUDA, never run on a GPU either
# (docs/gpu.md), so a failure there does not hide the EBC's result.
@pytest.mark.parametrize("kind", ["ebc", "ec"])
@pytest.mark.parametrize("world", [1, 2])
def test_cuda_mc_tables_remap_evict_and_train_as_torchrec_unsharded_on_the_global_batch(world: int, kind: str) -> None:
    evicting = run_spawned(world, _cases, kind)[0]
    assert all(2 * e > STEPS for e in evicting), f"evictions in most steps: {evicting} of {STEPS}"
