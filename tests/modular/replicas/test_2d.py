"""2D sparse parallelism (issue 36): `modular.shard(model, plan, mesh=mesh)` with a 2D mesh
("replicate", "shard") trains exactly as the unsharded EBC on the global batch (every rank's
samples, in global rank order), and a shard's copies in the replica groups stay bit-identical.

Each rank body loops over the plans (one per sharding type and a mixed one) under one optimizer:
the outputs of every step, the weights (and the fused optimizer's state) after the steps against
the reference, and every rank's shards against its copies in the other replica groups, byte for
byte. Replica groups get different batch sizes (the shard group agrees on one, replicas need not).
A DLRM's dense part beside 2D tables: FSDP2 HSDP on the same mesh, or DDP, with
`clip_grad_norm_` counting every element once. Note [exact replicas] in modular/kernels/exact_replicas.py.
"""

from __future__ import annotations

import copy
import hashlib

import pytest
import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

import modular
from planners.types import ShardingPlan
from tests.dist import run_on_ranks
from tests.modular.adam_reference import ADAM_BETAS, ADAM_EPS, ADAM_FAMILY, ADAM_LR, MomentsReference, touched_rows
from tests.modular.compare import close, local_blocks, state_error
from tests.modular.dlrm_cases import DLRM, DLRM_LR, MLP, dlrm_batch, global_dlrm_batch, loss_of, mixed_plan
from tests.modular.ebc_cases import CASES, global_batch, make_batch, make_ebc, placements_for
from tests.modular.fused_reference import FUSED_EPS, FUSED_LR, FusedReference, fused_ebc

DIMS = ("replicate", "shard")
STEPS = 3
SGD_LR = 0.5
FUSED = ("exact_sgd", "exact_adagrad", "exact_rowwise_adagrad")


def _batch_size(replica: int) -> int:
    return 2 + replica  # replica groups of different batch sizes


def _digests(tensors: dict) -> dict:
    # Of copies: `.numpy()` on a tensor marks its storage not resizable for good, which would keep
    # reshard's host staging (host_staging.py) from freeing it later in the same process.
    return {k: hashlib.sha256(t.detach().clone().numpy().tobytes()).hexdigest() for k, t in tensors.items()}


def _assert_replicas_identical(mesh: DeviceMesh, tensors: dict, what: str) -> None:
    """Every rank's `tensors` (by key) byte for byte equal to those of the ranks in its replica
    group (the same shard rank in the other replica groups)."""
    mine = (mesh.get_local_rank("shard"), _digests(tensors))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    for r, (s, digests) in enumerate(every):
        if s == mine[0] and digests != mine[1]:
            differ = sorted(k for k in digests if digests[k] != mine[1].get(k))
            raise AssertionError(f"{what}: rank {dist.get_rank()} and its replica rank {r} differ on {differ}")


def _train(mesh: DeviceMesh, case: str, optimizer: str | None, weighted: bool = False) -> float:
    """One plan trained sharded on `mesh` beside the unsharded reference on the global batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    replicas, group = mesh.mesh.shape
    if optimizer is None:
        ebc = make_ebc(weighted)
        ref_ebc = copy.deepcopy(ebc)
        ref_opt = torch.optim.SGD(ref_ebc.parameters(), lr=SGD_LR)
    else:
        ebc = fused_ebc(weighted)
        ref = FusedReference(copy.deepcopy(ebc), optimizer)
        ref_ebc = ref.ebc
        opt = modular.fuse_optimizer(ebc, optimizer, lr=FUSED_LR, eps=FUSED_EPS)
    plan = ShardingPlan(world_size=group, modules={"": placements_for(case, ebc, group)})
    model = modular.shard(ebc, plan, mesh=mesh)
    if optimizer is None:
        opt = torch.optim.SGD(modular.local_parameters(model), lr=SGD_LR) if modular.local_parameters(model) else None
    sizes = [_batch_size(r // group) for r in range(world)]
    starts = [sum(sizes[:r]) for r in range(world + 1)]
    mine = slice(starts[rank], starts[rank + 1])
    worst = 0.0
    label = f"{case}, {optimizer or 'SGD over local_parameters'}, rank {rank} of {tuple(mesh.mesh.shape)}"
    for step in range(STEPS):
        batches = [make_batch(ebc, seed=1000 * step + r, batch_size=sizes[r]) for r in range(world)]
        out = model(batches[rank]).values()
        expected = ref_ebc(global_batch(batches)).values()
        worst = max(worst, close(out, expected[mine], f"{label}: step {step} output"))
        target = torch.randn(expected.shape, generator=torch.Generator().manual_seed(step))
        (out * target[mine]).sum().backward()
        ((expected * target).sum() / world).backward()  # the mean over every rank's loss
        if opt is not None:
            opt.step()
            opt.zero_grad()
        if optimizer is None:
            ref_opt.step()
            ref_opt.zero_grad()
        else:
            ref.step()
    full = dict(ref_ebc.named_parameters())
    mine_now = {}
    for name, p in model.named_parameters():
        for tensor, rows, cols in local_blocks(p):
            what = f"{label}: {name}[{rows.start}:{rows.stop}, {cols.start}:{cols.stop}] after {STEPS} steps"
            worst = max(worst, close(tensor.detach(), full[name].detach()[rows, cols], what))
            mine_now[(name, rows.start, cols.start)] = tensor
    if optimizer is not None:
        state = opt.state_dict()["state"]
        for name in full:
            want = ref.state(name)
            if want is not None:
                got = next(iter(state[name].values()))
                worst = max(worst, state_error(got, want, f"{label}: {name} state"))
                pieces = [s.tensor for s in got.local_shards()] if isinstance(got, ShardedTensor) else [got]
                for i, piece in enumerate(pieces):
                    mine_now[(name, "state", i)] = piece
    _assert_replicas_identical(mesh, mine_now, label)
    return worst


def _train_cases(shape: tuple[int, int], optimizer: str | None) -> dict[str, float]:
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=DIMS)
    return {case: _train(mesh, case, optimizer) for case in CASES}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("optimizer", (None, *FUSED))
def test_2x2_matches_unsharded_on_the_global_batch(optimizer: str | None) -> None:
    results = run_on_ranks(4, _train_cases, (2, 2), optimizer, timeout=560)
    assert all(set(r) == set(CASES) for r in results)


def _refused(call, doing: str = "shard") -> str:
    try:
        call()
    except modular.ShardingError as e:
        return str(e)
    raise AssertionError(f"rank {dist.get_rank()}: {doing} accepted what it must refuse")


def _errors() -> list[str]:
    """Each mistake raises on every rank, naming the cause."""
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=DIMS)
    ebc = make_ebc(False)
    placements = placements_for("row_wise", ebc, 2)
    messages = []
    # A plan for 3 ranks on shard groups of 2.
    plan3 = ShardingPlan(world_size=3, modules={"": placements_for("row_wise", ebc, 3)})
    messages.append(_refused(lambda: modular.shard(copy.deepcopy(ebc), plan3, mesh=mesh)))
    plan = ShardingPlan(world_size=2, modules={"": placements})
    # The dims misnamed (the order FSDP2's HSDP mesh does not use).
    swapped = init_device_mesh("cpu", (2, 2), mesh_dim_names=("shard", "replicate"))
    messages.append(_refused(lambda: modular.shard(copy.deepcopy(ebc), plan, mesh=swapped)))
    # A 3D mesh.
    cube = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("a", "replicate", "shard"))
    messages.append(_refused(lambda: modular.shard(copy.deepcopy(ebc), plan, mesh=cube)))
    # Rank 0 passes another 2D mesh (its shard groups are the columns) than every other rank.
    other = DeviceMesh("cpu", torch.arange(4).view(2, 2).t().contiguous(), mesh_dim_names=DIMS)
    messages.append(
        _refused(lambda: modular.shard(copy.deepcopy(ebc), plan, mesh=other if rank == 0 else mesh))
    )
    # One rank only asks for a periodic sync.
    messages.append(
        _refused(lambda: modular.shard(
            copy.deepcopy(ebc), plan, mesh=mesh, replica_sync="periodic" if rank == 3 else "exact"
        ))
    )  # fmt: skip
    return messages


@pytest.mark.timeout(240)
def test_mesh_errors_raise_on_every_rank() -> None:
    for messages in run_on_ranks(4, _errors, timeout=200):
        wrong_size, misnamed, cube, disagree, sync = messages
        assert "the plan is for 3 ranks but mesh['shard'] has 2" in wrong_size, wrong_size
        assert "world_size=2" in wrong_size and "'shard' dim has 3" in wrong_size, wrong_size
        assert "('replicate', 'shard')" in misnamed and "('shard', 'replicate')" in misnamed, misnamed
        assert "3D mesh" in cube, cube
        assert "disagree" in disagree and "mesh" in disagree, disagree
        # Note [agreeing on options]: the option, each group of ranks and its value
        assert "disagree" in sync and "replica_sync: ranks [0, 1, 2] 'exact', ranks [3] 'periodic'" in sync, sync


def _train_six(shape: tuple[int, int]) -> dict[str, float]:
    """Six ranks as 3x2 or 2x3: the mixed plan and row-wise, weighted too, unfused and under
    row-wise Adagrad (column pieces exchange row statistics within the shard group)."""
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=DIMS)
    out = {}
    for case in ("mixed", "column_wise"):
        for optimizer in (None, "exact_rowwise_adagrad"):
            for weighted in (False, True):
                if weighted and optimizer is not None and case == "mixed":
                    continue  # the mixed plan names the weighted tables of make_ebc
                out[f"{case} {optimizer} {weighted}"] = _train(mesh, case, optimizer, weighted)
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("shape", [(3, 2), (2, 3)])
def test_six_ranks_match_unsharded(shape: tuple[int, int]) -> None:
    results = run_on_ranks(6, _train_six, shape, timeout=560)
    assert all(len(r) == 7 for r in results)


# -- the dense part beside 2D tables: FSDP2 HSDP on the same mesh, or DDP; clip_grad_norm_ ------


def _grads_match(model, ref, what: str) -> None:
    """Each rank's gradients against the reference's: the local blocks of sharded tables, whole
    DTensor gradients (collective) and plain ones."""
    refs = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        want = refs[name].grad
        if isinstance(p, ShardedTensor):
            for t, rows, cols in local_blocks(p):
                close(t.grad, want[rows, cols], f"{what}: grad of {name}[{rows.start}, {cols.start}]")
        else:
            got = p.grad.full_tensor() if isinstance(p, DTensor) else p.grad
            close(got, want, f"{what}: grad of {name}")


def _weights_match(model, ref, what: str) -> None:
    refs = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        if isinstance(p, ShardedTensor):
            for t, rows, cols in local_blocks(p):
                close(t.detach(), refs[name].detach()[rows, cols], f"{what}: {name}[{rows.start}, {cols.start}]")
        else:
            got = p.full_tensor() if isinstance(p, DTensor) else p.detach()
            close(got, refs[name].detach(), f"{what}: {name}")


def _dlrm_2d(wrap: str) -> list[float]:
    """A DLRM whose tables are 2D-sharded (the mixed plan over shard groups of 2) and whose MLPs
    are HSDP on the same mesh (or DDP), trained with clipping beside the unsharded reference on
    the global batch (equal batch sizes: the global mean BCE is the mean over ranks)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=DIMS)
    torch.manual_seed(0)
    ref = DLRM()
    model = copy.deepcopy(ref)
    modular.shard(model, mixed_plan(2), mesh=mesh)
    if wrap == "hsdp":
        forward = modular.apply_fully_shard(model, modules={MLP}, mesh=mesh)
    else:
        forward = modular.apply_ddp(model)
    opt = torch.optim.SGD(modular.local_parameters(model), lr=DLRM_LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=DLRM_LR)
    totals = []
    for step in range(3):
        batches = [dlrm_batch(step, r) for r in range(world)]
        loss_of(forward, batches[rank]).backward()
        loss_of(ref, global_dlrm_batch(batches)).backward()
        ref_norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]).item()
        total = modular.clip_grad_norm_(model, 0.5 * ref_norm)  # so that it clips
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5 * ref_norm)
        if abs(total.item() - ref_norm) > 1e-4 * max(1.0, ref_norm):
            raise AssertionError(f"rank {rank} step {step}: clip_grad_norm_ {total.item()} != {ref_norm}")
        _grads_match(model, ref, f"{wrap} rank {rank} step {step} (clipped)")
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        totals.append(total.item())
    _weights_match(model, ref, f"{wrap} rank {rank} after 3 steps")
    return totals


@pytest.mark.timeout(300)
@pytest.mark.parametrize("wrap", ["hsdp", "ddp"])
def test_dense_part_hsdp_or_ddp_and_clipping(wrap: str) -> None:
    results = run_on_ranks(4, _dlrm_2d, wrap, timeout=260)
    assert all(r == results[0] for r in results)  # one norm on every rank


# -- replica_sync="periodic": each replica group trains as a 1D job, sync_replicas averages -------


def _periodic(case: str, optimizer: str | None) -> float:
    """Each replica group against its own unsharded reference trained on the group's global batch
    (loss averaged over its G ranks); after step 1 both sides average the replicas (weights and
    the optimizer's state); step 2 then trains from the averages, and replicas differ again."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=DIMS)
    replicas, group = 2, 2
    mine_r, mine_s = rank // group, rank % group
    base = make_ebc(False) if optimizer is None else fused_ebc(False)
    plan = ShardingPlan(world_size=group, modules={"": placements_for(case, base, group)})
    if optimizer is None:
        refs = [copy.deepcopy(base) for _ in range(replicas)]
        ref_opts = [torch.optim.SGD(r.parameters(), lr=SGD_LR) for r in refs]
        model = modular.shard(copy.deepcopy(base), plan, mesh=mesh, replica_sync="periodic")
        opt = torch.optim.SGD(modular.local_parameters(model), lr=SGD_LR) if modular.local_parameters(model) else None
    else:
        fused_refs = [FusedReference(copy.deepcopy(base), optimizer) for _ in range(replicas)]
        refs = [f.ebc for f in fused_refs]
        ebc = copy.deepcopy(base)
        opt = modular.fuse_optimizer(ebc, optimizer, lr=FUSED_LR, eps=FUSED_EPS)
        model = modular.shard(ebc, plan, mesh=mesh, replica_sync="periodic")
    label = f"periodic {case} {optimizer or 'SGD'} rank {rank}"
    worst = 0.0
    for step in range(3):
        batches = [make_batch(base, seed=1000 * step + r, batch_size=2) for r in range(world)]
        out = model(batches[rank]).values()
        for r in range(replicas):
            mine = batches[r * group : (r + 1) * group]
            expected = refs[r](global_batch(mine)).values()
            target = torch.randn(expected.shape, generator=torch.Generator().manual_seed(10 * step + r))
            if r == mine_r:
                rows = slice(2 * mine_s, 2 * mine_s + 2)
                worst = max(worst, close(out, expected[rows], f"{label}: step {step} output"))
                (out * target[rows]).sum().backward()
            ((expected * target).sum() / group).backward()
        if opt is not None:
            opt.step()
            opt.zero_grad()
        for r in range(replicas):
            if optimizer is None:
                ref_opts[r].step()
                ref_opts[r].zero_grad()
            else:
                fused_refs[r].step()
        if step == 1:
            modular.sync_replicas(model, optimizer_state=True)
            with torch.no_grad():
                named = [dict(r.named_parameters()) for r in refs]
                for name in named[0]:
                    mean = sum(n[name] for n in named) / replicas
                    for n in named:
                        n[name].copy_(mean)
                    if optimizer == "exact_adagrad":
                        states = [f.opt.state[n[name]]["sum"] for f, n in zip(fused_refs, named)]
                        avg = sum(states) / replicas
                        for st in states:
                            st.copy_(avg)
    full = dict(refs[mine_r].named_parameters())
    for name, p in model.named_parameters():
        for tensor, rows, cols in local_blocks(p):
            worst = max(worst, close(tensor.detach(), full[name].detach()[rows, cols], f"{label}: {name}"))
    if optimizer == "exact_adagrad":
        state = opt.state_dict()["state"]
        for name in full:
            worst = max(worst, state_error(next(iter(state[name].values())), fused_refs[mine_r].state(name), f"{label}: {name} state"))
    return worst


def _periodic_cases() -> dict[str, float]:
    return {
        f"{case} {opt}": _periodic(case, opt)
        for case in ("mixed", "data_parallel", "row_wise")
        for opt in (None, "exact_adagrad")
    }


@pytest.mark.timeout(300)
def test_periodic_sync_matches_a_reference_that_averages_alike() -> None:
    results = run_on_ranks(4, _periodic_cases, timeout=260)
    assert all(len(r) == 6 for r in results)


def _diverged() -> list[str]:
    """Under exact sync, sync_replicas checks the copies: equal ones pass, one rank's shard
    written outside a step raises on every rank."""
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=DIMS)
    ebc = make_ebc(False)
    model = modular.shard(ebc, ShardingPlan(world_size=2, modules={"": placements_for("mixed", ebc, 2)}), mesh=mesh)
    modular.sync_replicas(model)  # equal copies: nothing raised
    if rank == 3:
        with torch.no_grad():
            next(iter(model.local_shard_views().values()))[0, 0] += 1.0
    return [_refused(lambda: modular.sync_replicas(model))]


@pytest.mark.timeout(120)
def test_a_diverged_replica_raises_on_every_rank() -> None:
    for (message,) in run_on_ranks(4, _diverged, timeout=100):
        assert "diverged" in message and "exact" in message, message


# -- the Adam family (torch emulation on CPU: touched rows' gradients gathered across replicas) ---


def _adam_2d() -> dict[str, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=DIMS)
    out = {}
    for kind in ADAM_FAMILY:
        for case in ("mixed", "column_wise"):
            label = f"{kind} {case} rank {rank}"
            ebc = fused_ebc(False)
            plan = ShardingPlan(world_size=2, modules={"": placements_for(case, ebc, 2)})
            ref = MomentsReference(copy.deepcopy(ebc), kind, weight_decay=0.0)
            opt = modular.fuse_optimizer(ebc, kind, lr=ADAM_LR, betas=ADAM_BETAS, eps=ADAM_EPS)
            model = modular.shard(ebc, plan, mesh=mesh)
            worst = 0.0
            for step in range(STEPS):
                batches = [make_batch(ebc, seed=1000 * step + r, batch_size=2) for r in range(world)]
                got = model(batches[rank]).values()
                expected = ref.module(global_batch(batches)).values()
                mine = slice(2 * rank, 2 * rank + 2)
                worst = max(worst, close(got, expected[mine], f"{label}: step {step} output"))
                target = torch.randn(expected.shape, generator=torch.Generator().manual_seed(step))
                (got * target[mine]).sum().backward()
                ((expected * target).sum() / world).backward()
                opt.step()
                ref.step(touched_rows(ref.module, batches))
            params = dict(ref.module.named_parameters())
            blocks = {}
            for name, p in model.named_parameters():
                for tensor, rows, cols in local_blocks(p):
                    worst = max(worst, close(tensor.detach(), params[name].detach()[rows, cols], f"{label}: {name}"))
                    blocks[(name, rows.start, cols.start)] = tensor
            _assert_replicas_identical(mesh, blocks, label)
            out[f"{kind} {case}"] = worst
    return out


@pytest.mark.timeout(400)
def test_adam_family_2x2_matches_unsharded() -> None:
    results = run_on_ranks(4, _adam_2d, timeout=360)
    assert all(len(r) == 8 for r in results)
