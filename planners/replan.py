"""`replan`: a plan for drifted tables that stays close to the current one (issue 39).

Note [a move within a budget]
Pooling factors drift while a model trains, and a rank that was balanced becomes the straggler.
`modular.reshard(model, new_plan)` moves only the blocks of weights and optimizer state whose
rank changes (Note [resharding in memory] in modular/resharding/__init__.py); `replan` counts
the same bytes (`move_bytes`) and returns the best plan it finds whose move fits a budget:

  1. The old plan, its shards scaled to any table whose rows changed, is priced on the new
     tables (what training costs if nothing moves).
  2. `plan()` plans the new tables from scratch. The cost model prices every rank of a host
     alike and every host alike, so its ranks may be renamed, hosts as a whole and ranks within
     a host, without changing any rank's cost: they are renamed to keep as many of its bytes
     where the old plan holds them as a greedy matching finds (not under pins or the TorchRec
     restriction, which name ranks).
  3. If moving to that plan fits the budget (and it is faster, and reshard takes every change),
     it is the answer: an unlimited budget gives a plan as good as `plan()`'s. Otherwise a greedy
     search starts from the old plan and changes one table at a time (planners/nearby.py):
     to its place in that plan; its shard on the slowest rank to a less loaded rank; or cut
     anew: part of that shard peeled onto a less loaded rank (a table-wise table becomes
     column- or row-wise, a sharded one gets a shard more), rows or columns shifted to the
     shard's neighbour (all of them: a shard fewer), a data-parallel table sharded (which
     moves nothing: every rank holds it) or a sharded one made data-parallel. Each step takes the
     change with the largest drop of the slowest rank per moved byte (where none lowers it,
     e.g. two ranks tie at the top, the ranks near the top may change too, for the largest drop
     of the sum of squared rank costs, never raising the slowest rank), within the budget and
     every rank's memory. A second walk ranks the changes by their drop alone (a run of cheap
     small steps can lead the first astray). The answer is the best prefix of either walk: the
     slowest rank lowest, then the fewest bytes.

Every step is priced exactly: the ranks' seconds and bytes by the cost model, the move by
`move_bytes` from the old placement as `modular.reshard` cuts its blocks (a table changed twice
pays once). A re-cut respects the table's constraint (types, shard counts, pinned ranks), keeps
column pieces to multiples of 4 columns where the width allows, and stays on the host of a
table-row-wise table. A table whose column pieces each keep their own row statistic
(`column_wise_statistic="per_shard"` under row-wise Adagrad) takes no other cut (its pieces may
move), since `modular.reshard` refuses one; nor does `torchrec_compatible` re-cut anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from planners.api import plan_with_stats
from planners.cost import CostModel, TableArrays
from planners.mc_cost import collision_price
from planners.inputs import (
    ColumnWiseStatistic, DataType, Optimizer, Table, TableConstraint, Topology, format_bytes,
)  # fmt: skip
from planners.model_tables import TablesLike, as_table_set, display_name, match_constraints
from planners.moves import adapt_placement, move_bytes, shards_of
from planners.nearby import greedy, refused, table_load
from planners.evaluate import plan_stats
from planners.stats import PlanStats
from planners.types import (
    PlanError, ShardingPlan, ShardingType, TablePlacement, even_split,
)  # fmt: skip
from planners.units import format_seconds, plural

__all__ = ["ReplanResult", "TableMove", "adapt_placement", "move_bytes", "replan"]

_T = ShardingType


@dataclass(frozen=True)
class TableMove:
    """One table that changes placement: where it was and goes, the bytes of weights and
    optimizer state that change rank, and why it moves (the slowest rank before and after)."""

    name: str  # 'fqn.table', or the bare name for the model's own collection
    before: TablePlacement
    after: TablePlacement
    bytes: int
    slowest_before: float  # seconds of the slowest rank before this move was taken
    slowest_after: float
    reason: str


@dataclass(frozen=True)
class ReplanResult:
    """The new plan and its report.

        result = planners.replan(old, tables, topology, batch_size=512, max_moved_bytes=20 * 2**30)
        result.plan, result.moved_bytes, result.received, result.stats.max_cost
        print(result.format())
    """

    plan: ShardingPlan
    stats: PlanStats  # the new plan on the new tables
    old_stats: PlanStats  # the old plan on the new tables (nothing moved)
    fresh_stats: PlanStats  # plan()'s plan on the new tables, the best known without a budget
    fresh_moved_bytes: int  # what moving all the way to plan()'s plan would move
    moves: tuple[TableMove, ...]
    left: tuple[tuple[str, int], ...]  # (table, bytes) that plan()'s plan moves and this does not
    received: tuple[int, ...]  # per rank, bytes it receives
    sent: tuple[int, ...]  # per rank, bytes it sends
    max_moved_bytes: float

    @property
    def moved_bytes(self) -> int:
        return sum(self.received)

    @property
    def bound(self) -> float:
        """The lower bound on any plan's slowest rank for the new tables (Note [the lower bound])."""
        return self.stats.lower_bound

    def format(self) -> str:
        """What moves and why, the old and new slowest rank, the bound, the bytes per rank."""
        old, new, fresh = self.old_stats, self.stats, self.fresh_stats
        budget = "unlimited" if math.isinf(self.max_moved_bytes) else format_bytes(self.max_moved_bytes)
        lines = [
            f"old plan on the new tables: slowest rank {old.slowest_rank.rank} "
            f"{format_seconds(old.max_cost)}",
            f"new plan: slowest rank {new.slowest_rank.rank} {format_seconds(new.max_cost)} "
            f"({100 * (new.max_cost / old.max_cost - 1):+.1f}%); lower bound "
            f"{format_seconds(new.lower_bound)}, slowest / bound {new.bound_ratio:.3f}",
            f"plan() from scratch: {format_seconds(fresh.max_cost)}, moving "
            f"{format_bytes(self.fresh_moved_bytes)}",
            f"moved: {format_bytes(self.moved_bytes)} of weights and optimizer state in "
            f"{plural(len(self.moves), 'table')} (budget {budget})",
        ]
        width = max((len(m.name) for m in self.moves), default=0)
        for m in self.moves:
            lines.append(f"  {m.name:<{width}}  {m.before.describe(new.topology.world_size)} -> "
                         f"{m.after.describe(new.topology.world_size)}, {format_bytes(m.bytes)}: "
                         f"{m.reason}")  # fmt: skip
        if self.left:
            shown = ", ".join(f"{n} ({format_bytes(b)})" for n, b in self.left[:8])
            more = f" and {len(self.left) - 8} more" if len(self.left) > 8 else ""
            lines.append(f"left in place (plan() moves them; over the budget or no gain): {shown}{more}")
        busy = [r for r in range(len(self.received)) if self.received[r] or self.sent[r]]
        if busy:
            lines.append("per rank (received / sent):")
            for r in busy[:16]:
                lines.append(f"  rank {r:>4}: {format_bytes(self.received[r]):>10} / "
                             f"{format_bytes(self.sent[r]):>10}")  # fmt: skip
            if len(busy) > 16:
                lines.append(f"  ... {plural(len(busy) - 16, 'more rank')}")
        return "\n".join(lines)


def _relabel(fresh: list[TablePlacement], old: list[TablePlacement], tables: list[Table],
             world: int, host: int) -> list[TablePlacement]:  # fmt: skip
    """`fresh` with its ranks renamed (whole hosts, then ranks within a host) to keep as many of
    its weight bytes on the ranks that already hold them as a greedy matching finds."""
    keep = np.zeros((world, world))  # [fresh rank, old rank]: bytes the fresh rank would keep
    for t, a, b in zip(tables, old, fresh):
        if a.sharding_type is _T.DATA_PARALLEL or b.sharding_type is _T.DATA_PARALLEL:
            continue  # a data-parallel copy is on every rank: no renaming changes what it keeps
        for n in shards_of(b, t, world):
            for s in shards_of(a, t, world):
                rows = min(s.row_offset + s.num_rows, n.row_offset + n.num_rows) - max(s.row_offset, n.row_offset)
                cols = min(s.col_offset + s.num_cols, n.col_offset + n.num_cols) - max(s.col_offset, n.col_offset)
                if rows > 0 and cols > 0:
                    keep[n.rank, s.rank] += rows * cols * t.dtype.num_bytes
    hosts = world // host
    by_host = keep.reshape(hosts, host, hosts, host).sum(axis=(1, 3))
    perm = np.empty(world, dtype=int)
    for fh, oh in _greedy_match(by_host):
        block = keep[fh * host:(fh + 1) * host, oh * host:(oh + 1) * host]
        for fr, orank in _greedy_match(block):
            perm[fh * host + fr] = oh * host + orank
    out = []
    for t, p in zip(tables, fresh):
        if not p.ranks:
            out.append(p)
            continue
        ranks = [int(perm[r]) for r in p.ranks]
        if p.sharding_type in (_T.ROW_WISE, _T.TABLE_ROW_WISE):
            # row blocks go out by rank: keep ranks increasing, each with its own row count
            sizes = p.sizes or tuple(s.num_rows for s in shards_of(p, t, world))
            pairs = sorted(zip(ranks, sizes))
            ranks, sizes2 = [r for r, _ in pairs], tuple(s for _, s in pairs)
            out.append(TablePlacement(p.sharding_type, tuple(ranks),
                                      None if sizes2 == even_split(sum(sizes2), len(sizes2)) else sizes2
                                      ).with_tier_of(p))
        else:
            out.append(TablePlacement(p.sharding_type, tuple(ranks), p.sizes).with_tier_of(p))
    return out


def _greedy_match(weights: np.ndarray) -> list[tuple[int, int]]:
    """A one-to-one matching of rows to columns, heaviest pairs first (ties by index)."""
    n = weights.shape[0]
    order = np.lexsort((np.arange(n * n), -weights.ravel()))
    used_r, used_c, out = np.zeros(n, bool), np.zeros(n, bool), []
    for flat in order:
        r, c = divmod(int(flat), n)
        if not used_r[r] and not used_c[c]:
            used_r[r] = used_c[c] = True
            out.append((r, c))
            if len(out) == n:
                break
    return out


def replan(
    plan: ShardingPlan,
    tables: TablesLike,
    topology: Topology,
    *,
    batch_size: int,
    max_moved_bytes: float | None,
    constraints: Mapping[str, TableConstraint] | None = None,
    optimizer: Optimizer | str = Optimizer.ROWWISE_ADAGRAD,
    module_fqn: str | None = None,
    column_wise_statistic: ColumnWiseStatistic | str = ColumnWiseStatistic.EXACT,
    pooling_factors: Mapping[str, float] | None = None,
    comm_dtype: DataType | str = DataType.FP32,
    torchrec_compatible: bool = False,
) -> ReplanResult:
    """The best plan for the updated `tables` (new pooling factors, new rows) whose move from
    `plan` stays within `max_moved_bytes` of weights and optimizer state changing rank, as
    `modular.reshard(model, result.plan)` would move them (Note [a move within a budget]).

        result = planners.replan(old_plan, tables, topology, batch_size=512,
                                 max_moved_bytes=20 * 2**30)
        print(result.format())
        if result.stats.max_cost < 0.9 * result.old_stats.max_cost:
            modular.reshard(model, result.plan)

    `max_moved_bytes=0` returns the old plan, re-priced; None (or math.inf) any move, giving a
    plan as good as `plan()`'s. The other arguments are `plan()`'s; `module_fqn` defaults to the
    old plan's one module. Raises PlanError when the tables are not the ones the plan places.
    """
    budget = math.inf if max_moved_bytes is None else float(max_moved_bytes)
    if not budget >= 0:
        raise PlanError(f"max_moved_bytes must be 0 or more bytes (None: no limit), got {max_moved_bytes!r}")
    if plan.world_size != topology.world_size:
        raise PlanError(f"the old plan is for {plan.world_size} ranks but the topology has "
                        f"{topology.world_size}; reshard keeps the world size, so replan at "
                        f"{plan.world_size}")  # fmt: skip
    if module_fqn is None:
        module_fqn = next(iter(plan.modules)) if len(plan.modules) == 1 else ""
    table_set = as_table_set(tables, module_fqn, pooling_factors=pooling_factors)
    optimizer = Optimizer.parse(optimizer)
    statistic = ColumnWiseStatistic.parse(column_wise_statistic)
    world, host = topology.world_size, int(topology.ranks_per_host or 1)
    names = [display_name(fqn, t.name) for fqn, t in table_set]
    plain = [t for _, t in table_set]
    old: list[TablePlacement] = []
    for (fqn, t), name in zip(table_set, names):
        if t.name not in plan.modules.get(fqn, {}):
            raise PlanError(f"table {name!r} is not in the old plan; reshard moves the tables a "
                            "model has, so plan again (planners.plan) to add a table")  # fmt: skip
        old.append(adapt_placement(plan.placement(fqn, t.name), t))
    placed = sum(len(m) for m in plan.modules.values())
    if placed != len(table_set):
        raise PlanError(f"the old plan places {placed} tables but {len(table_set)} are given; "
                        "pass every table of the plan (reshard keeps the tables)")  # fmt: skip
    settings = dict(batch_size=batch_size, constraints=constraints, optimizer=optimizer,
                    column_wise_statistic=statistic, comm_dtype=comm_dtype,
                    torchrec_compatible=torchrec_compatible)  # fmt: skip
    fresh_result = plan_with_stats(table_set_as_modules(table_set), topology, **settings)
    fresh = [fresh_result.plan.placement(fqn, t.name) for fqn, t in table_set]
    pinned = any(c.ranks for c in (constraints or {}).values())
    if not pinned and not torchrec_compatible and world <= 1024:
        fresh = _relabel(fresh, old, plain, world, host)
    model = CostModel(topology, batch_size, optimizer, column_wise_statistic=statistic,
                      comm_dtype=comm_dtype)  # fmt: skip
    mover = lambda t, a, b: move_bytes(t, a, b, world, optimizer, statistic)[0].sum()  # noqa: E731
    cost = [0 if a == b else int(mover(t, a, b)) for t, a, b in zip(plain, old, fresh)]
    base = model.batch_buffer_bytes(TableArrays.of(plain), wire=False) + collision_price(plain, model).reserve
    old_top = max(sum((table_load(model, t, p)[0] for t, p in zip(plain, old)), np.zeros(world)))
    fresh_top = fresh_result.stats.max_cost
    steps: list[tuple[int, float, float, str]] = []
    refuse = lambda a, b: refused(a, b, optimizer, statistic)  # noqa: E731
    whole = not any(refuse(a, b) for a, b in zip(old, fresh))  # reshard takes all of plan()'s plan
    if whole and sum(cost) <= budget and fresh_top < old_top:
        chosen = list(fresh)
        steps = [(i, old_top, fresh_top, "to its place in plan()'s plan, all of which fits the budget")
                 for i in range(len(old)) if old[i] != fresh[i]]  # fmt: skip
    elif budget > 0:
        pins = match_constraints(table_set, constraints, world)
        chosen, steps = greedy(old, fresh, plain, model, base, budget, mover, pins, refuse,
                               recut=not torchrec_compatible)  # fmt: skip
    else:
        chosen = list(old)
    modules: dict[str, dict[str, TablePlacement]] = {}
    old_modules: dict[str, dict[str, TablePlacement]] = {}
    for (fqn, t), p, q in zip(table_set, chosen, old):
        modules.setdefault(fqn, {})[t.name] = p
        old_modules.setdefault(fqn, {})[t.name] = q
    # priced as plan() priced its fresh plan (1D: replan plans no replica groups)
    new_plan = ShardingPlan(world, modules, ranks_per_host=topology.ranks_per_host,
                            priced_for=fresh_result.plan.priced_for)  # fmt: skip
    old_plan = ShardingPlan(world, old_modules, ranks_per_host=topology.ranks_per_host)
    groups = table_set_as_modules(table_set)
    stats = plan_stats(new_plan, groups, topology, **settings)
    old_stats = plan_stats(old_plan, groups, topology, **settings)
    received = np.zeros(world, dtype=np.int64)
    sent = np.zeros(world, dtype=np.int64)
    out_moves = []
    for i in dict.fromkeys(i for i, *_ in steps):
        if chosen[i] == old[i]:
            continue  # moved and moved back
        recv, send = move_bytes(plain[i], old[i], chosen[i], world, optimizer, statistic)
        received += recv
        sent += send
        mine = [st for st in steps if st[0] == i]
        reason = mine[0][3] if len(mine) == 1 else (
            f"{len(mine)} steps, first {mine[0][3]}; last {mine[-1][3]}")
        out_moves.append(TableMove(names[i], old[i], chosen[i], int(recv.sum()), mine[0][1],
                                   mine[-1][2], reason))  # fmt: skip
    left = tuple((names[i], cost[i]) for i in range(len(old))
                 if old[i] != fresh[i] and chosen[i] == old[i])  # fmt: skip
    return ReplanResult(new_plan, stats, old_stats, fresh_result.stats, sum(cost), tuple(out_moves),
                        left, tuple(int(x) for x in received), tuple(int(x) for x in sent), budget)  # fmt: skip


def table_set_as_modules(table_set) -> dict[str, list[Table]]:
    """A TableSet as the {module FQN: [Table]} mapping `plan` and `plan_stats` take."""
    out: dict[str, list[Table]] = {}
    for fqn, t in table_set:
        out.setdefault(fqn, []).append(t)
    return out
