"""`replan`'s search: from the old plan, one table's placement changed at a time, best gain per
moved byte first, within a budget (Note [a move within a budget] in planners/replan.py).

A step changes one table that has a shard on the slowest rank (a data-parallel copy counts), or
on a rank near it where nothing lowers the slowest rank: the table goes to its place in plan()'s
fresh plan, its shard on that rank goes to a less loaded rank (`relocations`), or the table is
cut anew (`recuts`): part of the shard peeled onto a less loaded rank, rows or columns shifted to
a neighbouring shard of the table (all of them: one shard fewer), a data-parallel table made a
sharded table on the least loaded ranks, a sharded one made data-parallel. Every candidate is
priced exactly: its ranks' seconds and bytes by the cost model, its move by `move_bytes` from
the old placement, as `modular.reshard` cuts the blocks. Two walks run, by gain per moved byte
and by gain (`greedy`).
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from planners.cost import CostModel, TableArrays
from planners.inputs import ColumnWiseStatistic, Optimizer, Table, TableConstraint
from planners.moves import per_piece_statistic, shards_of
from planners.options import column_unit
from planners.types import ShardingType, TablePlacement, even_split
from planners.units import format_seconds

__all__ = ["greedy", "recuts", "refused", "relocations", "table_load"]

_T = ShardingType
_SHARES = (1 / 8, 1 / 4, 1 / 2)  # of a shard, peeled off onto the least loaded rank, beside the even share
_HOT, _NEAR = 8, 0.9  # the ranks whose tables a step may change: up to 8, within 10% of the slowest
_PATIENCE = 24  # steps after the best prefix so far before the search gives up
Step = tuple[int, float, float, str]  # (table, slowest before, slowest after, why)


def table_load(model: CostModel, table: Table, p: TablePlacement) -> tuple[np.ndarray, np.ndarray]:
    """What one table adds to each rank's seconds and bytes (as `evaluate.evaluate` counts them)."""
    load, mem = table_loads(model, table, [p])
    return load[0], mem[0]


def table_loads(model: CostModel, table: Table,
                placements: Sequence[TablePlacement]) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """`table_load` of each placement, (placements, world) seconds and bytes: one cost-model call
    per sharding type."""
    world = model.topology.world_size
    load, mem = np.zeros((len(placements), world)), np.zeros((len(placements), world))
    by_kind: dict[ShardingType, list[tuple[int, int, int, int, int]]] = {}
    for n, p in enumerate(placements):
        shards = shards_of(p, table, world)
        k = 1 if p.sharding_type is _T.DATA_PARALLEL else len(shards)
        by_kind.setdefault(p.sharding_type, []).extend((n, s.rank, s.num_rows, s.num_cols, k) for s in shards)
    one = TableArrays.of([table])
    for kind, entries in by_kind.items():
        which, ranks, rows, cols, ks = (np.array(c) for c in zip(*entries))
        arrays = one.take(np.zeros(len(entries), dtype=int))
        cost = model.shard(kind, arrays, rows.astype(float), cols.astype(float), ks.astype(float))
        np.add.at(load, (which, ranks), cost.total)
        np.add.at(mem, (which, ranks), cost.memory)
        wire = model.arrival_wire_bytes(kind, arrays, cols.astype(float))
        mem += np.bincount(which, weights=np.broadcast_to(wire, which.shape), minlength=len(placements))[:, None]
    return load, mem


def refused(a: TablePlacement, b: TablePlacement, optimizer: Optimizer,
            statistic: ColumnWiseStatistic) -> bool:  # fmt: skip
    """Whether `modular.reshard` refuses this change (a per-piece row statistic re-cut)."""
    if not per_piece_statistic(a, optimizer, statistic):
        return False
    same_pieces = (a.sizes, len(a.ranks)) == (b.sizes, len(b.ranks))
    return not per_piece_statistic(b, optimizer, statistic) or not same_pieces


def _targets(p: TablePlacement, rank: int, load: np.ndarray, host: int,
             pins: TableConstraint | None, width: int) -> list[int]:  # fmt: skip
    """The `width` least loaded ranks that may take a new shard of `p`'s table: not holding one
    already, allowed by its pins, on `rank`'s host for table-row-wise."""
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
    return targets[:width]


def relocations(p: TablePlacement, rank: int, load: np.ndarray, host: int,
                pins: TableConstraint | None, width: int = 8) -> list[TablePlacement]:  # fmt: skip
    """`p` with its shard on `rank` moved to one of the `width` least loaded ranks that may take
    it (`_targets`)."""
    out = []
    for r in _targets(p, rank, load, host, pins, width):
        ranks = tuple(r if x == rank else x for x in p.ranks)
        if p.sharding_type in (_T.ROW_WISE, _T.TABLE_ROW_WISE) and ranks != tuple(sorted(ranks)):
            continue  # row blocks go out by rank; a move that reorders them is not a relocation
        out.append(TablePlacement(p.sharding_type, ranks, p.sizes).with_tier_of(p))
    return out


def _allows(con: TableConstraint | None, kind: ShardingType, ranks: Sequence[int], world: int) -> bool:
    """Whether `con` lets the table be `kind` on `ranks` (every rank for data-parallel)."""
    if con is None:
        return True
    if not con.allows(kind):
        return False
    if con.ranks and not set(range(world) if kind is _T.DATA_PARALLEL else ranks) <= set(con.ranks):
        return False
    if kind in (_T.TABLE_WISE, _T.ROW_WISE, _T.COLUMN_WISE):
        return con.min_shards <= len(ranks) and (con.max_shards is None or len(ranks) <= con.max_shards)
    return True


def _placement(table: Table, kind: ShardingType, ranks: list[int], sizes: list[int],
               con: TableConstraint | None, world: int) -> TablePlacement | None:  # fmt: skip
    """The placement of these shards, table-wise when one is left; None where the constraint
    forbids it. Sizes are left out where they are the even split `shards` derives anyway."""
    if len(ranks) == 1:
        kind = _T.TABLE_WISE
    if not _allows(con, kind, ranks, world):
        return None
    if kind is _T.TABLE_WISE:
        return TablePlacement(kind, (ranks[0],))
    total = table.embedding_dim if kind is _T.COLUMN_WISE else table.num_embeddings
    even = tuple(sizes) == even_split(total, len(sizes))
    return TablePlacement(kind, tuple(ranks), None if even else tuple(sizes))


def _amounts(size: int, unit: int, shares: Sequence[float]) -> list[int]:
    """Parts of a shard of `size` rows or columns, multiples of `unit`, at most all of it; none
    under 1/32 of it (steps that small gain little per step, and there is a bounded number)."""
    least = max(unit, size / 32)
    return sorted({c for f in shares if least <= (c := unit * round(f * size / unit)) <= size})


def recuts(
    p: TablePlacement, table: Table, rank: int, load: np.ndarray, host: int,
    con: TableConstraint | None, own: float, width: int = 3,
) -> list[tuple[TablePlacement, str]]:  # fmt: skip
    """`table` (placed `p`, adding `own` seconds to `rank`) cut anew so that `rank` carries less
    of it, each with why (the module's docstring). A part peeled or shifted to a rank is the one
    that evens the two ranks if the table's seconds scaled with its rows or columns, half of it,
    and fixed shares; column pieces stay multiples of 4 columns where the width allows."""
    world, dim = len(load), table.embedding_dim
    kind = p.sharding_type
    targets = _targets(p, rank, load, host, con, width)
    found: list[tuple[TablePlacement | None, str]] = []
    if kind is _T.DATA_PARALLEL:  # every rank holds a copy: sharding it moves nothing
        found += [(_placement(table, _T.TABLE_WISE, [r], [dim], con, world),
                   f"data-parallel made table-wise on rank {r}") for r in targets]  # fmt: skip
        if table.num_embeddings >= world:
            found.append((_placement(table, _T.ROW_WISE, list(range(world)),
                                     list(even_split(table.num_embeddings, world)), con, world),
                          "data-parallel made row-wise on every rank"))  # fmt: skip
        unit = column_unit(dim)
        if len(targets) >= 2 and dim >= 2 * unit:
            half = unit * (dim // unit // 2)
            found.append((_placement(table, _T.COLUMN_WISE, targets[:2], [dim - half, half], con, world),
                          f"data-parallel made column-wise on ranks {targets[0]} and {targets[1]}"))  # fmt: skip
        return [(q, why) for q, why in found if q is not None]
    if _allows(con, _T.DATA_PARALLEL, (), world):
        found.append((TablePlacement(_T.DATA_PARALLEL), "made data-parallel, a copy on every rank"))
    shards = shards_of(p, table, world)
    ranks = [s.rank for s in shards]
    j = ranks.index(rank)

    def shares(r: int, fixed: tuple[float, ...]) -> tuple[float, ...]:
        even = min(1.0, max(0.0, float(load[rank] - load[r])) / (2 * own)) if own > 0 else 0.5
        return (even, even / 2) + fixed

    # Peel part of the shard onto a less loaded rank: a table-wise table becomes column- or
    # row-wise over two ranks, a column-, row- or table-row-wise one gets one shard more.
    for new_kind in [_T.COLUMN_WISE, _T.ROW_WISE] if kind is _T.TABLE_WISE else [kind]:
        cols = new_kind is _T.COLUMN_WISE
        sizes = [s.num_cols if cols else s.num_rows for s in shards]
        axis, w = "columns" if cols else "rows", sizes[j]
        for n, r in enumerate(targets):
            for c in _amounts(w, column_unit(dim) if cols else 1, shares(r, _SHARES if n == 0 else ())):
                if c < w:
                    found.append((_placement(table, new_kind, ranks[:j] + [rank, r] + ranks[j + 1:],
                                             sizes[:j] + [w - c, c] + sizes[j + 1:], con, world),
                                  f"{c:_} of its {w:_} {axis} on rank {rank} peeled onto rank {r}"))  # fmt: skip
    if kind is not _T.TABLE_WISE:  # shift rows or columns to a neighbour (all: one shard fewer)
        cols = kind is _T.COLUMN_WISE
        sizes = [s.num_cols if cols else s.num_rows for s in shards]
        axis, w = "columns" if cols else "rows", sizes[j]
        for n in (j - 1, j + 1):
            if not 0 <= n < len(ranks) or ranks[n] == rank:
                continue
            for c in _amounts(w, column_unit(dim) if cols else 1, shares(ranks[n], _SHARES + (1.0,))):
                moved = [s - c if i == j else s + c if i == n else s for i, s in enumerate(sizes)]
                keep = [i for i, s in enumerate(moved) if s > 0]
                q = _placement(table, kind, [ranks[i] for i in keep], [moved[i] for i in keep], con, world)
                found.append((q, f"{c:_} of its {w:_} {axis} on rank {rank} shifted to its "
                                 f"neighbour on rank {ranks[n]}"))  # fmt: skip
    # a tiered table stays tiered, and never becomes a data-parallel copy (modular tiers none)
    return [(q.with_tier_of(p), why) for q, why in found if q is not None
            and (p.cache_load_factor is None or q.sharding_type is not _T.DATA_PARALLEL)]  # fmt: skip


def greedy(
    old: list[TablePlacement], fresh: list[TablePlacement], tables: list[Table], model: CostModel,
    base: float, budget: float, mover: Callable[[Table, TablePlacement, TablePlacement], float],
    pins: Sequence[TableConstraint | None], refuse: Callable[[TablePlacement, TablePlacement], bool],
    recut: bool,
) -> tuple[list[TablePlacement], list[Step]]:
    """The better of two walks (`_walk`): one ranking steps by gain per moved byte, which
    spends a small budget well, and one by gain, which a cheap step cannot lead astray."""
    runs = [_walk(old, fresh, tables, model, base, budget, mover, pins, refuse, recut, by_bytes)
            for by_bytes in (True, False)]  # fmt: skip
    return min(runs, key=lambda run: run[2])[:2]


def _walk(
    old: list[TablePlacement], fresh: list[TablePlacement], tables: list[Table], model: CostModel,
    base: float, budget: float, mover: Callable[[Table, TablePlacement, TablePlacement], float],
    pins: Sequence[TableConstraint | None], refuse: Callable[[TablePlacement, TablePlacement], bool],
    recut: bool, by_bytes: bool,
) -> tuple[list[TablePlacement], list[Step], tuple[float, int]]:
    """From the old plan, takes one table's change at a time (the module's docstring), best gain
    per moved byte first (Note [a move within a budget]). Returns the placements of the best
    prefix and its steps (table, slowest before and after, why); no re-cuts unless `recut`."""
    world, host = model.topology.world_size, int(model.topology.ranks_per_host or 1)
    capacity = float(model.topology.capacity)
    cur = list(old)
    contrib = [table_load(model, t, p) for t, p in zip(tables, cur)]
    load = sum((c[0] for c in contrib), np.zeros(world))
    mem = base + sum((c[1] for c in contrib), np.zeros(world))
    spent_by = [0] * len(cur)
    steps: list[tuple[int, TablePlacement, float, float, str]] = []
    best_prefix, best_key = 0, (float(load.max()), 0)
    patience_from, top_at_best = 0, best_key[0]
    moved: dict[tuple[int, TablePlacement], int] = {}
    priced: dict[tuple[int, TablePlacement], tuple[np.ndarray, np.ndarray]] = {}

    def options(ranks: list[int], top: float) -> list[tuple[int, TablePlacement, str]]:
        """Changes of the tables with a shard on `ranks` (the first: the slowest)."""
        out = []
        for i, p in enumerate(cur):
            data_parallel = p.sharding_type is _T.DATA_PARALLEL
            for r in ranks[:1] if data_parallel else [r for r in ranks if r in p.ranks]:
                where = f"rank {r}, the slowest" if load[r] == top else f"rank {r}, near the slowest"
                if not data_parallel:
                    out.extend((i, q, f"off {where}") for q in relocations(p, r, load, host, pins[i]))
                if recut:
                    cuts = recuts(p, tables[i], r, load, host, pins[i], own=contrib[i][0][r])
                    out.extend((i, q, f"cut anew ({where}): {why}") for q, why in cuts)
        return out

    def best_of(options: list[tuple[int, TablePlacement, str]], top: float, best):
        """The best of `options` and `best` (a step: its key, table, placement, why, ...)."""
        spent = sum(spent_by)
        within = []
        for i, q, where in options:
            if q == cur[i] or refuse(old[i], q):
                continue
            if (i, q) not in moved:  # the same change comes up again at later steps
                moved[i, q] = int(mover(tables[i], old[i], q)) if q != old[i] else 0
            if spent + moved[i, q] - spent_by[i] <= budget:
                within.append((i, q, where))
        unpriced: dict[int, list[TablePlacement]] = {}
        for i, q, _ in within:
            if (i, q) not in priced and q not in unpriced.setdefault(i, []):
                unpriced[i].append(q)
        for i, qs in unpriced.items():
            loads, mems = table_loads(model, tables[i], qs)
            for n, q in enumerate(qs):
                priced[i, q] = loads[n], mems[n]
        for i, q, where in within:
            nb = moved[i, q]
            extra = nb - spent_by[i]
            c = priced[i, q]
            new_load = load - contrib[i][0] + c[0]
            new_mem = mem - contrib[i][1] + c[1]
            if not np.all((new_mem <= capacity) | (new_mem <= mem)):
                continue
            new_top = float(new_load.max())
            per_byte = max(extra, 1) if by_bytes else 1
            if new_top < top:
                key = (0, -(top - new_top) / per_byte)
            elif new_top == top and np.sum(new_load**2) < np.sum(load**2):
                key = (1, -(np.sum(load**2) - np.sum(new_load**2)) / per_byte)
            else:
                continue
            if best is None or key < best[0]:
                best = (key, i, q, where, nb, c, new_load, new_mem, new_top, extra)
        return best

    for _ in range(4 * len(cur) + 16):
        top = float(load.max())
        slow = int(np.argmax(load))
        fresh_moves = [(i, fresh[i], "to its place in plan()'s plan")
                       for i in range(len(cur)) if cur[i] != fresh[i]]  # fmt: skip
        best = best_of(fresh_moves + options([slow], top), top, None)
        if best is None or best[0][0] == 1:
            # Nothing lowers the slowest rank (ranks tie at the top, or its tables' targets are
            # full): the ranks just below it may make room, or even out the top, first.
            hot = [int(r) for r in np.argsort(-load, kind="stable")[:_HOT] if load[r] >= _NEAR * top]
            best = best_of(options([r for r in hot if r != slow], top), top, best)
        if best is None:
            break
        key, i, q, where, nb, c, load, mem, new_top, extra = best
        if key[0] == 0:
            why = (f"{where}: the slowest rank {format_seconds(top)} -> {format_seconds(new_top)} "
                   + (f"({format_seconds((top - new_top) / extra * 2**30)} per GiB moved)" if extra > 0
                      else "(no more bytes moved)"))  # fmt: skip
        else:
            why = f"{where}: evens the ranks at the top ({format_seconds(top)}) for a later move"
        cur[i], contrib[i], spent_by[i] = q, c, nb
        steps.append((i, q, top, new_top, why))
        k = (new_top, sum(spent_by))
        if k < best_key:
            best_prefix, best_key = len(steps), k
            if new_top < (1 - 1e-4) * top_at_best:
                patience_from, top_at_best = len(steps), new_top
        if len(steps) - patience_from >= _PATIENCE:
            break  # evening out the top for a while bought nothing: it will not
    final = list(old)
    for i, q, *_ in steps[:best_prefix]:
        final[i] = q
    return final, [(i, a, b, w) for i, _, a, b, w in steps[:best_prefix]], best_key
