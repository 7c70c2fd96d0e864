"""Candidate placements of every table, priced at once, and the lower bound they imply.

A candidate is a (sharding type, shard count) pair: table-wise; column-wise over 2..W shards;
table-row-wise over 2..H ranks of one host; row-wise over 2..W ranks; data-parallel. For n
tables and the m candidates other than row-wise the prices are (n, m) arrays, with `valid` false
where a candidate does not apply (too few rows or columns, a constraint forbids it, a shard does
not fit in memory); row-wise ones, up to 4,096 shard counts a table, are priced in closed form
(`RowWise`, Note [row-wise candidates in closed form] in planners/row_wise.py).

Note [the lower bound]
Whatever the plan, (1) the slowest rank is at least as slow as the largest shard it holds, and
(2) it is at least as slow as the mean rank, total work / W. Let T* be the optimum. Every table's
chosen candidate then has its largest shard <= T*, so the total work is at least
f(T*) = sum over tables of min{total(t, o) : maxshard(t, o) <= T*}, and f(T*) <= W * T*.
f is a non-increasing step function, so the smallest T with f(T) <= W * T is a lower bound on
T*; `lower_bound` finds it exactly by bisection over the breakpoints of f. A shard's price is
affine in its rows (columns), so the total of k shards does not depend on how the table is
split, and the largest of k shards has at least ceil(N / k) rows, or ceil(d / 4k) * 4 columns
when column shards are multiples of 4 columns (FBGEMM's kernels need dim % 4 == 0, and
TorchRec's planner keeps to it too). So the bound holds for every plan under this cost model,
TorchRec's included. It ignores memory packing and pinned ranks, which can only raise the
optimum.

Note [plans TorchRec runs unchanged]
`plan(..., torchrec_compatible=True)` keeps only candidates that `to_torchrec` converts as they
are, with no `TorchRecLayoutWarning` and no moved row (Note [row-wise layouts in TorchRec] and
Note [column pieces in TorchRec] in planners/torchrec_interop.py), under its default fused kernel
on any device: row-wise over every rank of the world and table-row-wise over every rank of one
host, each in TorchRec's block split (ceil(N / n) rows per rank in rank order) with no empty
block (fbgemm's fused CPU kernel fails on one); column pieces of multiples of 4 columns (as
always); a table whose width is no multiple of 4 only data-parallel. The search then never
resizes, merges or peels a row-wise or table-row-wise table's shards. A block split's largest
shard is the even split's, so every remaining candidate costs what it did, and the lower bound
is the restricted problem's (reported as such); `plan_stats` with `torchrec_compatible=True`
gives the same.
"""

from __future__ import annotations

from typing import Iterator, NamedTuple, Sequence

import numpy as np

from planners.cost import CostModel, TableArrays
from planners.inputs import Table, TableConstraint
from planners.row_wise import RowWise, whole_blocks
from planners.types import ShardingType

__all__ = ["Candidates", "column_unit", "enumerate_candidates", "lower_bound", "select"]

_T = ShardingType


def column_unit(dim: int) -> int:
    """Column shards are multiples of 4 columns (FBGEMM's kernels want dim % 4 == 0) when
    the table's dim allows it, else of 1."""
    return 4 if dim % 4 == 0 else 1


class Candidates(NamedTuple):
    """Every candidate of every table. The explicit ones, `columns[j]` = (type, shards), are
    priced in (tables, m) arrays; the row-wise ones, any of 2..min(W, N) shards, in closed form
    by `row_wise` (Note [row-wise candidates in closed form] in planners/row_wise.py). A choice of
    candidate per table is a code: j for `columns[j]`, `m + k` for row-wise over k."""

    columns: tuple[tuple[ShardingType, int], ...]
    valid: np.ndarray  # allowed, shape ok, largest shard fits in memory
    allowed: np.ndarray  # allowed by constraints and the table's shape, memory ignored
    max_cost: np.ndarray  # seconds of the largest shard (the even split the search emits)
    total: np.ndarray  # seconds summed over all shards (W copies for data-parallel)
    # bytes the largest shard needs on its rank, with what the placement adds to every rank
    # (`CostModel.everywhere_bytes`: row-wise pieces' low-precision copies; less for a
    # data-parallel copy)
    max_memory: np.ndarray
    row_wise: RowWise
    torchrec: bool = False  # only what TorchRec runs as planned (Note [plans TorchRec runs unchanged])

    @property
    def row_wise_base(self) -> int:
        return len(self.columns)

    def any_valid(self) -> np.ndarray:
        """Per table, whether any candidate's largest shard fits."""
        return self.valid.any(axis=1) | (self.row_wise.lo <= self.row_wise.hi)

    def option(self, code: int) -> tuple[ShardingType, int]:
        """The (type, shards) of a choice code."""
        if code < self.row_wise_base:
            return self.columns[code]
        return (_T.ROW_WISE, int(code - self.row_wise_base))

    def _split(self, choice: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        rw = np.flatnonzero(choice >= self.row_wise_base)
        return rw, choice[rw] - self.row_wise_base

    def cost_of(self, choice: np.ndarray) -> np.ndarray:
        """Seconds of the largest shard of each table's chosen candidate."""
        rows = np.arange(len(choice))
        out = self.max_cost[rows, np.minimum(choice, self.row_wise_base - 1)].copy()
        rw, k = self._split(choice)
        if len(rw):
            out[rw] = self.row_wise.cost(rw, k)
        return out

    def memory_of(self, choice: np.ndarray) -> np.ndarray:
        """Bytes of the largest shard of each table's chosen candidate (`max_memory`)."""
        rows = np.arange(len(choice))
        out = self.max_memory[rows, np.minimum(choice, self.row_wise_base - 1)].copy()
        rw, k = self._split(choice)
        if len(rw):
            out[rw] = self.row_wise.memory(rw, k)
        return out

    def by_total(self, i: int) -> Iterator[tuple[ShardingType, int]]:
        """Table i's valid sharded candidates (not data-parallel), cheapest in total first;
        ties in the order of the columns, row-wise after the explicit ones."""
        rw = self.row_wise
        explicit = [(float(self.total[i, j]), j) for j in np.flatnonzero(self.valid[i])
                    if self.columns[j][0] is not _T.DATA_PARALLEL]  # fmt: skip
        explicit.sort()
        pos, k0, hi = 0, int(rw.lo[i]), int(rw.hi[i])
        while k0 <= hi:  # the row-wise counts that fit, in order, merged with the explicit ones
            ks, fits, totals = rw.chunk(i, k0)
            for k, rw_total in zip(ks[fits].tolist(), totals[fits].tolist()):
                while pos < len(explicit) and explicit[pos][0] <= rw_total:
                    yield self.columns[explicit[pos][1]]
                    pos += 1
                yield (_T.ROW_WISE, k)
            k0 += len(ks)
        for _, j in explicit[pos:]:
            yield self.columns[j]

    def smallest_memory(self, i: int, *, allowed_only: bool) -> float:
        """The fewest bytes a largest shard of table i needs, over its allowed candidates
        (`allowed_only`) or its valid ones."""
        mask = self.allowed[i] if allowed_only else self.valid[i]
        best = float(np.min(np.where(mask, self.max_memory[i], np.inf)))
        rw = self.row_wise
        lo, hi = (rw.allowed_lo[i], rw.allowed_hi[i]) if allowed_only else (rw.lo[i], rw.hi[i])
        if lo <= hi:  # one table, for a message: every k (a few thousand at most)
            ks = np.arange(lo, hi + 1)
            best = min(best, float(rw.memory(np.full(len(ks), i), ks).min()))
        return best


def _pinned_per_host(pins: tuple[int, ...], world: int, host: int) -> int:
    counts = np.bincount(np.array(pins, dtype=np.int64) // host, minlength=world // host)
    return int(counts.max()) if len(pins) else host


def enumerate_candidates(
    tables: Sequence[Table],
    model: CostModel,
    constraints: Sequence[TableConstraint | None],
    shard_capacity: float,
    *,
    torchrec: bool = False,
) -> Candidates:
    """Prices every candidate of every table; `shard_capacity` is the memory a rank has for
    shards. `torchrec` keeps only what TorchRec runs as planned (Note [plans TorchRec runs
    unchanged])."""
    topo = model.topology
    world, host = topo.world_size, int(topo.ranks_per_host or 1)
    arrays = TableArrays.of(tables, [None if c is None else c.tier for c in constraints])
    t2 = TableArrays(*(a[:, None] for a in arrays))
    n = len(tables)
    units = np.array([column_unit(t.embedding_dim) for t in tables], dtype=np.float64)[:, None]
    max_cw = int(min(world, max((t.embedding_dim // column_unit(t.embedding_dim)) for t in tables)))
    columns: list[tuple[ShardingType, int]] = []
    blocks = []  # (max_cost, total, max_mem, shape_ok)

    def add(kind: ShardingType, ks: np.ndarray, big_rows, big_cols, rows, cols, ok) -> None:
        big = model.shard(kind, t2, big_rows, big_cols, ks)  # the largest shard
        mean = model.shard(kind, t2, rows, cols, ks)  # an exact 1/k split: k of them = total
        shape = np.broadcast(big.total, ks).shape
        needs = big.memory + model.everywhere_bytes(kind, t2, ks)
        blocks.append((
            np.broadcast_to(big.total, shape), np.broadcast_to(mean.total * ks, shape),
            np.broadcast_to(needs, shape), np.broadcast_to(ok, shape),
        ))  # fmt: skip
        columns.extend((kind, int(k)) for k in ks.ravel())

    one = np.ones((1, 1))
    add(_T.TABLE_WISE, one, t2.rows, t2.dim, t2.rows, t2.dim, np.ones((n, 1), bool))
    ks = np.arange(2, max_cw + 1, dtype=np.float64)[None, :]
    if ks.size:
        cw_units = t2.dim / units
        add(_T.COLUMN_WISE, ks, t2.rows, units * np.ceil(cw_units / ks), t2.rows, t2.dim / ks,
            ks <= cw_units)  # fmt: skip
    ks = np.arange(2, host + 1, dtype=np.float64)[None, :]
    if ks.size:
        add(_T.TABLE_ROW_WISE, ks, np.ceil(t2.rows / ks), t2.dim, t2.rows / ks, t2.dim,
            ks <= t2.rows)  # fmt: skip
    dp = model.shard(_T.DATA_PARALLEL, t2, t2.rows, t2.dim, one)
    dp_needs = dp.memory + model.everywhere_bytes(_T.DATA_PARALLEL, t2, one)
    blocks.append((dp.total, dp.total * world, dp_needs, np.ones((n, 1), bool)))
    columns.append((_T.DATA_PARALLEL, world))

    max_cost, total, max_mem, shape_ok = (
        np.concatenate([b[i] for b in blocks], axis=1) for i in range(4)
    )
    allowed = shape_ok & _constraint_mask(columns, constraints, world, host)
    if torchrec:
        allowed &= _torchrec_mask(columns, arrays, host)
    return Candidates(
        columns=tuple(columns),
        valid=allowed & (max_mem <= shard_capacity),
        allowed=allowed,
        max_cost=max_cost,
        total=total,
        max_memory=max_mem,
        row_wise=RowWise.of(arrays, model, constraints, shard_capacity, torchrec=torchrec),
        torchrec=torchrec,
    )


def _torchrec_mask(columns: Sequence[tuple[ShardingType, int]], t: TableArrays,
                   host: int) -> np.ndarray:  # fmt: skip
    """The explicit candidates TorchRec runs as planned: a table whose width is no multiple of
    4 only data-parallel; table-row-wise only over a whole host with no empty block."""
    kinds = np.array([kind.value for kind, _ in columns])
    ks = np.array([k for _, k in columns])
    dp = kinds == _T.DATA_PARALLEL.value
    twrw = kinds == _T.TABLE_ROW_WISE.value
    fourfold = (t.dim % 4 == 0)[:, None]
    host_ok = (ks == host)[None, :] & whole_blocks(t.rows, host)[:, None]
    return dp[None, :] | (fourfold & (~twrw[None, :] | host_ok))


def _constraint_mask(
    columns: Sequence[tuple[ShardingType, int]],
    constraints: Sequence[TableConstraint | None],
    world: int,
    host: int,
) -> np.ndarray:
    kinds = [kind for kind, _ in columns]
    ks = np.array([k for _, k in columns])
    mask = np.ones((len(constraints), len(columns)), dtype=bool)
    for i, c in enumerate(constraints):
        if c is None:
            continue
        row = np.array([c.allows(kind) for kind in kinds])
        sharded = np.array([kind is not _T.DATA_PARALLEL for kind in kinds])
        row &= ~sharded | (ks >= c.min_shards)
        if c.max_shards is not None:
            row &= ~sharded | (ks <= c.max_shards)
        if c.ranks:
            row &= ~sharded | (ks <= len(c.ranks))
            twrw = np.array([kind is _T.TABLE_ROW_WISE for kind in kinds])
            row &= ~twrw | (ks <= _pinned_per_host(c.ranks, world, host))
            if len(c.ranks) < world:
                row &= sharded
        if c.cache_load_factor is not None:  # modular tiers no data-parallel copy
            row &= sharded
        mask[i] = row
    return mask


def _work(c: Candidates, cost: np.ndarray, t: float) -> tuple[float, np.ndarray]:
    """f(t), the least total work of the tables when every largest shard is <= t, and per
    table the row-wise k that gives it (0: an explicit candidate does)."""
    explicit = np.where(cost <= t, c.total, np.inf).min(axis=1)
    rows = np.arange(len(cost))
    k = c.row_wise.smallest_under(rows, t)
    some = np.flatnonzero(k)
    per_table = explicit.copy()
    if len(some):
        per_table[some] = np.minimum(explicit[some], c.row_wise.total(some, k[some]))
    return float(per_table.sum()), k


def lower_bound(c: Candidates, world_size: int) -> float:
    """The smallest T with f(T) <= W * T (Note [the lower bound]); inf if a table has no candidate.

    f steps down at the breakpoints p_0 < p_1 < ... (every candidate's largest shard); the answer
    is the first breakpoint p_j with f(p_j) <= W p_j, or f(p_{j-1}) / W where that is smaller.
    A bisection over the explicit candidates' breakpoints, then over the floats between two of
    them, keeps a point lo below the answer; from lo, the next breakpoint nb settles it when
    f(lo) / W < nb (the answer is f(lo) / W) or f(nb) <= W nb (it is nb)."""
    cost = np.where(c.valid, c.max_cost, np.inf)
    rw, rows = c.row_wise, np.arange(len(cost))
    live = np.flatnonzero(rw.lo <= rw.hi)
    cheapest, dearest = cost.min(axis=1), np.where(np.isfinite(cost), cost, -np.inf).max(axis=1)
    if len(live):  # a row-wise table's largest shard is smallest at its most shards
        cheapest[live] = np.minimum(cheapest[live], rw.cost(live, rw.hi[live]))
        dearest[live] = np.maximum(dearest[live], rw.cost(live, rw.lo[live]))
    if not np.all(np.isfinite(cheapest)):
        return float("inf")
    low, high = float(cheapest.max()), float(dearest.max())
    work = lambda t: _work(c, cost, t)[0]  # noqa: E731
    w_low = work(low)
    if w_low <= world_size * low:
        return low
    if work(high) > world_size * high:
        return work(high) / world_size
    explicit = np.unique(cost[(cost > low) & (cost < high)])
    lo_i, hi_i = -1, len(explicit)  # explicit[-1] stands for low, explicit[len] for high
    lo, w_lo, hi = low, w_low, high
    while hi_i - lo_i > 1:
        mid = (lo_i + hi_i) // 2
        w = work(float(explicit[mid]))
        if w <= world_size * explicit[mid]:
            hi_i, hi = mid, float(explicit[mid])
        else:
            lo_i, lo, w_lo = mid, float(explicit[mid]), w
    bits_lo, bits_hi = np.float64(lo).view(np.int64), np.float64(hi).view(np.int64)
    while True:
        above = np.where(cost > lo, cost, np.inf).min()
        k = rw.largest_over(rows, lo)
        some = np.flatnonzero(k)
        nb = min(float(above), float(rw.cost(some, k[some]).min())) if len(some) else float(above)
        if w_lo / world_size < nb:
            return w_lo / world_size
        if work(nb) <= world_size * nb:
            return nb
        # nb is no answer; halve what is left (positive floats order as their bits do)
        bits_lo, lo, w_lo = np.float64(nb).view(np.int64), nb, work(nb)
        mid_bits = bits_lo + (bits_hi - bits_lo) // 2
        mid = float(np.int64(mid_bits).view(np.float64))
        if mid > lo:
            w = work(mid)
            if w <= world_size * mid:
                bits_hi = mid_bits
            else:
                bits_lo, lo, w_lo = mid_bits, mid, w


def select(c: Candidates, target: float) -> np.ndarray:
    """Per table, the code of the cheapest-in-total valid candidate whose largest shard is <=
    `target` (or, where none is, of the valid candidate with the smallest largest shard); ties
    go to the earlier of TW, CW, TWRW, RW, DP, as when row-wise were explicit columns between
    TWRW and DP."""
    ok = c.valid & (c.max_cost <= target)
    choice = np.where(ok, c.total, np.inf).argmin(axis=1)
    best = np.where(ok.any(axis=1), c.total[np.arange(len(choice)), choice], np.inf)
    dp = len(c.columns) - 1  # data-parallel is the last explicit column
    rw, rows = c.row_wise, np.arange(len(choice))
    k = rw.smallest_under(rows, target)
    some = np.flatnonzero(k)
    if len(some):
        tot = rw.total(some, k[some])
        take = (tot < best[some]) | ((tot == best[some]) & (choice[some] == dp))
        choice[some[take]] = c.row_wise_base + k[some[take]]
        best[some[take]] = tot[take]
    none = ~np.isfinite(best)
    if none.any():
        choice[none] = _smallest_shard(c, np.flatnonzero(none))
    return choice


def _smallest_shard(c: Candidates, idx: np.ndarray) -> np.ndarray:
    """Codes of the valid candidates with the smallest largest shard (the first on ties)."""
    cost = np.where(c.valid[idx], c.max_cost[idx], np.inf)
    j = cost.argmin(axis=1)
    best = cost[np.arange(len(idx)), j]
    rw = c.row_wise
    live = np.flatnonzero(rw.lo[idx] <= rw.hi[idx])
    if len(live):
        least = rw.cost(idx[live], rw.hi[idx[live]])
        # the first (smallest) valid k with that least cost; a fallback, so one table at a time
        k = np.array([rw.smallest_under(np.array([i]), float(x))[0] for i, x in zip(idx[live], least)])
        dp = len(c.columns) - 1
        take = (least < best[live]) | ((least == best[live]) & (j[live] == dp))
        j[live[take]] = c.row_wise_base + k[take]
    return j
