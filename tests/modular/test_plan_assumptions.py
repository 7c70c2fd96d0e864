"""What a plan was priced for, checked where it is applied (issue 50; Note [a plan's assumptions]
in modular/plan_assumptions.py), on gloo ranks.

- A difference that changes the layout (the replica groups against the mesh, row-wise Adagrad's
  column-wise statistic against `fuse_optimizer`'s) raises `ShardingError` on every rank, the
  same message naming both values, before any collective but the plan's agreement; `reshard`
  refuses alike.
- A difference that changes only the price (the optimizer, fused or not; the comm dtype; the
  replica sync) warns `modular.PlanMismatchWarning` once per process for each pair, naming both
  values at the caller's line, and the model still trains as the unsharded reference does on
  the global batch (the loss averaged over ranks, tests/modular/compare.py).
- A plan that records nothing (written by hand) warns nothing; nor does a planner's plan run
  as it was priced.
The warning is once per process, and pooled ranks (tests/dist.py) keep what earlier tests warned:
the warning tests run on fresh ranks (`spawn_ranks`).
"""

from __future__ import annotations

import copy
import dataclasses
import re
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import modular
import planners
from planners import PlanAssumptions, ShardingPlan
from tests.dist import expect_errors_on_all_ranks, spawn_ranks
from tests.modular.collectives import no_collectives
from tests.modular.compare import close, local_blocks
from tests.modular.ebc_cases import BATCH, global_batch, make_batch, make_ebc, placements_for
from tests.modular.fused_reference import FUSED_EPS, FUSED_LR, FusedReference, fused_ebc
from tests.modular.test_shard_errors import AGREEMENT

TIMEOUT_S = 90
STEPS = 3
SGD_LR = 0.5
DIMS = ("replicate", "shard")


class _Towers(nn.Module):
    """Two EBCs reading the same features: two planned modules with the same difference."""

    def __init__(self) -> None:
        super().__init__()
        self.a = fused_ebc()
        self.b = fused_ebc()

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return torch.cat([self.a(kjt).values(), self.b(kjt).values()], dim=1)


def _priced(plan: ShardingPlan, **assumed) -> ShardingPlan:
    return dataclasses.replace(plan, priced_for=PlanAssumptions(batch_size=BATCH, **assumed))


def _planner_plan(ebc: nn.Module, **options) -> ShardingPlan:
    """`planners.plan`'s plan of `ebc`'s tables (each looked up by a feature of its own: the
    cases' tables share features, which the planner refuses), priced as `options` say."""
    tables = [planners.Table(c.name, c.num_embeddings, c.embedding_dim) for c in ebc.embedding_bag_configs()]
    topology = planners.Topology(dist.get_world_size(), device_memory="1GiB")
    return planners.plan(tables, topology, batch_size=BATCH, **options)


def _mismatches(caught: list) -> list[tuple[str, str]]:
    """(message, file) of each PlanMismatchWarning recorded."""
    return [(str(w.message), w.filename) for w in caught if issubclass(w.category, modular.PlanMismatchWarning)]


def _shard_warnings(call, *args, **kwargs) -> list[tuple[str, str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call(*args, **kwargs)
    return _mismatches(caught)


def _train(model: nn.Module, ref: nn.Module, step_model, step_ref, template: nn.Module) -> float:
    """`STEPS` steps of `model` on this rank's batch beside `ref` on the global batch; the worst
    difference of outputs, then of every table piece this rank holds."""
    rank, world = dist.get_rank(), dist.get_world_size()
    worst = 0.0
    for step in range(STEPS):
        batches = [make_batch(template, seed=1000 * step + r) for r in range(world)]
        out = model(batches[rank])
        out = out if isinstance(out, torch.Tensor) else out.values()
        expected = ref(global_batch(batches))
        expected = expected if isinstance(expected, torch.Tensor) else expected.values()
        mine = slice(rank * out.shape[0], (rank + 1) * out.shape[0])
        worst = max(worst, close(out, expected[mine], f"rank {rank} step {step} output"))
        target = torch.randn(expected.shape, generator=torch.Generator().manual_seed(step))
        (out * target[mine]).sum().backward()
        ((expected * target).sum() / world).backward()  # the mean over every rank's loss
        step_model()
        step_ref()
    full = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        for tensor, rows, cols in local_blocks(p):
            worst = max(worst, close(tensor.detach(), full[name].detach()[rows, cols], f"rank {rank} {name}"))
    return worst


def _on_fresh_ranks(world: int, fn, *args) -> list:
    """`fn` on new ranks, which have warned nothing yet; raises if any rank failed."""
    outcomes = spawn_ranks(world, fn, *args, timeout=TIMEOUT_S)
    failed = [o for o in outcomes if o.error is not None or o.timed_out or o.exitcode not in (0, None)]
    assert not failed, "\n".join(
        f"rank {o.rank}: {o.error.exc_type + ': ' + o.error.message + o.error.traceback if o.error else ''}"
        f" exit {o.exitcode} timed out {o.timed_out}\n{o.output[-3000:]}"
        for o in failed
    )
    return [o.result for o in outcomes]


# -- a difference in layout: refused on every rank -----------------------------------------------


def _layout_difference(case: str) -> None:
    world = dist.get_world_size()
    mesh = None
    if case == "replicas_without_a_mesh":  # priced for 2 replica groups, run in 1D
        ebc = make_ebc(False)
        plan = _priced(ShardingPlan(world, {"": placements_for("mixed", ebc, world)}), replicas=2)
    elif case == "no_replicas_on_a_2d_mesh":  # priced for 1D, run on 2 replica groups of 1 rank
        mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=DIMS)
        ebc = make_ebc(False)
        plan = _priced(ShardingPlan(1, {"": placements_for("table_wise", ebc, 1)}))
    elif case == "per_shard_statistic_fused_on_meta":  # priced exact, fused per_shard (pending)
        ebc = make_ebc(False, device=torch.device("meta"))
        modular.fuse_optimizer(ebc, "exact_rowwise_adagrad", lr=0.1, column_wise_statistic="per_shard")
        plan = _priced(ShardingPlan(world, {"": placements_for("column_wise", ebc, world)}))
    elif case == "exact_statistic_fused_materialised":  # priced per_shard, fused exact
        ebc = fused_ebc()
        modular.fuse_optimizer(ebc, "exact_rowwise_adagrad", lr=0.1)
        plan = _priced(ShardingPlan(world, {"": placements_for("column_wise", ebc, world)}),
                       column_wise_statistic="per_shard")  # fmt: skip
    else:
        raise ValueError(case)
    with no_collectives(allow=AGREEMENT):  # refused before anything is built
        modular.shard(ebc, plan, mesh=mesh)


LAYOUT_ERRORS = {
    "replicas_without_a_mesh": r"modular\.shard: the plan was priced for 2 replica groups \(planners\.plan\(\.\.\., replicas=2\)\) but it runs without replica groups \(a process group or a 1D mesh: 1\);.* Run it on a 2D mesh \('replicate', 'shard'\) with mesh\['replicate'\]\.size\(\) == 2, or plan for this one with planners\.plan\(\.\.\., replicas=1\)",
    "no_replicas_on_a_2d_mesh": r"modular\.shard: the plan was priced for 1 replica group \(planners\.plan\(\.\.\., replicas=1\)\) but the mesh has 2 \(mesh\['replicate'\]\.size\(\) == 2\);.* Run it on no 2D mesh, or plan for this one with planners\.plan\(\.\.\., replicas=2\)",
    "per_shard_statistic_fused_on_meta": r"modular\.shard: the plan was priced for column_wise_statistic 'exact' but module '' is fused with column_wise_statistic='per_shard' \(modular\.fuse_optimizer\);.*: fuse with column_wise_statistic='exact', or plan with planners\.plan\(\.\.\., column_wise_statistic='per_shard'\)",
    "exact_statistic_fused_materialised": r"modular\.shard: the plan was priced for column_wise_statistic 'per_shard' but module '' is fused with column_wise_statistic='exact'.*: fuse with column_wise_statistic='per_shard', or plan with planners\.plan\(\.\.\., column_wise_statistic='exact'\)",
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(LAYOUT_ERRORS))
def test_a_layout_difference_raises_on_every_rank_naming_both_values(case: str) -> None:
    messages = expect_errors_on_all_ranks(2, _layout_difference, case, timeout=TIMEOUT_S)
    assert len(set(messages)) == 1, messages
    assert re.search(LAYOUT_ERRORS[case], messages[0]), messages[0]


def _reshard_to_another_statistic() -> None:
    world = dist.get_world_size()
    ebc = fused_ebc()
    modular.fuse_optimizer(ebc, "exact_rowwise_adagrad", lr=0.1, column_wise_statistic="per_shard")
    modular.shard(ebc, ShardingPlan(world, {"": placements_for("table_wise", ebc, world)}))  # nothing recorded
    new = _priced(ShardingPlan(world, {"": placements_for("row_wise", ebc, world)}))  # priced exact
    with no_collectives(allow=AGREEMENT):
        modular.reshard(ebc, new)


@pytest.mark.timeout(120)
def test_reshard_refuses_a_layout_difference_on_every_rank() -> None:
    messages = expect_errors_on_all_ranks(2, _reshard_to_another_statistic, timeout=TIMEOUT_S)
    assert len(set(messages)) == 1, messages
    assert re.search(r"modular\.reshard: the plan was priced for column_wise_statistic 'exact' but module '' is fused "
                     r"with column_wise_statistic='per_shard'", messages[0]), messages[0]  # fmt: skip


# -- a difference in price: one warning per pair, and training as unsharded ------------------------


def _fused_priced_for_adam_and_fp16() -> dict:
    world = dist.get_world_size()
    model = _Towers()
    ref = FusedReference(copy.deepcopy(model), "exact_rowwise_adagrad")
    opt = modular.fuse_optimizer(model, "exact_rowwise_adagrad", lr=FUSED_LR, eps=FUSED_EPS)
    plan = _priced(ShardingPlan(world, {"a": placements_for("mixed", model.a, world),
                                        "b": placements_for("column_wise", model.b, world)}),
                   optimizer="adam", comm_dtype="fp16")  # fmt: skip
    warned = _shard_warnings(modular.shard, model, plan)  # FP32 comms, row-wise Adagrad
    again = _Towers()  # the same differences on another model of the same process: not again
    modular.fuse_optimizer(again, "exact_rowwise_adagrad", lr=FUSED_LR, eps=FUSED_EPS)
    warned_again = _shard_warnings(modular.shard, again, plan)
    worst = _train(model, ref.ebc, lambda: (opt.step(), opt.zero_grad()), ref.step, fused_ebc())
    moved = _priced(ShardingPlan(world, {"a": placements_for("row_wise", model.a, world),
                                         "b": placements_for("table_wise", model.b, world)}),
                    optimizer="exact_rowwise_adagrad", comm_dtype="bf16")  # fmt: skip
    resharded = _shard_warnings(modular.reshard, model, moved)
    return {"warned": warned, "again": warned_again, "worst": worst, "resharded": resharded}


@pytest.mark.timeout(180)
def test_a_price_difference_warns_once_naming_both_values_and_trains_as_unsharded() -> None:
    for rank, out in enumerate(_on_fresh_ranks(2, _fused_priced_for_adam_and_fp16)):
        messages = sorted(m for m, _ in out["warned"])
        # two modules with both differences: one warning for each difference, not for each module
        assert len(messages) == 2, (rank, messages)
        comm, optimizer = messages
        assert re.match(r"modular\.shard: the plan was priced for comm_dtype fp16 but module 'a' sends its outputs "
                        r"and their gradients in fp32;.* give modular\.shard comm_dtype=torch\.float16, or plan with "
                        r"planners\.plan\(\.\.\., comm_dtype='fp32'\)", comm), comm  # fmt: skip
        assert re.match(r"modular\.shard: the plan was priced for the fused optimizer 'adam' but module 'a' is fused "
                        r"with 'exact_rowwise_adagrad' \(modular\.fuse_optimizer\);.* plan with planners\.plan\(\.\.\., "
                        r"optimizer='exact_rowwise_adagrad'\)", optimizer), optimizer  # fmt: skip
        assert all(f == __file__ for _, f in out["warned"]), out["warned"]  # at the caller's line
        assert out["again"] == [], out["again"]
        assert out["worst"] < 1e-5
        (resharded, where), = out["resharded"]  # the optimizer now as priced: the comm dtype only
        assert re.match(r"modular\.reshard: the plan was priced for comm_dtype bf16 but module 'a' sends its outputs "
                        r"and their gradients in fp32", resharded), resharded  # fmt: skip
        assert where == __file__


def _unfused_priced_fused() -> dict:
    ebc = make_ebc(False)
    ref = copy.deepcopy(ebc)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=SGD_LR)
    # the planner's own plan of these tables (priced for fused row-wise Adagrad, its default)
    plan = _planner_plan(ebc)
    warned = _shard_warnings(modular.shard, ebc, plan)
    opt = torch.optim.SGD(modular.local_parameters(ebc), lr=SGD_LR)
    worst = _train(ebc, ref, lambda: (opt.step(), opt.zero_grad()), lambda: (ref_opt.step(), ref_opt.zero_grad()), ref)
    return {"warned": warned, "worst": worst}


@pytest.mark.timeout(180)
def test_an_unfused_model_under_a_plan_priced_fused_warns_and_trains_as_unsharded() -> None:
    for out in _on_fresh_ranks(2, _unfused_priced_fused):
        (message, where), = out["warned"]
        assert re.match(r"modular\.shard: the plan was priced for the fused optimizer 'exact_rowwise_adagrad' but module "
                        r"'' is not fused \(a torch optimizer over modular\.local_parameters trains it.*call "
                        r"modular\.fuse_optimizer\(model, 'exact_rowwise_adagrad', lr=\.\.\.\) before modular\.shard",
                        message), message  # fmt: skip
        assert where == __file__
        assert out["worst"] < 1e-5


def _periodic_priced_exact_run() -> dict:
    world = dist.get_world_size()  # 2 replica groups of one rank each
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=DIMS)
    ebc = fused_ebc()
    ref = FusedReference(copy.deepcopy(ebc), "exact_rowwise_adagrad")
    opt = modular.fuse_optimizer(ebc, "exact_rowwise_adagrad", lr=FUSED_LR, eps=FUSED_EPS)
    plan = _priced(ShardingPlan(1, {"": placements_for("table_wise", ebc, 1)}), replicas=world,
                   replica_sync="periodic")  # fmt: skip
    warned = _shard_warnings(modular.shard, ebc, plan, mesh=mesh, replica_sync="exact")
    worst = _train(ebc, ref.ebc, lambda: (opt.step(), opt.zero_grad()), ref.step, fused_ebc())
    return {"warned": warned, "worst": worst}


@pytest.mark.timeout(180)
def test_another_replica_sync_warns_and_exact_sync_trains_as_unsharded() -> None:
    for out in _on_fresh_ranks(2, _periodic_priced_exact_run):
        (message, _), = out["warned"]
        assert re.match(r"modular\.shard: the plan was priced for replica_sync 'periodic' but the mesh's 2 replica "
                        r"groups sync 'exact';.* give modular\.shard replica_sync='periodic', or plan with "
                        r"planners\.plan\(\.\.\., replica_sync='exact'\)", message), message  # fmt: skip
        assert out["worst"] < 1e-5


# -- nothing recorded, or nothing different: silent ------------------------------------------------


def _silent_plans() -> dict:
    world = dist.get_world_size()
    placements = {"": placements_for("mixed", make_ebc(False), world)}
    # written by hand: nothing recorded, so unfused tables and FP16 comms are not compared
    by_hand = _shard_warnings(modular.shard, make_ebc(False), ShardingPlan(world, placements),
                              comm_dtype=torch.float16)  # fmt: skip
    # the planner's plan, fused and sent as it was priced
    ebc = make_ebc(False, device=torch.device("meta"))
    planned = _planner_plan(ebc, comm_dtype="fp16", optimizer="exact_adagrad")
    modular.fuse_optimizer(ebc, "exact_adagrad", lr=0.1)
    as_priced = _shard_warnings(modular.shard, ebc, planned, comm_dtype=torch.float16)
    # the hand plan again, now recording FP32 comms: the comparison was live all along
    recorded = _shard_warnings(modular.shard, make_ebc(False),
                               _priced(ShardingPlan(world, placements), optimizer="exact_sgd"),
                               comm_dtype=torch.float16)  # fmt: skip
    return {"by_hand": by_hand, "as_priced": as_priced, "recorded": [m for m, _ in recorded]}


@pytest.mark.timeout(180)
def test_a_plan_recording_nothing_or_run_as_priced_warns_nothing() -> None:
    for out in _on_fresh_ranks(2, _silent_plans):
        assert out["by_hand"] == [] and out["as_priced"] == [], out
        assert len(out["recorded"]) == 2, out["recorded"]  # unfused (exact_sgd) and FP16 comms
        assert any("comm_dtype fp32 but module '' sends its outputs and their gradients in fp16" in m for m in out["recorded"])
        assert any("'exact_sgd' but module '' is not fused" in m for m in out["recorded"])


def _unfused_plans() -> dict:
    # an unfused model under a plan priced unfused: what was priced runs, nothing is warned
    ebc = make_ebc(False)
    unfused = _shard_warnings(modular.shard, ebc, _planner_plan(ebc, optimizer="unfused_sgd"))
    # a fused model under it: a price difference
    fused = fused_ebc()
    modular.fuse_optimizer(fused, "exact_sgd", lr=0.1)
    return {"unfused": unfused,
            "fused": _shard_warnings(modular.shard, fused, _planner_plan(fused, optimizer="unfused_sgd"))}


@pytest.mark.timeout(180)
def test_a_plan_priced_unfused_matches_an_unfused_model_and_warns_for_a_fused_one() -> None:
    for out in _on_fresh_ranks(2, _unfused_plans):
        assert out["unfused"] == []
        (message, where), = out["fused"]
        assert re.match(r"modular\.shard: the plan was priced for unfused tables \('unfused_sgd': a gradient "
                        r"buffer .* but module '' is fused with 'exact_sgd' .*optimizer='exact_sgd'\)",
                        message), message  # fmt: skip
        assert where == __file__
