"""The router's fast paths (fbgemm segment permutation and block bucketization) give, bit for
bit, what the straightforward per-id router gives, for every plan; bad batches are rejected with
the same problem, feature and message. Pure: one process, no process group.

`ReferenceRouter` (benchmarks/_router_reference.py) is the previous, per-id implementation (a searchsorted over (slot, row) keys and
a stable sort by route), kept as the specification; the structural checks (dtypes, lengths,
weights' count), which have no fast path, are the router's own.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from modular.routing.checks import Problem
from modular.routing.router import Router
from planners.types import ShardingType, TablePlacement
from benchmarks._router_reference import ReferenceRouter, assert_same_routes, routers
from tests.modular.ebc_cases import CASES, features_of, id_bounds, make_batch, make_ebc, placements_for

# -- helpers -----------------------------------------------------------------------------------

SUM_, MEAN_ = PoolingType.SUM, PoolingType.MEAN


def _random_batch(
    features: list[str],
    bounds: dict[str, int],
    *,
    seed: int,
    batch_size: int,
    max_len: int,
    weighted: bool,
    dtype: torch.dtype = torch.int64,
) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_len + 1, (len(features) * batch_size,), generator=g)
    values = torch.cat(
        [
            torch.randint(0, bounds[f], (int(n),), generator=g)
            for f, n in zip(features, lengths.view(len(features), batch_size).sum(1))
        ]
    )
    weights = torch.rand(values.numel(), generator=g) + 0.5 if weighted else None
    return KeyedJaggedTensor(
        keys=features, values=values.to(dtype), lengths=lengths.to(dtype), weights=weights,
        stride=batch_size,
    )  # fmt: skip


def _assert_routes_alike(router: Router, ref: ReferenceRouter, kjt: KeyedJaggedTensor) -> None:
    assert ref.check(kjt) is None
    assert router.check(kjt) is None
    want = ref.route(kjt)
    assert_same_routes(router.route(kjt), want)
    rejection, routed = router.check_and_route(kjt)
    assert rejection is None
    assert_same_routes(routed, want)


def _batches(ebc: EmbeddingBagCollection):
    weighted = ebc.is_weighted()
    features, bounds = features_of(ebc), id_bounds(ebc)
    yield make_batch(ebc, seed=0)
    yield make_batch(ebc, seed=1, batch_size=1)
    yield make_batch(ebc, seed=2, empty_feature=features[0])
    yield make_batch(ebc, seed=3, empty_feature=features[-1])
    yield make_batch(ebc, seed=4, empty=True)
    for seed, (batch, max_len) in enumerate([(17, 5), (64, 12), (5, 40)]):
        yield _random_batch(
            features, bounds, seed=10 + seed, batch_size=batch, max_len=max_len, weighted=weighted
        )
    # int32 ids and lengths (routed as int64).
    yield _random_batch(
        features, bounds, seed=20, batch_size=9, max_len=6, weighted=weighted, dtype=torch.int32
    )


# -- the plans of the runtime tests ------------------------------------------------------------


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_routes_match_reference(case: str, world: int, weighted: bool) -> None:
    ebc = make_ebc(weighted)
    router, ref = routers(
        ebc.embedding_bag_configs(), placements_for(case, ebc, world), world, weighted
    )
    for kjt in _batches(ebc):
        _assert_routes_alike(router, ref, kjt)


@pytest.mark.parametrize("case", ["table_wise", "row_wise", "column_wise", "mixed"])
def test_normalised_batch_routes_match_reference(case: str) -> None:
    ebc = make_ebc(False)
    router, ref = routers(ebc.embedding_bag_configs(), placements_for(case, ebc, 3), 3, False)
    kjt = make_batch(ebc, seed=5, batch_size=6, keys=features_of(ebc)[::-1])
    rejection, normalised = router.normalise(kjt)
    assert rejection is None
    _assert_routes_alike(router, ref, normalised)


# -- random plans --------------------------------------------------------------------------------

_KINDS = (
    ShardingType.TABLE_WISE,
    ShardingType.ROW_WISE,
    ShardingType.COLUMN_WISE,
    ShardingType.TABLE_ROW_WISE,
    ShardingType.DATA_PARALLEL,
)


@st.composite
def _sizes(draw, total: int, parts: int) -> tuple[int, ...]:
    """`parts` positive sizes summing to `total`, or None (the even split)."""
    if parts == 1 or draw(st.booleans()):
        return None
    cuts = sorted(draw(st.sets(st.integers(1, total - 1), min_size=parts - 1, max_size=parts - 1)))
    edges = [0, *cuts, total]
    return tuple(b - a for a, b in zip(edges, edges[1:]))


@st.composite
def _plans(draw):
    weighted = draw(st.booleans())
    world = draw(st.integers(1, 4))
    pool = ["a", "b", "c", "d", "e"]
    configs, placements = [], {}
    for i in range(draw(st.integers(1, 4))):
        rows = draw(st.integers(1, 40))
        dim = draw(st.integers(1, 6))
        features = draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3, unique=True))
        pooling = SUM_ if weighted else draw(st.sampled_from([SUM_, MEAN_]))
        name = f"t{i}"
        configs.append(
            EmbeddingBagConfig(
                name=name, num_embeddings=rows, embedding_dim=dim, feature_names=features,
                pooling=pooling,
            )
        )  # fmt: skip
        kind = draw(st.sampled_from(_KINDS))
        if kind is ShardingType.DATA_PARALLEL:
            placements[name] = TablePlacement(kind)
        elif kind is ShardingType.TABLE_WISE:
            placements[name] = TablePlacement(kind, ranks=(draw(st.integers(0, world - 1)),))
        else:
            total = dim if kind is ShardingType.COLUMN_WISE else rows
            # Ranks in any order; a column-wise table may put two shards on one rank.
            ranks = draw(st.permutations(range(world)))
            ranks = ranks[: draw(st.integers(1, min(world, total)))]
            if kind is ShardingType.COLUMN_WISE and len(ranks) < total and draw(st.booleans()):
                ranks = [*ranks, ranks[0]]
            placements[name] = TablePlacement(
                kind, ranks=tuple(ranks), sizes=draw(_sizes(total, len(ranks)))
            )
    return configs, placements, world, weighted, draw(st.integers(0, 2**31 - 1))



@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_plans())
def test_random_plans_match_reference(plan) -> None:
    configs, placements, world, weighted, seed = plan
    router, ref = routers(configs, placements, world, weighted)
    features = list(router.features)
    bounds = {f: int(b) for f, b in zip(features, router.id_bound.tolist())}
    for i, (batch, max_len) in enumerate([(1, 3), (7, 4), (33, 9)]):
        kjt = _random_batch(
            features, bounds, seed=seed + i, batch_size=batch, max_len=max_len, weighted=weighted
        )
        _assert_routes_alike(router, ref, kjt)


# -- rejections ------------------------------------------------------------------------------------


def _with(kjt: KeyedJaggedTensor, **changes) -> KeyedJaggedTensor:
    parts = dict(
        keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths(),
        weights=kjt.weights_or_none(), stride=kjt.stride(),
    )  # fmt: skip
    parts.update(changes)
    return KeyedJaggedTensor(**parts)


def _bad_batches(ebc: EmbeddingBagCollection):
    """(what, batch) pairs that every router must reject."""
    features, bounds = features_of(ebc), id_bounds(ebc)
    kjt = _random_batch(
        features, bounds, seed=7, batch_size=8, max_len=4, weighted=ebc.is_weighted()
    )
    values, lengths = kjt.values(), kjt.lengths()
    per_feature = lengths.view(len(features), 8).sum(1)
    starts = torch.cumsum(per_feature, 0) - per_feature
    for f, name in enumerate(features):
        if int(per_feature[f]) == 0:
            continue
        first, last = int(starts[f]), int(starts[f] + per_feature[f] - 1)
        for what, pos, value in [
            ("id at bound", last, bounds[name]),
            ("negative id", first, -1),
            ("huge id", last, 2**40),
        ]:
            v = values.clone()
            v[pos] = value
            yield f"{what} in {name}", _with(kjt, values=v)
        # Two bad ids: the first is named, both are counted.
        v = values.clone()
        v[last] = bounds[name] + 3
        v[first] = -5
        yield f"two bad ids in {name}", _with(kjt, values=v)
        if ebc.is_weighted():
            for bad in (float("nan"), float("inf"), -float("inf")):
                w = kjt.weights().clone()
                w[last] = bad
                yield f"weight {bad} in {name}", _with(kjt, weights=w)
    yield "lengths too long", _with(kjt, lengths=torch.cat([lengths[:-1], lengths[-1:] + 1]))
    yield "lengths too short", _with(kjt, values=torch.cat([values, values[:1]]))
    neg = lengths.clone()
    neg[3] = -1
    neg[4] += 1
    yield "negative length", _with(kjt, lengths=neg)
    yield "float ids", _with(kjt, values=values.float())
    yield "missing lengths", _with(kjt, lengths=lengths[:-1])
    if ebc.is_weighted():
        yield "no weights", _with(kjt, weights=None)
        yield "float64 weights", _with(kjt, weights=kjt.weights().double())
        yield "too few weights", _with(kjt, weights=kjt.weights()[:-1])


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("case", ["table_wise", "row_wise", "mixed", "data_parallel"])
def test_rejections_match_reference(case: str, weighted: bool) -> None:
    ebc = make_ebc(weighted)
    router, ref = routers(ebc.embedding_bag_configs(), placements_for(case, ebc, 2), 2, weighted)
    seen = 0
    for what, kjt in _bad_batches(ebc):
        want = ref.check(kjt)
        assert want is not None, what
        assert router.check(kjt) == want, what
        assert router.check_and_route(kjt) == (want, None), what
        seen += 1
    assert seen > 10


def test_rejections_with_one_bound_for_all_features() -> None:
    """All tables of one size: ids are checked by one min/max over the batch."""
    configs = [
        EmbeddingBagConfig(
            name=f"t{i}", num_embeddings=50, embedding_dim=4, feature_names=[f"f{i}"], pooling=SUM_
        )
        for i in range(3)
    ]  # fmt: skip
    placements = {c.name: TablePlacement(ShardingType.ROW_WISE) for c in configs}
    router, ref = routers(configs, placements, 2, False)
    assert router._uniform_bound
    ebc = EmbeddingBagCollection(tables=configs)
    for what, kjt in _bad_batches(ebc):
        want = ref.check(kjt)
        assert want is not None, what
        assert router.check_and_route(kjt) == (want, None), what
    kjt = _random_batch(
        features_of(ebc), id_bounds(ebc), seed=3, batch_size=16, max_len=5, weighted=False
    )
    _assert_routes_alike(router, ref, kjt)


def test_huge_finite_weights_are_accepted() -> None:
    """Weights whose sum overflows to inf are still finite, one by one."""
    ebc = make_ebc(True)
    router, ref = routers(ebc.embedding_bag_configs(), placements_for("mixed", ebc, 2), 2, True)
    kjt = make_batch(ebc, seed=3, batch_size=8)
    kjt = _with(kjt, weights=torch.full_like(kjt.weights(), 3e38))
    assert not bool(torch.isfinite(kjt.weights().sum()))
    _assert_routes_alike(router, ref, kjt)


# -- batches with more features than the module reads (Note [batches with more features]) --------


def _superset(kjt: KeyedJaggedTensor, keys: list[str], extra: dict[str, int], *, seed: int) -> KeyedJaggedTensor:
    """`kjt`'s features in the order `keys`, which also names the `extra` features (each with ids
    up to its bound, far outside the module's tables: a read of them would be caught)."""
    g = torch.Generator().manual_seed(seed)
    batch = kjt.stride()
    jts = kjt.to_dict()
    weighted = kjt.weights_or_none() is not None
    lengths, values, weights = [], [], []
    for k in keys:
        if k in extra:
            n = torch.randint(0, 4, (batch,), generator=g)
            v = torch.randint(1000, 1000 + extra[k], (int(n.sum()),), generator=g)
            w = torch.full((v.numel(),), float("nan"))
        else:
            n, v = jts[k].lengths(), jts[k].values()
            w = jts[k].weights() if weighted else None
        lengths.append(n)
        values.append(v.to(kjt.values().dtype))
        weights.append(w)
    return KeyedJaggedTensor(
        keys=keys, values=torch.cat(values), lengths=torch.cat(lengths).to(kjt.lengths().dtype),
        weights=torch.cat(weights) if weighted else None, stride=batch,
    )  # fmt: skip


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("case", ["table_wise", "row_wise", "column_wise", "data_parallel", "mixed"])
def test_a_batch_with_more_features_routes_the_modules_own(case: str, weighted: bool) -> None:
    """Extra features anywhere (ids out of every table, NaN weights) and the module's in another
    order: normalise selects exactly the module's batch, and routing it matches the reference."""
    ebc = make_ebc(weighted)
    router, ref = routers(ebc.embedding_bag_configs(), placements_for(case, ebc, 3), 3, weighted)
    features = features_of(ebc)
    for seed, dtype in [(0, torch.int64), (1, torch.int32)]:
        own = _random_batch(features, id_bounds(ebc), seed=seed, batch_size=5, max_len=4, weighted=weighted, dtype=dtype)
        for keys in (
            ["x_first", *features[::-1], "x_last"],
            [*features[:2], "x_mid", *features[2:]],
            [*features, "x_last"],  # a prefix in the module's order
            ["x_first", "x_mid", *features],
        ):
            kjt = _superset(own, keys, {"x_first": 7, "x_mid": 50, "x_last": 3}, seed=seed)
            rejection, selected = router.normalise(kjt)
            assert rejection is None, rejection
            assert selected.keys() == features
            for got, want in [
                (selected.lengths(), own.lengths()), (selected.values(), own.values()),
                (selected.weights_or_none(), own.weights_or_none()),
            ]:  # fmt: skip
                assert (got is None) == (want is None)
                if want is not None:
                    assert got.dtype == want.dtype and torch.equal(got, want), keys
            _assert_routes_alike(router, ref, selected)


def test_the_selection_is_made_once_per_key_order_and_exact_keys_pass_through() -> None:
    ebc = make_ebc(False)
    router, _ = routers(ebc.embedding_bag_configs(), placements_for("mixed", ebc, 2), 2, False)
    features = features_of(ebc)
    own = make_batch(ebc, seed=3)
    assert router.normalise(own) == (None, own)  # the same object: nothing copied, nothing cached
    assert router._permutations == {}
    kjt = _superset(own, ["x", *features], {"x": 4}, seed=0)
    router.normalise(kjt)
    selection = router._permutations[tuple(kjt.keys())]
    assert selection.order == [1, 2, 3, 4, 5] and not selection.is_permutation
    router.normalise(_superset(make_batch(ebc, seed=4), ["x", *features], {"x": 4}, seed=1))
    assert router._permutations == {tuple(kjt.keys()): selection}


def _rejection(router: Router, kjt: KeyedJaggedTensor):
    rejection, selected = router.normalise(kjt)
    assert selected is None
    return rejection


def test_missing_and_repeated_features_are_rejected_naming_them() -> None:
    ebc = make_ebc(False)
    router, _ = routers(ebc.embedding_bag_configs(), placements_for("mixed", ebc, 2), 2, False)
    own = make_batch(ebc, seed=3)
    keys = ["f_zz", "f_a", "f_b", "f_d", "f_e"]  # 'f_c' misspelt
    r = _rejection(router, _superset(own, keys, {"f_zz": 3}, seed=0))
    assert r.problem is Problem.FEATURES and r.feature == 2
    assert r.message == (
        "the batch for module 'm' does not match its tables: feature 'f_c' (table 't_mean') is "
        "missing; features ['f_zz'] are not read by any table of this module. It reads the "
        "features ['f_a', 'f_b', 'f_c', 'f_d', 'f_e'], each once, in any order; features that "
        "none of its tables read are ignored"
    )
    for repeated, feature in [("f_d", 3), ("x", -1)]:
        keys = ["f_a", "f_b", "f_c", "f_d", "f_e", "x"]
        jts = _superset(own, keys, {"x": 3}, seed=0).to_dict()
        kjt = KeyedJaggedTensor.from_jt_dict(jts)
        twice = KeyedJaggedTensor(
            keys=[*keys, repeated], values=torch.cat([kjt.values(), jts[repeated].values()]),
            lengths=torch.cat([kjt.lengths(), jts[repeated].lengths()]),
        )  # fmt: skip
        r = _rejection(router, twice)
        assert r.problem is Problem.FEATURES and r.feature == feature
        assert f"feature {repeated!r} appears 2 times in the keys {[*keys, repeated]}" in r.message
    assert router._permutations == {}  # nothing cached for a rejected key order


def test_extra_features_must_agree_with_the_values_as_a_whole() -> None:
    """fbgemm reads every feature's lengths to find the selected ids, so the whole batch's
    lengths, values and weights must agree; the extra features' ids are not checked."""
    ebc = make_ebc(True)
    router, _ = routers(ebc.embedding_bag_configs(), placements_for("mixed", ebc, 2), 2, True)
    features = features_of(ebc)
    own = make_batch(ebc, seed=3, batch_size=4)
    kjt = _superset(own, ["x", *features], {"x": 5}, seed=2)
    x = kjt.to_dict()["x"]
    assert int(x.lengths().sum()) > 0
    lengths = kjt.lengths().clone()
    lengths[1] += 1  # an extra feature's bag longer than its ids
    r = _rejection(router, _with(kjt, lengths=lengths))
    assert r.problem is Problem.LENGTHS and "lengths sum to" in r.message
    lengths = kjt.lengths().clone()
    lengths[0], lengths[1] = -1, lengths[1] + 1
    r = _rejection(router, _with(kjt, lengths=lengths))
    assert r.problem is Problem.LENGTHS and r.feature == -1
    assert r.message == (
        "feature 'x' of the batch for module 'm' (read by none of its tables, but its lengths "
        "place the other features' ids) has length -1 for sample 0; lengths must count the ids of each bag"
    )
    r = _rejection(router, _with(kjt, weights=kjt.weights()[:-1]))
    assert r.problem is Problem.WEIGHTS
    r = _rejection(router, _with(kjt, lengths=kjt.lengths()[:-1]))
    assert r.problem is Problem.LENGTHS and "19 lengths for 5 features is not a whole batch (batch size 4 x 5 = 20)" in r.message
    # The extra feature's ids (1000 and up) and NaN weights are not the module's: accepted.
    rejection, selected = router.normalise(kjt)
    assert rejection is None and router.check(selected) is None
