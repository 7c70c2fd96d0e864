"""The router's fast paths (fbgemm segment permutation and block bucketization) give, bit for
bit, what the straightforward per-id router gives, for every plan; bad batches are rejected with
the same problem, feature and message. Pure: one process, no process group.

`ReferenceRouter` is the previous, per-id implementation (a searchsorted over (slot, row) keys and
a stable sort by route), kept as the specification; the structural checks (dtypes, lengths,
weights' count), which have no fast path, are the router's own.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from modular._checks import Problem, Rejection
from modular._input import Routed, Router
from modular._tables import table_infos
from modular._layout import ROW_SPLIT, Layout, build_layout
from planners.types import ShardingType, TablePlacement
from tests.modular.cases import CASES, features_of, id_bounds, make_batch, make_ebc, placements_for

_SLOT_SHIFT = 40  # ids are < 2**40, so (slot << 40) + id orders by slot, then id


class ReferenceRouter:
    """The per-id router: each id is copied once per slot of its feature, its route found by a
    searchsorted over (slot << 40) + row keys, and the ids stably sorted by route."""

    def __init__(self, layout: Layout, *, module: str, is_weighted: bool, device: torch.device):
        self.module = module
        self.is_weighted = is_weighted
        self.features = layout.features
        self.num_routes = len(layout.routes)
        self.routes_per_rank = layout.routes_per_rank()
        # The checks' tables and bounds are shared with Router (its structure checks too).
        self._structure = Router(layout, module=module, is_weighted=is_weighted, device=device)
        self.feature_tables = self._structure.feature_tables
        self.id_bound = self._structure.id_bound


        # Each id of feature f is copied into one slot per (output, column shard); a slot holds
        # one route, or all row-split routes of an output, told apart by the id's row.
        slots: dict[tuple, int] = {}
        slot_feature: list[int] = []
        keys, key_route, row_offset = [], [], []
        for i, r in enumerate(layout.routes):
            row_split = layout.placements[layout.table_index(r.table)].sharding_type in ROW_SPLIT
            slot_key = (r.output,) if row_split else (r.output, r.shard_index)
            if slot_key not in slots:
                slots[slot_key] = len(slots)
                slot_feature.append(r.feature)
            keys.append((slots[slot_key] << _SLOT_SHIFT) + r.shard.row_offset)
            key_route.append(i)
            row_offset.append(r.shard.row_offset)
        # Slots are renumbered so that a feature's slots are consecutive.
        order = sorted(range(len(slot_feature)), key=lambda s: (slot_feature[s], s))
        renumber = {old: new for new, old in enumerate(order)}
        keys = [
            (renumber[k >> _SLOT_SHIFT] << _SLOT_SHIFT) + (k & ((1 << _SLOT_SHIFT) - 1)) for k in keys
        ]
        by_key = sorted(zip(keys, key_route))
        nf = len(layout.features)
        copies = [0] * nf
        for f in slot_feature:
            copies[f] += 1
        first_slot = [0] * nf
        for f in range(1, nf):
            first_slot[f] = first_slot[f - 1] + copies[f - 1]
        as_long = dict(dtype=torch.int64, device=device)
        self.copies = torch.tensor(copies, **as_long)
        self.first_slot = torch.tensor(first_slot, **as_long)
        self.boundary_keys = torch.tensor([k for k, _ in by_key], **as_long)
        self.boundary_route = torch.tensor([r for _, r in by_key], **as_long)
        self.route_row_offset = torch.tensor(row_offset, **as_long)
        self.single_copy = all(c == 1 for c in copies)
        ends = [0]
        for n in self.routes_per_rank:
            ends.append(ends[-1] + n)
        self.rank_route_ends = torch.tensor(ends, **as_long)

    def check(self, kjt: KeyedJaggedTensor) -> Optional[Rejection]:
        """Finds the first problem in a batch whose features are already in order."""
        # Dtypes and lengths are checked by the same code on both sides (no fast path there).
        rejection = self._structure._check_structure(kjt)
        if rejection is not None:
            return rejection
        values, lengths, weights = kjt.values(), kjt.lengths(), kjt.weights_or_none()
        if values.numel() == 0:
            return None
        fidx = self.feature_of_values(lengths, kjt.stride())
        bad = (values < 0) | (values >= self.id_bound[fidx])
        if bool(bad.any()):
            pos = int(bad.nonzero()[0, 0])
            f = int(fidx[pos])
            tables = ", ".join(repr(t) for t in self.feature_tables[f])
            return Rejection(
                Problem.ID_RANGE,
                f,
                f"feature {self.features[f]!r} of module {self.module!r} has id "
                f"{int(values[pos])}, outside table {tables} (valid ids are 0 to "
                f"{int(self.id_bound[f]) - 1}); {int(bad.sum())} ids are out of range",
            )
        if self.is_weighted and weights is not None:
            bad = ~torch.isfinite(weights)
            if bool(bad.any()):
                pos = int(bad.nonzero()[0, 0])
                f = int(fidx[pos])
                tables = ", ".join(repr(t) for t in self.feature_tables[f])
                return Rejection(
                    Problem.WEIGHTS,
                    f,
                    f"feature {self.features[f]!r} (table {tables}) of module {self.module!r} "
                    f"has a non-finite per-sample weight ({float(weights[pos])}); "
                    f"{int(bad.sum())} weights are NaN or inf",
                )
        return None

    def feature_of_values(self, lengths: torch.Tensor, batch_size: int) -> torch.Tensor:
        nf = len(self.features)
        per_feature = lengths.view(nf, batch_size).sum(1)
        return torch.repeat_interleave(
            torch.arange(nf, device=lengths.device), per_feature, output_size=int(per_feature.sum())
        )

    # -- routing ----------------------------------------------------------------------------

    def route(self, kjt: KeyedJaggedTensor) -> Routed:
        """Copies each id into its routes, shifted to the shard's first row, ordered by route."""
        values = kjt.values().long()
        lengths = kjt.lengths().long()
        weights = kjt.weights() if self.is_weighted else None
        batch = kjt.stride()
        num_bags = lengths.numel()
        bag = torch.repeat_interleave(
            torch.arange(num_bags, device=values.device), lengths, output_size=values.numel()
        )
        fidx = torch.div(bag, batch, rounding_mode="floor")
        sample = bag - fidx * batch
        if self.single_copy:
            slot = self.first_slot[fidx]
            src = None
        else:
            copies = self.copies[fidx]
            total = int(copies.sum())
            src = torch.repeat_interleave(
                torch.arange(values.numel(), device=values.device), copies, output_size=total
            )
            start = torch.cumsum(copies, 0) - copies
            within = torch.arange(total, device=values.device) - torch.repeat_interleave(
                start, copies, output_size=total
            )
            slot = self.first_slot[fidx[src]] + within
            values, sample = values[src], sample[src]
            if weights is not None:
                weights = weights[src]
        key = (slot << _SLOT_SHIFT) + values
        route = self.boundary_route[torch.searchsorted(self.boundary_keys, key, right=True) - 1]
        ids = values - self.route_row_offset[route]
        # A stable sort of int16 keys is a few times faster on CPU than of int64 ones (a radix
        # sort: 3.5 vs 14-20 ms for 163,840 ids), and route numbers are small.
        narrow = torch.int16 if self.num_routes <= torch.iinfo(torch.int16).max else torch.int32
        order = torch.argsort(route.to(narrow), stable=True)
        route_lengths = torch.bincount(
            route * batch + sample, minlength=self.num_routes * batch
        )
        per_route = route_lengths.view(self.num_routes, batch).sum(1)
        cumulative = torch.cat([per_route.new_zeros(1), torch.cumsum(per_route, 0)])
        return Routed(
            lengths=route_lengths,
            values=ids[order],
            weights=None if weights is None else weights[order],
            counts=torch.diff(cumulative[self.rank_route_ends]),
        )




# -- helpers -----------------------------------------------------------------------------------

CPU = torch.device("cpu")
SUM_, MEAN_ = PoolingType.SUM, PoolingType.MEAN


def _routers(
    configs: list[EmbeddingBagConfig],
    placements: dict[str, TablePlacement],
    world: int,
    weighted: bool,
) -> tuple[Router, ReferenceRouter]:
    # the tables as sharding reads them (unweighted here: the router takes `weighted` itself)
    tables = table_infos(EmbeddingBagCollection(tables=configs, device=torch.device("meta")), "m")
    shards = tuple(
        placements[t.name].shards(
            num_embeddings=t.num_embeddings, embedding_dim=t.embedding_dim, world_size=world,
            table=t.name,
        )
        for t in tables
    )  # fmt: skip
    layout = build_layout(
        tables, tuple(placements[t.name] for t in tables), shards, world_size=world, rank=0
    )
    kwargs = dict(module="m", is_weighted=weighted, device=CPU)
    return Router(layout, **kwargs), ReferenceRouter(layout, **kwargs)


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


def _assert_same(got: Routed, want: Routed) -> None:
    assert got.values_per_rank == want.values_per_rank
    for name in ("lengths", "values", "weights"):
        a, b = getattr(got, name), getattr(want, name)
        if b is None:
            assert a is None, name
            continue
        assert a is not None, name
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape, b.shape)
        # Bit for bit (weights included: NaN-free, compared as raw bits).
        if a.is_floating_point():
            a, b = a.view(torch.int32), b.view(torch.int32)
        assert torch.equal(a, b), name


def _assert_routes_alike(router: Router, ref: ReferenceRouter, kjt: KeyedJaggedTensor) -> None:
    assert ref.check(kjt) is None
    assert router.check(kjt) is None
    want = ref.route(kjt)
    _assert_same(router.route(kjt), want)
    rejection, routed = router.check_and_route(kjt)
    assert rejection is None
    _assert_same(routed, want)


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
    router, ref = _routers(
        ebc.embedding_bag_configs(), placements_for(case, ebc, world), world, weighted
    )
    for kjt in _batches(ebc):
        _assert_routes_alike(router, ref, kjt)


@pytest.mark.parametrize("case", ["table_wise", "row_wise", "column_wise", "mixed"])
def test_normalised_batch_routes_match_reference(case: str) -> None:
    ebc = make_ebc(False)
    router, ref = _routers(ebc.embedding_bag_configs(), placements_for(case, ebc, 3), 3, False)
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
    router, ref = _routers(configs, placements, world, weighted)
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
    router, ref = _routers(ebc.embedding_bag_configs(), placements_for(case, ebc, 2), 2, weighted)
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
    router, ref = _routers(configs, placements, 2, False)
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
    router, ref = _routers(ebc.embedding_bag_configs(), placements_for("mixed", ebc, 2), 2, True)
    kjt = make_batch(ebc, seed=3, batch_size=8)
    kjt = _with(kjt, weights=torch.full_like(kjt.weights(), 3e38))
    assert not bool(torch.isfinite(kjt.weights().sum()))
    _assert_routes_alike(router, ref, kjt)
