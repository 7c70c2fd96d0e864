"""Which tables go on a tier: the ones a user tiers (checked here) and, when no plan fits with
every table resident, the ones `plan` tiers by itself (docs/planner.md, "Tiered tables").

Note [choosing tiers]
`plan` tiers a table by itself only when the search finds no plan with every table resident
(it raised NoPlanError). It then tiers the largest tables (by weights and optimizer state)
first, as few as possible, all with the largest cache load factor of `CACHE_LADDER` (0.5 down
to 0.01) that plans: the fewest n such that the n largest tierable tables at 0.01 plan, found by
bisection (tiering one more table never needs more memory: its cache and bookkeeping are less
than its rows), then the largest factor at which those n plan. Each step asks only whether a
plan fits, a probe (Note [probing for a fit] in planners/search.py), and one full search plans
the choice: a search more than the resident plan's, and a dozen probes, only for inputs that did
not fit. A tierable table is one whose constraint
does not set `cache_load_factor` nor `allow_tier=False`, and that modular can tier (`refusal`);
a tiered table is never data-parallel, nor cut into column pieces under an optimizer whose
pieces share whole rows' statistics (modular/tiered/tier_plan.py refuses both), which its
effective constraint (`tiered_constraint`) says. If no plan fits even with every tierable table
at 0.01, NoPlanError says how many bytes are missing in all, or else why a table fits no rank.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Sequence, TypeVar

from planners.column_pieces import column_stat_floats
from planners.cost import CostModel
from planners.explain import NoPlanError, table_footprint
from planners.inputs import DataType, Optimizer, Table, TableConstraint, format_bytes
from planners.model_tables import TableSet, display_name
from planners.stats import PlanStats
from planners.tier_cost import CACHE_LADDER, TierSpec
from planners.types import PlanError, ShardingType
from planners.units import plural

__all__ = ["AutoTiers", "choose_tiers", "refusal", "tier_overflow", "tiered_constraint", "with_given_tiers"]

logger = logging.getLogger(__name__)
_ADAM = frozenset({Optimizer.ADAM, Optimizer.PARTIAL_ROWWISE_ADAM, Optimizer.LAMB,
                   Optimizer.PARTIAL_ROWWISE_LAMB})  # fmt: skip
_R = TypeVar("_R")


@dataclasses.dataclass(frozen=True)
class AutoTiers:
    """What `plan` tiered by itself (Note [choosing tiers]): the tables and their load factor."""

    tables: tuple[str, ...]
    cache_load_factor: float

    def describe(self, listed: int = 8) -> str:
        """One line; the first `listed` tables by name, the rest counted."""
        names = ", ".join(self.tables[:listed])
        more = f" and {len(self.tables) - listed} more" if len(self.tables) > listed else ""
        return (f"no plan fits with every table resident, so the planner tiered "
                f"{plural(len(self.tables), 'table')} at cache_load_factor "
                f"{self.cache_load_factor:g}: {names}{more} (modular.shard needs tier_dir=; "
                "TableConstraint(allow_tier=False) keeps a table resident)")  # fmt: skip


def refusal(table: Table, model: CostModel) -> str | None:
    """Why modular cannot tier `table` under `model`'s optimizer (modular/tiered/tier_plan.py
    refuses it on every rank), or None."""
    if not model.optimizer.fused:
        return (f"its rows and their update live in the cache, so it needs a fused optimizer, "
                f"not {model.optimizer.value}")  # fmt: skip
    if table.dtype is not DataType.FP32:
        return f"tiers hold FP32 tables so far, not {table.dtype.value}"
    if table.embedding_dim % 4 and model.optimizer not in _ADAM:
        return (f"a width of {table.embedding_dim} (not a multiple of 4) takes the torch emulation "
                f"of {model.optimizer.value}, which the tier does not wrap")  # fmt: skip
    if model.replicas is not None and model.replicas.count > 1:
        return "2D layouts (replicas > 1) take no tiered tables yet"
    return None


def tiered_constraint(con: TableConstraint | None, tier: TierSpec, model: CostModel,
                      where: str) -> TableConstraint:  # fmt: skip
    """`con` with the tier, and the sharding types modular tiers: never data-parallel, nor column
    pieces whose optimizer shares whole rows' statistics across them."""
    con = con or TableConstraint()
    kinds = set(con.sharding_types or ShardingType) - {ShardingType.DATA_PARALLEL}
    if column_stat_floats(model.optimizer, model.column_wise_statistic):
        kinds.discard(ShardingType.COLUMN_WISE)
    if not kinds:
        raise PlanError(f"{where} may only be {', '.join(k.value for k in con.sharding_types)}, "
                        "which modular does not tier (a data-parallel copy, or column pieces "
                        "sharing rows' statistics); allow table_wise or row_wise")  # fmt: skip
    ordered = tuple(k for k in ShardingType if k in kinds)
    return dataclasses.replace(con, sharding_types=ordered, cache_load_factor=tier.cache_load_factor,
                               cache_policy=tier.cache_policy, hit_rate=tier.hit_rate,
                               zipf_alpha=tier.zipf_alpha)  # fmt: skip


def with_given_tiers(table_set: TableSet, cons: Sequence[TableConstraint | None],
                     model: CostModel) -> list[TableConstraint | None]:  # fmt: skip
    """The constraints, each that sets `cache_load_factor` made effective (`tiered_constraint`);
    PlanError naming a table modular cannot tier."""
    out = list(cons)
    for i, ((fqn, table), con) in enumerate(zip(table_set, cons)):
        if con is None or con.tier is None:
            continue
        where = f"tiered table {display_name(fqn, table.name)!r}"
        why = refusal(table, model)
        if why is not None:
            raise PlanError(f"{where}: {why}; drop cache_load_factor to plan it resident")
        out[i] = tiered_constraint(con, con.tier, model, where)
    return out


def choose_tiers(search: Callable[[list[TableConstraint | None]], _R],
                 fits: Callable[[list[TableConstraint | None]], bool], table_set: TableSet,
                 cons: Sequence[TableConstraint | None], model: CostModel, base: float,
                 resident: NoPlanError) -> tuple[_R, list[TableConstraint | None], AutoTiers]:  # fmt: skip
    """Note [choosing tiers]: `search(constraints)` plans or raises NoPlanError, and
    `fits(constraints)` says whether it would plan (its probe: Note [probing for a fit] in
    planners/search.py); `resident` is what it raised with every table resident (`cons`).
    Returns the plan, the constraints it was made under and what was tiered."""
    topo = model.topology
    room = topo.world_size * (topo.capacity - base)  # for weights, state and caches, in all
    tierable = [i for i, ((_, t), c) in enumerate(zip(table_set, cons))
                if (c is None or (c.allow_tier and c.cache_load_factor is None))
                and refusal(t, model) is None and _kinds_ok(c)]  # fmt: skip
    if not tierable or room <= 0:  # nothing to tier, or the batch alone does not fit
        raise resident
    opt = model.optimizer
    foot = [table_footprint(t, opt, c) for (_, t), c in zip(table_set, cons)]
    order = sorted(tierable, key=lambda i: (-foot[i], i))

    def fewest(factor: float) -> int:
        """The fewest tables tiered at `factor` whose bytes fit all ranks together (a necessary
        condition: a search is the test), or len(order) + 1."""
        need = sum(foot)
        for n, i in enumerate(order):
            if need <= room:
                return n
            need -= foot[i] - table_footprint(table_set[i][1], opt, TableConstraint(cache_load_factor=factor))
        return len(order) if need <= room else len(order) + 1

    def tiered(n: int, factor: float) -> list[TableConstraint | None]:
        """The constraints with the `n` largest tierable tables at `factor`."""
        trial = list(cons)
        for i in order[:n]:
            where = f"table {display_name(*_names(table_set, i))!r}"
            con = cons[i] or TableConstraint()  # its policy, hit rate and Zipf exponent, if given
            tier = TierSpec(factor, con.cache_policy, con.hit_rate, con.zipf_alpha)
            trial[i] = tiered_constraint(cons[i], tier, model, where)
        return trial

    smallest = CACHE_LADDER[-1]
    least = {f: fewest(f) for f in CACHE_LADDER}
    lo, hi, step = 0, max(least[smallest], 1), 1  # n = lo does not plan; try hi
    while hi > len(order) or not fits(tiered(hi, smallest)):
        if hi >= len(order):  # not even with every tierable table tiered: the search says why
            trial = tiered(len(order), smallest)
            try:
                search(trial)
            except NoPlanError as e:
                raise _short(table_set, trial, model, base, e, len(order), resident) from None
            raise AssertionError("the probe found no plan where the search found one")
        lo, hi, step = hi, min(hi + step, len(order)), 2 * step
    while hi - lo > 1:  # the fewest that plan, between a jump's ends
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(tiered(mid, smallest)) else (mid, hi)
    factor = next((f for f in CACHE_LADDER[:-1] if least[f] <= hi and fits(tiered(hi, f))), smallest)
    trial = tiered(hi, factor)
    auto = AutoTiers(tuple(display_name(*_names(table_set, i)) for i in order[:hi]), factor)
    planned = search(trial)  # the one full search: a probe that fits is a search that plans
    logger.warning("%s", auto.describe())
    return planned, trial, auto


def _names(table_set: TableSet, i: int) -> tuple[str, str]:
    return table_set[i][0], table_set[i][1].name


def _kinds_ok(con: TableConstraint | None) -> bool:
    """Whether the constraint allows a sharding type modular tiers (any but data-parallel)."""
    return con is None or not con.sharding_types or any(
        k is not ShardingType.DATA_PARALLEL for k in con.sharding_types)


def _short(table_set: TableSet, cons: Sequence[TableConstraint | None], model: CostModel,
           base: float, error: NoPlanError, tiered: int, resident: NoPlanError) -> NoPlanError:  # fmt: skip
    """The error when no plan fits even with `tiered` tables tiered at the smallest factor: the
    bytes missing in all (weights, state and caches against every rank's room), else the
    search's reason with that many tiered; then why no resident plan fits, with its ways out."""
    topo = model.topology
    world, room = topo.world_size, topo.capacity - base
    need = sum(table_footprint(t, model.optimizer, c) for (_, t), c in zip(table_set, cons))
    what = (f"no plan fits even with the {plural(tiered, 'largest tierable table')} on a tier at "
            f"the smallest cache (cache_load_factor {CACHE_LADDER[-1]:g})")
    if need > world * room:
        what += (f": the tables then need {format_bytes(need)} of weights, optimizer state and "
                 f"caches but {world} ranks have {format_bytes(world * room)} for them "
                 f"({format_bytes(room)} each after {format_bytes(base)} of batch buffers): "
                 f"{format_bytes(need - world * room)} missing in all, "
                 f"{format_bytes((need - world * room) / world)} per rank")  # fmt: skip
    else:
        what += f"; with those tiered, {error}"
    return NoPlanError(f"{what}\nwith every table resident, {resident}", resident.tables)


def tier_overflow(stats: PlanStats) -> NoPlanError | None:
    """The error for a plan whose tiered stores exceed a rank's tier (`Topology.tier_memory`),
    naming the rank with the most missing; None when every rank's tier holds its stores."""
    over = [r for r in stats.ranks if r.tier_bytes > r.tier_capacity]
    if not over:
        return None
    r = max(over, key=lambda r: r.tier_bytes - r.tier_capacity)
    return NoPlanError(
        f"no plan fits the tier: the plan puts {format_bytes(r.tier_bytes)} of tiered tables' "
        f"stores on rank {r.rank}, whose tier holds {format_bytes(r.tier_capacity)} "
        f"(Topology.tier_memory, --tier-memory): {format_bytes(r.tier_bytes - r.tier_capacity)} "
        f"missing there ({plural(len(over), 'rank')} over); a larger tier_memory or more ranks "
        "(the store holds every row, whatever the cache)",
        [t.name for t in stats.tables if t.cache_load_factor is not None])  # fmt: skip
