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
  3. If moving to that plan fits the budget (and it is faster), it is the answer: an unlimited
     budget gives a plan as good as `plan()`'s. Otherwise a greedy search starts from the old
     plan and moves whole tables to their place in that plan, one at a time, taking the move
     with the largest drop of the slowest rank per moved byte (and, where no single move lowers
     it, e.g. two ranks tie at the top, the largest drop of the sum of squared rank costs per
     byte, never raising the slowest rank), within the budget and every rank's memory. The
     answer is the best prefix of those moves: the slowest rank lowest, then the fewest bytes.

The search mixes two valid plans table by table, so its result is valid too. It does not cut a
table anew (e.g. peel half a table off the slowest rank): a table moves to its place in the
fresh plan or stays. A table whose column pieces each keep their own row statistic
(`column_wise_statistic="per_shard"` under row-wise Adagrad) moves only to the same pieces,
since `modular.reshard` refuses any other cut of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from planners.api import plan_with_stats
from planners.cost import CostModel, TableArrays
from planners.inputs import (
    ColumnWiseStatistic, DataType, Optimizer, Table, TableConstraint, Topology, format_bytes,
)  # fmt: skip
from planners.model_tables import TablesLike, as_table_set, display_name, match_constraints
from planners.moves import adapt_placement, move_bytes, per_piece_statistic, shards_of
from planners.stats import PlanStats, format_seconds, plan_stats, plural
from planners.types import (
    PlanError, ShardingPlan, ShardingType, TablePlacement, even_split,
)  # fmt: skip

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


def _table_load(model: CostModel, table: Table, p: TablePlacement) -> tuple[np.ndarray, np.ndarray]:
    """What one table adds to each rank's seconds and bytes (as `stats.evaluate` counts them)."""
    world = model.topology.world_size
    shards = shards_of(p, table, world)
    kind = p.sharding_type
    k = 1.0 if kind is _T.DATA_PARALLEL else float(len(shards))
    arrays = TableArrays.of([table]).take(np.zeros(len(shards), dtype=int))
    rows = np.array([s.num_rows for s in shards], dtype=np.float64)
    cols = np.array([s.num_cols for s in shards], dtype=np.float64)
    ranks = np.array([s.rank for s in shards])
    cost = model.shard(kind, arrays, rows, cols, k)
    load, mem = np.zeros(world), np.zeros(world)
    np.add.at(load, ranks, cost.total)
    np.add.at(mem, ranks, cost.memory)
    mem += float(np.sum(model.arrival_wire_bytes(kind, arrays, cols)))
    return load, mem


def _relabel(fresh: list[TablePlacement], old: list[TablePlacement], tables: list[Table],
             world: int, host: int) -> list[TablePlacement]:  # fmt: skip
    """`fresh` with its ranks renamed (whole hosts, then ranks within a host) to keep as many of
    its weight bytes on the ranks that already hold them as a greedy matching finds."""
    keep = np.zeros((world, world))  # [fresh rank, old rank]: bytes the fresh rank would keep
    for t, a, b in zip(tables, old, fresh):
        if a.sharding_type is _T.DATA_PARALLEL or b.sharding_type is _T.DATA_PARALLEL:
            continue  # a replica is on every rank: no renaming changes what it keeps
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
                                      None if sizes2 == even_split(sum(sizes2), len(sizes2)) else sizes2))
        else:
            out.append(TablePlacement(p.sharding_type, tuple(ranks), p.sizes))
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
    base = model.batch_buffer_bytes(TableArrays.of(plain), wire=False)
    old_top = max(sum((_table_load(model, t, p)[0] for t, p in zip(plain, old)), np.zeros(world)))
    fresh_top = fresh_result.stats.max_cost
    steps: list[tuple[int, float, float, str]] = []
    if sum(cost) <= budget and fresh_top < old_top:
        chosen = list(fresh)
        steps = [(i, old_top, fresh_top, "to its place in plan()'s plan, all of which fits the budget")
                 for i in range(len(old)) if old[i] != fresh[i]]  # fmt: skip
    elif budget > 0:
        pins = match_constraints(table_set, constraints, world)
        allowed = [not _refused(old[i], fresh[i], optimizer, statistic) for i in range(len(old))]
        chosen, steps = _greedy(old, fresh, plain, model, base, budget, mover, pins, allowed)
    else:
        chosen = list(old)
    modules: dict[str, dict[str, TablePlacement]] = {}
    old_modules: dict[str, dict[str, TablePlacement]] = {}
    for (fqn, t), p, q in zip(table_set, chosen, old):
        modules.setdefault(fqn, {})[t.name] = p
        old_modules.setdefault(fqn, {})[t.name] = q
    new_plan = ShardingPlan(world, modules, ranks_per_host=topology.ranks_per_host)
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
        reason = "; then ".join(st[3] for st in mine)
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


def _refused(a: TablePlacement, b: TablePlacement, optimizer: Optimizer,
             statistic: ColumnWiseStatistic) -> bool:  # fmt: skip
    """Whether `modular.reshard` refuses this change (a per-piece row statistic re-cut)."""
    if not per_piece_statistic(a, optimizer, statistic):
        return False
    return not per_piece_statistic(b, optimizer, statistic) or (a.sizes, len(a.ranks)) != (b.sizes, len(b.ranks))


def _relocations(i: int, p: TablePlacement, rank: int, load: np.ndarray, host: int,
                 pins: TableConstraint | None, width: int = 8) -> list[TablePlacement]:  # fmt: skip
    """`p` with its shard on `rank` moved to one of the `width` least loaded ranks that may take
    it: not holding the table already, allowed by its pins, on the same host for table-row-wise."""
    ok = np.ones(len(load), dtype=bool)
    ok[list(p.ranks)] = False
    if pins is not None and pins.ranks:
        allowed = np.zeros(len(load), dtype=bool)
        allowed[list(pins.ranks)] = True
        ok &= allowed
    if p.sharding_type is _T.TABLE_ROW_WISE:
        h = rank // host
        ok[: h * host] = False
        ok[(h + 1) * host:] = False
    targets = [int(r) for r in np.flatnonzero(ok)]
    targets.sort(key=lambda r: (load[r], r))
    out = []
    for r in targets[:width]:
        ranks = tuple(r if x == rank else x for x in p.ranks)
        sizes = p.sizes
        if p.sharding_type in (_T.ROW_WISE, _T.TABLE_ROW_WISE) and ranks != tuple(sorted(ranks)):
            continue  # row blocks go out by rank; a move that reorders them is not a relocation
        out.append(TablePlacement(p.sharding_type, ranks, sizes))
    return out


def _greedy(
    old: list[TablePlacement], fresh: list[TablePlacement], tables: list[Table], model: CostModel,
    base: float, budget: float, mover, pins: Sequence[TableConstraint | None], allowed: list[bool],
) -> tuple[list[TablePlacement], list[tuple[int, float, float, str]]]:
    """From the old plan, moves a table to its fresh placement, or one shard of the slowest rank
    to a least loaded rank, best gain per moved byte first (Note [a move within a budget]).
    Returns the placements of the best prefix and its steps (table, slowest before and after,
    why)."""
    world, host = model.topology.world_size, int(model.topology.ranks_per_host or 1)
    capacity = float(model.topology.capacity)
    cur = list(old)
    contrib = [_table_load(model, t, p) for t, p in zip(tables, cur)]
    load = sum((c[0] for c in contrib), np.zeros(world))
    mem = base + sum((c[1] for c in contrib), np.zeros(world))
    spent_by = [0] * len(cur)
    steps: list[tuple[int, TablePlacement, float, float, str]] = []
    best_prefix, best_key = 0, (float(load.max()), 0)
    for _ in range(4 * len(cur) + 16):
        top = float(load.max())
        slow = int(np.argmax(load))
        options: list[tuple[int, TablePlacement, str]] = [
            (i, fresh[i], "to its place in plan()'s plan") for i in range(len(cur))
            if allowed[i] and cur[i] != fresh[i]
        ]
        for i, p in enumerate(cur):
            if p.sharding_type is not _T.DATA_PARALLEL and slow in p.ranks and allowed[i]:
                options.extend((i, q, f"off rank {slow}, the slowest")
                               for q in _relocations(i, p, slow, load, host, pins[i]))  # fmt: skip
        best = None
        spent = sum(spent_by)
        for i, q, where in options:
            nb = int(mover(tables[i], old[i], q)) if q != old[i] else 0
            extra = nb - spent_by[i]
            if spent + extra > budget:
                continue
            c = _table_load(model, tables[i], q)
            new_load = load - contrib[i][0] + c[0]
            new_mem = mem - contrib[i][1] + c[1]
            if not np.all((new_mem <= capacity) | (new_mem <= mem)):
                continue
            new_top = float(new_load.max())
            per_byte = max(extra, 1)
            if new_top < top:
                key = (0, -(top - new_top) / per_byte)
            elif new_top == top and np.sum(new_load**2) < np.sum(load**2):
                key = (1, -(np.sum(load**2) - np.sum(new_load**2)) / per_byte)
            else:
                continue
            if best is None or key < best[0]:
                best = (key, i, q, where, nb, c, new_load, new_mem, new_top, per_byte)
        if best is None:
            break
        key, i, q, where, nb, c, load, mem, new_top, per_byte = best
        if key[0] == 0:
            why = (f"{where}: the slowest rank {format_seconds(top)} -> {format_seconds(new_top)} "
                   f"({format_seconds((top - new_top) / per_byte * 2**30)} per GiB moved)")  # fmt: skip
        else:
            why = f"{where}: evens the ranks at the top ({format_seconds(top)}) for a later move"
        cur[i], contrib[i], spent_by[i] = q, c, nb
        steps.append((i, q, top, new_top, why))
        k = (new_top, sum(spent_by))
        if k < best_key:
            best_prefix, best_key = len(steps), k
    final = list(old)
    for i, q, *_ in steps[:best_prefix]:
        final[i] = q
    return final, [(i, a, b, w) for i, _, a, b, w in steps[:best_prefix]]
