"""An MC-EmbeddingCollection (torchrec's ManagedCollisionEmbeddingCollection: sequence
embeddings) through DCP checkpoints from world 2 (row-wise) to 3 (a mixed plan: column-wise and
table-wise) to 1, fused (exact row-wise Adagrad, its optimizer state in the checkpoint) and
unfused (SGD), and `export` / `load_unsharded` with torchrec's unsharded module's state_dict
(Note [sharded managed collisions] in modular/mc/sharded_mch.py). Two MC tables, LFU at interval
2 (checkpointed mid-interval) and DistanceLFU at interval 1, small enough that most intervals
evict, beside a plain EC table in the same checkpoint. The reference is
torchrec's unsharded MC-EC fed the global batch, resumed from its own state_dict at each
checkpoint (torchrec keeps its eviction history in non-persistent buffers); step by step the
remapped ids and the sequence outputs, after each load and each phase the collision state
(torch.equal) and the weights."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingCollection
from torchrec.modules.mc_modules import (
    DistanceLFU_EvictionPolicy, LFU_EvictionPolicy, ManagedCollisionCollection, MCHManagedCollisionModule,
)  # fmt: skip
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import modular
from planners.types import ShardingPlan, ShardingType, TablePlacement
from tests.dist import run_on_ranks
from tests.modular.compare import full_value
from tests.modular.ebc_cases import global_batch
from tests.modular.fused_reference import FUSED_EPS, FUSED_LR, FusedReference
from tests.modular.mc.beside_reference import assert_same_collision_state
from tests.modular.mc.test_split_state import FEATURES, HASH, _batch

# table -> (policy, eviction_interval, zch_size)
SPECS = {"t_a": (LFU_EvictionPolicy, 2, 12), "t_b": (DistanceLFU_EvictionPolicy, 1, 8)}
DIM = 8
PLAIN = 10  # rows of the plain EC table beside
PHASES = [(2, "row_wise", range(0, 5)), (3, "mixed", range(5, 12)), (1, "row_wise", range(12, 17))]
FUSED = "exact_rowwise_adagrad"


def _model() -> nn.Module:
    torch.manual_seed(0)
    tables = [EmbeddingConfig(name=t, num_embeddings=SPECS[t][2], embedding_dim=DIM, feature_names=FEATURES[t])
              for t in FEATURES]  # fmt: skip
    mcc = ManagedCollisionCollection(managed_collision_modules={
        t: MCHManagedCollisionModule(zch_size=z, device=torch.device("cpu"), eviction_policy=policy(),
                                     eviction_interval=i, input_hash_size=HASH)
        for t, (policy, i, z) in SPECS.items()}, embedding_configs=tables)  # fmt: skip
    model = nn.Module()
    model.mc = ManagedCollisionEmbeddingCollection(EmbeddingCollection(tables=tables), mcc,
                                                   return_remapped_features=True)  # fmt: skip
    model.ec = EmbeddingCollection(tables=[EmbeddingConfig(name="t_plain", num_embeddings=PLAIN, embedding_dim=DIM,
                                                           feature_names=["fp"])])  # fmt: skip
    return model


def _plain_batch(step: int, rank: int) -> KeyedJaggedTensor:
    """Ids of the plain EC table beside: 2-4 samples, 0-3 ids each."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    lengths = torch.randint(0, 4, (int(torch.randint(2, 5, (1,), generator=g)),), generator=g)
    return KeyedJaggedTensor(keys=["fp"], values=torch.randint(0, PLAIN, (int(lengths.sum()),), generator=g),
                             lengths=lengths)  # fmt: skip


def _placements(kind: str, world: int) -> dict[str, TablePlacement]:
    if kind == "row_wise":
        return {t: TablePlacement(ShardingType.ROW_WISE) for t in SPECS}
    if kind == "data_parallel":
        return {t: TablePlacement(ShardingType.DATA_PARALLEL) for t in SPECS}
    assert kind == "mixed" and world == 3, kind
    return {"t_a": TablePlacement(ShardingType.COLUMN_WISE), "t_b": TablePlacement(ShardingType.TABLE_WISE, ranks=(2,))}


def _sharded(kind: str, fused: bool) -> tuple[nn.Module, object]:
    world = dist.get_world_size()
    model = _model()
    opt = modular.fuse_optimizer(model, FUSED, lr=FUSED_LR, eps=FUSED_EPS) if fused else None
    modular.shard(model, ShardingPlan(world_size=world, modules={
        "mc._embedding_module": _placements(kind, world),
        "ec": {"t_plain": TablePlacement(ShardingType.TABLE_WISE, ranks=(world - 1,))}}))  # fmt: skip
    if fused:
        assert not modular.local_parameters(model), "fused tables handed to a torch optimizer"
        return model, opt
    params = list(modular.local_parameters(model))
    return model, torch.optim.SGD(params, lr=FUSED_LR) if params else None  # a rank may hold no table


def _reference_optimizer(ref: nn.Module, fused: bool, row_sums: Optional[dict] = None) -> FusedReference:
    """The torch equivalent of the model's optimizer; `row_sums`: row-wise Adagrad's state to resume."""
    out = FusedReference(ref, FUSED if fused else "exact_sgd")  # the MC tables and the plain one
    if row_sums is not None:
        out.row_sums = {n: s.clone() for n, s in row_sums.items()}
    return out


def _resumed(ref: nn.Module, ref_opt: FusedReference, fused: bool) -> tuple[nn.Module, FusedReference]:
    fresh = _model()
    fresh.load_state_dict(ref.state_dict())
    return fresh, _reference_optimizer(fresh, fused, ref_opt.row_sums if fused else None)


def _reference(upto: int, fused: bool) -> tuple[nn.Module, FusedReference]:
    """torchrec's module through the phases before `upto`, resumed from its state_dict at each."""
    ref = _model()
    ref_opt = _reference_optimizer(ref, fused)
    for world, _, steps in PHASES[:upto]:
        _train(None, None, ref, ref_opt, world, 0, steps, "")
        ref, ref_opt = _resumed(ref, ref_opt, fused)
    return ref, ref_opt


def _held(ref: nn.Module) -> dict[str, set[int]]:
    sd = ref.mc._managed_collision_collection.state_dict()
    top = torch.iinfo(torch.int64).max
    return {t: {int(x) for x in sd[f"_managed_collision_modules.{t}._mch_sorted_raw_ids"] if x < top} for t in SPECS}


def _train(model, opt, ref: nn.Module, ref_opt: FusedReference, world: int, rank: int, steps: range,
           label: str) -> dict[str, int]:  # fmt: skip
    """`steps` of `model.mc` on this rank's batch (None: the reference alone) beside `ref.mc` on the
    global batch, comparing the remapped ids and outputs; the steps at which each table evicted."""
    evicted = {t: 0 for t in SPECS}
    seen = _held(ref)
    for step in steps:
        batches = [_batch(step, r) for r in range(world)]
        strides = [b.stride() for b in batches]
        before = sum(strides[:rank])
        whole = global_batch(batches)
        plain = [_plain_batch(step, r) for r in range(world)]
        ref_out, ref_remapped = ref.mc(whole)
        ref_plain = ref.ec(global_batch(plain))["fp"]
        if model is not None:
            out, remapped = model.mc(batches[rank])
            mine = model.ec(plain[rank])["fp"]
        plain_start = sum(int(b.lengths().sum()) for b in plain[:rank])
        plain_rows = ref_plain.values()[plain_start: plain_start + int(plain[rank].lengths().sum())]
        probe = torch.randn(ref_plain.values().shape, generator=torch.Generator().manual_seed(-step - 1))
        ref_loss = (ref_plain.values() * probe).sum() / world
        if model is not None:
            torch.testing.assert_close(mine.values(), plain_rows, rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"{label} step {step}: the plain EC's outputs: {m}")  # fmt: skip
            loss = (mine.values() * probe[plain_start: plain_start + mine.values().shape[0]]).sum()
        for key in whole.keys():
            lengths = ref_remapped[key].lengths()
            start, count = int(lengths[:before].sum()), int(lengths[before: before + strides[rank]].sum())
            probe = torch.randn(ref_out[key].values().shape, generator=torch.Generator().manual_seed(step))
            ref_loss = ref_loss + (ref_out[key].values() * probe).sum() / world
            if model is None:
                continue
            what = f"{label} step {step}: {key}"
            assert torch.equal(remapped[key].lengths(), lengths[before: before + strides[rank]]), f"{what}: lengths"
            assert torch.equal(remapped[key].values(), ref_remapped[key].values()[start: start + count]), f"{what}: remapped ids"
            assert torch.equal(out[key].lengths(), ref_out[key].lengths()[before: before + strides[rank]]), f"{what}: output lengths"
            torch.testing.assert_close(out[key].values(), ref_out[key].values()[start: start + count], rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"{what}: outputs: {m}")  # fmt: skip
            loss = loss + (out[key].values() * probe[start: start + count]).sum()
        if model is not None:
            loss.backward()
            if opt is not None:
                opt.step()
                opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        held = _held(ref)
        for t in SPECS:
            evicted[t] += bool(seen[t] - held[t])  # a raw id the table held is gone: evicted
        seen = held
    return evicted


def _same(model: nn.Module, ref: nn.Module, label: str) -> None:
    assert_same_collision_state(model, ref, label)
    for table, collection in [(t, "mc._embedding_module") for t in SPECS] + [("t_plain", "ec")]:
        got = full_value(model.get_submodule(collection).embeddings[table].weight)
        torch.testing.assert_close(got, ref.get_submodule(collection).embeddings[table].weight.detach(),
                                   rtol=1e-4, atol=1e-5, msg=lambda m: f"{label}: table {table}: {m}")  # fmt: skip


def _split(model: nn.Module, label: str) -> None:
    """Each rank holds only its slots of each table (Note [sharded managed collisions])."""
    world = dist.get_world_size()
    for t, (_, _, zch) in SPECS.items():
        held = model.mc._managed_collision_collection._managed_collision_modules[t]._shard.raw.numel()
        assert held <= -(-(zch - 1) // world), f"{label}: table {t}: {held} slots held of {zch} at world {world}"


def _phase(index: int, load_from: dict[bool, str], save_to: dict[bool, str]) -> dict[bool, dict[str, int]]:
    world, rank = dist.get_world_size(), dist.get_rank()
    _, kind, steps = PHASES[index]
    evicted = {}
    for fused in (False, True):
        label = f"phase {index} ({kind} at world {world}) fused={fused} rank {rank}"
        model, opt = _sharded(kind, fused)
        ref, ref_opt = _reference(index, fused)
        if load_from:
            modular.checkpoint.load(load_from[fused], model, opt if fused else None)
            _same(model, ref, f"{label}: loaded")
            _split(model, f"{label}: loaded")
        evicted[fused] = _train(model, opt, ref, ref_opt, world, rank, steps, label)
        _same(model, ref, f"{label}: trained")
        _split(model, f"{label}: trained")
        modular.checkpoint.save(save_to[fused], model, opt if fused else None)
        exported = modular.checkpoint.export(model)
        if exported is not None:  # torchrec's unsharded MC-EC loads it, strict, and holds ref's state
            unsharded = _model()
            unsharded.load_state_dict(exported, strict=True)
            assert exported.keys() == ref.state_dict().keys(), f"{label}: exported keys"
            _same(unsharded, ref, f"{label}: exported")
        other, _ = _sharded("data_parallel", fused)  # another plan, fused alike
        modular.checkpoint.load_unsharded(other, ref.state_dict())
        _same(other, ref, f"{label}: load_unsharded")
    return evicted


def test_an_mc_embedding_collection_moves_through_checkpoints_from_world_2_to_3_to_1(tmp_path) -> None:
    paths = [{f: str(tmp_path / f"ckpt{i}_{'fused' if f else 'sgd'}") for f in (False, True)} for i in range(3)]
    evicted = {t: 0 for t in SPECS}
    for i, (world, _, _) in enumerate(PHASES):
        counts = run_on_ranks(world, _phase, i, paths[i - 1] if i else {}, paths[i], timeout=180)[0]
        assert counts[False] == counts[True], f"phase {i}: the reference evicts alike fused or not"
        for t in SPECS:
            evicted[t] += counts[False][t]
    steps = sum(len(s) for _, _, s in PHASES)
    intervals = {t: steps // SPECS[t][1] for t in SPECS}
    assert all(2 * evicted[t] > intervals[t] for t in SPECS), f"evictions in most intervals: {evicted} of {intervals}"
