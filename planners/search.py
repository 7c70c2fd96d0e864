"""The search: pick a candidate per table, pack the shards onto ranks, then improve by local moves.

Note [how the search works]
1. `options.enumerate_candidates` prices every (type, shard count) of every table, and
   `options.lower_bound` gives T_lb, a lower bound on the slowest rank (Note [the lower bound]).
2. For each target T in T_lb * (1, 1.01, 1.03, ...), every table takes its cheapest-in-total
   candidate whose largest shard is <= T (`options.select`): a low target splits big tables
   finely (more total work, easier to balance), a high one keeps them whole.
3. The shards are packed largest first (by max(cost / T, memory / capacity)) onto the least
   loaded ranks that have memory for them and that the table's pins allow; a table that does
   not fit this way tries its other candidates, cheapest first. Data-parallel tables add the
   same cost and memory to every rank, where every rank has room (else the table tries its
   sharded candidates); a placement's low-precision copies on every rank are charged with it
   (`everywhere`). If no target packs, the same runs again choosing the ranks with the most
   free memory instead of the least loaded ones.
4. Local search on the slowest rank (planners/refine.py): move a shard away, swap it for a
   smaller one, shift rows or columns to another shard of the same table, or peel part of a
   shard off onto a new rank -- whichever leaves both ranks lowest, while that is below the
   current maximum. Shard prices are affine in the shard's rows (columns), so every move is
   priced exactly.
5. The best plan over all targets wins. Everything is ordered by (value, index), so the same
   input gives the same plan.

Note [where the sweep stops]
Below 2**20 tables x ranks every target of step 2 is packed both ways (well under a second at
1,000 x 256). From there on a fill costs up to a second (10,000 tables on 4,096 ranks: a dozen
wrap-arounds of 10,000 tables while bisecting the cap), so a fill runs only for targets up to the
slowest rank of the best plan found so far, and gives up once a cap at least that high has
failed: its plan would be slower, and at these sizes the local search takes a filled plan down by
a fraction of a percent at most. The spread still runs for every target: it costs a tenth of a
fill, and the local search can take a coarse target's spread far below it (3,000 tables on 2,048
ranks: target 1.10x the bound packed at 1.097x and ended at 1.062x, beating every plan of the
targets below it). On 31 frontier inputs (the benchmark's tables and tests/planners' at 1,200 to
10,000 tables on 1,024 to 4,096 ranks, three optimizer settings) this gave the full sweep's plan
every time, in a quarter to a sixth of its time.

Note [probing for a fit]
When `plan` tiers tables by itself (Note [choosing tiers]) it asks a dozen times whether a plan
fits, and keeps the plan of one answer only. A probe (`search(..., probe=True)`, after
`short_of_room`) gives the answer a search would, for less:
- A search plans iff one of its packs places every table: the local search only moves what is
  placed, and the fills it skips above the best plan's load are skipped only once a pack has
  placed everything. So a probe returns the first packing that places every table, unrefined.
- A pack that leaves a table without room has failed whatever it does with the rest, and only
  the search's first failing pack's leftovers are read (the error names them, when no pack
  places every table). So every other pack returns at its first table without room.
- A pack charges each table at least the fewest bytes of its candidates in all (its shards, and
  what it adds to every rank; a fill's pieces, 1 to W of them, at least those of the table whole
  or cut in two or W), and packs no rank beyond its capacity. So when those bytes exceed the
  ranks' room in all, no pack places every table, and `short_of_room` says so before the lower
  bound and the packs (the probes that fail, most of them, say so here).
`choose_tiers` probes its bisection and its ladder, then runs one full search, for the count and
the load factor it chose: the plan a full search at every step gave. Separately, `_LeastLoaded`
backs off to the scan under tight memory (the same rank, without popping the full ranks).
"""

from __future__ import annotations

import heapq
from typing import Iterator, NamedTuple, Sequence

import numpy as np

from planners.cost import CostModel, TableArrays
from planners.mc_cost import collision_price
from planners.inputs import Table, TableConstraint
from planners.options import Candidates, column_unit, select
from planners.prices import ShardPrices
from planners.refine import Problem, State, least_loaded, refine
from planners.types import ShardingType, block_split, even_split

__all__ = ["Placement", "SearchOutcome", "search", "shard_sizes", "short_of_room"]

_T = ShardingType
_TARGETS = (1.0, 1.01, 1.03, 1.06, 1.1, 1.15, 1.25, 1.4, 1.7, 2.0, 3.0, float("inf"))
_FRONTIER = 1 << 20  # tables x ranks from which the sweep stops early (Note [where the sweep stops])


class Placement(NamedTuple):
    """Where one table went: its type, the rank of each shard, and each shard's rows/columns."""

    kind: ShardingType
    ranks: tuple[int, ...]
    sizes: tuple[int, ...]  # rows (RW, TWRW) or columns (CW) per shard; () for TW and DP


class SearchOutcome(NamedTuple):
    """The best packing found, or the tables that could not be placed."""

    placements: tuple[Placement, ...] | None
    max_load: float
    unplaced: tuple[int, ...]  # indices of tables that found no room, when placements is None


def shard_sizes(table: Table, kind: ShardingType, k: int) -> tuple[int, ...]:
    """Columns (TW, CW) or rows (RW, TWRW) of each of the `k` even shards; () for DP."""
    if kind is _T.TABLE_WISE:
        return (table.embedding_dim,)
    if kind is _T.COLUMN_WISE:
        unit = column_unit(table.embedding_dim)
        return tuple(unit * s for s in even_split(table.embedding_dim // unit, k))
    if kind in (_T.ROW_WISE, _T.TABLE_ROW_WISE):
        return even_split(table.num_embeddings, k)
    return ()


def largest_shard(table: Table, kind: ShardingType, k: int) -> int:
    """`max(shard_sizes(table, kind, k))` without the sizes (even splits: the first is largest)."""
    if kind is _T.COLUMN_WISE:
        unit = column_unit(table.embedding_dim)
        return unit * -(-(table.embedding_dim // unit) // k)
    if kind in (_T.ROW_WISE, _T.TABLE_ROW_WISE):
        return -(-table.num_embeddings // k)
    return table.embedding_dim


def _room_everywhere(p: Problem, s: State, extra: float) -> bool:
    """Whether every rank has room for `extra` more bytes (a data-parallel copy, or low-precision
    copies)."""
    return float(s.mem.max()) + extra <= p.capacity


def _choose_ranks(p: Problem, s: State, index: int, kind: ShardingType, mems: list[float],
                  by_memory: bool, extra: float = 0.0) -> list[int] | None:  # fmt: skip
    """The ranks for the shards of one table, least loaded first, or None if they do not fit;
    `extra` bytes go to every rank with them."""
    world = len(s.load)
    if extra and not _room_everywhere(p, s, extra):
        return None  # (with nothing extra, every rank is within capacity already)
    fits = (s.mem + extra + max(mems) if extra else s.mem + max(mems)) <= p.capacity
    if p.pins[index] is not None:
        fits &= p.pins[index]
    key = s.mem if by_memory else s.load
    k = len(mems)
    if kind is _T.TABLE_ROW_WISE:
        host = world // p.model.topology.hosts
        masked = np.where(fits, key, np.inf).reshape(-1, host)
        order = np.argsort(masked, axis=1, kind="stable")[:, :k]
        kth = np.take_along_axis(masked, order, axis=1)[:, -1]
        if not np.isfinite(kth.min()):
            return None
        h = int(np.argmin(kth))
        return [int(h * host + r) for r in order[h]]
    if k == 1:
        r = int(np.argmin(np.where(fits, key, np.inf)))
        return [r] if fits[r] else None
    chosen = least_loaded(key, fits, k)
    return chosen if len(chosen) == k else None


class _LeastLoaded:
    """The rank `_choose_ranks` picks for a one-shard table (least loaded with room, then the
    lowest rank), from a heap of (load, rank) kept beside `State.load` instead of a scan of the
    world per table. Loads only grow while packing, so an entry whose load is no longer its
    rank's is stale and dropped; `touched` adds a rank's new load. Under tight memory most
    ranks lack room, and popping them costs more than the scan: after a pick gives up, the next
    1, 2, 4, ... (at most `_BACKOFF`) picks go straight to the scan, which picks the same rank."""

    _SCAN = 64  # ranks without room popped before the scan is cheaper
    _BACKOFF = 256

    def __init__(self, load: np.ndarray) -> None:
        self.load = load
        self.heap = list(zip(load.tolist(), range(len(load))))
        heapq.heapify(self.heap)
        self.skip = self.backoff = 0  # picks left to send to the scan; the last such run

    def touched(self, r: int) -> None:
        heapq.heappush(self.heap, (float(self.load[r]), r))

    def pick(self, mem: np.ndarray, need: float, capacity: float) -> int | None:
        """The rank, -1 if no rank has room, None if many have none (then scan)."""
        if self.skip:
            self.skip -= 1
            return None
        heap, aside, found = self.heap, [], -1
        while heap:
            load, r = heap[0]
            if load != self.load[r]:
                heapq.heappop(heap)
            elif mem[r] + need <= capacity:
                found = r
                break
            else:
                aside.append(heapq.heappop(heap))
                if len(aside) > self._SCAN:
                    found = None
                    break
        for entry in aside:
            heapq.heappush(heap, entry)
        self.backoff = 0 if found is not None else min(2 * self.backoff or 1, self._BACKOFF)
        self.skip = self.backoff
        return found


def _tries(c: Candidates, i: int, first: tuple[ShardingType, int]) -> Iterator[tuple]:
    """The chosen candidate, then the table's other sharded candidates, cheapest first."""
    yield first
    for option in c.by_total(i):
        if option != first:
            yield option


def _splittable(p: Problem, i: int, kind: ShardingType) -> bool:
    """Whether the fill packing may cut table i into column shards of any width it likes."""
    con = p.constraints[i]
    if kind not in (_T.TABLE_WISE, _T.COLUMN_WISE):
        return False
    return con is None or (con.allows(_T.COLUMN_WISE) and not con.ranks and con.min_shards == 1
                           and con.max_shards is None and con.allows(_T.TABLE_WISE))  # fmt: skip


def _wrap(p: Problem, s: State, items: list[int], cap: float) -> list | None:
    """McNaughton's wrap-around with a price per piece: fill the ranks, emptiest first, up to
    `cap` seconds each, cutting tables into column shards where a rank is full. Returns
    [(table, [(rank, columns), ...]), ...], or None if `cap` is too low."""
    order = np.lexsort((np.arange(len(s.load)), s.load)).tolist()
    load, mem = s.load.tolist(), s.mem.tolist()  # Python floats: the same IEEE sums, faster
    wholes, parts = p.prices.of(_T.COLUMN_WISE, 1), p.prices.of(_T.COLUMN_WISE, 2)
    capacity, ranks, inf = p.capacity, len(order), float("inf")
    pos, out = 0, []
    for i in items:
        left, pieces = p.tables[i].embedding_dim, []
        while left > 0:
            if pos >= ranks:
                return None
            r = order[pos]
            # Whole where it fits; once cut, every piece pays the price of a piece.
            a, b, am, bm, step = wholes[i] if not pieces else parts[i]
            free = min((cap - load[r] - a) / b if b > 0 else inf,
                       (capacity - mem[r] - am) / bm if bm > 0 else inf)  # fmt: skip
            if not pieces and free < left:
                a, b, am, bm, step = parts[i]
                free = min((cap - load[r] - a) / b if b > 0 else inf,
                           (capacity - mem[r] - am) / bm if bm > 0 else inf)  # fmt: skip
            take = left if free >= left else max(0, int(free // step) * step)
            if take > 0:
                pieces.append((r, take))
                load[r] += a + b * take
                mem[r] += am + bm * take
                left -= take
                if left == 0 and cap - load[r] > a:
                    break  # room is left on this rank for the next table
            pos += 1
        out.append((i, pieces))
    return out


def _fill(p: Problem, s: State, items: list[int], bound: float, ceiling: float = np.inf) -> bool:
    """Places the splittable `items` by `_wrap` at the lowest cap that works (bisection); gives
    up (False) once a cap of `ceiling` or more fails (Note [where the sweep stops])."""
    if not items:
        return True
    base = max(bound, float(s.load.max()))
    low, high, best, grow = base, None, None, 0.005
    while grow < 8:  # find a cap that works, doubling the headroom
        best = _wrap(p, s, items, base * (1 + grow))
        if best is not None:
            high = base * (1 + grow)
            break
        low = base * (1 + grow)
        if low >= ceiling:
            return False
        grow *= 2
    if best is None or high is None:
        return False
    for _ in range(12):
        mid = (low + high) / 2
        trial = _wrap(p, s, items, mid)
        if trial is None:
            low = mid
        else:
            high, best = mid, trial
    for i, pieces in best:
        f = p.prices.affine(i, _T.COLUMN_WISE, len(pieces))
        s.kinds[i] = _T.TABLE_WISE if len(pieces) == 1 else _T.COLUMN_WISE
        s.ranks[i] = [r for r, _ in pieces]
        s.sizes[i] = [x for _, x in pieces]
        s.fits[i] = f
        for r, x in pieces:
            s.load[r] += f.a + f.b * x
            s.mem[r] += f.am + f.bm * x
    return True


def _pack(p: Problem, choice: np.ndarray, target: float, mode: str,
          ceiling: float = np.inf, stop: bool = False) -> tuple[State, list]:  # fmt: skip
    """Packs the chosen candidates: mode "spread" (least loaded ranks first), "memory" (most
    free memory first) or "fill" (fixed shards spread, then the rest by `_fill`, which gives up
    above `ceiling`). `stop`: return at the first table that finds no room, with it alone as
    unplaced (Note [probing for a fit])."""
    by_memory = mode == "memory"
    c = p.candidates
    world = p.model.topology.world_size
    n = len(p.tables)
    s = State.empty(n, world, p.base_memory)
    picked = [c.option(int(j)) for j in choice]
    for i, (kind, _) in enumerate(picked):
        if kind is _T.DATA_PARALLEL:
            f = p.prices.affine(i, kind, 1)
            add = f.am + p.prices.everywhere(i, kind, 1)
            if not _room_everywhere(p, s, add):
                continue  # no room for another data-parallel copy: a sharded candidate below, if any
            s.load += f.a
            s.mem += add
            s.kinds[i] = kind
    rows = np.arange(n)
    weight = np.maximum(c.cost_of(choice) / max(target, 1e-30),
                        c.memory_of(choice) / p.capacity)  # fmt: skip
    unplaced: list[int] = []
    order = [int(i) for i in np.lexsort((rows, -weight))]
    later = [i for i in order if mode == "fill" and _splittable(p, i, picked[i][0])]
    deferred = set(later)
    least = None if by_memory else _LeastLoaded(s.load)
    wholes = p.prices.of(_T.TABLE_WISE, 1)
    for i in order:
        if s.kinds[i] is _T.DATA_PARALLEL or i in deferred:
            continue
        if least is not None and picked[i][0] is _T.TABLE_WISE and p.pins[i] is None:
            # the common case, without a scan of the world: what _choose_ranks would pick
            f, d = wholes[i], p.tables[i].embedding_dim
            r = least.pick(s.mem, f.am + f.bm * d, p.capacity)
            if r is not None and r >= 0:
                s.kinds[i], s.ranks[i], s.sizes[i], s.fits[i] = _T.TABLE_WISE, [r], [d], f
                s.load[r] += f.a + f.b * d
                s.mem[r] += f.am + f.bm * d
                least.touched(r)
                continue
        ranks = None
        lowest = float(s.mem.min())  # the rank with the most room
        for kind, k in _tries(c, i, picked[i]):
            if kind is _T.DATA_PARALLEL:
                continue  # a data-parallel copy that did not fit above
            f = p.prices.affine(i, kind, k)
            extra = p.prices.everywhere(i, kind, k)
            if lowest + extra + (f.am + f.bm * largest_shard(p.tables[i], kind, k)) > p.capacity:
                continue  # no rank has room for its largest shard: _choose_ranks would say so
            sizes = list(shard_sizes(p.tables[i], kind, k))
            mems = [f.am + f.bm * x for x in sizes]
            ranks = _choose_ranks(p, s, i, kind, mems, by_memory, extra)
            if ranks is not None:
                break
        if ranks is None:
            unplaced.append(i)
            if stop:
                return s, unplaced
            continue
        if c.torchrec and kind in (_T.ROW_WISE, _T.TABLE_ROW_WISE):
            # TorchRec's layout: block i on the i-th rank (Note [plans TorchRec runs unchanged])
            ranks, sizes = sorted(ranks), list(block_split(p.tables[i].num_embeddings, k))
        s.kinds[i], s.ranks[i], s.sizes[i], s.fits[i] = kind, ranks, sizes, f
        if extra:
            s.mem += extra
        for r, x in zip(ranks, sizes):  # the biggest shard goes to the least loaded rank
            s.load[r] += f.a + f.b * x
            s.mem[r] += f.am + f.bm * x
            if least is not None:
                least.touched(r)
    if later and not unplaced and not _fill(p, s, later, target, ceiling):
        unplaced = later
    return s, unplaced


def _fewest_bytes(p: Problem) -> np.ndarray:
    """Per table, the fewest bytes any pack of `p` charges the ranks for it (Note [probing for a
    fit]): the least over its valid candidates of its shards' bytes and what it adds to every
    rank, and over the pieces a fill may cut it into (1 to W)."""
    c, prices, t = p.candidates, p.prices, p.arrays
    world = p.model.topology.world_size

    def everywhere(kind: ShardingType, k: int) -> np.ndarray | float:
        return p.model.everywhere_bytes(kind, t, float(k)) if p.model.wire_bytes else 0.0

    whole, piece = prices.bytes_of(_T.COLUMN_WISE, 1), prices.bytes_of(_T.COLUMN_WISE, 2)
    cut = np.minimum(2 * piece[0], world * piece[0]) + piece[1] * t.dim  # 2..W pieces of a fill
    filled = np.array([_splittable(p, i, _T.TABLE_WISE) for i in range(len(t.rows))], dtype=bool)
    least = np.where(filled, np.minimum(whole[0] + whole[1] * t.dim, cut), np.inf)
    for j, (kind, k) in enumerate(c.columns):
        if not c.valid[:, j].any():
            continue
        if kind is _T.DATA_PARALLEL:
            am, _ = prices.bytes_of(kind, 1)
            need = world * (am + everywhere(kind, 1))
        else:
            am, bm = prices.bytes_of(kind, k)
            size = t.dim if kind in (_T.TABLE_WISE, _T.COLUMN_WISE) else t.rows
            need = k * am + bm * size + world * everywhere(kind, k)
        least = np.where(c.valid[:, j], np.minimum(least, need), least)
    rw = c.row_wise
    live = np.flatnonzero(rw.lo <= rw.hi)
    if len(live):  # k shards' bytes are affine in k: the least is at an end of lo..hi
        am, bm = prices.bytes_of(_T.ROW_WISE, 2)
        ends = []
        for k in (rw.lo[live], rw.hi[live]):
            extra = p.model.everywhere_bytes(_T.ROW_WISE, t.take(live), k.astype(np.float64))
            ends.append(k * am[live] + bm[live] * t.rows[live] + world * extra)
        least[live] = np.minimum(least[live], np.minimum(*ends))
    return least


def _placements(s: State) -> tuple[Placement, ...]:
    out = []
    for kind, ranks, sizes in zip(s.kinds, s.ranks, s.sizes):
        if kind is _T.DATA_PARALLEL:
            out.append(Placement(kind, (), ()))
        elif kind is _T.TABLE_WISE:
            out.append(Placement(kind, tuple(ranks), ()))
        elif kind is _T.COLUMN_WISE:
            out.append(Placement(kind, tuple(ranks), tuple(sizes)))
        else:
            # row blocks follow rank order (TorchRec lays them out so); sizes travel with ranks
            pairs = sorted(zip(ranks, sizes))
            out.append(Placement(kind, tuple(r for r, _ in pairs), tuple(x for _, x in pairs)))
    return tuple(out)


def _problem(tables: Sequence[Table], model: CostModel, candidates: Candidates,
             constraints: Sequence[TableConstraint | None], capacity: float) -> Problem:  # fmt: skip
    world = model.topology.world_size
    pins = []
    for con in constraints:
        if con is None or not con.ranks:
            pins.append(None)
        else:
            mask = np.zeros(world, dtype=bool)
            mask[list(con.ranks)] = True
            pins.append(mask)
    arrays = TableArrays.of(tables, [None if c is None else c.tier for c in constraints])
    return Problem(tables, arrays, model, candidates, tuple(constraints), tuple(pins), capacity,
                   model.batch_buffer_bytes(arrays) + collision_price(tables, model).reserve,
                   ShardPrices(model, arrays))  # fmt: skip


def short_of_room(tables: Sequence[Table], model: CostModel, candidates: Candidates,
                  constraints: Sequence[TableConstraint | None], capacity: float) -> bool:  # fmt: skip
    """Whether the tables' candidates need more bytes in all than the ranks have, so that no
    pack places them all (Note [probing for a fit])."""
    p = _problem(tables, model, candidates, constraints, capacity)
    room = model.topology.world_size * (capacity - p.base_memory)
    return float(_fewest_bytes(p).sum()) > room * (1 + 1e-9)  # far above the packs' rounding


def search(
    tables: Sequence[Table],
    model: CostModel,
    candidates: Candidates,
    constraints: Sequence[TableConstraint | None],
    capacity: float,
    bound: float,
    *,
    probe: bool = False,
) -> SearchOutcome:
    """Runs Note [how the search works] and returns the best packing (or what did not fit).
    `probe`: only whether a plan fits (Note [probing for a fit]): the first packing that
    places every table, unrefined, or None with one table that found no room."""
    world = model.topology.world_size
    p = _problem(tables, model, candidates, constraints, capacity)
    best: tuple[float, tuple[Placement, ...]] | None = None
    first_unplaced: tuple[int, ...] = ()
    seen: set[bytes] = set()
    # Note [where the sweep stops]: at the frontier sizes, no fill for targets above the best
    # plan's slowest rank
    frontier = len(tables) * world >= _FRONTIER
    choices: dict[float, np.ndarray] = {}
    for modes in (("spread", "fill"), ("memory",)):
        for factor, mode in ((f, m) for f in _TARGETS for m in modes):
            target = bound * factor
            if frontier and mode == "fill" and best is not None and target > best[0]:
                continue
            if factor not in choices:
                choices[factor] = select(candidates, target)
            choice = choices[factor]
            key = choice.tobytes() + mode.encode()
            if key in seen:
                continue
            seen.add(key)
            ceiling = best[0] if frontier and best is not None else np.inf
            # only the first pack's leftovers are read (for the error), and only if none fits
            stop = probe or best is not None or bool(first_unplaced)
            s, unplaced = _pack(p, choice, target, mode, ceiling, stop)
            if unplaced:
                first_unplaced = first_unplaced or tuple(sorted(unplaced))
                continue
            if probe:
                return SearchOutcome(_placements(s), float(s.load.max()), ())
            refine(p, s, good_enough=bound * 1.0005)  # within 0.05% of optimal: done
            top = float(s.load.max())
            if best is None or top < best[0] * (1 - 1e-12):
                best = (top, _placements(s))
        if best is not None:
            break
    if best is None:
        return SearchOutcome(None, float("inf"), first_unplaced)
    return SearchOutcome(best[1], best[0], ())
