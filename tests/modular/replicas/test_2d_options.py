"""The options of 1D sharding under a 2D mesh (issue 36; the core parity is test_2d.py): DTensor
tables, prefetch, apply_compile and variable-batch (VBE) KJTs, each against the unsharded
reference trained in the same rank body on the global batch (every rank's samples, the loss the
mean over all G x R ranks'), under exact replica sync (Note [exact replicas]).

- DTensor tables span the whole ("replicate", "shard") mesh with `Replicate()` on "replicate"
  before the 1D placement (Note [table tensor types]), for every sharding type, their fused
  state too; they train exactly with every batch prefetched and keep the unsharded FQNs.
  `full_tensor()` raises on every rank naming the way that works (the plan's uneven split is not
  DTensor's), and that way, `modular.unshard`, gives every rank the whole tables. A DCP
  checkpoint saved at 2x2 loads into 1D at 3 ranks bit for bit (weights and fused state).
- VBE batches (ranks with different request counts, so replica groups with different strides; one
  rank's batch a plain one at odd steps) train like torchrec's unsharded EBC on each rank's batch.
- A DLRM with 2D tables and an HSDP dense part under `apply_compile` compiles its towers once,
  never recompiles, and trains like the reference.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import modular
from modular.tables.forms import is_sharded, local_pieces
from planners.types import ShardingPlan, ShardingType
from tests.dist import run_on_ranks
from tests.modular.compare import close
from tests.modular.dlrm_cases import DLRM, DLRM_LR, MLP, dlrm_batch, global_dlrm_batch, loss_of, mixed_plan
from tests.modular.ebc_cases import CASES, global_batch, make_batch, make_ebc, placements_for
from tests.modular.fused_reference import FUSED_EPS, FUSED_LR, FusedReference, fused_ebc
from tests.modular.replicas.test_2d import _assert_replicas_identical, _weights_match
from tests.modular.pooled.test_variable_batch import vbe_batch

DIMS = ("replicate", "shard")
STEPS = 3
SGD_LR = 0.5
TIMEOUT = 240.0


def _mesh(shape: tuple[int, int]) -> DeviceMesh:
    return init_device_mesh("cpu", shape, mesh_dim_names=DIMS)


def _blocks(p: torch.Tensor) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """(region, tensor) of each piece of a table (or state laid out like it) this rank holds:
    its shards, or the whole of a data-parallel copy."""
    if is_sharded(p):
        return [(tuple(slice(o, o + n) for o, n in zip(off, size)), t) for off, size, t in local_pieces(p)]
    return [(tuple(slice(0, n) for n in p.shape), p)]


def _local_blocks_match(model, full: dict[str, torch.Tensor], worst: float, label: str) -> tuple[float, dict]:
    """Each local block of the model's tables against the same region of the reference's
    (`full`): the largest difference so far, and the blocks by (name, first row, first column)."""
    mine_now = {}
    for name, p in model.named_parameters():
        for region, t in _blocks(p):
            worst = max(worst, close(t.detach(), full[name].detach()[region], f"{label}: {name}{region}"))
            mine_now[(name, region[0].start, region[1].start)] = t
    return worst, mine_now


def _pieces_of(state: dict[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], list]]:
    """Each entry's global shape and this rank's pieces (offsets, tensor), to assemble whole."""
    return {
        k: (tuple(v.shape), [(tuple(s.start for s in region), t.detach().clone()) for region, t in _blocks(v)])
        for k, v in state.items()
    }


def _assemble(per_rank: list[dict[str, tuple]]) -> dict[str, torch.Tensor]:
    """The whole tensors from every rank's pieces (a copy's pieces must agree with the others)."""
    out: dict[str, torch.Tensor] = {}
    for pieces in per_rank:
        for k, (shape, blocks) in pieces.items():
            full = out.setdefault(k, torch.full(shape, float("nan")))
            for offsets, t in blocks:
                region = full[tuple(slice(o, o + n) for o, n in zip(offsets, t.shape))]
                seen = ~region.isnan()
                assert torch.equal(region[seen], t[seen]), f"replicas of {k} at {offsets} differ"
                region.copy_(t)
    assert not any(v.isnan().any() for v in out.values()), "a piece of the checkpoint is missing"
    return out


def _fused_state(opt: Any) -> dict[str, torch.Tensor]:
    return {f"{fqn}.{name}": v for fqn, s in opt.state_dict()["state"].items() for name, v in s.items()
            if isinstance(v, torch.Tensor) and v.dim() > 0}  # fmt: skip


# -- DTensor tables over the 2D mesh, every batch prefetched; a 2x2 DCP checkpoint into 1D -------


def _check_placements(model, opt, plan: ShardingPlan, mesh: DeviceMesh, label: str) -> None:
    """Every sharded table a DTensor over the 2D mesh, (Replicate(), the 1D placement), its fused
    state (Replicate(), Shard(0)) for row state; data-parallel tables plain tensors."""
    placements = plan.modules[""]
    state = _fused_state(opt) if opt is not None else {}
    for name, p in model.named_parameters():
        kind = placements[name.split(".")[1]].sharding_type
        if kind is ShardingType.DATA_PARALLEL:
            assert not isinstance(p, DTensor), f"{label}: data-parallel {name} is a {type(p).__name__}"
            continue
        cut = Shard(1) if kind is ShardingType.COLUMN_WISE else Shard(0)
        assert isinstance(p, DTensor) and p.device_mesh == mesh, f"{label}: {name} is {type(p).__name__}"
        assert p.placements == (Replicate(), cut), f"{label}: {name} placements {p.placements}"
        for key, s in state.items():
            if key.startswith(name + "."):
                want = (Replicate(), cut if s.dim() == 2 else Shard(0))
                assert isinstance(s, DTensor) and s.device_mesh == mesh, f"{label}: {key} is {type(s).__name__}"
                assert s.placements == want, f"{label}: {key} placements {s.placements}"
        with pytest.raises(modular.ShardingError, match="modular.checkpoint.export"):
            p.full_tensor()  # refused on every rank before any collective: none hangs


def _dtensor_case(mesh: DeviceMesh, case: str, optimizer: Optional[str]) -> tuple[float, Any, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    group = mesh.size(1)
    ebc = make_ebc(False) if optimizer is None else fused_ebc(False)
    plan = ShardingPlan(world_size=group, modules={"": placements_for(case, ebc, group)})
    ref = FusedReference(copy.deepcopy(ebc), optimizer) if optimizer else None
    ref_ebc = ref.ebc if ref else copy.deepcopy(ebc)
    ref_opt = None if ref else torch.optim.SGD(ref_ebc.parameters(), lr=SGD_LR)
    fused = modular.fuse_optimizer(ebc, optimizer, lr=FUSED_LR, eps=FUSED_EPS) if optimizer else None
    model = modular.shard(ebc, plan, mesh=mesh, tensor_type="dtensor")
    opt = fused or torch.optim.SGD(modular.local_parameters(model), lr=SGD_LR)
    label = f"dtensor {case} {optimizer or 'SGD'} rank {rank} of {tuple(mesh.mesh.shape)}"
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref_ebc.named_parameters()], label
    assert list(model.state_dict()) == list(ref_ebc.state_dict()), label
    _check_placements(model, fused, plan, mesh, label)
    batches = [[make_batch(ebc, seed=1000 * step + r, batch_size=2) for r in range(world)] for step in range(STEPS)]
    modular.prefetch(model, batches[0][rank])
    # In the background on a second gloo group per shard group (Note [prefetched input dist]).
    assert model._prefetcher.overlaps, f"{label}: prefetch runs at once"
    worst = 0.0
    for step in range(STEPS):
        assert id(batches[step][rank]) in model._prefetcher._pending, f"{label}: step {step} not prefetched"
        out = model(batches[step][rank]).values()
        if step + 1 < STEPS:  # the next batch's input dist, before this one's backward
            modular.prefetch(model, batches[step + 1][rank])
        expected = ref_ebc(global_batch(batches[step])).values()
        mine = slice(2 * rank, 2 * rank + 2)
        worst = max(worst, close(out, expected[mine], f"{label}: step {step} output"))
        target = torch.randn(expected.shape, generator=torch.Generator().manual_seed(step))
        (out * target[mine]).sum().backward()
        ((expected * target).sum() / world).backward()
        opt.step()
        opt.zero_grad()
        if ref is not None:
            ref.step()
        else:
            ref_opt.step()
            ref_opt.zero_grad()
    assert not model._prefetcher._pending, f"{label}: a prefetched batch was left unused"
    full = dict(ref_ebc.named_parameters())
    worst, mine_now = _local_blocks_match(model, full, worst, label)
    with modular.unshard(model) as whole:  # the whole tables on every rank, which full_tensor() refuses
        assert sorted(whole) == sorted(full), f"{label}: unshard gave {sorted(whole)}"
        for name, t in whole.items():
            worst = max(worst, close(t, full[name].detach(), f"{label}: unshard's {name}"))
    for key, s in (_fused_state(fused) if fused else {}).items():
        want = ref.state(key.rsplit(".", 1)[0])
        for region, t in _blocks(s):
            worst = max(worst, close(t, want[region], f"{label}: {key}{region}"))
            mine_now[(key, region[0].start)] = t
    _assert_replicas_identical(mesh, mine_now, label)
    return worst, model, opt


def _dtensor_2x2(path: str) -> dict[str, Any]:
    """Every plan under a rotating optimizer; the mixed one (fused Adagrad) saved with DCP."""
    mesh = _mesh((2, 2))
    out: dict[str, Any] = {}
    for i, case in enumerate(CASES):
        out[case], model, opt = _dtensor_case(mesh, case, (None, "exact_rowwise_adagrad", "exact_adagrad")[i % 3])
    assert case == "mixed" and isinstance(opt, modular.FusedOptimizer), (case, type(opt))
    modular.checkpoint.save(path, model, opt)
    out["saved"] = _pieces_of({**model.state_dict(), **_fused_state(opt)})
    return out


def _load_1d(path: str, saved: dict[str, torch.Tensor]) -> int:
    """The 2x2 checkpoint into DTensor tables sharded 1D over every rank by another plan: every
    piece of every table and of its Adagrad state equals the saved one, bit for bit."""
    world = dist.get_world_size()
    ebc = fused_ebc(False)
    opt = modular.fuse_optimizer(ebc, "exact_adagrad", lr=FUSED_LR, eps=FUSED_EPS)
    model = modular.shard(ebc, ShardingPlan(world_size=world, modules={"": placements_for("mixed", ebc, world)}),
                          tensor_type="dtensor")  # fmt: skip
    with torch.no_grad():  # nothing of the saved model left before the load
        for value in (*model.state_dict().values(), *_fused_state(opt).values()):
            for _, t in _blocks(value):
                t.fill_(-1.0)
    modular.checkpoint.load(path, model, opt)
    compared = 0
    for key, value in {**model.state_dict(), **_fused_state(opt)}.items():
        if isinstance(value, DTensor):  # in 1D as in 2D: refused on every rank, none left waiting
            with pytest.raises(modular.ShardingError, match="modular.unshard"):
                value.full_tensor()
        assert key in saved, f"{key} was not in the checkpoint"
        for region, t in _blocks(value):
            assert torch.equal(t, saved[key][region]), f"rank {dist.get_rank()}: {key}{region} differs from the saved"
            compared += 1
    return compared


@pytest.mark.timeout(600)
def test_dtensor_tables_over_the_2d_mesh_train_prefetched_and_load_into_1d(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    ranks = run_on_ranks(4, _dtensor_2x2, path, timeout=TIMEOUT)
    assert all(set(CASES) <= set(r) for r in ranks)
    saved = _assemble([r["saved"] for r in ranks])
    assert any(".sum" in k for k in saved) and any(k.endswith(".weight") for k in saved), sorted(saved)
    compared = run_on_ranks(3, _load_1d, path, saved, timeout=TIMEOUT)
    assert min(compared) >= 4, compared  # every rank holds pieces of the tables and their state


# -- variable batch per feature (VBE) under exact replica sync -------------------------------------


def _vbe_case(mesh: DeviceMesh, case: str, weighted: bool, optimizer: Optional[str], prefetch: bool) -> float:
    """Each rank's VBE batch (1-3 requests of 6 samples, by rank and step; the last rank's a plain
    KJT at odd steps) against torchrec's unsharded EBC on the same batch; the reference loss is
    the mean over every rank's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = mesh.size(1)
    ref_ebc = make_ebc(weighted)
    ebc = copy.deepcopy(ref_ebc)
    fused = modular.fuse_optimizer(ebc, optimizer, lr=FUSED_LR, eps=FUSED_EPS) if optimizer else None
    model = modular.shard(ebc, ShardingPlan(world_size=group, modules={"": placements_for(case, ebc, group)}), mesh=mesh)
    opt = fused or torch.optim.SGD(modular.local_parameters(model), lr=SGD_LR)
    ref = FusedReference(ref_ebc, optimizer) if optimizer else torch.optim.SGD(ref_ebc.parameters(), lr=SGD_LR)
    label = f"vbe {case} weighted={weighted} {optimizer or 'SGD'} prefetch={prefetch} rank {rank} of {tuple(mesh.mesh.shape)}"
    worst = 0.0
    for step in range(STEPS):
        batches = [
            vbe_batch(ref_ebc, 100 * step + r, 1 + (r + step) % 3, plain=r == world - 1 and step % 2 == 1)
            for r in range(world)
        ]
        if prefetch:
            modular.prefetch(model, batches[rank])
        got = model(batches[rank]).values()
        wants = [ref_ebc(b).values() for b in batches]
        worst = max(worst, close(got, wants[rank], f"{label}: step {step} output"))
        targets = [torch.randn(w.shape, generator=torch.Generator().manual_seed(10 * step + r)) for r, w in enumerate(wants)]
        (got * targets[rank]).sum().backward()
        (sum((w * t).sum() for w, t in zip(wants, targets)) / world).backward()
        opt.step()
        opt.zero_grad()
        ref.step()
        if optimizer is None:
            ref.zero_grad()
    full = dict(ref_ebc.named_parameters())
    worst, mine_now = _local_blocks_match(model, full, worst, label)
    _assert_replicas_identical(mesh, mine_now, label)
    return worst


def _vbe(shape: tuple[int, int], cases: tuple[str, ...]) -> dict[str, float]:
    mesh = _mesh(shape)
    out = {}
    for i, case in enumerate(cases):
        optimizer = (None, "exact_rowwise_adagrad", "exact_sgd")[i % 3]
        out[case] = _vbe_case(mesh, case, bool(i % 2), optimizer, prefetch=bool(i % 2 == 0))
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("shape, cases", [((2, 2), CASES), ((3, 2), ("mixed", "column_wise"))])
def test_vbe_batches_train_like_the_unsharded_ebc_under_exact_sync(shape: tuple[int, int], cases: tuple[str, ...]) -> None:
    results = run_on_ranks(shape[0] * shape[1], _vbe, shape, cases, timeout=TIMEOUT)
    assert all(set(r) == set(cases) for r in results)


# -- apply_compile: a DLRM with 2D tables and HSDP towers ------------------------------------------


def _compiled_dlrm() -> list[float]:
    """The towers compiled (apply_compile) under HSDP, every batch prefetched: one compile, no
    recompiles after the first step, no graph break, and the weights of every step against the
    unsharded reference on the global batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch._dynamo.reset()
    counters.clear()
    mesh = _mesh((2, 2))
    torch.manual_seed(0)
    ref = DLRM()
    model = copy.deepcopy(ref)
    modular.shard(model, mixed_plan(2), mesh=mesh)
    modular.apply_fully_shard(model, modules={MLP}, mesh=mesh)
    modular.apply_compile(model, modules={MLP})
    opt = torch.optim.SGD(modular.local_parameters(model), lr=DLRM_LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=DLRM_LR)
    batches = [[dlrm_batch(step, r) for r in range(world)] for step in range(4)]
    losses = []
    for step, mine in enumerate(batches):
        if step + 1 < len(batches):
            modular.prefetch(model, batches[step + 1][rank].sparse)
        with torch._dynamo.config.patch(error_on_recompile=step >= 1):
            loss = loss_of(model, mine[rank])
            loss.backward()
        loss_of(ref, global_dlrm_batch(mine)).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        _weights_match(model, ref, f"compiled rank {rank} step {step}")
        losses.append(float(loss))
    assert counters["stats"]["unique_graphs"] > 0, "apply_compile compiled nothing"
    assert not counters["graph_break"], dict(counters["graph_break"])
    return losses


@pytest.mark.timeout(600)
def test_apply_compile_over_2d_tables_matches_the_reference_without_recompiles() -> None:
    losses = run_on_ranks(4, _compiled_dlrm, timeout=TIMEOUT)
    assert all(len(l) == 4 for l in losses)
