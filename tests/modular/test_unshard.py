"""`modular.unshard`: full tables inside, written back into the shards (and the fused kernels) on
exit, for both kinds of sharded collection alike: an EmbeddingBagCollection's tables
(`embedding_bags.<t>.weight`) and an EmbeddingCollection's (`embeddings.<t>.weight`), as
ShardedTensors or DTensors, in FP32 or FP16. Each rank body compares with the unsharded
collection given the same change, on the global batch.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor
from torchrec.modules.embedding_configs import DataType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import modular
from modular.tables.forms import Piece, is_sharded, local_pieces
from planners.types import ShardingPlan
from tests.dist import expect_errors_on_all_ranks, run_on_ranks
from tests.modular.compare import close, local_blocks
from tests.modular.ebc_cases import CASES, global_batch, make_batch, placements_for, unweighted_tables
from tests.modular.sequence_cases import SEQ_FEATURES, seq_a_tables, seq_make_batch, seq_placements_for

KINDS = ("bags", "seqs")
ATTR = {"bags": "embedding_bags", "seqs": "embeddings"}
# Per kind: its tables (the first two picked by `tables=` below), and its largest one.
NAMES = {"bags": ["t_sum", "t_mean", "t_small", "t_big"], "seqs": ["s_big", "s_mid", "s_small"]}
PICK = {"bags": ("t_sum", "t_big"), "seqs": ("s_mid", "s_big")}
LR, EPS = 0.3, 1e-3
TIMEOUT_S = 100


class Holder(nn.Module):
    """One collection under the FQN `emb`."""

    def __init__(self, emb: nn.Module) -> None:
        super().__init__()
        self.emb = emb

    def forward(self, kjt: KeyedJaggedTensor):
        return self.emb(kjt)


def _configs(kind: str, *, dim: int | None = None, dtype: DataType = DataType.FP32) -> list:
    configs = unweighted_tables() if kind == "bags" else seq_a_tables()
    if kind == "bags" and dim is not None:  # widths fbgemm's fused kernel takes (8 and 16) and not (5)
        dims = {"t_sum": dim, "t_mean": 12, "t_small": 5, "t_big": 16}
        return [dataclasses.replace(c, embedding_dim=dims[c.name], data_type=dtype) for c in configs]
    return [dataclasses.replace(c, embedding_dim=dim or c.embedding_dim, data_type=dtype) for c in configs]


def make_model(kind: str, *, seed: int, **table_kwargs) -> Holder:
    torch.manual_seed(seed)
    configs = _configs(kind, **table_kwargs)
    return Holder(EmbeddingBagCollection(tables=configs) if kind == "bags" else EmbeddingCollection(tables=configs))


def plan_for(kind: str, case: str, ref: Holder, world: int) -> ShardingPlan:
    if kind == "bags":
        placements = placements_for(case, ref.emb, world)
    else:
        placements = seq_placements_for(case, ref.emb.embedding_configs(), world)
    return ShardingPlan(world_size=world, modules={"emb": placements})


def fqn(kind: str, table: str) -> str:
    return f"emb.{ATTR[kind]}.{table}.weight"


def _batches(kind: str, ref: Holder, world: int, seed: int) -> list[KeyedJaggedTensor]:
    if kind == "bags":
        return [make_batch(ref.emb, seed=seed + r) for r in range(world)]
    return [seq_make_batch(SEQ_FEATURES["seq_a"], seed=seed + r) for r in range(world)]


def _rows(kind: str, batches: list[KeyedJaggedTensor], key: str | None) -> slice:
    """This rank's rows of the global output (of `key`, for an EC)."""
    rank = dist.get_rank()
    if kind == "bags":
        n = batches[rank].stride()
        return slice(rank * n, (rank + 1) * n)
    feature = key.split("@")[0]
    before = sum(int(b[feature].lengths().sum()) for b in batches[:rank])
    return slice(before, before + int(batches[rank][feature].lengths().sum()))


def _outputs(kind: str, out) -> dict:
    return {None: out.values()} if kind == "bags" else {k: jt.values() for k, jt in out.items()}


def outputs_match(kind: str, model: Holder, ref: Holder, what: str, seed: int = 7) -> float:
    """This rank's outputs against the reference's on the global batch."""
    batches = _batches(kind, ref, dist.get_world_size(), seed)
    got, want = _outputs(kind, model(batches[dist.get_rank()])), _outputs(kind, ref(global_batch(batches)))
    assert list(got) == list(want), (what, list(got), list(want))
    return max(close(got[k], want[k][_rows(kind, batches, k)], f"{what} {k or ''}") for k in want)


def _change(full: torch.Tensor, table: str) -> None:
    """The same change on every rank and in the reference: rows re-initialised, one clipped."""
    g = torch.Generator().manual_seed(sum(map(ord, table)))
    full[1:4] = torch.randn(full[1:4].shape, generator=g)
    full[-1].clamp_(-0.01, 0.01)


def _shards_equal(model: Holder, ref: Holder, what: str) -> int:
    """Every piece this rank holds equals the reference's table there, bit for bit."""
    refs = dict(ref.named_parameters())
    n = 0
    for name, p in model.named_parameters():
        for t, r, c in local_blocks(p):
            assert t.dtype == refs[name].dtype and torch.equal(t.detach(), refs[name].detach()[r, c]), f"{what}: {name}[{r}, {c}]"
            n += 1
    return n


# -- every placement -------------------------------------------------------------------------------


def _every_case(kind: str) -> dict[str, int]:
    """Per case: the full tables inside equal the unsharded ones (every rank) and the model shows
    them; writeback=False changes nothing; writeback of changed rows gives the changed
    reference's outputs, with the shards back in place."""
    world = dist.get_world_size()
    checked = {}
    for case in CASES:
        ref = make_model(kind, seed=3)
        model = modular.shard(copy.deepcopy(ref), plan_for(kind, case, ref, world))
        ref_weights = dict(ref.named_parameters())
        with modular.unshard(model, writeback=False) as full:
            assert sorted(full) == sorted(ref_weights) == sorted(fqn(kind, t) for t in NAMES[kind]), sorted(full)
            for name, t in full.items():
                assert t.device.type == "cpu"
                torch.testing.assert_close(t, ref_weights[name].detach(), atol=0, rtol=0)
                assert dict(model.named_parameters())[name] is t  # the model shows it too
                t.zero_()  # not written back
        outputs_match(kind, model, ref, f"{kind} {case} after writeback=False")
        with modular.unshard(model) as full:
            for name, t in full.items():
                _change(t, name)
        with torch.no_grad():
            for name, p in ref_weights.items():
                _change(p, name)
        for name, p in model.named_parameters():
            if case != "data_parallel":
                assert isinstance(p, ShardedTensor), f"{name} is a {type(p).__name__} after unshard"
        outputs_match(kind, model, ref, f"{kind} {case} after writeback")
        checked[case] = _shards_equal(model, ref, f"{kind} {case} after writeback")
    return checked


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("kind", KINDS)
def test_unshard_returns_each_kinds_tables_and_writes_changes_back(kind: str, world: int) -> None:
    results = run_on_ranks(world, _every_case, kind, timeout=200)
    for r in results:
        assert set(r) == set(CASES) and all(n > 0 for n in r.values()), results


def _rank0_only(kind: str, case: str, tensor_type: str) -> list[str]:
    """rank0_only: rank 0 alone holds the tables picked (one by FQN, one by name); its change
    reaches every rank's shards, under either tensor type."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = make_model(kind, seed=4)
    model = modular.shard(copy.deepcopy(ref), plan_for(kind, case, ref, world), tensor_type=tensor_type)
    by_fqn, by_name = PICK[kind]
    with modular.unshard(model, tables=[fqn(kind, by_fqn), by_name], rank0_only=True, offload_to_cpu=False) as full:
        got = sorted(full)
        if rank != 0:
            assert full == {}, sorted(full)
        for name, t in full.items():
            torch.testing.assert_close(t, dict(ref.named_parameters())[name].detach(), atol=0, rtol=0)
            _change(t, name)
    with torch.no_grad():
        for name in (fqn(kind, by_fqn), fqn(kind, by_name)):
            _change(dict(ref.named_parameters())[name], name)
    want = DTensor if tensor_type == "dtensor" else ShardedTensor
    for name, p in model.named_parameters():
        if case != "data_parallel":
            assert isinstance(p, want), f"{name} is a {type(p).__name__} after unshard"
    outputs_match(kind, model, ref, f"{kind} {case} {tensor_type} rank0_only writeback")
    return got


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", KINDS)
def test_rank0_only_writeback_reaches_every_rank(kind: str, world: int) -> None:
    for case, tensor_type in [
        ("mixed", "sharded_tensor"), ("column_wise", "sharded_tensor"),
        ("data_parallel", "sharded_tensor"), ("mixed", "dtensor"), ("row_wise", "dtensor"),
    ]:  # fmt: skip
        got = run_on_ranks(world, _rank0_only, kind, case, tensor_type, timeout=TIMEOUT_S)
        assert got[0] == sorted(fqn(kind, t) for t in PICK[kind]), (case, tensor_type, got)
        assert all(g == [] for g in got[1:]), got


# -- the fused optimizer, DTensor tables and FP16 tables ------------------------------------------


def _fused_writeback(kind: str, case: str, tensor_type: str, rank0_only: bool) -> float:
    """A fused model trains 2 steps, its tables are changed through unshard, it trains 2 more:
    weights and Adagrad state equal the reference given the same change (its state untouched)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ref = make_model(kind, seed=0, dim=8)
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.Adagrad(ref.parameters(), lr=LR, eps=EPS)
    opt = modular.fuse_optimizer(model, "exact_adagrad", lr=LR, eps=EPS)
    modular.shard(model, plan_for(kind, case, ref, world), tensor_type=tensor_type)
    worst = 0.0
    for step in range(4):
        if step == 2:
            with modular.unshard(model, rank0_only=rank0_only) as full:
                for name, t in full.items():
                    _change(t, name)
            with torch.no_grad():
                for name, p in ref.named_parameters():
                    _change(p, name)
        batches = _batches(kind, ref, world, seed=100 * step)
        got, want = _outputs(kind, model(batches[rank])), _outputs(kind, ref(global_batch(batches)))
        loss = ref_loss = 0
        for k, expected in want.items():
            target = torch.randn(expected.shape, generator=torch.Generator().manual_seed(step))
            mine = _rows(kind, batches, k)
            worst = max(worst, close(got[k], expected[mine], f"{kind} {case} step {step} output {k}"))
            loss = loss + (got[k] * target[mine]).sum()
            ref_loss = ref_loss + (expected * target).sum() / world
        loss.backward()
        ref_loss.backward()
        opt.step()
        ref_opt.step()
        ref_opt.zero_grad()
    with modular.unshard(model, writeback=False) as full:
        for name, p in ref.named_parameters():
            worst = max(worst, close(full[name], p.detach(), f"{kind} {case} {name} after training"))
    state = opt.state_dict()["state"]
    for name, p in ref.named_parameters():
        want, got = ref_opt.state[p]["sum"], next(iter(state[name].values()))
        pieces = local_pieces(got) if is_sharded(got) else [Piece((0, 0), tuple(want.shape), got)]
        assert pieces or case != "data_parallel", (name, type(got))
        for (r, c), (nr, nc), t in pieces:
            worst = max(worst, close(t, want[r : r + nr, c : c + nc], f"{kind} {case} {name} state"))
    return worst


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", KINDS)
def test_writeback_reaches_the_fused_optimizer(kind: str, world: int) -> None:
    for i, (case, tensor_type) in enumerate([
        ("mixed", "sharded_tensor"), ("column_wise", "sharded_tensor"), ("table_row_wise", "sharded_tensor"),
        ("data_parallel", "sharded_tensor"), ("mixed", "dtensor"), ("row_wise", "dtensor"),
        ("table_wise", "sharded_tensor"),
    ]):  # fmt: skip
        worst = run_on_ranks(world, _fused_writeback, kind, case, tensor_type, i % 2 == 1, timeout=200)
        assert all(w <= 1e-5 for w in worst), (case, tensor_type, worst)


def _fp16(kind: str, case: str, rank0_only: bool) -> int:
    """FP16 tables come out in FP16, equal to the unsharded ones, and go back bit for bit."""
    world = dist.get_world_size()
    ref = make_model(kind, seed=5, dtype=DataType.FP16)
    model = modular.shard(copy.deepcopy(ref), plan_for(kind, case, ref, world))
    refs = dict(ref.named_parameters())
    with modular.unshard(model, rank0_only=rank0_only) as full:
        assert rank0_only and dist.get_rank() > 0 or sorted(full) == sorted(refs), sorted(full)
        for name, t in full.items():
            assert t.dtype == torch.float16, (name, t.dtype)
            assert torch.equal(t, refs[name].detach()), name
            _change(t, name)
    with torch.no_grad():
        for name, p in refs.items():
            _change(p, name)
    return _shards_equal(model, ref, f"{kind} {case} FP16 after writeback")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", KINDS)
def test_fp16_tables_unshard_in_their_dtype(kind: str) -> None:
    for case, rank0_only in [("mixed", False), ("mixed", True), ("row_wise", True)]:
        assert all(n > 0 for n in run_on_ranks(2, _fp16, kind, case, rank0_only, timeout=TIMEOUT_S))


# -- errors: named by each kind's FQNs ----------------------------------------------------------------


def _shape_change(kind: str, how: str) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    ref = make_model(kind, seed=5)
    model = modular.shard(copy.deepcopy(ref), plan_for(kind, "mixed", ref, world))
    small, big = NAMES[kind][1], PICK[kind][1]
    try:
        with modular.unshard(model, rank0_only=how == "rank0_resize") as full:
            for t in full.values():
                t.zero_()  # must not reach the shards: nothing is written back
            if rank == world - 1 and how == "assign":
                getattr(model.emb, ATTR[kind])[small].weight = nn.Parameter(torch.zeros(3, 2))
            if rank == 0 and how == "rank0_resize":
                full[fqn(kind, big)].resize_(29, 2)
            if rank == world - 1 and how == "raise":
                raise KeyError("the user's own error")
    finally:  # shards restored, unchanged, on every rank
        outputs_match(kind, model, ref, f"{kind} {how}: the model after a failed unshard")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("kind", KINDS)
def test_a_shape_change_or_an_error_inside_raises_on_every_rank(kind: str, world: int) -> None:
    small = NAMES[kind][1]
    errors = expect_errors_on_all_ranks(world, _shape_change, kind, "assign", timeout=TIMEOUT_S)
    for e in errors:
        assert f"table {small!r} ({fqn(kind, small)}) is (3, 2) on exit" in e and "wrote nothing back" in e, e
    if world > 1:
        big = PICK[kind][1]
        errors = expect_errors_on_all_ranks(world, _shape_change, kind, "rank0_resize", timeout=TIMEOUT_S)
        for e in errors:
            assert f"table {big!r} ({fqn(kind, big)}) is (29, 2) on exit" in e and "on rank 0" in e, e
    errors = expect_errors_on_all_ranks(world, _shape_change, kind, "raise", timeout=TIMEOUT_S)
    assert "the user's own error" in errors[-1], errors
    for e in errors[:-1]:
        assert f"on rank {world - 1}, KeyError" in e and "wrote nothing back" in e, e


class Both(nn.Module):
    """An EBC and an EC that both have a table named 't_sum'."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(6)
        self.bags = EmbeddingBagCollection(tables=unweighted_tables())
        tables = seq_a_tables()
        self.seqs = EmbeddingCollection(tables=[dataclasses.replace(tables[0], name="t_sum"), *tables[1:]])


def _both_kinds(which: str) -> list[str]:
    world = dist.get_world_size()
    ref = Both()
    plan = ShardingPlan(world_size=world, modules={
        "bags": placements_for("mixed", ref.bags, world),
        "seqs": seq_placements_for("mixed", ref.seqs.embedding_configs(), world),
    })  # fmt: skip
    model = modular.shard(copy.deepcopy(ref), plan)
    if which == "ambiguous":
        with modular.unshard(model, tables=["t_sum"]):
            raise AssertionError("unreachable: the selection is refused on entry")
    with modular.unshard(model, tables=["s_mid", "bags.embedding_bags.t_sum.weight", "seqs.embeddings.t_sum.weight"]) as full:
        got = sorted(full)
        for name, t in full.items():
            _change(t, name)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name in got:
                _change(p, name)
    _shards_equal(model, ref, "both kinds after writeback")
    return got


@pytest.mark.timeout(120)
def test_one_call_unshards_tables_of_both_kinds_by_their_own_fqns() -> None:
    got = run_on_ranks(2, _both_kinds, "select", timeout=TIMEOUT_S)
    assert got[0] == ["bags.embedding_bags.t_sum.weight", "seqs.embeddings.s_mid.weight", "seqs.embeddings.t_sum.weight"], got
    errors = expect_errors_on_all_ranks(2, _both_kinds, "ambiguous", timeout=TIMEOUT_S)
    for e in errors:
        assert "'t_sum' names tables of several modules: 'bags.embedding_bags.t_sum.weight', 'seqs.embeddings.t_sum.weight'" in e, e


def _bad_selection(kind: str, which: str) -> None:
    rank = dist.get_rank()
    ref = make_model(kind, seed=5)
    model = modular.shard(copy.deepcopy(ref), plan_for(kind, "row_wise", ref, dist.get_world_size()))
    tables = {"unknown": ["t_nope"], "differ": [PICK[kind][rank % 2]]}[which]
    with modular.unshard(model, tables=tables):
        raise AssertionError("unreachable: the selection is refused on entry")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", KINDS)
def test_a_bad_selection_raises_on_every_rank_before_anything_moves(kind: str) -> None:
    errors = expect_errors_on_all_ranks(2, _bad_selection, kind, "unknown", timeout=50)
    listed = sorted(fqn(kind, t) for t in NAMES[kind])
    assert all(f"'t_nope' is not a sharded table of the model; name a table by its weight FQN, one of {listed}" in e for e in errors), errors
    errors = expect_errors_on_all_ranks(2, _bad_selection, kind, "differ", timeout=50)
    a, b = PICK[kind]
    assert all(f"the ranks of module 'emb' select different tables (rank 0: [{a!r}]; rank 1: [{b!r}])" in e for e in errors), errors
