"""Row-wise candidates in closed form: every table's 2..min(W, N) shards without an (n, W) array.

Note [row-wise candidates in closed form]
A row-wise table over k ranks has the largest shard ceil(N / k) rows, so its largest shard costs
c(k) = a + b * ceil(N / k) (every term of the cost model is affine in a shard's rows) and its k
shards cost k * a + b * N in total. So c is non-increasing and the total increasing in k: of the
row-wise candidates whose largest shard is under a target T, the cheapest is the smallest k with
c(k) <= T, ceil(N / floor((T - a) / b)). At 4,096 ranks, pricing every k of every table
explicitly took (n, 4,096) arrays: 5.7 GiB for 10,000 tables, and with the choices and the bound
made over them, half the planner's time. This prices only the k that a question needs. Every
answer is checked against the cost model's exact float for that k and moved by single steps where
rounding put it one off, so a candidate's price here is bit-for-bit `CostModel.shard`'s, as it
was when every k was an explicit column.

A candidate is valid when its largest shard, with the bytes it adds to every rank
(`CostModel.everywhere_bytes`), fits `capacity`. Under FP32 comms that is every k from some
k_min on; under FP16/BF16 comms each row-wise piece adds copies to every rank, so memory can
also rule out large k, and (through ceil) a k between two valid ones: the valid k are [lo, hi]
less such holes, which `_next_valid` steps over.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from planners.cost import CostModel, TableArrays
from planners.inputs import TableConstraint
from planners.types import ShardingType

__all__ = ["RowWise", "whole_blocks"]

_RW = ShardingType.ROW_WISE
_NONE = 0  # "no such k": a k is always >= 2


def whole_blocks(rows: np.ndarray, ranks: int | np.ndarray) -> np.ndarray:
    """Whether TorchRec's block split of `rows` over `ranks` leaves no rank empty:
    (ranks - 1) * ceil(rows / ranks) < rows (9 rows over 8 ranks leave three empty)."""
    return (ranks - 1) * np.ceil(rows / ranks) < rows


@dataclass(frozen=True, eq=False)
class RowWise:
    """The row-wise candidates of every table; `lo[i]..hi[i]` are table i's valid shard counts
    (`lo > hi`: none), `allowed_lo..allowed_hi` those its shape and constraint allow."""

    model: CostModel
    t: TableArrays
    capacity: float
    allowed_lo: np.ndarray
    allowed_hi: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    a: np.ndarray  # the largest shard costs about a + b * rows (a guess; answers are exact)
    b: np.ndarray
    # `chunk`'s answers, by (table, first k): a search asks for the same table's first row-wise
    # candidates many times (planners/search.py's retries), each a full price (Note [row-wise
    # candidates in closed form] prices them exactly, one numpy call per question).
    _chunks: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    CHUNK = 16  # row-wise shard counts priced together by `chunk`

    @classmethod
    def of(cls, t: TableArrays, model: CostModel, constraints: Sequence[TableConstraint | None],
           capacity: float, *, torchrec: bool = False) -> RowWise:  # fmt: skip
        """`torchrec`: only TorchRec's layout, every rank of the world in its block split, with
        no empty block (Note [plans TorchRec runs unchanged] in planners/options.py)."""
        world = model.topology.world_size
        n = len(t.rows)
        lo = np.full(n, 2, dtype=np.int64)
        hi = np.minimum(world, t.rows).astype(np.int64)
        for i, con in enumerate(constraints):
            if con is None:
                continue
            if not con.allows(_RW):
                hi[i] = 0
                continue
            lo[i] = max(2, con.min_shards)
            if con.max_shards is not None:
                hi[i] = min(hi[i], con.max_shards)
            if con.ranks:
                hi[i] = min(hi[i], len(con.ranks))
        if torchrec:  # only k = W, if the constraint allows it
            ok = (lo <= world) & (hi >= world) & whole_blocks(t.rows, world) & (t.dim % 4 == 0)
            lo[:] = world
            hi = np.where(ok, world, 0).astype(np.int64)
        one = model.shard(_RW, t, 1.0, t.dim, 2.0).total
        full = model.shard(_RW, t, t.rows, t.dim, 2.0).total
        b = (full - one) / np.maximum(t.rows - 1, 1)
        self = cls(model, t, float(capacity), lo, hi, lo.copy(), hi.copy(), one - b, b)
        self._fit_memory()
        return self

    # -- exact prices of table(s) `idx` over k shards (k: float array like idx) -------------

    def _big(self, idx: np.ndarray, k: np.ndarray):
        t = self.t.take(idx)
        return self.model.shard(_RW, t, np.ceil(t.rows / k), t.dim, k), t

    def cost(self, idx: np.ndarray, k: np.ndarray) -> np.ndarray:
        """Seconds of the largest of k shards (the even split)."""
        return self._big(idx, np.asarray(k, dtype=np.float64))[0].total

    def memory(self, idx: np.ndarray, k: np.ndarray) -> np.ndarray:
        """Bytes of the largest of k shards, plus what the placement adds to every rank."""
        k = np.asarray(k, dtype=np.float64)
        big, t = self._big(idx, k)
        return big.memory + self.model.everywhere_bytes(_RW, t, k)

    def total(self, idx: np.ndarray, k: np.ndarray) -> np.ndarray:
        """Seconds of all k shards together."""
        k = np.asarray(k, dtype=np.float64)
        t = self.t.take(idx)
        return self.model.shard(_RW, t, t.rows / k, t.dim, k).total * k

    def fits(self, idx: np.ndarray, k: np.ndarray) -> np.ndarray:
        return self.memory(idx, k) <= self.capacity

    def chunk(self, i: int, k0: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Table i's shard counts k0 .. k0 + CHUNK - 1 (at most `hi[i]`), whether each fits, and
        each one's `total`: one vectorised price, kept (a few MiB at most: CHUNK counts a table,
        and only the first chunks a search reaches)."""
        key = (i, k0)
        got = self._chunks.get(key)
        if got is None:
            if len(self._chunks) > 1 << 18:
                self._chunks.clear()
            ks = np.arange(k0, min(k0 + self.CHUNK, int(self.hi[i]) + 1), dtype=np.int64)
            idx = np.full(len(ks), i)
            got = self._chunks[key] = (ks, self.fits(idx, ks), self.total(idx, ks))
        return got

    # -- the valid range ---------------------------------------------------------------------

    def _fit_memory(self) -> None:
        """Narrows lo..hi to the k whose largest shard fits: from the relaxation without the
        ceil (a lower bound on the bytes, convex in k), then exact steps inward."""
        idx = np.flatnonzero(self.allowed_lo <= self.allowed_hi)
        if not len(idx):
            return
        t = self.t.take(idx)
        # memory(k) >= am + bm * N / k + e1 * k - e0 (am, bm: the shard's bytes, affine in rows)
        zero = self.model.shard(_RW, t, 0.0, t.dim, 2.0).memory
        one = self.model.shard(_RW, t, 1.0, t.dim, 2.0).memory
        bm = one - zero
        once, twice = (self.model.everywhere_bytes(_RW, t, k) for k in (1.0, 2.0))
        e1 = twice - once  # everywhere_bytes(k) = k * e1 - e0
        e0 = e1 - once
        room = self.capacity - zero + e0
        with np.errstate(divide="ignore", invalid="ignore"):
            plain = np.where(room > 0, bm * t.rows / room, np.inf)  # e1 == 0: k >= bm N / room
            disc = room * room - 4 * e1 * bm * t.rows
            root = np.sqrt(np.maximum(disc, 0.0))
            k1 = np.where(e1 > 0, np.where(disc >= 0, (room - root) / (2 * e1), np.inf), plain)
            k2 = np.where(e1 > 0, np.where(disc >= 0, (room + root) / (2 * e1), -np.inf), np.inf)
        lo = np.maximum(self.allowed_lo[idx], np.floor(np.nan_to_num(k1, posinf=1e18)) - 1)
        hi = np.minimum(self.allowed_hi[idx], np.ceil(np.nan_to_num(k2, neginf=-1e18)) + 1)
        lo = self._next_valid(idx, lo.astype(np.int64), hi.astype(np.int64), +1)
        some = lo != _NONE
        hi = np.where(some, hi, 0).astype(np.int64)
        hi[some] = self._next_valid(idx[some], hi[some], lo[some], -1)
        self.lo[idx] = np.where(some, lo, 1)
        self.hi[idx] = hi

    def _next_valid(self, idx: np.ndarray, k: np.ndarray, stop: np.ndarray, step: int) -> np.ndarray:
        """From k, stepping by `step` (+1 or -1) up to `stop`, the first k whose shard fits; 0
        where none does."""
        k = k.copy()
        todo = np.flatnonzero((k - stop) * step <= 0)
        out = np.full(len(k), _NONE, dtype=np.int64)
        while len(todo):
            ok = self.fits(idx[todo], k[todo])
            out[todo[ok]] = k[todo[ok]]
            todo = todo[~ok]
            k[todo] += step
            todo = todo[(k[todo] - stop[todo]) * step <= 0]
        return out

    def valid(self, idx: np.ndarray, k: np.ndarray) -> np.ndarray:
        k = np.asarray(k, dtype=np.int64)
        inside = (k >= self.lo[idx]) & (k <= self.hi[idx])
        out = inside.copy()
        if inside.any():
            where = np.flatnonzero(inside)
            out[where] = self.fits(idx[where], k[where])
        return out

    # -- questions the bound and the search ask ----------------------------------------------

    def _first_under(self, idx: np.ndarray, target: float) -> np.ndarray:
        """Per table, the smallest k in lo..hi+1 whose largest shard costs at most `target`,
        memory aside (hi + 1: none does)."""
        lo, hi = self.lo[idx], self.hi[idx]
        a, b, rows = self.a[idx], self.b[idx], self.t.rows[idx]
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            most_rows = np.floor((target - a) / b)
            guess = np.where(most_rows >= 1, np.ceil(rows / np.maximum(most_rows, 1)), np.inf)
        top = np.maximum(hi, lo) + 1
        k = np.clip(np.nan_to_num(guess, posinf=1e18), lo, top).astype(np.int64)
        # exact steps: down while the k below still costs at most target, up while k costs more
        down = np.flatnonzero((lo <= hi) & (k > lo))
        while len(down):
            down = down[self.cost(idx[down], k[down] - 1) <= target]
            k[down] -= 1
            down = down[k[down] > lo[down]]
        up = np.flatnonzero((lo <= hi) & (k <= hi))
        while len(up):
            up = up[self.cost(idx[up], k[up]) > target]
            k[up] += 1
            up = up[k[up] <= hi[up]]
        return np.where(lo <= hi, k, top)

    def smallest_under(self, idx: np.ndarray, target: float) -> np.ndarray:
        """Per table, the smallest valid k whose largest shard costs at most `target` (the
        cheapest such in total), or 0 where none does."""
        k = self._first_under(idx, target)
        out = np.full(len(idx), _NONE, dtype=np.int64)
        where = np.flatnonzero(k <= self.hi[idx])
        if len(where):  # over a hole in the valid range (FP16 comms), to the next k that fits
            out[where] = self._next_valid(idx[where], k[where], self.hi[idx][where], +1)
        return out

    def largest_over(self, idx: np.ndarray, target: float) -> np.ndarray:
        """Per table, the largest valid k whose largest shard costs more than `target`, or 0."""
        start = self._first_under(idx, target) - 1
        out = np.full(len(idx), _NONE, dtype=np.int64)
        live = np.flatnonzero((start >= self.lo[idx]) & (self.lo[idx] <= self.hi[idx]))
        if len(live):
            out[live] = self._next_valid(idx[live], start[live], self.lo[idx][live], -1)
        return out
