"""`modular.reshard` of a model sharded in 2D (mesh ("replicate", "shard"), 2x2 gloo ranks): every
replica group applies the same moves inside its shard group, and training across the reshard
equals the unsharded reference on the global batch.

One launch runs every case: 2 steps before the reshard and 3 after, outputs every step, weights
and fused state right after the reshard and at the end against the reference, and every rank's
shards (and state) against its copies in the other replica group, byte for byte. Unfused (SGD
over `local_parameters`, rebuilt after the reshard) table-wise -> row-wise with a rank of the
second replica group failing mid-reshard first (every rank raises, the old module trains on) and
a plan for the world size rather than the shard group's (refused on every rank); fused
row-wise Adagrad row-wise -> column-wise (pieces change); Adam data-parallel -> mixed; Adagrad
over DTensor tables column-wise -> table-row-wise (they keep Replicate() on "replicate"); and
replica_sync="periodic", resharded while the replicas differ, against one reference per replica
group that averages alike (tests/modular/replicas/test_2d.py's `_periodic`). The unfused and the Adam cases
run again with the old shards of rebuilt kernels staged through host memory (the path off CPU,
Note [reshard memory]; forced on these CPU ranks): every reshard stages storages, the failure
restores them, and the rest holds as above.
"""

from __future__ import annotations

import contextlib
import copy
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate

import modular
from modular.resharding import call as reshard_call
from modular.resharding import moves as reshard_moves
from modular.resharding import host_staging as reshard_staging
from modular.tables.forms import is_sharded, local_pieces
from planners.types import ShardingPlan
from tests.dist import run_on_ranks
from tests.modular.adam_reference import ADAM_BETAS, ADAM_EPS, ADAM_LR
from tests.modular.compare import close
from tests.modular.ebc_cases import global_batch, make_batch, make_ebc, placements_for
from tests.modular.fused_reference import FUSED_EPS, FUSED_LR, fused_ebc
from tests.modular.replicas.test_2d import _assert_replicas_identical, _refused
from tests.modular.resharding.test_reshard import _Reference  # the unsharded EBC under the torch twin of the optimizer

DIMS = ("replicate", "shard")
REPLICAS, GROUP = 2, 2
LR = 0.3  # as test_reshard.py's, which _Reference steps with

# (before, after, optimizer (None: SGD over local_parameters), tensor_type)
EXACT = (
    ("table_wise", "row_wise", None, "sharded_tensor"),
    ("row_wise", "column_wise", "exact_rowwise_adagrad", "sharded_tensor"),
    ("data_parallel", "mixed", "adam", "sharded_tensor"),
    ("column_wise", "table_row_wise", "exact_adagrad", "dtensor"),
)


def _pieces(t: torch.Tensor) -> list[tuple[tuple, torch.Tensor]]:
    """(offsets, tensor) of each local piece of a table or state entry (whole if not sharded)."""
    if is_sharded(t):
        return [(tuple(p.offsets), p.tensor.detach()) for p in local_pieces(t)]
    return [((0,) * t.dim(), t.detach())]


def _compare(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    for offsets, tensor in _pieces(got):
        where = tuple(slice(o, o + n) for o, n in zip(offsets, tensor.shape))
        close(tensor.detach(), want.detach()[where], what)


def _check(model, ref: _Reference, fused, mesh, what: str) -> None:
    """Weights (and fused state) against the reference; every piece against its replicas'."""
    refs = dict(ref.module.named_parameters())
    mine = {}
    for name, p in model.named_parameters():
        _compare(p, refs[name], f"{what}: {name}")
        mine.update({(name, o): t for o, t in _pieces(p)})
    if fused is not None:
        for name, entries in fused.state_dict()["state"].items():
            want = ref.state(name)
            assert sorted(entries) == sorted(want), f"{what}: state of {name}: {sorted(entries)}"
            for key, got in entries.items():
                _compare(got, want[key], f"{what}: state {key} of {name}")
                mine.update({(name, key, o): t for o, t in _pieces(got)})
    _assert_replicas_identical(mesh, mine, what)


def _exact(mesh, before: str, after: str, optimizer: str | None, form: str) -> dict[str, str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    ebc = fused_ebc() if optimizer else make_ebc(False)
    ref = _Reference(ebc, optimizer)
    fused = None
    if optimizer == "adam":
        fused = modular.fuse_optimizer(ebc, optimizer, lr=ADAM_LR, betas=ADAM_BETAS, eps=ADAM_EPS)
    elif optimizer:
        fused = modular.fuse_optimizer(ebc, optimizer, lr=FUSED_LR, eps=FUSED_EPS)
    plan = ShardingPlan(world_size=GROUP, modules={"": placements_for(before, ebc, GROUP)})
    model = modular.shard(ebc, plan, mesh=mesh, tensor_type=form)
    opt = fused or torch.optim.SGD(modular.local_parameters(model), lr=LR)
    what = f"rank {rank} {optimizer or 'sgd'} {form}: {before} -> {after}"
    out: dict[str, str] = {}
    for step in range(5):
        if step == 2:
            new = ShardingPlan(world_size=GROUP, modules={"": placements_for(after, ebc, GROUP)})
            if optimizer is None:
                inside = model._sharded
                wrong = ShardingPlan(world_size=world, modules={"": placements_for(after, ebc, world)})
                out["wrong world"] = _refused(lambda: modular.reshard(model, wrong), doing="reshard")
                fault = RuntimeError("injected fault")
                failing = mock.patch.object(reshard_moves, "copy_block", side_effect=fault)
                with failing if rank == 3 else contextlib.nullcontext():  # the 2nd replica group's
                    out["fault"] = _refused(lambda: modular.reshard(model, new), doing="reshard")
                assert model._sharded is inside, f"{what}: a refused reshard replaced the module"
                _check(model, ref, fused, mesh, f"{what}, after the refusals")
            assert modular.reshard(model, new) is model
            assert model.replicas is not None and model.replicas.size == REPLICAS
            _check(model, ref, fused, mesh, f"{what}, after the reshard")
            for name, p in model.named_parameters():
                if isinstance(p, DTensor):
                    assert p.device_mesh.mesh_dim_names == DIMS and p.placements[0] == Replicate(), (
                        f"{what}: {name} lost its 2D placement: {p.placements} on {p.device_mesh}"
                    )
            assert form != "dtensor" or any(isinstance(p, DTensor) for p in model.parameters())
            if optimizer is None:
                opt = torch.optim.SGD(modular.local_parameters(model), lr=LR)
        batches = [make_batch(ebc, seed=1000 * step + r, batch_size=2) for r in range(world)]
        got = model(batches[rank]).values()
        expected = ref.module(global_batch(batches)).values()
        mine = slice(2 * rank, 2 * rank + 2)
        close(got, expected[mine], f"{what}: step {step} output")
        target = torch.randn(expected.shape, generator=torch.Generator().manual_seed(step))
        (got * target[mine]).sum().backward()
        ((expected * target).sum() / world).backward()
        opt.step()
        opt.zero_grad()
        ref.step(batches)
    _check(model, ref, fused, mesh, f"{what}, at the end")
    return out


@torch.no_grad()
def _average(refs: list) -> None:
    named = [dict(r.named_parameters()) for r in refs]
    for name in named[0]:
        mean = sum(n[name] for n in named) / len(named)
        for n in named:
            n[name].copy_(mean)


def _periodic(mesh) -> None:
    """Each replica group trains as a 1D job against its own reference (its group's global
    batch); both sides average after step 0, the reshard after step 1 moves each group's own
    (different) values, and the resharded model's sync_replicas averages as the references do."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine_r, mine_s = rank // GROUP, rank % GROUP
    base = make_ebc(False)
    refs = [copy.deepcopy(base) for _ in range(REPLICAS)]
    ref_opts = [torch.optim.SGD(r.parameters(), lr=LR) for r in refs]
    plan = ShardingPlan(world_size=GROUP, modules={"": placements_for("mixed", base, GROUP)})
    model = modular.shard(copy.deepcopy(base), plan, mesh=mesh, replica_sync="periodic")
    opt = torch.optim.SGD(modular.local_parameters(model), lr=LR)
    what = f"periodic rank {rank}"
    for step in range(5):
        if step == 2:
            new = ShardingPlan(world_size=GROUP, modules={"": placements_for("row_wise", base, GROUP)})
            modular.reshard(model, new)
            opt = torch.optim.SGD(modular.local_parameters(model), lr=LR)
            full = dict(refs[mine_r].named_parameters())
            for name, p in model.named_parameters():
                _compare(p, full[name], f"{what}: {name} after the reshard")
        batches = [make_batch(base, seed=1000 * step + r, batch_size=2) for r in range(world)]
        out = model(batches[rank]).values()
        for r in range(REPLICAS):
            expected = refs[r](global_batch(batches[r * GROUP : (r + 1) * GROUP])).values()
            target = torch.randn(expected.shape, generator=torch.Generator().manual_seed(10 * step + r))
            if r == mine_r:
                rows = slice(2 * mine_s, 2 * mine_s + 2)
                close(out, expected[rows], f"{what}: step {step} output")
                (out * target[rows]).sum().backward()
            ((expected * target).sum() / GROUP).backward()
        opt.step()
        opt.zero_grad()
        for o in ref_opts:
            o.step()
            o.zero_grad()
        if step == 0:
            modular.sync_replicas(model)
            _average(refs)
    modular.sync_replicas(model)  # the new module kept the periodic axis
    _average(refs)
    full = dict(refs[0].named_parameters())
    mine = {}
    for name, p in model.named_parameters():
        _compare(p, full[name], f"{what}: {name} after the last sync")
        mine.update({(name, o): t for o, t in _pieces(p)})
    _assert_replicas_identical(mesh, mine, f"{what} after the last sync")


@contextlib.contextmanager
def _staged(counts: list):
    """Host staging forced on; `counts` gets the number of storages each reshard staged."""
    real = reshard_call.Staged

    def staged(*args, **kwargs):
        made = real(*args, **kwargs)
        counts.append(len(made._storages))
        return made

    with mock.patch.object(reshard_staging, "_STAGE_THROUGH_HOST", True), \
            mock.patch.object(reshard_call, "Staged", staged):  # fmt: skip
        yield


def _cases() -> dict[str, str]:
    mesh = init_device_mesh("cpu", (REPLICAS, GROUP), mesh_dim_names=DIMS)
    out: dict[str, str] = {}
    for case in EXACT:
        out.update(_exact(mesh, *case))
    _periodic(mesh)
    for case in (EXACT[0], EXACT[2]):  # the unfused case (with its failure) and Adam's, staged
        counts: list = []
        with _staged(counts):
            got = _exact(mesh, *case)
        out.update({f"staged {k}": v for k, v in got.items()})
        assert counts and all(counts), f"rank {dist.get_rank()}: {case[:2]} staged {counts} storages"
    return out


@pytest.mark.timeout(300)
def test_2x2_reshard_matches_unsharded_and_keeps_replicas_identical() -> None:
    for r in run_on_ranks(4, _cases, timeout=260):
        wrong = r["wrong world"]
        assert "the plan is for 4 ranks" in wrong and "shard groups of 2" in wrong, wrong
        assert "2 replica groups of 2 ranks" in wrong and "world_size=2" in wrong, wrong
        for fault in (r["fault"], r["staged fault"]):
            assert "modular.reshard failed on rank 3 while filling the new shards of module ''" in fault, fault
            assert "RuntimeError: injected fault" in fault and "keeps its old shards" in fault, fault
