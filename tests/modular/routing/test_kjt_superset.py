"""A sharded EBC or EC takes a KJT that carries more features than it reads (Note [batches with
more features] in modular/routing/router.py), as torchrec's unsharded modules do: it reads its
own, in its own order, and gives the unsharded module's outputs and gradients on that KJT.

`Combined` hands ONE KJT to an EmbeddingBagCollection and an EmbeddingCollection that share a
feature ('f_a'); the KJT also carries a feature neither reads ('junk', with ids no table has), and
each rank puts its keys in another order. Every test compares with the same unsharded model on
the global batch (every rank's bags of a feature, in rank order), computed in the test.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import modular
from modular.tables.forms import is_sharded, local_pieces
from planners.types import ShardingPlan, ShardingType, TablePlacement
from tests.dist import run_on_ranks
from tests.modular.compare import close

TIMEOUT_S = 100
BATCH = 3
STEPS = 3
LR = 0.5
# Ids of each feature are below the smallest table it feeds ('f_a': t_sum's 13 rows, not s_item's
# 17); 'junk' is read by no table, and its ids are outside every one: reading them would fail.
BOUNDS = {"f_a": 13, "f_b": 13, "f_c": 11, "f_e": 29, "item": 17, "hist": 23, "cat": 7, "junk": 10**6}
KEYS = ["hist", "junk", "f_c", "item", "f_a", "cat", "f_e", "f_b"]
OWN = {"bags": ["f_a", "f_b", "f_c", "f_e"], "seqs": ["item", "f_a", "hist", "cat"]}


def bag_tables() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name="t_sum", num_embeddings=13, embedding_dim=5, feature_names=["f_a", "f_b"]),
        EmbeddingBagConfig(name="t_mean", num_embeddings=11, embedding_dim=7, feature_names=["f_c"], pooling=PoolingType.MEAN),
        EmbeddingBagConfig(name="t_big", num_embeddings=29, embedding_dim=4, feature_names=["f_e"]),
    ]


def seq_tables() -> list[EmbeddingConfig]:
    return [
        EmbeddingConfig(name="s_item", num_embeddings=17, embedding_dim=6, feature_names=["item", "f_a"]),
        EmbeddingConfig(name="s_hist", num_embeddings=23, embedding_dim=6, feature_names=["hist"]),
        EmbeddingConfig(name="s_cat", num_embeddings=7, embedding_dim=6, feature_names=["cat"]),
    ]


class Combined(nn.Module):
    """An EBC and an EC reading one KJT, as a model written for torchrec's unsharded modules may."""

    def __init__(self) -> None:
        super().__init__()
        self.bags = EmbeddingBagCollection(tables=bag_tables())
        self.seqs = EmbeddingCollection(tables=seq_tables())

    def forward(self, kjt: KeyedJaggedTensor):
        return self.bags(kjt), self.seqs(kjt)


def make_model() -> Combined:
    torch.manual_seed(0)
    return Combined()


def plan_for(case: str, world: int) -> ShardingPlan:
    """Every table under one sharding type, or `mixed`: each type once over the two modules."""
    everyone, backwards = tuple(range(world)), tuple(range(world))[::-1]
    by_case = {
        "table_wise": lambda i: TablePlacement(ShardingType.TABLE_WISE, ranks=((world - 1 + i) % world,)),
        "row_wise": lambda i: TablePlacement(ShardingType.ROW_WISE),
        "column_wise": lambda i: TablePlacement(ShardingType.COLUMN_WISE),
        "data_parallel": lambda i: TablePlacement(ShardingType.DATA_PARALLEL),
    }
    if case in by_case:
        bags = {t.name: by_case[case](i) for i, t in enumerate(bag_tables())}
        seqs = {t.name: by_case[case](i + 1) for i, t in enumerate(seq_tables())}
    else:
        bags = {
            "t_sum": TablePlacement(ShardingType.ROW_WISE, ranks=backwards),
            "t_mean": TablePlacement(ShardingType.COLUMN_WISE),
            "t_big": TablePlacement(ShardingType.TABLE_WISE, ranks=(world - 1,)),
        }
        seqs = {
            "s_item": TablePlacement(ShardingType.TABLE_ROW_WISE, ranks=everyone),
            "s_hist": TablePlacement(ShardingType.DATA_PARALLEL),
            # world + 1 column pieces: the last rank holds two
            "s_cat": TablePlacement(ShardingType.COLUMN_WISE, ranks=(world - 1, *everyone)),
        }
    return ShardingPlan(world_size=world, modules={"bags": bags, "seqs": seqs})


def make_batch(keys: list[str], *, seed: int, empty: str | None = None) -> KeyedJaggedTensor:
    """0-3 ids per bag, the first bag of every feature empty; `empty` has no ids at all."""
    g = torch.Generator().manual_seed(seed)
    lengths, values = [], []
    for f in sorted(keys):  # the same ids whatever the order of the keys
        n = torch.randint(0, 4, (BATCH,), generator=g)
        n[0] = 0
        if f == empty:
            n.zero_()
        lengths.append(n)
        values.append(torch.randint(0, BOUNDS[f], (int(n.sum()),), generator=g))
    by_key = dict(zip(sorted(keys), zip(lengths, values)))
    return KeyedJaggedTensor(
        keys=keys,
        values=torch.cat([by_key[k][1] for k in keys]),
        lengths=torch.cat([by_key[k][0] for k in keys]),
    )


def rank_batches(world: int, step: int, keys: list[str] = KEYS) -> list[KeyedJaggedTensor]:
    """Every rank's batch for one step, rank r's keys rotated by r (each rank its own order); at
    step 1 the last rank has no 'f_a' ids (read by both modules)."""
    return [
        make_batch(keys[r:] + keys[:r], seed=100 * step + r, empty="f_a" if (step, r) == (1, world - 1) else None)
        for r in range(world)
    ]


def global_batch(batches: list[KeyedJaggedTensor]) -> KeyedJaggedTensor:
    """Every rank's bags of each feature, in rank order, under the first rank's keys."""
    keys = batches[0].keys()
    per_key = [(kjt[k].lengths(), kjt[k].values()) for k in keys for kjt in batches]
    return KeyedJaggedTensor(
        keys=keys, values=torch.cat([v for _, v in per_key]), lengths=torch.cat([n for n, _ in per_key])
    )


class Rows:
    """This rank's rows of the global outputs."""

    def __init__(self, batches: list[KeyedJaggedTensor], rank: int) -> None:
        self.batches, self.rank = batches, rank

    def bags(self) -> slice:
        return slice(self.rank * BATCH, (self.rank + 1) * BATCH)

    def seq(self, key: str) -> slice:
        feature = key.split("@")[0]
        before = sum(int(b[feature].lengths().sum()) for b in self.batches[: self.rank])
        return slice(before, before + int(self.batches[self.rank][feature].lengths().sum()))


def _near(got: torch.Tensor, want: torch.Tensor, what: str, tol: float) -> None:
    """`close` (FP32's tolerance), or within `tol` relative and absolute (a low-precision option)."""
    if not tol:
        close(got, want, what)
        return
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol, msg=lambda m: f"{what}: {m}")


def compare_outputs(got, want, rows: Rows, what: str, tol: float = 0.0, seq_dtype=torch.float32) -> int:
    """The rank's outputs of both modules against the global ones; returns how many it compared.
    `seq_dtype`: the EC's output dtype (its rows are the reference's rounded to it)."""
    (bags, seqs), (want_bags, want_seqs) = got, want
    if bags.keys() != want_bags.keys():
        raise AssertionError(f"{what}: EBC keys {bags.keys()}, expected {want_bags.keys()}")
    _near(bags.values(), want_bags.values()[rows.bags()], f"{what}: EBC output", tol)
    if list(seqs) != list(want_seqs):
        raise AssertionError(f"{what}: EC keys {list(seqs)}, expected {list(want_seqs)}")
    for key, jt in want_seqs.items():
        feature = key.split("@")[0]
        if not torch.equal(seqs[key].lengths(), rows.batches[rows.rank][feature].lengths()):
            raise AssertionError(f"{what}: EC {key!r} lengths {seqs[key].lengths()}")
        if seqs[key].values().dtype != seq_dtype:
            raise AssertionError(f"{what}: EC {key!r} is {seqs[key].values().dtype}, not {seq_dtype}")
        _near(seqs[key].values(), jt.values()[rows.seq(key)].to(seq_dtype), f"{what}: EC {key!r}", tol)
    return 1 + len(want_seqs)


def loss(outputs, targets, bag_rows: slice, seq_rows) -> torch.Tensor:
    """Every output element weighed by its own target."""
    bags, seqs = outputs
    total = (bags.values().float() * targets["bags"][bag_rows]).sum()
    for key, jt in seqs.items():
        total = total + (jt.values().float() * targets[key][seq_rows(key)]).sum()
    return total


def compare_tables(model: nn.Module, ref: nn.Module, what: str, grads: bool, tol: float = 0.0) -> int:
    """This rank's pieces of every table (ShardedTensor or DTensor shards, or whole data-parallel
    copies)."""
    ref_params = dict(ref.named_parameters())
    compared = 0
    for name, param in model.named_parameters():
        want = ref_params[name].grad if grads else ref_params[name].detach()
        pieces = local_pieces(param) if is_sharded(param) else [((0, 0), tuple(param.shape), param)]
        for (r, c), (nr, nc), tensor in pieces:
            got = tensor.grad if grads else tensor.detach()
            _near(got, want[r : r + nr, c : c + nc], f"{what}: {'grad of ' if grads else ''}{name}[{r}:{r + nr}, {c}:{c + nc}]", tol)
            compared += 1
    return compared


# -- one KJT for an EBC and an EC, trained against the unsharded model ---------------------------


# The EC options over a combined batch: the EC's rows out in FP16 and sent in FP16, the EBC's sums
# sent in BF16; each within its rounding (and the gradients' and weights' after 3 steps).
PRECISION = {
    "output_dtype": {"seqs": torch.float16},
    "comm_dtype": {"bags": torch.bfloat16, "seqs": torch.float16},
}
PRECISION_TOL = 2.0**-6  # BF16's rounding (2**-8) of sums, gradients and 3 SGD steps of both


def _train_combined(case: str, tensor_type: str, precision: bool = False) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = make_model()
    options = PRECISION if precision else {}
    tol = PRECISION_TOL if precision else 0.0
    seq_dtype = torch.float16 if precision else torch.float32
    model = modular.shard(copy.deepcopy(ref), plan_for(case, world), tensor_type=tensor_type, **options)
    assert isinstance(model.bags, modular.ShardedEmbeddingBagCollection)
    assert isinstance(model.seqs, modular.ShardedEmbeddingCollection)
    want = DTensor if tensor_type == "dtensor" else ShardedTensor
    for name, p in model.named_parameters():
        assert case == "data_parallel" or "s_hist" in name or isinstance(p, want), (name, type(p))
    opt = torch.optim.SGD(modular.local_parameters(model), lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    compared = 0
    for step in range(STEPS):
        what = f"{case}, {tensor_type}, rank {rank}/{world}, step {step}"
        batches = rank_batches(world, step)
        rows = Rows(batches, rank)
        out = model(batches[rank])
        whole = global_batch(batches)
        expected = ref(whole)
        compared += compare_outputs(out, expected, rows, what, tol, seq_dtype)
        g = torch.Generator().manual_seed(step)
        targets = {"bags": torch.randn(expected[0].values().shape, generator=g)}
        for key, jt in expected[1].items():
            targets[key] = torch.randn(jt.values().shape, generator=g)
        loss(out, targets, rows.bags(), rows.seq).backward()
        (loss(expected, targets, slice(None), lambda key: slice(None)) / world).backward()
        compared += compare_tables(model, ref, what, grads=True, tol=tol)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    compared += compare_tables(model, ref, f"{case}, rank {rank}: after {STEPS} steps", grads=False, tol=tol)
    # Each module made its selection once for each rank's key order, and kept none for its own.
    cached = {m: len(getattr(model, m)._router._permutations) for m in OWN}
    return {"compared": compared, "cached": cached}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize(
    "case, tensor_type, precision",
    [(c, "sharded_tensor", False) for c in ("table_wise", "row_wise", "column_wise", "data_parallel", "mixed")]
    + [("mixed", "dtensor", False), ("mixed", "dtensor", True), ("row_wise", "sharded_tensor", True)],
)
def test_one_kjt_for_an_ebc_and_an_ec_trains_like_the_unsharded_model(case: str, tensor_type: str, precision: bool, world: int) -> None:
    results = run_on_ranks(world, _train_combined, case, tensor_type, precision, timeout=TIMEOUT_S)
    for r in results:
        # outputs (the EBC's and 4 EC keys) each step, and the grads and weights of this
        # rank's pieces (every rank holds some: 6 tables over at most 3 ranks)
        assert r["compared"] >= STEPS * (1 + 4) + STEPS + 1, results
        assert r["cached"] == {"bags": 1, "seqs": 1}, results


def _exact_keys_alone(kind: str) -> list:
    """A module given exactly its own features, in its own order, selects nothing."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = make_model()
    model = modular.shard(copy.deepcopy(ref), plan_for("mixed", world))
    module, ref_module = getattr(model, kind), getattr(ref, kind)
    order = list(module.layout.features)
    batches = [make_batch(order, seed=r) for r in range(world)]  # the same order on every rank
    out, want = module(batches[rank]), ref_module(global_batch(batches))
    if kind == "bags":
        close(out.values(), want.values()[Rows(batches, rank).bags()], "exact keys")
    else:
        for key, jt in want.items():
            close(out[key].values(), jt.values()[Rows(batches, rank).seq(key)], f"exact keys {key!r}")
    return [order, len(module._router._permutations)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["bags", "seqs"])
def test_a_kjt_of_exactly_the_modules_features_selects_nothing(kind: str) -> None:
    results = run_on_ranks(2, _exact_keys_alone, kind, timeout=TIMEOUT_S)
    assert results[0] == [OWN[kind], 0], results


# -- bad batches: every rank raises -------------------------------------------------------------


def _bad_superset(kind: str, problem: str) -> list[str]:
    """Rank 1 hands `kind` a superset that is bad (`problem`); every rank's error, then a good
    superset step on every rank matches the reference (nothing was left half-sent)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = make_model()
    model = modular.shard(copy.deepcopy(ref), plan_for("mixed", world))
    module, ref_module = getattr(model, kind), getattr(ref, kind)
    batch = rank_batches(world, 0)[rank]
    if rank == 1:
        jts = batch.to_dict()
        lost = {"bags": "f_c", "seqs": "hist"}[kind]
        twice = {"bags": "f_b", "seqs": "item"}[kind]
        if problem == "missing":
            keys = [k for k in batch.keys() if k != lost]
            batch = KeyedJaggedTensor.from_jt_dict({k: jts[k] for k in keys})
        elif problem == "repeated":
            keys = [*batch.keys(), twice]
            batch = KeyedJaggedTensor(
                keys=keys, values=torch.cat([jts[k].values() for k in keys]),
                lengths=torch.cat([jts[k].lengths() for k in keys]),
            )  # fmt: skip
        elif problem == "negative_length_of_junk":
            lengths = batch.lengths().clone()
            at = batch.keys().index("junk") * BATCH
            lengths[at + 2] += int(lengths[at + 1]) + 1  # the lengths still sum to the ids...
            lengths[at + 1] = -1  # ...but one of junk's bags has -1 ids
            batch = KeyedJaggedTensor(keys=batch.keys(), values=batch.values(), lengths=lengths)
    try:
        module(batch)
    except modular.InputError as e:
        message = str(e)
    else:
        raise AssertionError(f"rank {rank}: a bad superset ({problem} on rank 1) did not raise")
    batches = rank_batches(world, 2)
    out, want = module(batches[rank]), ref_module(global_batch(batches))
    rows = Rows(batches, rank)
    if kind == "bags":
        close(out.values(), want.values()[rows.bags()], "good batch after a bad one")
    else:
        for key, jt in want.items():
            close(out[key].values(), jt.values()[rows.seq(key)], f"good batch after a bad one: {key!r}")
    return [message]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", ["bags", "seqs"])
def test_a_bad_superset_raises_on_every_rank_naming_the_feature(kind: str, world: int) -> None:
    table = {"bags": "t_mean", "seqs": "s_hist"}[kind]
    lost = {"bags": "f_c", "seqs": "hist"}[kind]
    twice = {"bags": "f_b", "seqs": "item"}[kind]
    messages = [m for [m] in run_on_ranks(world, _bad_superset, kind, "missing", timeout=TIMEOUT_S)]
    assert f"the batch for module {kind!r} does not match its tables: feature {lost!r} (table {table!r}) is missing" in messages[1], messages
    assert f"It reads the features {OWN[kind]}, each once, in any order" in messages[1], messages
    for r, m in enumerate(messages):
        if r != 1:
            assert m.startswith(f"rank 1 rejected its batch for module {kind!r} (missing or repeated features in feature {lost!r})"), m
    messages = [m for [m] in run_on_ranks(world, _bad_superset, kind, "repeated", timeout=TIMEOUT_S)]
    assert f"feature {twice!r} appears 2 times in the keys" in messages[1], messages
    assert all(m.startswith("rank 1 rejected its batch") for r, m in enumerate(messages) if r != 1), messages
    messages = [m for [m] in run_on_ranks(world, _bad_superset, kind, "negative_length_of_junk", timeout=TIMEOUT_S)]
    assert f"feature 'junk' of the batch for module {kind!r} (read by none of its tables" in messages[1], messages
    assert all(m.startswith("rank 1 rejected its batch") and "(lengths that do not match the values)" in m for r, m in enumerate(messages) if r != 1), messages


# -- prefetch ---------------------------------------------------------------------------------------


def _prefetch_superset() -> dict:
    """The combined KJT prefetched for both modules (`modules=` names them: they read different
    features), and for one module alone; outputs and gradients match the reference. Without
    `modules=` every rank is refused alike, naming the call that fits."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = make_model()
    model = modular.shard(copy.deepcopy(ref), plan_for("mixed", world))
    opt = torch.optim.SGD(modular.local_parameters(model), lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    batches = [rank_batches(world, step) for step in range(STEPS)]
    try:
        modular.prefetch(model, batches[0][rank])
    except modular.InputError as e:
        refused = str(e)
    else:
        raise AssertionError("prefetch without modules= of collections reading different features")
    modular.prefetch(model, batches[0][rank], modules=["bags", "seqs"])
    compared = 0
    for step in range(STEPS):
        if step + 1 < STEPS:
            modular.prefetch(model, batches[step + 1][rank], modules=["bags", "seqs"])
        for name in OWN:
            pending = getattr(model, name)._prefetcher._pending
            assert id(batches[step][rank]) in pending, f"step {step}: {name} did not prefetch"
        rows = Rows(batches[step], rank)
        out = model(batches[step][rank])
        expected = ref(global_batch(batches[step]))
        compared += compare_outputs(out, expected, rows, f"prefetched step {step}")
        g = torch.Generator().manual_seed(step)
        targets = {"bags": torch.randn(expected[0].values().shape, generator=g)}
        for key, jt in expected[1].items():
            targets[key] = torch.randn(jt.values().shape, generator=g)
        loss(out, targets, rows.bags(), rows.seq).backward()
        (loss(expected, targets, slice(None), lambda key: slice(None)) / world).backward()
        compared += compare_tables(model, ref, f"prefetched step {step}", grads=True)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    for name in OWN:
        assert not getattr(model, name)._prefetcher._pending, f"{name} kept a batch"
    # One module alone, and a superset it lacks a feature of: raised at its forward, everywhere.
    batch = rank_batches(world, 5)
    modular.prefetch(model, batch[rank], modules=["seqs"])
    got = model.seqs(batch[rank])
    for key, jt in ref.seqs(global_batch(batch)).items():
        close(got[key].values(), jt.values()[Rows(batch, rank).seq(key)], f"seqs alone {key!r}")
    bad = rank_batches(world, 6, keys=[k for k in KEYS if k != "f_e"] if rank == 0 else KEYS)[rank]
    modular.prefetch(model, bad, modules=["bags"])
    try:
        model.bags(bad)
    except modular.InputError as e:
        missing = str(e)
    else:
        raise AssertionError("a prefetched superset without 'f_e' did not raise")
    return {"refused": refused, "missing": missing, "compared": compared}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 3])
def test_prefetch_takes_a_kjt_with_more_features(world: int) -> None:
    results = run_on_ranks(world, _prefetch_superset, timeout=TIMEOUT_S)
    for r in results:
        assert r["refused"].startswith("prefetch: the model's sharded collections read different features"), r
        assert "for one KJT that the model hands to all of them (each reads its own features), modules=['bags', 'seqs']" in r["refused"], r
        assert r["compared"] >= STEPS * (5 + 1), r
    assert "feature 'f_e' (table 't_big') is missing" in results[0]["missing"], results
    for r in results[1:]:
        assert r["missing"].startswith("rank 0 rejected its batch for module 'bags' (missing or repeated features in feature 'f_e')"), r


def _prefetch_same_features() -> int:
    """Without `modules=`: the only sharded collection gets a superset of its features."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = make_model().bags
    model = modular.shard(copy.deepcopy(ref), ShardingPlan(world_size=world, modules={"": plan_for("mixed", world).modules["bags"]}))
    compared = 0
    for step in range(2):
        batches = rank_batches(world, step)
        modular.prefetch(model, batches[rank])
        out = model(batches[rank]).values()
        close(out, ref(global_batch(batches)).values()[Rows(batches, rank).bags()], f"step {step}")
        compared += 1
    assert not model._prefetcher._pending
    return compared


@pytest.mark.timeout(120)
def test_prefetch_without_modules_takes_a_superset_for_one_collection() -> None:
    assert run_on_ranks(2, _prefetch_same_features, timeout=TIMEOUT_S) == [2, 2]
