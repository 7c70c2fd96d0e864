"""Probes (Note [probing for a fit] in planners/search.py): `plan` tiering tables by itself gives
the plan of a full search at every step of Note [choosing tiers], and each shortcut a probe takes
answers as the full search does."""

from __future__ import annotations

import numpy as np
import pytest

import planners
from planners import NoPlanError, ShardingType, Table, TableConstraint, Topology
from planners.cost import CostModel, TableArrays
from planners.explain import before_candidates, before_search, explain_no_plan
from planners.mc_cost import collision_price
from planners.model_tables import as_table_set
from planners.options import enumerate_candidates, lower_bound, select
from planners.search import _LeastLoaded, _choose_ranks, _fewest_bytes, _pack, _problem, search, short_of_room
from planners.tier_choice import choose_tiers, tiered_constraint
from planners.tier_cost import CACHE_LADDER, TierSpec
from planners.types import even_split
from tests.planners.helpers import synthetic

_T = ShardingType
BATCH = 512


def _tight(tables: list[Table], world: int, share: float, hosts: int = 2) -> Topology:
    """`world` ranks whose memory in all is `share` of the tables' weights and row-wise Adagrad."""
    need = sum(t.num_embeddings * t.embedding_dim * 4 * 1.25 for t in tables)
    return Topology(world, ranks_per_host=world // hosts, device_memory=int(need * share / world))


# Inputs short of the memory they need: (tables, seed, world, share, comm dtype, most rows).
# Small tables, so that what a shard holds beyond its rows counts (as at 10,000 tables).
CASES = [(60, 2, 8, 0.9, "fp32", 1e5), (50, 3, 16, 0.6, "fp16", 1e6), (40, 1, 8, 0.7, "fp32", 1e5),
         (30, 5, 4, 0.8, "bf16", 1e5), (80, 4, 8, 1.1, "fp32", 1e5)]  # fmt: skip


class _Searches:
    """The pieces of `plan` around the search, for one input: a full search or a probe of any
    constraints, as `planners/api.py` runs them."""

    def __init__(self, tables: list[Table], topo: Topology, comm: str) -> None:
        self.tables, self.topo = tables, topo
        self.model = CostModel(topo, BATCH, comm_dtype=planners.DataType.parse(comm))
        self.table_set = as_table_set(tables, "")
        arrays = TableArrays.of(tables)
        self.base = self.model.batch_buffer_bytes(arrays) + collision_price(tables, self.model).reserve

    def prepared(self, cons):
        """The candidates, or the NoPlanError that comes before any search."""
        early = before_candidates(self.table_set, cons, self.model, self.base)
        if early is not None:
            return early
        c = enumerate_candidates(self.tables, self.model, cons, self.topo.capacity - self.base)
        return before_search(self.table_set, c, cons, self.model, self.base) or c

    def full(self, cons):
        c = self.prepared(cons)
        if isinstance(c, NoPlanError):
            raise c
        out = search(self.tables, self.model, c, cons, float(self.topo.capacity),
                     lower_bound(c, self.topo.world_size))  # fmt: skip
        if out.placements is None:
            raise explain_no_plan(self.table_set, c, cons, self.model, self.base, out.unplaced)
        return out.placements

    def probe(self, cons) -> tuple[bool, bool]:
        """(whether the probe finds a plan, whether `short_of_room` answered before packing)."""
        c = self.prepared(cons)
        if isinstance(c, NoPlanError):
            return False, False
        if short_of_room(self.tables, self.model, c, cons, float(self.topo.capacity)):
            return False, True
        out = search(self.tables, self.model, c, cons, float(self.topo.capacity),
                     lower_bound(c, self.topo.world_size), probe=True)  # fmt: skip
        return out.placements is not None, False

    def tiered(self, n: int, factor: float, given=None) -> list[TableConstraint | None]:
        """The n largest tables at `factor` (tier_choice's order), over the `given` constraints."""
        foot = [t.num_embeddings * t.embedding_dim for t in self.tables]
        order = sorted(range(len(self.tables)), key=lambda i: (-foot[i], i))
        cons: list[TableConstraint | None] = list(given or [None] * len(self.tables))
        whole_rows = {_T.TABLE_WISE, _T.ROW_WISE, _T.TABLE_ROW_WISE}  # what tiers under row-wise Adagrad
        tierable = [i for i in order if cons[i] is None or not cons[i].sharding_types
                    or whole_rows & set(cons[i].sharding_types)]  # fmt: skip
        for i in tierable[:n]:
            cons[i] = tiered_constraint(cons[i], TierSpec(factor), self.model, self.tables[i].name)
        return cons

    def near_the_edge(self, factor: float = CACHE_LADDER[-1]) -> list[int]:
        """Counts of tiered tables from the fewest whose bytes fit (where the packs fail or
        barely fit), and one with room to spare."""
        n = len(self.tables)
        first = next((m for m in range(n + 1)
                      if not isinstance(self.prepared(self.tiered(m, factor)), NoPlanError)), None)  # fmt: skip
        if first is None:  # not even with every table tiered
            return []
        return sorted({*range(first, min(first + 12, n + 1)), max(first, n // 2)})


@pytest.mark.parametrize("case", CASES[:3])
def test_plan_tiers_as_a_full_search_at_every_step_would(case):
    """Note [choosing tiers] with every probe a full search (the planner before probes) gives
    the same tables, load factor and plan as `plan` with probes."""
    n, seed, world, share, comm, rows = case
    tables = synthetic(n, seed, max_rows=rows)
    topo = _tight(tables, world, share)
    got = planners.plan_with_stats(tables, topo, batch_size=BATCH, comm_dtype=comm)
    s = _Searches(tables, topo, comm)

    def fits(cons) -> bool:
        try:
            s.full(cons)
        except NoPlanError:
            return False
        return True

    cons = [None] * n
    with pytest.raises(NoPlanError) as resident:
        s.full(cons)
    placements, _, auto = choose_tiers(s.full, fits, s.table_set, cons, s.model, s.base, resident.value)
    assert got.stats.auto_tiers == auto and len(auto.tables) >= 1
    for t, p in zip(tables, placements):
        placed = got.plan.modules[""][t.name]
        assert (placed.sharding_type, placed.ranks) == (p.kind, p.ranks), t.name
        total = t.embedding_dim if p.kind is _T.COLUMN_WISE else t.num_embeddings
        if p.kind in (_T.ROW_WISE, _T.TABLE_ROW_WISE, _T.COLUMN_WISE):
            assert (placed.sizes or even_split(total, len(p.ranks))) == p.sizes, t.name


@pytest.mark.parametrize("case", CASES[:4])
def test_a_probe_answers_as_the_full_search_does(case):
    """At every step `choose_tiers` might take (any count of the largest tables, any load
    factor), the probe finds a plan exactly when the full search does; and both answers, and
    answers from `short_of_room` alone, occur (else this would test nothing)."""
    n, seed, world, share, comm, rows = case
    tables = synthetic(n, seed, max_rows=rows)
    s = _Searches(tables, _tight(tables, world, share), comm)
    seen = set()
    for factor in (CACHE_LADDER[0], CACHE_LADDER[-1]):
        for count in {0, *s.near_the_edge(factor)}:
            cons = s.tiered(count, factor)
            try:
                s.full(cons)
                planned = True
            except NoPlanError:
                planned = False
            probed, short = s.probe(cons)
            assert probed == planned, (count, factor)
            seen.add((planned, short))
    assert (True, False) in seen and (False, True) in seen, seen


@pytest.mark.parametrize("case", [c for c in CASES if c[2] >= 8])  # room for every type
def test_no_pack_charges_a_table_fewer_bytes_than_short_of_room_counts(case):
    """`_fewest_bytes` is a lower bound table by table: every table a pack places, by whatever
    candidate, fill or data-parallel copy, is charged at least that many bytes on the ranks. (A
    bound that dropped the candidate a table fits by would count more, and this fails.)"""
    n, seed, world, share, comm, rows = case
    tables = synthetic(n, seed, max_rows=rows)
    s = _Searches(tables, _tight(tables, world, share), comm)
    # a table that may take one type only is charged that type's bytes: each type in the bound
    types = [("row_wise",), ("table_row_wise",), ("column_wise",), ("row_wise", "column_wise"), ()]
    given = [TableConstraint(sharding_types=types[i % 5], min_shards=1 + i % 3) for i in range(n)]
    small = min(range(n), key=lambda i: tables[i].num_embeddings)
    given[small] = TableConstraint(sharding_types=("data_parallel",))
    tight, kinds = 0, set()
    for count in (0, *s.near_the_edge()):
        cons = s.tiered(count, CACHE_LADDER[-1], given)
        c = s.prepared(cons)
        if isinstance(c, NoPlanError):
            continue
        p = _problem(tables, s.model, c, cons, float(s.topo.capacity))
        least = _fewest_bytes(p)
        bound = lower_bound(c, world)
        for factor in (1.0, 1.1, 2.0, float("inf")):
            for mode in ("spread", "fill", "memory"):
                st, _ = _pack(p, select(c, bound * factor), bound * factor, mode)
                for i, kind in enumerate(st.kinds):
                    if kind is None:
                        continue
                    charged = _charged(p, st, i, world)
                    assert least[i] <= charged * (1 + 1e-12), (i, kind, least[i], charged)
                    tight += bool(least[i] >= charged * (1 - 1e-12))
                    kinds.add(kind)
    assert tight > 0 and kinds == set(ShardingType)  # reached, by every type


def _charged(p, st, i: int, world: int) -> float:
    kind = st.kinds[i]
    if kind is _T.DATA_PARALLEL:
        return world * (p.prices.affine(i, kind, 1).am + p.prices.everywhere(i, kind, 1))
    f = st.fits[i]
    return sum(f.am + f.bm * x for x in st.sizes[i]) + world * p.prices.everywhere(i, kind, len(st.ranks[i]))


@pytest.mark.parametrize("case", CASES[:3])
def test_a_pack_that_stops_early_fails_exactly_when_the_whole_pack_does(case):
    """`_pack(stop=True)` returns at the first table of the full pack's leftovers, and places
    every table where the full pack does (then the same packing)."""
    n, seed, world, share, comm, rows = case
    tables = synthetic(n, seed, max_rows=rows)
    s = _Searches(tables, _tight(tables, world, share), comm)
    outcomes = set()
    for count in s.near_the_edge():
        cons = s.tiered(count, CACHE_LADDER[-1])
        c = s.prepared(cons)
        if isinstance(c, NoPlanError):
            continue
        p = _problem(tables, s.model, c, cons, float(s.topo.capacity))
        bound = lower_bound(c, world)
        for factor in (1.0, 1.4, float("inf")):
            for mode in ("spread", "fill", "memory"):
                choice = select(c, bound * factor)
                whole, left = _pack(p, choice, bound * factor, mode)
                cut, first = _pack(p, choice, bound * factor, mode, stop=True)
                outcomes.add(bool(left))
                assert bool(first) == bool(left)
                if left:  # one table, or the fill's tables when the fill failed
                    assert first == left if mode == "fill" and len(first) > 1 else first == [left[0]]
                else:
                    assert cut.ranks == whole.ranks and cut.sizes == whole.sizes
    assert outcomes == {True, False}


def test_the_least_loaded_heap_backs_off_to_the_scans_rank():
    """Under tight memory `_LeastLoaded.pick` sends picks to the scan; whatever it does, the rank
    of a one-shard table is the scan's: least loaded with room, then the lowest rank."""
    rng = np.random.default_rng(0)
    world, capacity = 300, 100.0
    for start in (0.0, 97.0, 98.5):  # from roomy to full ranks
        load, mem = rng.uniform(0, 1, world), rng.uniform(start, start + 3.0, world)
        least = _LeastLoaded(load)
        backed_off = 0
        for _ in range(400):
            need = float(rng.uniform(0.01, 3.0))
            backed_off += least.skip > 0
            r = least.pick(mem, need, capacity)
            fits = mem + need <= capacity
            scan = int(np.argmin(np.where(fits, load, np.inf))) if fits.any() else -1
            assert r is None or r == scan, (r, scan)
            if scan < 0:
                continue
            load[scan] += float(rng.uniform(0.0, 0.2))
            mem[scan] += need
            least.touched(scan)
        assert backed_off > 0 or start == 0.0


def test_the_scan_picks_what_choose_ranks_does():
    """What `_pack` asks `_choose_ranks` when the heap backs off (a table-wise table, one shard,
    nothing pinned): the scan above is that rank."""
    tables = synthetic(12, 7)
    s = _Searches(tables, _tight(tables, 4, 2.0), "fp32")
    cons = [None] * len(tables)
    c = s.prepared(cons)
    p = _problem(tables, s.model, c, cons, float(s.topo.capacity))
    st, _ = _pack(p, select(c, lower_bound(c, 4)), lower_bound(c, 4), "spread")
    for i, t in enumerate(tables):
        f = p.prices.affine(i, _T.TABLE_WISE, 1)
        need = f.am + f.bm * t.embedding_dim
        fits = st.mem + need <= p.capacity
        got = _choose_ranks(p, st, i, _T.TABLE_WISE, [need], False)
        want = [int(np.argmin(np.where(fits, st.load, np.inf)))] if fits.any() else None
        assert got == want


def test_auto_tier_off_still_raises_the_resident_error():
    """`auto_tier=False` raises what the resident search raises, where tiers would plan."""
    tables = synthetic(40, 1)
    topo = _tight(tables, 8, 0.7)
    s = _Searches(tables, topo, "fp32")
    with pytest.raises(NoPlanError) as resident:
        s.full([None] * len(tables))
    with pytest.raises(NoPlanError) as off:
        planners.plan(tables, topo, batch_size=BATCH, auto_tier=False)
    assert str(off.value) == str(resident.value) and "no plan fits" in str(off.value)
    assert planners.plan_with_stats(tables, topo, batch_size=BATCH).stats.auto_tiers
