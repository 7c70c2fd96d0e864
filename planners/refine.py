"""Local search on a packed plan: lower the slowest rank by moving, swapping, resizing and
peeling shards (step 4 of Note [how the search works] in planners/search.py)."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Sequence

import numpy as np

from planners.cost import CostModel, TableArrays
from planners.inputs import Table, TableConstraint
from planners.prices import Affine, ShardPrices
from planners.types import ShardingType

__all__ = ["Problem", "State", "least_loaded", "refine"]

_T = ShardingType


class Problem(NamedTuple):
    """What stays fixed while the search runs."""

    tables: Sequence[Table]
    arrays: TableArrays
    model: CostModel
    candidates: Any  # options.Candidates
    constraints: tuple[TableConstraint | None, ...]
    pins: tuple[np.ndarray | None, ...]  # per table, a bool mask of the ranks it may use
    capacity: float  # bytes per rank for shards and batch buffers
    base_memory: float  # batch buffers, the same on every rank
    prices: ShardPrices  # every table's shard prices, and the bytes a placement adds everywhere


@dataclasses.dataclass
class State:
    """A packing in progress: per-rank load and memory, and each table's shards. Mutable
    scratch that never leaves the search."""

    load: np.ndarray
    mem: np.ndarray
    kinds: list[ShardingType | None]
    ranks: list[list[int]]  # per table, the rank of each shard
    sizes: list[list[int]]  # per table, the columns (TW, CW) or rows (RW, TWRW) of each shard
    fits: list[Affine | None]  # per table, its shard price

    @classmethod
    def empty(cls, tables: int, world: int, base_memory: float) -> State:
        return cls(np.zeros(world), np.full(world, base_memory), [None] * tables,
                   [[] for _ in range(tables)], [[] for _ in range(tables)], [None] * tables)  # fmt: skip


def _floor(x: float, step: int) -> int:
    return int(np.floor(x / step)) * step if np.isfinite(x) else 0


def refine(p: Problem, s: State, good_enough: float = 0.0, max_steps: int | None = None) -> None:
    """While the slowest rank can be lowered by one move, make the move that lowers it most;
    stop early once it is at most `good_enough` seconds (e.g. just above the lower bound)."""
    world = len(s.load)
    host = int(p.model.topology.ranks_per_host or 1)
    on_rank: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    for i, ranks in enumerate(s.ranks):
        for j, r in enumerate(ranks):
            on_rank[r].append((i, j))
    everywhere = np.ones(world, dtype=bool)

    def allowed(i: int, j: int | None) -> np.ndarray:
        """Ranks that may take shard j of table i (or a new shard when j is None)."""
        ok = (p.pins[i] if p.pins[i] is not None else everywhere).copy()
        ok[s.ranks[i]] = False  # a table keeps its shards on distinct ranks
        if s.kinds[i] is _T.TABLE_ROW_WISE and j is not None:
            h = s.ranks[i][j] // host
            ok[: h * host] = False
            ok[(h + 1) * host:] = False
        return ok

    def add(i: int, j: int, r: int, sign: float) -> None:
        f, x = s.fits[i], s.sizes[i][j]
        s.load[r] += sign * (f.a + f.b * x)
        s.mem[r] += sign * (f.am + f.bm * x)

    def relocate(i: int, j: int, r2: int) -> None:
        r = s.ranks[i][j]
        add(i, j, r, -1.0)
        s.ranks[i][j] = r2
        add(i, j, r2, +1.0)
        on_rank[r].remove((i, j))
        on_rank[r2].append((i, j))

    def resize(i: int, j: int, j2: int, dx: int) -> None:
        r, r2 = s.ranks[i][j], s.ranks[i][j2]
        add(i, j, r, -1.0)
        add(i, j2, r2, -1.0)
        s.sizes[i][j] -= dx
        s.sizes[i][j2] += dx
        add(i, j, r, +1.0)
        add(i, j2, r2, +1.0)

    def peel(i: int, j: int, r2: int, dx: int) -> None:
        r = s.ranks[i][j]
        s.mem += _everywhere_step(p, s, i, +1)
        add(i, j, r, -1.0)
        if s.kinds[i] is _T.TABLE_WISE:
            s.kinds[i] = _T.COLUMN_WISE
        s.fits[i] = _grown_fit(p, s, i)  # a column piece may cost more than the table whole
        s.sizes[i][j] -= dx
        add(i, j, r, +1.0)
        s.ranks[i].append(r2)
        s.sizes[i].append(dx)
        add(i, len(s.ranks[i]) - 1, r2, +1.0)
        on_rank[r2].append((i, len(s.ranks[i]) - 1))

    def merge(i: int, j: int, j2: int) -> None:
        s.mem += _everywhere_step(p, s, i, -1)
        for jj, rr in enumerate(s.ranks[i]):
            add(i, jj, rr, -1.0)
            on_rank[rr].remove((i, jj))
        s.sizes[i][j2] += s.sizes[i][j]
        del s.sizes[i][j], s.ranks[i][j]
        if len(s.ranks[i]) == 1 and s.kinds[i] is _T.COLUMN_WISE:
            s.fits[i] = p.prices.affine(i, _T.COLUMN_WISE, 1)  # whole again
            if _allows(p, i, _T.TABLE_WISE):
                s.kinds[i] = _T.TABLE_WISE
        for jj, rr in enumerate(s.ranks[i]):
            add(i, jj, rr, +1.0)
            on_rank[rr].append((i, jj))

    steps = max_steps if max_steps is not None else 20 * sum(len(r) for r in s.ranks) + 200
    for _ in range(steps):
        r = int(np.argmax(s.load))
        top = float(s.load[r])
        if top <= good_enough:
            return
        best: list[Any] = [top * (1 - 1e-7), None]  # the new max of the pair must beat this
        free = p.capacity - s.mem

        def offer(new: float, action: tuple) -> None:
            if new < best[0]:
                best[0], best[1] = new, action

        for i, j in sorted(on_rank[r]):
            f, x = s.fits[i], s.sizes[i][j]
            c, m = f.a + f.b * x, f.am + f.bm * x
            ok = allowed(i, j)
            # move the shard to the least loaded rank with room
            okm = ok & (free >= m)
            if okm.any():
                r2 = int(np.argmin(np.where(okm, s.load, np.inf)))
                offer(max(s.load[r2] + c, top - c), ("move", i, j, r2))
            # swap it for a cheaper shard of one of the least loaded ranks
            for r2 in least_loaded(s.load, ok, 8):
                for i2, j2 in on_rank[r2]:
                    f2 = s.fits[i2]
                    c2 = f2.a + f2.b * s.sizes[i2][j2]
                    if c2 >= c or i2 == i:
                        continue
                    new = max(top - c + c2, s.load[r2] - c2 + c)
                    if new >= best[0]:
                        continue
                    m2 = f2.am + f2.bm * s.sizes[i2][j2]
                    if free[r2] + m2 < m or free[r] + m < m2 or not _may_take(p, s, i2, j2, r, host):
                        continue
                    offer(new, ("swap", i, j, r2, i2, j2))
            # shift rows/columns to another shard of the same table
            if len(s.ranks[i]) > 1 and f.b > 0 and not _fixed_rows(p, s, i):
                others = [(j2, r2) for j2, r2 in enumerate(s.ranks[i]) if j2 != j]
                for j2, r2 in others:
                    dx = min(_floor((top - s.load[r2]) / (2 * f.b), f.step), x - f.step)
                    if f.bm > 0:
                        dx = min(dx, _floor(free[r2] / f.bm, f.step))
                    if dx >= f.step:
                        offer(max(top - f.b * dx, s.load[r2] + f.b * dx), ("resize", i, j, j2, dx))
            # merge the shard into another shard of the same table (saves its fixed cost)
            if len(s.ranks[i]) > 1 and _may_merge(p, s, i):
                # the last two column pieces merge into the table whole, at its own price
                whole = (p.prices.affine(i, _T.COLUMN_WISE, 1)
                         if len(s.ranks[i]) == 2 and s.kinds[i] is _T.COLUMN_WISE else None)  # fmt: skip
                for j2, r2 in enumerate(s.ranks[i]):
                    if j2 == j:
                        continue
                    if whole is None:
                        grow, room = f.b * x, f.bm * x
                    else:
                        x2 = s.sizes[i][j2]
                        grow = whole.a + whole.b * (x + x2) - (f.a + f.b * x2)
                        room = whole.am + whole.bm * (x + x2) - (f.am + f.bm * x2)
                    if free[r2] >= room:
                        offer(max(top - c, s.load[r2] + grow), ("merge", i, j, j2))
            # peel part of the shard off onto a new rank (both parts priced as pieces: g)
            if f.b > 0 and x >= 2 * f.step and _may_split(p, s, i):
                okp = allowed(i, None)
                g = _grown_fit(p, s, i)
                more = _everywhere_step(p, s, i, +1)  # a row-wise piece's copies on every rank
                if okp.any() and g.b > 0 and float(free.min()) >= more:
                    r2 = int(np.argmin(np.where(okp, s.load, np.inf)))
                    rest = top - c + g.a + g.b * x  # this rank, with the whole shard a piece
                    dx = _floor((rest - s.load[r2] - g.a) / (2 * g.b), g.step)
                    dx = max(g.step, min(dx, x - g.step))
                    if (free[r2] >= g.am + g.bm * dx + more
                            and free[r] >= (g.am - f.am) + (g.bm - f.bm) * x + more):  # fmt: skip
                        new = max(rest - g.b * dx, s.load[r2] + g.a + g.b * dx)
                        offer(new, ("peel", i, j, r2, dx))
        action = best[1]
        if action is None:
            return
        if action[0] == "move":
            relocate(*action[1:])
        elif action[0] == "swap":
            _, i, j, r2, i2, j2 = action
            relocate(i, j, r2)
            relocate(i2, j2, r)
        elif action[0] == "resize":
            resize(*action[1:])
        elif action[0] == "merge":
            merge(*action[1:])
        else:
            peel(*action[1:])


def least_loaded(load: np.ndarray, ok: np.ndarray, k: int) -> list[int]:
    """Up to k of the ranks where `ok`, least loaded first, ties to the lower rank: what a
    stable sort of the world would give, in O(W)."""
    masked = np.where(ok, load, np.inf)
    count = int(np.count_nonzero(ok))
    k = min(k, count)
    if k == 0:
        return []
    if k == count:
        chosen = np.flatnonzero(ok)
    else:
        kth = np.partition(masked, k - 1)[k - 1]
        take = masked < kth
        take[np.flatnonzero(masked == kth)[: k - int(np.count_nonzero(take))]] = True
        chosen = np.flatnonzero(take)  # in rank order, so a stable sort breaks ties by rank
    return chosen[np.argsort(masked[chosen], kind="stable")].tolist()


def _everywhere_step(p: Problem, s: State, i: int, dk: int) -> float:
    """What every rank's memory changes by when table i gains (dk = +1) or loses (-1) a
    shard: a row-wise piece's low-precision copies (`ShardPrices.everywhere`); 0 for
    column pieces, whose columns add up to the table's width whatever their number."""
    kind, k = s.kinds[i], len(s.ranks[i])
    if kind is not _T.ROW_WISE:
        return 0.0
    return p.prices.everywhere(i, kind, k + dk) - p.prices.everywhere(i, kind, k)


def _may_take(p: Problem, s: State, i2: int, j2: int, r: int, host: int) -> bool:
    """Whether shard j2 of table i2 may live on rank r (memory is checked by the caller)."""
    if p.pins[i2] is not None and not p.pins[i2][r]:
        return False
    if r in s.ranks[i2]:
        return False
    return not (s.kinds[i2] is _T.TABLE_ROW_WISE and r // host != s.ranks[i2][j2] // host)


def _grown_fit(p: Problem, s: State, i: int) -> Affine:
    """The shard price of table i once it has one more shard: a column-wise piece's for a
    table- or column-wise table (Note [how the search works]), else its own."""
    if s.kinds[i] in (_T.TABLE_WISE, _T.COLUMN_WISE):
        return p.prices.affine(i, _T.COLUMN_WISE, 2)
    return s.fits[i]


def _fixed_rows(p: Problem, s: State, i: int) -> bool:
    """Whether table i's rows stay as placed: TorchRec's block split (Note [plans TorchRec runs
    unchanged] in planners/options.py)."""
    return p.candidates.torchrec and s.kinds[i] in (_T.ROW_WISE, _T.TABLE_ROW_WISE)


def _may_split(p: Problem, s: State, i: int) -> bool:
    """Whether table i may get one more shard: column-wise (from table- or column-wise) or
    row-wise, within its constraint; table-row-wise keeps its shard count (its price depends
    on it)."""
    kind = s.kinds[i]
    if kind not in (_T.TABLE_WISE, _T.COLUMN_WISE, _T.ROW_WISE) or _fixed_rows(p, s, i):
        return False
    grown = _T.ROW_WISE if kind is _T.ROW_WISE else _T.COLUMN_WISE
    con = p.constraints[i]
    if con is None:
        return True
    if not con.allows(grown):
        return False
    return con.max_shards is None or len(s.ranks[i]) + 1 <= con.max_shards


def _allows(p: Problem, i: int, kind: ShardingType) -> bool:
    con = p.constraints[i]
    return con is None or con.allows(kind)


def _may_merge(p: Problem, s: State, i: int) -> bool:
    """Whether table i may lose a shard: row- or column-wise above its min_shards (table-row-wise
    keeps its shard count)."""
    if s.kinds[i] not in (_T.COLUMN_WISE, _T.ROW_WISE) or _fixed_rows(p, s, i):
        return False
    con = p.constraints[i]
    remaining = len(s.ranks[i]) - 1
    if s.kinds[i] is _T.ROW_WISE and remaining < 2:
        return False  # one row-wise shard is a table-wise table: leave that to the packing
    return con is None or remaining >= con.min_shards
