"""The fused Adam family (Note [fused Adam and LAMB]): sharded training equals the unsharded
tables under `adam_family_step` (tests/modular/adam_reference.py) on the global batch, for every
plan, world sizes 1-3, EBCs and ECs, with per-sample weights, prefetch, DTensor tables and FP16
tables; data-parallel copies stay bit-identical; column pieces combine their rows' statistics
in one exchange per statistic and step."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torchrec.modules.embedding_configs import DataType
from torchrec.modules.embedding_modules import EmbeddingBagCollection

import modular
from planners.types import ShardingPlan, ShardingType, TablePlacement
from modular.tables.forms import global_size, is_sharded, local_pieces
from tests.dist import run_on_ranks
from tests.modular.adam_reference import (
    ADAM_BETAS, ADAM_EPS, ADAM_FAMILY, ADAM_LR, MomentsReference, touched_rows,
)
from tests.modular.compare import ATOL, close
from tests.modular.ebc_cases import BATCH, CASES, global_batch, make_batch, placements_for
from tests.modular.fused_reference import fused_ebc, fused_tables
from tests.modular.sequence_cases import (
    make_seq_model, seq_global_batch, seq_plan_for, seq_rank_batches,
)
from tests.modular.kernels.test_low_precision import fp32_mirror

STEPS = 5
HYPER = {"lr": ADAM_LR, "betas": ADAM_BETAS, "eps": ADAM_EPS}
U16 = 2.0**-11
# Weight decay under two kinds, none under the other two: both paths of each update.
DECAY = {"adam": 0.05, "partial_rowwise_adam": 0.0, "lamb": 0.0, "partial_rowwise_lamb": 0.05}


def whole(value: torch.Tensor) -> torch.Tensor:
    """A weight or state entry in full on every rank (collective for sharded ones): the local
    pieces of a ShardedTensor or table DTensor (1-D or 2-D) summed over ranks (they are
    disjoint), a data-parallel copy as it is."""
    if not is_sharded(value):
        return value.detach().float().clone()  # a clone: the data-parallel copy trains on
    out = torch.zeros(global_size(value))
    for piece in local_pieces(value):
        out[tuple(slice(o, o + n) for o, n in zip(piece.offsets, piece.sizes))] = piece.tensor.detach().float()
    dist.all_reduce(out)
    return out


def _same_on_every_rank(t: torch.Tensor, what: str) -> None:
    got = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(got, t.contiguous())
    for r, other in enumerate(got):
        assert torch.equal(other, t), f"{what}: rank {r} differs from rank {dist.get_rank()}"


def _matches_reference(model, opt, ref: MomentsReference, worst: float, label: str) -> tuple[float, dict]:
    """Each table and its moments against the reference's after `STEPS` steps, and the step
    count: the worst difference so far, and the optimizer's state."""
    state = opt.state_dict()["state"]
    params = dict(ref.module.named_parameters())
    for name, p in model.named_parameters():
        worst = max(worst, close(whole(p), params[name].detach(), f"{label}: {name}"))
        for key, want in ref.state(name).items():
            worst = max(worst, close(whole(state[name][key]), want, f"{label}: {name} {key}"))
        assert int(state[name]["step"]) == STEPS, (label, name, state[name]["step"])
    return worst, state


def _train(
    kind: str,
    case: str,
    *,
    weighted: bool = False,
    prefetch: bool = False,
    tensor_type: str = "sharded_tensor",
    placements: dict | None = None,
) -> float:
    """`STEPS` fused steps of `case`'s plan against the reference; the worst difference."""
    world, rank = dist.get_world_size(), dist.get_rank()
    label = f"{kind}, {case or 'placements'}, rank {rank}/{world}"
    ebc = fused_ebc(weighted)
    plan = ShardingPlan(world_size=world, modules={"": placements or placements_for(case, ebc, world)})
    ref = MomentsReference(copy.deepcopy(ebc), kind, weight_decay=DECAY[kind])
    opt = modular.fuse_optimizer(ebc, kind, weight_decay=DECAY[kind], **HYPER)
    model = modular.shard(ebc, plan, tensor_type=tensor_type)
    every = [[make_batch(ebc, seed=1000 * step + r) for r in range(world)] for step in range(STEPS)]
    if prefetch:
        modular.prefetch(model, every[0][rank])
    worst = 0.0
    for step, batches in enumerate(every):
        if prefetch and step + 1 < STEPS:
            modular.prefetch(model, every[step + 1][rank])
        out = model(batches[rank]).values()
        expected = ref.module(global_batch(batches)).values()
        mine = slice(rank * out.shape[0], (rank + 1) * out.shape[0])
        worst = max(worst, close(out, expected[mine], f"{label}: step {step} output"))
        target = torch.randn(expected.shape, generator=torch.Generator().manual_seed(step))
        (out * target[mine]).sum().backward()
        ((expected * target).sum() / world).backward()
        opt.step()
        ref.step(touched_rows(ref.module, batches))
    worst, state = _matches_reference(model, opt, ref, worst, label)
    for name, p in model.named_parameters():
        if not is_sharded(p) and world > 1:  # a data-parallel copy
            _same_on_every_rank(p.detach(), f"{label}: data-parallel copy {name}")
            _same_on_every_rank(state[name]["exp_avg_sq"], f"{label}: data-parallel copy {name} exp_avg_sq")
    return worst


def _every_plan(cases: tuple[str, ...]) -> dict[str, float]:
    return {f"{kind}/{case}": _train(kind, case) for kind in ADAM_FAMILY for case in cases}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_plan_trains_like_the_unsharded_tables(world: int) -> None:
    cases = ("table_wise",) if world == 1 else CASES
    for rank, worst in enumerate(run_on_ranks(world, _every_plan, cases, timeout=280)):
        assert len(worst) == len(ADAM_FAMILY) * len(cases), (rank, worst)
        assert max(worst.values()) <= ATOL, (rank, worst)


def _options() -> dict[str, float]:
    out = {}
    for kind in ADAM_FAMILY:
        out[f"{kind}/weighted"] = _train(kind, "column_wise", weighted=True)
        out[f"{kind}/dtensor"] = _train(kind, "mixed", tensor_type="dtensor")
    for case in ("row_wise", "data_parallel"):
        out[f"weighted/{case}"] = _train("partial_rowwise_lamb", case, weighted=True)
    for kind in ("partial_rowwise_adam", "lamb"):
        out[f"{kind}/prefetch"] = _train(kind, "mixed", prefetch=True)
    return out


@pytest.mark.timeout(200)
def test_per_sample_weights_dtensor_tables_and_prefetch() -> None:
    for rank, worst in enumerate(run_on_ranks(2, _options, timeout=180)):
        assert len(worst) == 2 * len(ADAM_FAMILY) + 4, (rank, worst)


CW, TW = ShardingType.COLUMN_WISE, ShardingType.TABLE_WISE
SOME_RANKS = {  # on 3 ranks: rank 0 holds no piece of 't_small', rank 2 two of 't_big'
    "t_sum": TablePlacement(CW, ranks=(0, 1)),
    "t_mean": TablePlacement(TW, ranks=(0,)),
    "t_small": TablePlacement(CW, ranks=(1, 2), sizes=(3, 2)),
    "t_big": TablePlacement(CW, ranks=(2, 2, 1), sizes=(8, 4, 4)),
}
NOT_ON_RANK_2 = {  # rank 2 holds no table at all, yet joins the exchanges
    "t_sum": TablePlacement(CW, ranks=(0, 1)),
    "t_mean": TablePlacement(TW, ranks=(0,)),
    "t_small": TablePlacement(CW, ranks=(1, 0), sizes=(3, 2)),
    "t_big": TablePlacement(TW, ranks=(1,)),
}


def _trained_then_sharded(kind: str, case: str) -> float:
    """A fused EBC trained unsharded for 2 steps on every rank's batches, then sharded: its
    moments and step count go with it, and 3 more steps equal the reference's."""
    world, rank = dist.get_world_size(), dist.get_rank()
    label = f"{kind}, {case}, trained before shard, rank {rank}/{world}"
    ebc = fused_ebc()
    ref = MomentsReference(copy.deepcopy(ebc), kind, weight_decay=DECAY[kind])
    opt = modular.fuse_optimizer(ebc, kind, weight_decay=DECAY[kind], **HYPER)
    worst = 0.0
    for step in range(STEPS):
        if step == 2:
            plan = ShardingPlan(world_size=world, modules={"": placements_for(case, fused_ebc(), world)})
            ebc = modular.shard(ebc, plan)
        batches = [make_batch(ref.module, seed=1000 * step + r) for r in range(world)]
        whole_batch = global_batch(batches)
        target = torch.randn(ref.module(whole_batch).values().shape, generator=torch.Generator().manual_seed(step))
        ref.module.zero_grad()
        # Unsharded, each rank trains on the global batch; sharded, on its own share of it.
        mine = slice(rank * BATCH, (rank + 1) * BATCH) if step >= 2 else slice(None)
        out = ebc(batches[rank] if step >= 2 else whole_batch).values()
        loss = (out * target[mine]).sum() / (world if step < 2 else 1)
        loss.backward()
        ((ref.module(whole_batch).values() * target).sum() / world).backward()
        ref.step(touched_rows(ref.module, batches))
    return _matches_reference(ebc, opt, ref, worst, label)[0]


@pytest.mark.timeout(120)
def test_sharding_a_trained_fused_model_carries_its_moments_and_step() -> None:
    for kind in ("adam", "partial_rowwise_lamb"):
        for case in ("column_wise", "mixed"):
            run_on_ranks(2, _trained_then_sharded, kind, case, timeout=100)


def _column_pieces_on_some_ranks(kind: str, placements: dict) -> tuple[float, int]:
    """Trains `placements` on 3 ranks; returns the worst difference and this rank's
    row-statistics exchanges."""
    import modular.fused.backward as backward

    calls = []
    original = backward.all_to_all

    def spy(tensor, **kw):
        if "row statistics" in kw.get("what", ""):
            calls.append(list(kw["input_splits"]))
        return original(tensor, **kw)

    backward.all_to_all = spy
    try:
        worst = _train(kind, "", placements=placements)
    finally:
        backward.all_to_all = original
    return worst, len(calls)


@pytest.mark.timeout(120)
def test_column_pieces_combine_whole_row_statistics_in_one_exchange_each() -> None:
    # partial_rowwise: the rows' mean of g**2; LAMB: the norms of w and r; both for the last.
    exchanges = {"adam": 0, "partial_rowwise_adam": 1, "lamb": 1, "partial_rowwise_lamb": 2}
    for kind, per_step in exchanges.items():
        for placements in (SOME_RANKS, NOT_ON_RANK_2):
            results = run_on_ranks(3, _column_pieces_on_some_ranks, kind, placements, timeout=100)
            for rank, (worst, calls) in enumerate(results):
                assert worst <= ATOL and calls == per_step * STEPS, (kind, rank, worst, calls)


def _fp16(kinds: tuple[str, ...]) -> dict[str, float]:
    """FP16 tables, FP32 moments: within 2 FP16 ulps of an FP32 reference rounded once a step."""
    world, rank = dist.get_world_size(), dist.get_rank()
    results = {}
    for kind in kinds:
        for case in ("mixed", "data_parallel"):
            label = f"{kind}, {case}, FP16, rank {rank}/{world}"
            torch.manual_seed(0)
            tables = fused_tables()
            for c in tables:  # the same tables, held in FP16
                c.data_type = DataType.FP16
            ebc = EmbeddingBagCollection(tables=tables)
            ref = MomentsReference(fp32_mirror(ebc), kind, weight_decay=DECAY[kind])
            opt = modular.fuse_optimizer(ebc, kind, weight_decay=DECAY[kind], **HYPER)
            model = modular.shard(ebc, ShardingPlan(world_size=world, modules={"": placements_for(case, ebc, world)}))
            for step in range(3):
                batches = [make_batch(ebc, seed=1000 * step + r) for r in range(world)]
                out = model(batches[rank]).values()
                expected = ref.module(global_batch(batches)).values()
                mine = slice(rank * out.shape[0], (rank + 1) * out.shape[0])
                target = torch.randn(expected.shape, generator=torch.Generator().manual_seed(step))
                (out * target[mine]).sum().backward()
                ((expected * target).sum() / world).backward()
                ref.step(touched_rows(ref.module, batches))
                with torch.no_grad():  # the new rows rounded to FP16 once, as the kernels do
                    for p in ref.module.parameters():
                        p.copy_(p.half().float())
            state = opt.state_dict()["state"]
            params = dict(ref.module.named_parameters())
            same = total = 0
            for name, p in model.named_parameters():
                assert p.dtype == torch.float16, (label, name, p.dtype)
                got, want = whole(p), params[name].detach()
                assert ((got - want).abs() <= 4 * U16 * want.abs() + 1e-6).all(), (label, name, (got - want).abs().max())
                same += int((got == want).sum())
                total += got.numel()
                for key, value in ref.state(name).items():
                    assert state[name][key].dtype == torch.float32, (label, name, key)
                    torch.testing.assert_close(whole(state[name][key]), value, rtol=1e-3, atol=1e-6)
                if case == "data_parallel" and world > 1:
                    _same_on_every_rank(p.detach(), f"{label}: data-parallel copy {name}")
            assert same >= 0.99 * total, (label, same, total)
            results[f"{kind}/{case}"] = same / total
    return results


@pytest.mark.timeout(120)
def test_fp16_tables_keep_fp32_moments_and_copies_stay_identical() -> None:
    run_on_ranks(2, _fp16, ADAM_FAMILY, timeout=100)


def _sequences(cases: tuple[str, ...]) -> dict[str, float]:
    """The sequence cases' model (two ECs and an EBC), fused whole."""
    world, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    for kind in ADAM_FAMILY:
        for case in cases:
            label = f"{kind}, {case}, sequences, rank {rank}/{world}"
            ref = make_seq_model()
            model = copy.deepcopy(ref)
            reference = MomentsReference(ref, kind, weight_decay=DECAY[kind])
            opt = modular.fuse_optimizer(model, kind, weight_decay=DECAY[kind], **HYPER)
            modular.shard(model, seq_plan_for(case, world))
            for step in range(3):
                batches = seq_rank_batches(world, step)
                mine = batches[rank]
                full = {m: seq_global_batch([b[m] for b in batches]) for m in mine}
                got = model(mine["seq_a"], mine["seq_b"], mine["bags"])
                want = ref(full["seq_a"], full["seq_b"], full["bags"])
                # Sum losses: each rank's rows weigh the same in its loss as in the reference's.
                loss = got[2].values().square().sum() + sum(
                    jt.values().square().sum() for o in got[:2] for jt in o.values()
                )
                ref_loss = want[2].values().square().sum() / world + sum(
                    jt.values().square().sum() for o in want[:2] for jt in o.values()
                ) / world
                loss.backward()
                ref_loss.backward()
                touched = {}
                for m in ("seq_a", "seq_b", "bags"):
                    touched.update(touched_rows(getattr(ref, m), [b[m] for b in batches], f"{m}."))
                reference.step(touched)
            state = opt.state_dict()["state"]
            params = dict(ref.named_parameters())
            worst = 0.0
            for name, p in model.named_parameters():
                worst = max(worst, close(whole(p), params[name].detach(), f"{label}: {name}"))
                for key, value in reference.state(name).items():
                    worst = max(worst, close(whole(state[name][key]), value, f"{label}: {name} {key}"))
            out[f"{kind}/{case}"] = worst
    return out


@pytest.mark.timeout(200)
def test_embedding_collections_train_like_the_unsharded_model() -> None:
    # The squared outputs' losses differ from the reference's by the ranks' split of the
    # sequences, but every row's gradient is the same sum, as Note [grad scaling across ranks].
    run_on_ranks(2, _sequences, ("column_wise", "mixed", "data_parallel"), timeout=180)


# -- single process --------------------------------------------------------------------------------


def test_state_is_named_like_fbgemm_and_shaped_per_kind() -> None:
    for kind in ADAM_FAMILY:
        ebc = fused_ebc()
        opt = modular.fuse_optimizer(ebc, kind, **HYPER)
        ebc(make_batch(ebc, seed=0)).values().sum().backward()
        state = opt.state_dict()["state"]["embedding_bags.t_mean.weight"]
        assert set(state) == {"exp_avg", "exp_avg_sq", "step"}, (kind, set(state))
        rows = (11,) if kind.startswith("partial_rowwise") else (11, 7)
        assert tuple(state["exp_avg"].shape) == (11, 7) and tuple(state["exp_avg_sq"].shape) == rows
        assert int(state["step"]) == 1
        assert opt.state_dict()["param_groups"][0]["betas"] == ADAM_BETAS


def test_load_state_dict_restores_moments_and_step() -> None:
    ebc = fused_ebc()
    opt = modular.fuse_optimizer(ebc, "partial_rowwise_lamb", **HYPER)
    for seed in range(2):
        ebc(make_batch(ebc, seed=seed)).values().sum().backward()
    saved = copy.deepcopy(opt.state_dict())
    with torch.no_grad():  # a forward without grad is not a step
        ebc(make_batch(ebc, seed=5))
    ebc(make_batch(ebc, seed=2)).values().sum().backward()
    assert int(opt.state_dict()["state"]["embedding_bags.t_sum.weight"]["step"]) == 3
    opt.load_state_dict(saved)
    for key, value in opt.state_dict()["state"].items():
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(value[name], saved["state"][key][name]), (key, name)
    broken = copy.deepcopy(saved)
    broken["state"]["embedding_bags.t_big.weight"]["step"] = torch.tensor(7)
    with pytest.raises(ValueError, match=r"step counts of the tables differ .*'t_big': 7"):
        opt.load_state_dict(broken)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"betas": (0.9, 1.0)}, "betas must be two numbers in [0, 1), got (0.9, 1.0)"),
        ({"column_wise_statistic": "per_shard"}, "column_wise_statistic='per_shard' applies to exact_rowwise_adagrad only"),
        ({"weight_decay": -0.1}, "weight_decay must be >= 0"),
    ],
)
def test_bad_hyperparameters_are_named(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        modular.fuse_optimizer(fused_ebc(), "lamb", lr=0.1, **kwargs)
