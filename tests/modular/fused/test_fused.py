"""Fused optimizers: sharded + fused training equals the unsharded EBC under a torch reference.

The tables mix widths of 8 (fbgemm's fused kernel) and 5 / 7 (the emulated path), so both kernels
of Note [fused tables] are compared against the same reference on every plan.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.modules.embedding_modules import EmbeddingBagCollection

import modular
from planners.types import ShardingPlan, ShardingType, TablePlacement
from tests.dist import run_on_ranks
from tests.modular.compare import close, local_blocks, state_error
from tests.modular.ebc_cases import CASES, global_batch, make_batch, placements_for
from tests.modular.fused_reference import (
    FUSED_EPS, FUSED_LR, FUSED_STEPS, FusedReference, fused_ebc, fused_tables, own_pieces,
)

OPTIMIZERS = ("exact_sgd", "exact_adagrad", "exact_rowwise_adagrad")
LR, EPS, STEPS = FUSED_LR, FUSED_EPS, FUSED_STEPS


def _train(
    case: str,
    optimizer: str,
    weight_decay: float = 0.0,
    lookups: int = 1,
    halve_lr: bool = False,
    placements: dict | None = None,
    empty: dict | None = None,
    weighted: bool = False,
    kernels: dict | None = None,
    prefetch: bool = False,
    statistic: str = "exact",
    shapes: dict | None = None,
) -> dict[str, float]:
    """Trains `case`'s plan (or `placements`) fused and the reference side by side, comparing
    outputs, weights and state; `kernels` and `shapes` receive each table's kernel class and
    the global shape of its optimizer state. The EBC is fused, then sharded (Note [order of
    sharding calls]): `shard` cuts the one-process fused module into fused shards."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ebc = fused_ebc(weighted)
    hyper = {"lr": LR, "eps": EPS, "weight_decay": weight_decay, "column_wise_statistic": statistic}
    plan = ShardingPlan(world_size=world, modules={"": placements or placements_for(case, ebc, world)})
    pieces = own_pieces(plan, ebc) if statistic == "per_shard" else None
    ref = FusedReference(copy.deepcopy(ebc), optimizer, weight_decay, pieces=pieces)
    keys_before = [n for n, _ in ebc.named_parameters()]
    opt = modular.fuse_optimizer(ebc, optimizer, **hyper)
    model = modular.shard(ebc, plan)
    assert [n for n, _ in model.named_parameters()] == keys_before
    assert modular.local_parameters(model) == [], "fused tables must not reach a dense optimizer"
    if kernels is not None:  # each table this rank holds: the kernel class that looks it up
        for k in (*model._kernels, *model._local_kernels):
            kernels.update({table: type(k).__name__ for table, _ in k.group.shards})
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if halve_lr else None
    worst = 0.0
    every = [
        [make_batch(ebc, seed=1000 * step + 100 * lookup + r, empty_feature=(empty or {}).get(step)) for r in range(world)]
        for step in range(STEPS) for lookup in range(lookups)
    ]  # fmt: skip
    if prefetch:  # each forward's input dist runs in the background during the step before
        modular.prefetch(model, every[0][rank])
    for step in range(STEPS):
        loss, ref_loss = 0.0, 0.0
        for lookup in range(lookups):  # several lookups before one backward: one update
            n = step * lookups + lookup
            batches = every[n]
            if prefetch and n + 1 < len(every):
                modular.prefetch(model, every[n + 1][rank])
            if prefetch:
                assert id(batches[rank]) in model._prefetcher._pending, "this batch was not prefetched"
            out = model(batches[rank]).values()
            expected = ref.ebc(global_batch(batches)).values()
            target = torch.randn(expected.shape, generator=torch.Generator().manual_seed(step + 50 * lookup))
            mine = slice(rank * out.shape[0], (rank + 1) * out.shape[0])
            worst = max(worst, close(out, expected[mine], f"{case} step {step} output"))
            loss = loss + (out * target[mine]).sum()
            ref_loss = ref_loss + (expected * target).sum() / world
        loss.backward()
        ref_loss.backward()
        opt.step()
        opt.zero_grad()
        ref.step()
        if scheduler is not None:
            scheduler.step()
            ref.lr *= 0.5
            for group in ref.opt.param_groups if ref.opt is not None else []:
                group["lr"] *= 0.5
    state = opt.state_dict()["state"]
    for name, p in model.named_parameters():
        full = dict(ref.ebc.named_parameters())[name].detach()
        for tensor, rows, cols in local_blocks(p):
            worst = max(worst, close(tensor, full[rows, cols], f"{case} {name} weight"))
        want = ref.state(name)
        if shapes is not None and name in state:
            shapes[name] = tuple(next(iter(state[name].values())).size())
        if want is None:
            assert state.get(name, {}) == {}
            continue
        worst = max(worst, state_error(next(iter(state[name].values())), want, f"{case} {name} state"))
    return {"worst": worst}


def _train_all_cases(optimizer: str) -> dict[str, float]:
    out = {}
    for case in CASES:
        out[case] = _train(case, optimizer)["worst"]
    return out


def _train_with_weight_decay() -> dict[str, float]:
    return {c: _train(c, "exact_rowwise_adagrad", 0.05)["worst"] for c in CASES}


@pytest.mark.timeout(120)
def test_rowwise_adagrad_weight_decay_matches_fbgemm_l2_semantics() -> None:
    results = run_on_ranks(2, _train_with_weight_decay, timeout=100)
    assert set(results[0]) == set(CASES)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_fused_training_matches_unsharded_reference(world: int, optimizer: str) -> None:
    results = run_on_ranks(world, _train_all_cases, optimizer, timeout=200)
    assert set(results[0]) == set(CASES)


def _train_with_lr_schedule() -> dict[str, float]:
    return {c: _train(c, "exact_rowwise_adagrad", halve_lr=True)["worst"] for c in CASES}


@pytest.mark.timeout(120)
def test_lr_scheduler_drives_every_fused_kernel_kind() -> None:
    # fbgemm's kernel (table-wise, row-wise), its two-pass column-wise form, the replayed
    # data-parallel copies and the torch emulation (widths 5 and 7) all follow a StepLR.
    results = run_on_ranks(2, _train_with_lr_schedule, timeout=100)
    assert set(results[0]) == set(CASES)


def _train_column_wise_twice_per_step() -> float:
    return _train("column_wise", "exact_rowwise_adagrad", lookups=2)["worst"]


@pytest.mark.timeout(120)
def test_column_wise_rowwise_adagrad_sums_two_lookups_into_one_update() -> None:
    # Column shards of widths 4 and 8 take fbgemm's kernel in two passes (Note [row statistics
    # across column shards]), which merges the two lookups' batches; widths 3/4 and 2/3 the torch
    # emulation, which sums their gradients. Both must equal one update of the summed gradient.
    run_on_ranks(2, _train_column_wise_twice_per_step, timeout=100)


def _train_column_wise_on_some_ranks() -> tuple[float, list[int]]:
    """Column-wise tables on subsets of 3 ranks, one rank holding two shards of a table; returns
    the worst difference and this rank's per-peer floats in the row statistics' all-to-all."""
    import modular.fused.backward as fused

    CW, TW = ShardingType.COLUMN_WISE, ShardingType.TABLE_WISE
    placements = {
        "t_sum": TablePlacement(CW, ranks=(0, 1)),  # widths 4/4 (fbgemm, two passes); not on 2
        "t_mean": TablePlacement(TW, ranks=(0,)),
        "t_small": TablePlacement(CW, ranks=(1, 2), sizes=(3, 2)),  # emulated widths
        "t_big": TablePlacement(CW, ranks=(2, 2, 1), sizes=(8, 4, 4)),  # rank 2 holds two
    }
    sent: list[list[int]] = []
    original = fused.all_to_all

    def spy(tensor, *, input_splits, output_splits, group, what="", **kw):
        if "row statistics" in what:
            sent.append(list(input_splits))
            assert input_splits == output_splits
        return original(tensor, input_splits=input_splits, output_splits=output_splits, group=group, what=what, **kw)

    fused.all_to_all = spy
    try:
        worst = _train("", "exact_rowwise_adagrad", placements=placements)["worst"]
    finally:
        fused.all_to_all = original
    assert len(sent) == STEPS, sent  # one exchange per step, on every rank
    return worst, sent


def _ids_and_rows(step: int, features: list[str]) -> tuple[int, int]:
    """The global batch of `_train`'s step: its ids of `features` and the distinct ids."""
    ids = []
    for r in range(3):
        kjt = make_batch(fused_ebc(), seed=1000 * step + r).to_dict()
        ids.extend(kjt[f].values() for f in features)
    ids = torch.cat(ids)
    return ids.numel(), ids.unique().numel()


@pytest.mark.timeout(120)
def test_column_row_statistics_travel_only_between_the_ranks_holding_the_table() -> None:
    results = run_on_ranks(3, _train_column_wise_on_some_ranks, timeout=100)
    sent = [s for _, s in results]
    for step in range(STEPS):
        to0, to1, to2 = (sent[r][step] for r in range(3))
        # Ranks 0 and 2 share no column-wise table: nothing travels between them.
        assert to0[2] == 0 and to2[0] == 0 and to0[0] == to1[1] == to2[2] == 0, sent
        # t_sum (fbgemm's kernel on both holders) between 0 and 1: one float per id of its two
        # features. t_big (fbgemm) per id, t_small (emulated widths) per touched row, between 1
        # and 2 (Note [row statistics across column shards]).
        sum_ids, _ = _ids_and_rows(step, ["f_a", "f_b"])
        big_ids, _ = _ids_and_rows(step, ["f_e"])
        _, small_rows = _ids_and_rows(step, ["f_d", "f_a"])
        assert to0[1] == to1[0] == sum_ids > 0, (step, sent)
        assert to1[2] == to2[1] == big_ids + small_rows > 0, (step, sent)


def _train_weighted(optimizer: str) -> dict[str, float]:
    world = dist.get_world_size()
    return {
        # The same plans as unweighted (cases' weighted "mixed" plan names other tables).
        c: _train(c, optimizer, weighted=True, placements=placements_for(c, fused_ebc(), world))["worst"]
        for c in CASES
    }  # fmt: skip


@pytest.mark.timeout(120)
@pytest.mark.parametrize("optimizer", ["exact_sgd", "exact_rowwise_adagrad"])
def test_per_sample_weights_train_like_the_reference(optimizer: str) -> None:
    # fbgemm's kernel with weights in each form: plain (table-, row-wise), two passes
    # (column-wise) and the replayed data-parallel copies.
    results = run_on_ranks(2, _train_weighted, optimizer, timeout=100)
    assert set(results[0]) == set(CASES)


def _train_column_wise_with_a_table_unused_in_a_step() -> float:
    # Step 1 looks up nothing in t_mean (widths 4/3: the emulation) and step 2 nothing in t_big
    # (8/8: fbgemm in two passes), on every rank: no touched rows, nothing to exchange.
    return _train("column_wise", "exact_rowwise_adagrad", empty={1: "f_c", 2: "f_e"})["worst"]


@pytest.mark.timeout(120)
def test_column_wise_table_with_no_ids_in_a_step() -> None:
    run_on_ranks(2, _train_column_wise_with_a_table_unused_in_a_step, timeout=100)


def _train_column_piece_beside_whole_tables() -> tuple[float, dict]:
    CW, TW = ShardingType.COLUMN_WISE, ShardingType.TABLE_WISE
    placements = {
        "t_sum": TablePlacement(TW, ranks=(0,)),  # SUM, 8 wide: t_big's pieces' kernel group once
        "t_mean": TablePlacement(TW, ranks=(1,)),
        "t_small": TablePlacement(TW, ranks=(0,)),
        "t_big": TablePlacement(CW, ranks=(0, 1), sizes=(8, 8)),
    }
    kernels: dict = {}
    worst = _train("", "exact_rowwise_adagrad", placements=placements, kernels=kernels)["worst"]
    return worst, kernels


@pytest.mark.timeout(120)
def test_column_pieces_get_a_kernel_of_their_own() -> None:
    # Planned plans put a column piece beside whole tables on one rank (the example's DLRM on 4
    # and 8 ranks does); under row-wise Adagrad only the piece may take the two passes of Note
    # [row statistics across column shards], the whole tables keep fbgemm's single fused pass.
    results = run_on_ranks(2, _train_column_piece_beside_whole_tables, timeout=100)
    assert results[0][1] == {"t_sum": "FusedKernel", "t_big": "RowStatsFusedKernel", "t_small": "EmulatedFusedKernel"}, results
    assert results[1][1] == {"t_mean": "EmulatedFusedKernel", "t_big": "RowStatsFusedKernel"}, results


def _train_two_pieces_on_one_rank() -> dict[str, float]:
    last = dist.get_world_size() - 1
    placements = {
        "t_sum": TablePlacement(ShardingType.COLUMN_WISE, ranks=(last, last)),  # f_a and f_b read it
        "t_mean": TablePlacement(ShardingType.TABLE_WISE, ranks=(0,)),
        "t_small": TablePlacement(ShardingType.TABLE_WISE, ranks=(0,)),
        "t_big": TablePlacement(ShardingType.COLUMN_WISE, ranks=(0, last)),
    }
    return {o: _train("column_wise", o, placements=placements)["worst"] for o in OPTIMIZERS}


@pytest.mark.parametrize("world", [1, 2])
def test_two_column_pieces_of_a_table_two_features_read_on_one_rank(world: int) -> None:
    # Both pieces of t_sum (width 8: fbgemm's kernel) on one rank, each looked up by two features:
    # the kernel group's routes must keep each piece's together (fbgemm's CPU backward crashed
    # under row-wise Adagrad and updated Adagrad wrongly when they interleaved).
    for worst in run_on_ranks(world, _train_two_pieces_on_one_rank):
        assert all(w <= 1e-5 for w in worst.values()), worst


def _train_column_pieces_on_one_rank_only() -> float:
    # Rank 1 holds only t_sum, whole and in fbgemm's plain fused kernel: nothing of its own to
    # do at the end of backward, yet it must join the column statistics' all-to-all.
    placements = {
        "t_sum": TablePlacement(ShardingType.TABLE_WISE, ranks=(1,)),
        "t_mean": TablePlacement(ShardingType.TABLE_WISE, ranks=(0,)),
        "t_small": TablePlacement(ShardingType.TABLE_WISE, ranks=(0,)),
        "t_big": TablePlacement(ShardingType.COLUMN_WISE, ranks=(0, 0)),
    }
    return _train("column_wise", "exact_rowwise_adagrad", placements=placements)["worst"]


def test_a_rank_without_column_pieces_joins_their_statistics_exchange() -> None:
    assert all(w <= 1e-5 for w in run_on_ranks(2, _train_column_pieces_on_one_rank_only, timeout=60))


def _train_prefetching() -> dict[str, float]:
    # The end-of-backward collectives (column statistics, data-parallel copies' gathers) run while the next
    # batch's input dist is in flight on the prefetch group (Note [prefetched input dist]).
    return {c: _train(c, "exact_rowwise_adagrad", prefetch=True, lookups=1 + (c == "column_wise"))["worst"]
            for c in ("column_wise", "mixed", "data_parallel")}  # fmt: skip


@pytest.mark.timeout(120)
def test_prefetched_fused_training_matches_the_reference() -> None:
    results = run_on_ranks(2, _train_prefetching, timeout=100)
    assert set(results[0]) == {"column_wise", "mixed", "data_parallel"}


def _fuse_after_shard() -> dict[str, object]:
    """Fusing an already sharded model: refused on this rank, the model left as it was."""
    world = dist.get_world_size()
    ebc = fused_ebc()
    model = modular.shard(ebc, ShardingPlan(world_size=world, modules={"": placements_for("mixed", ebc, world)}))
    before = {n: [t.clone() for t, _, _ in local_blocks(p)] for n, p in model.named_parameters()}
    with pytest.raises(modular.ShardingError) as info:
        modular.fuse_optimizer(model, "exact_rowwise_adagrad", lr=LR, eps=EPS)
    unchanged = all(
        torch.equal(t, b) for n, p in model.named_parameters() for (t, _, _), b in zip(local_blocks(p), before[n])
    )
    model(make_batch(ebc, seed=dist.get_rank())).values().sum().backward()  # still trains, unfused
    return {"message": str(info.value), "fused": model.fused, "unchanged": unchanged,
            "dense": len(modular.local_parameters(model)) > 0}  # fmt: skip


@pytest.mark.timeout(120)
def test_fusing_after_shard_is_refused_on_every_rank_naming_the_order() -> None:
    # Note [order of sharding calls]: fusing a sharded module held every shard twice while its
    # kernels were swapped (benchmarks/shard_memory.py); fused first, shard builds fused shards.
    for rank, out in enumerate(run_on_ranks(2, _fuse_after_shard, timeout=100)):
        message = out["message"]
        assert "modules [''] are already sharded" in message, (rank, message)
        assert "call modular.fuse_optimizer before modular.shard" in message, (rank, message)
        assert out["fused"] is None and out["unchanged"] and out["dense"], (rank, out)


def _state_keys(kind: str) -> tuple[list[str], list[str], list[tuple[int, ...]]]:
    world = dist.get_world_size()
    ebc = fused_ebc()
    placement = {
        "data_parallel": TablePlacement(ShardingType.DATA_PARALLEL),
        "table_wise": TablePlacement(ShardingType.TABLE_WISE, ranks=(1,)),
        "row_wise": TablePlacement(ShardingType.ROW_WISE),
        "column_wise": TablePlacement(ShardingType.COLUMN_WISE),
    }[kind]
    plan = ShardingPlan(world_size=world, modules={"": {c.name: placement for c in fused_tables()}})
    opt = modular.fuse_optimizer(ebc, "exact_rowwise_adagrad", lr=LR)
    modular.shard(ebc, plan)
    sd = opt.state_dict()
    shapes = [tuple(next(iter(v.values())).size()) for _, v in sorted(sd["state"].items())]
    return sorted(sd["state"]), [sorted(v) for v in sd["state"].values()][0], shapes


@pytest.mark.timeout(120)
def test_state_dict_keys_do_not_depend_on_the_sharding_type() -> None:
    seen = {k: run_on_ranks(2, _state_keys, k, timeout=60)[0] for k in ("data_parallel", "table_wise", "row_wise", "column_wise")}
    first = seen["data_parallel"]
    assert first[0] == [f"embedding_bags.{c.name}.weight" for c in sorted(fused_tables(), key=lambda c: c.name)]
    assert first[1] == ["row_sum"]
    for kind, keys in seen.items():
        assert keys == first, kind


def test_unsharded_fused_ebc_trains_in_one_process_without_a_process_group() -> None:
    ebc = fused_ebc()
    ref = FusedReference(copy.deepcopy(ebc), "exact_adagrad")
    opt = modular.fuse_optimizer(ebc, "exact_adagrad", lr=LR, eps=EPS)
    # marked, not copied (Note [fusing at shard]); its tables are no dense optimizer's
    assert type(ebc) is EmbeddingBagCollection and modular.local_parameters(ebc) == []
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ref_scheduler = torch.optim.lr_scheduler.StepLR(ref.opt, step_size=1, gamma=0.5)
    for step in range(STEPS):
        batch = make_batch(ebc, seed=step)
        out = ebc(batch).values()
        assert isinstance(ebc, modular.ShardedEmbeddingBagCollection) and ebc.is_local  # fused at first use
        expected = ref.ebc(batch).values()
        close(out, expected, f"step {step}")
        out.square().sum().backward()
        expected.square().sum().backward()
        opt.step()
        ref.step()
        scheduler.step()
        ref_scheduler.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(LR * 0.5**STEPS)
    for name, p in ebc.named_parameters():
        close(p.detach(), dict(ref.ebc.named_parameters())[name].detach(), name)


def test_optimizer_state_dict_round_trip_in_one_process() -> None:
    ebc = fused_ebc()
    opt = modular.fuse_optimizer(ebc, "exact_rowwise_adagrad", lr=LR)
    ebc(make_batch(ebc, seed=1)).values().sum().backward()
    saved = copy.deepcopy(opt.state_dict())
    assert any(v["row_sum"].abs().sum() > 0 for v in saved["state"].values())
    ebc(make_batch(ebc, seed=2)).values().sum().backward()
    moved = opt.state_dict()["state"]
    assert any(not torch.equal(moved[k]["row_sum"], saved["state"][k]["row_sum"]) for k in moved)
    opt.load_state_dict(saved)
    for key, value in opt.state_dict()["state"].items():
        assert torch.equal(value["row_sum"], saved["state"][key]["row_sum"]), key


@pytest.mark.parametrize(
    "name, kwargs, message",
    [
        ("adamw", {"lr": 0.1}, "'adamw' is not supported; fuse_optimizer takes 'exact_sgd', 'exact_adagrad', 'exact_rowwise_adagrad', 'adam', "),
        ("exact_adagrad", {"lr": 0.0}, "lr must be positive, got 0.0"),
        ("exact_adagrad", {"lr": 0.1, "eps": -1.0}, "eps must be positive"),
        ("exact_adagrad", {"lr": 0.1, "weight_decay": 0.01}, "fbgemm's exact_adagrad kernel has no weight decay"),
        ("exact_sgd", {"lr": 0.1, "weight_decay": 0.01}, "fbgemm's exact_sgd kernel has no weight decay"),
        ("exact_rowwise_adagrad", {"lr": 0.1, "weight_decay": -1.0}, "weight_decay must be >= 0"),
    ],
)
def test_unsupported_optimizer_or_hyperparameter_is_named(name: str, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        modular.fuse_optimizer(fused_ebc(), name, **kwargs)


def test_fusing_twice_is_an_error() -> None:
    ebc = fused_ebc()
    modular.fuse_optimizer(ebc, "exact_sgd", lr=0.1)
    with pytest.raises(ValueError, match="already fused"):
        modular.fuse_optimizer(ebc, "exact_sgd", lr=0.1)


def _meta_order(source: str, statistic: str = "exact") -> dict[str, torch.Tensor]:
    """Trains an EBC fused, then sharded under the mixed plan (t_mean in column pieces); returns
    this rank's weights and row-wise state, and the kernel class per table. `source` "meta": the
    EBC is on meta, so `fuse_optimizer` only marks it and `shard` builds its shards fused;
    "materialised": an EBC holding the weights `shard` gives the meta one (each shard's init_fn),
    fused into a one-process module that `shard` then cuts."""
    world = dist.get_world_size()
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables=fused_tables(), device=torch.device("meta"))
    plan = ShardingPlan(world_size=world, modules={"": placements_for("mixed", ebc, world)})
    hyper = {"lr": LR, "eps": EPS, "column_wise_statistic": statistic}
    if source == "materialised":
        weights = [modular.checkpoint.export(modular.shard(copy.deepcopy(ebc), plan))]
        dist.broadcast_object_list(weights, src=0)
        ebc = EmbeddingBagCollection(tables=fused_tables())
        ebc.load_state_dict(weights[0], strict=True)
    opt = modular.fuse_optimizer(ebc, "exact_rowwise_adagrad", **hyper)
    if source == "meta":
        assert all(p.is_meta for p in ebc.parameters()), "a meta EBC must not be materialised"
        assert opt.state_dict()["state"] == {}
    model = modular.shard(ebc, plan)
    assert model.fused is not None
    kernels = {f"kernel/{t}/{j}": type(k).__name__ for k in (*model._kernels, *model._local_kernels) for t, j in k.group.shards}
    for step in range(STEPS):
        model(make_batch(ebc, seed=31 * step + dist.get_rank())).values().square().sum().backward()
        opt.step()
    out = {n: t.clone() for n, p in model.named_parameters() for t, _, _ in local_blocks(p)}
    for key, value in opt.state_dict()["state"].items():
        row_sum = value["row_sum"]
        out[f"{key}/state shape"] = tuple(row_sum.size())
        for s in row_sum.local_shards() if isinstance(row_sum, ShardedTensor) else []:
            out[f"{key}/state/{s.metadata.shard_offsets}"] = s.tensor.clone()
    return {**out, **kernels}


@pytest.mark.timeout(120)
def test_fusing_a_meta_ebc_builds_fused_shards_directly_and_trains_like_a_materialised_one() -> None:
    a = run_on_ranks(2, _meta_order, "meta", timeout=100)
    b = run_on_ranks(2, _meta_order, "materialised", timeout=100)
    for rank, (x, y) in enumerate(zip(a, b)):
        assert x.keys() == y.keys() and any("/state/" in k for k in x)
        for name in x:
            assert _same(x[name], y[name]), f"rank {rank} {name}"


def _same(x: object, y: object) -> bool:
    return torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


def _weight_grad_work(case: str, fused: bool) -> tuple[list[str], list[list[int]]]:
    """One weighted step (forward, backward, fused update): the fbgemm ops that ran to compute
    a gradient for the per-sample weights, and the `feature_requires_grad` each weighted call of
    fbgemm's split TBE got (its CPU op still runs, but skips every feature marked 0)."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen as TBE
    from torch.profiler import ProfilerActivity, profile

    world = dist.get_world_size()
    ref = fused_ebc(weighted=True)
    model = copy.deepcopy(ref)
    if fused:  # before shard (Note [order of sharding calls])
        modular.fuse_optimizer(model, "exact_rowwise_adagrad", lr=0.1)
    modular.shard(model, ShardingPlan(world_size=world, modules={"": placements_for(case, ref, world)}))
    batch = make_batch(ref, seed=dist.get_rank())
    marks, original = [], TBE.forward

    def spy(self, indices, offsets, per_sample_weights=None, feature_requires_grad=None, **kwargs):
        if per_sample_weights is not None and torch.is_grad_enabled():
            marks.append(None if feature_requires_grad is None else feature_requires_grad.tolist())
        return original(self, indices, offsets, per_sample_weights, feature_requires_grad, **kwargs)

    TBE.forward = spy
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model(batch).values().sum().backward()
    finally:
        TBE.forward = original
    return sorted({e.key for e in prof.key_averages() if "grad_indice_weights" in e.key}), marks


@pytest.mark.timeout(120)
def test_no_gradient_is_computed_for_per_sample_weights() -> None:
    # Note [no gradient for per-sample weights]: fbgemm computes one unless told, and it took
    # 40 of a 47 ms fused backward; the weights never require grad here.
    for rank, (ops, marks) in enumerate(run_on_ranks(2, _weight_grad_work, "table_wise", True, timeout=100)):
        assert marks and all(m is not None and set(m) == {0} for m in marks), (rank, marks)
    # The dense kernel's CPU backward is ours (Note [dense gradient buffer]): fbgemm's op never runs.
    assert [ops for ops, _ in run_on_ranks(2, _weight_grad_work, "table_wise", False, timeout=100)] == [[], []]
