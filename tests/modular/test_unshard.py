"""`modular.unshard`: full tables inside, written back into the shards (and the fused kernels) on
exit, compared with the unsharded EBC given the same change."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection

import modular
from tests.dist import expect_errors_on_all_ranks, run_on_ranks
from tests.modular.compare import close
from tests.modular.ebc_cases import CASES, global_batch, make_batch, make_ebc, plan_for

LR, EPS = 0.3, 1e-3


def _change(full: torch.Tensor, table: str) -> None:
    """The same change on every rank and in the reference: rows re-initialised, one clipped."""
    g = torch.Generator().manual_seed(sum(map(ord, table)))
    full[1:4] = torch.randn(full[1:4].shape, generator=g)
    full[-1].clamp_(-0.01, 0.01)


def _outputs_match(model, ref, what: str, seed: int = 7) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    batches = [make_batch(ref, seed=seed + r) for r in range(world)]
    out = model(batches[rank]).values()
    expected = ref(global_batch(batches)).values()
    close(out, expected[rank * out.shape[0] : (rank + 1) * out.shape[0]], what)


def _unshard_every_case() -> dict[str, int]:
    """Per case: the full tables inside equal the unsharded ones (every rank), writeback of
    changed rows gives the changed reference's outputs, and writeback=False changes nothing."""
    world = dist.get_world_size()
    checked = {}
    for case in CASES:
        ebc = make_ebc(False, seed=3)
        ref = copy.deepcopy(ebc)
        model = modular.shard(ebc, plan_for(case, ebc, world))
        ref_weights = dict(ref.named_parameters())
        with modular.unshard(model, writeback=False) as full:
            assert sorted(full) == sorted(ref_weights), sorted(full)
            for fqn, t in full.items():
                assert t.device.type == "cpu"
                torch.testing.assert_close(t, ref_weights[fqn].detach(), atol=0, rtol=0)
                assert dict(model.named_parameters())[fqn] is t  # the model shows it too
                t.zero_()  # not written back
        _outputs_match(model, ref, f"{case} after writeback=False")
        with modular.unshard(model) as full:
            for fqn, t in full.items():
                _change(t, fqn)
        with torch.no_grad():
            for fqn, p in ref_weights.items():
                _change(p, fqn)
        for fqn, p in model.named_parameters():
            if case != "data_parallel":
                assert isinstance(p, ShardedTensor), f"{fqn} is a {type(p).__name__} after unshard"
        _outputs_match(model, ref, f"{case} after writeback")
        checked[case] = len(full)
    return checked


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_unshard_returns_the_tables_and_writes_changes_back(world: int) -> None:
    results = run_on_ranks(world, _unshard_every_case, timeout=200)
    assert all(r == {c: 4 for c in CASES} for r in results), results


def _rank0_only(case: str, tensor_type: str = "sharded_tensor") -> list[str]:
    """rank0_only: rank 0 alone holds the (selected) tables; its change reaches every rank."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ebc = make_ebc(False, seed=4)
    ref = copy.deepcopy(ebc)
    model = modular.shard(ebc, plan_for(case, ebc, world), tensor_type=tensor_type)
    names = ["embedding_bags.t_sum.weight", "t_big"]  # by FQN or by table name
    with modular.unshard(model, tables=names, rank0_only=True, offload_to_cpu=False) as full:
        got = sorted(full)
        if rank != 0:
            assert full == {}, sorted(full)
        for fqn, t in full.items():
            torch.testing.assert_close(t, dict(ref.named_parameters())[fqn].detach(), atol=0, rtol=0)
            _change(t, fqn)
    with torch.no_grad():
        for fqn in ("embedding_bags.t_sum.weight", "embedding_bags.t_big.weight"):
            _change(dict(ref.named_parameters())[fqn], fqn)
    _outputs_match(model, ref, f"{case} rank0_only writeback")
    return got


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_rank0_only_writeback_reaches_every_rank(world: int) -> None:
    for case, tensor_type in [
        ("mixed", "sharded_tensor"), ("column_wise", "sharded_tensor"),
        ("data_parallel", "sharded_tensor"), ("mixed", "dtensor"),
    ]:
        got = run_on_ranks(world, _rank0_only, case, tensor_type, timeout=100)
        assert got[0] == ["embedding_bags.t_big.weight", "embedding_bags.t_sum.weight"]
        assert all(g == [] for g in got[1:]), got


def _fused_tables() -> list[EmbeddingBagConfig]:
    """The tables of tests/modular/ebc_cases.py's mixed plan; widths 8, 12 and 16 take fbgemm's fused kernel, 5 the torch emulation."""
    return [
        EmbeddingBagConfig(name="t_sum", num_embeddings=13, embedding_dim=8, feature_names=["f_a", "f_b"]),
        EmbeddingBagConfig(name="t_mean", num_embeddings=11, embedding_dim=12, feature_names=["f_c"], pooling=PoolingType.MEAN),
        EmbeddingBagConfig(name="t_small", num_embeddings=7, embedding_dim=5, feature_names=["f_d"], pooling=PoolingType.MEAN),
        EmbeddingBagConfig(name="t_big", num_embeddings=29, embedding_dim=16, feature_names=["f_e"]),
    ]


def _fused_writeback(case: str, rank0_only: bool) -> float:
    """A fused model trains 2 steps, its tables are changed through unshard, it trains 2 more:
    weights and Adagrad state equal the reference given the same change (its state untouched)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables=_fused_tables())
    ref = copy.deepcopy(ebc)
    ref_opt = torch.optim.Adagrad(ref.parameters(), lr=LR, eps=EPS)
    opt = modular.fuse_optimizer(ebc, "exact_adagrad", lr=LR, eps=EPS)
    model = modular.shard(ebc, plan_for(case, ebc, world))
    worst = 0.0
    for step in range(4):
        if step == 2:
            with modular.unshard(model, rank0_only=rank0_only) as full:
                for fqn, t in full.items():
                    _change(t, fqn)
            with torch.no_grad():
                for fqn, p in ref.named_parameters():
                    _change(p, fqn)
        batches = [make_batch(ref, seed=100 * step + r) for r in range(world)]
        out = model(batches[rank]).values()
        expected = ref(global_batch(batches)).values()
        target = torch.randn(expected.shape, generator=torch.Generator().manual_seed(step))
        mine = slice(rank * out.shape[0], (rank + 1) * out.shape[0])
        worst = max(worst, close(out, expected[mine], f"{case} step {step} output"))
        (out * target[mine]).sum().backward()
        ((expected * target).sum() / world).backward()
        opt.step()
        ref_opt.step()
        ref_opt.zero_grad()
    with modular.unshard(model, writeback=False) as full:
        for fqn, p in ref.named_parameters():
            worst = max(worst, close(full[fqn], p.detach(), f"{case} {fqn} after training"))
    state = opt.state_dict()["state"]
    for fqn, p in ref.named_parameters():
        want = ref_opt.state[p]["sum"]
        got = next(iter(state[fqn].values()))
        shards = got.local_shards() if isinstance(got, ShardedTensor) else None
        if shards is None:
            worst = max(worst, close(got, want, f"{case} {fqn} state"))
            continue
        for s in shards:
            (r0, c0), (nr, nc) = s.metadata.shard_offsets, s.metadata.shard_sizes
            worst = max(worst, close(s.tensor, want[r0 : r0 + nr, c0 : c0 + nc], f"{case} {fqn} state"))
    return worst


def _fused_every_case() -> dict[str, float]:
    return {
        case: _fused_writeback(case, rank0_only=i % 2 == 1) for i, case in enumerate(CASES)
    }


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 3])
def test_writeback_reaches_the_fused_optimizer(world: int) -> None:
    results = run_on_ranks(world, _fused_every_case, timeout=200)
    assert set(results[0]) == set(CASES)


def _shape_change(how: str) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    ebc = make_ebc(False, seed=5)
    ref = copy.deepcopy(ebc)
    model = modular.shard(ebc, plan_for("mixed", ebc, world))
    try:
        with modular.unshard(model, rank0_only=how == "rank0_resize") as full:
            for t in full.values():
                t.zero_()  # must not reach the shards: nothing is written back
            if rank == world - 1 and how == "assign":
                model.embedding_bags.t_mean.weight = torch.nn.Parameter(torch.zeros(12, 7))
            if rank == 0 and how == "rank0_resize":
                full["embedding_bags.t_big.weight"].resize_(29, 6)
            if rank == world - 1 and how == "raise":
                raise KeyError("the user's own error")
    finally:
        for fqn, p in model.named_parameters():  # shards restored, unchanged, on every rank
            if "t_big" in fqn or "t_sum" in fqn:
                assert isinstance(p, ShardedTensor), fqn
        _outputs_match(model, ref, f"{how}: the model after a failed unshard")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 3])
def test_a_shape_change_or_an_error_inside_raises_on_every_rank(world: int) -> None:
    errors = expect_errors_on_all_ranks(world, _shape_change, "assign", timeout=100)
    for e in errors:
        assert "table 't_mean' (embedding_bags.t_mean.weight) is (12, 7) on exit" in e, e
        assert "shards it as (11, 7)" in e and "wrote nothing back" in e, e
    if world > 1:
        errors = expect_errors_on_all_ranks(world, _shape_change, "rank0_resize", timeout=100)
        assert all("table 't_big'" in e and "(29, 6)" in e and "on rank 0" in e for e in errors), errors
    errors = expect_errors_on_all_ranks(world, _shape_change, "raise", timeout=100)
    assert "the user's own error" in errors[-1], errors
    for e in errors[:-1]:
        assert f"on rank {world - 1}, KeyError" in e and "wrote nothing back" in e, e


def _bad_selection(which: str) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    ebc = make_ebc(False, seed=5)
    model = modular.shard(ebc, plan_for("row_wise", ebc, world))
    tables = {"unknown": ["t_nope"], "differ": ["t_sum"] if rank == 0 else ["t_big"]}[which]
    with modular.unshard(model, tables=tables):
        raise AssertionError("unreachable: the selection is refused on entry")


@pytest.mark.timeout(60)
def test_a_bad_selection_raises_on_every_rank_before_anything_moves() -> None:
    errors = expect_errors_on_all_ranks(2, _bad_selection, "unknown", timeout=50)
    assert all("'t_nope' is not a sharded table of the model" in e for e in errors), errors
    assert all("embedding_bags.t_sum.weight" in e for e in errors), errors
    errors = expect_errors_on_all_ranks(2, _bad_selection, "differ", timeout=50)
    assert all("rank 0: ['t_sum']; rank 1: ['t_big']" in e for e in errors), errors
