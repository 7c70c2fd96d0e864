"""Candidate placements of every table, priced at once, and the lower bound they imply.

A candidate is a (sharding type, shard count) pair: table-wise; column-wise over 2..W shards;
table-row-wise over 2..H ranks of one host; row-wise over 2..W ranks; data-parallel. For n
tables and m candidates the prices are (n, m) arrays, with `valid` false where a candidate does
not apply (too few rows or columns, a constraint forbids it, a shard does not fit in memory).

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
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from planners.cost import CostModel, TableArrays
from planners.inputs import Table, TableConstraint
from planners.types import ShardingType

__all__ = ["Candidates", "column_unit", "enumerate_candidates", "lower_bound", "select"]

_T = ShardingType


def column_unit(dim: int) -> int:
    """Column shards are multiples of 4 columns (FBGEMM's kernels want dim % 4 == 0) when
    the table's dim allows it, else of 1."""
    return 4 if dim % 4 == 0 else 1


class Candidates(NamedTuple):
    """Every candidate of every table: `columns[j]` = (type, shards); arrays are (tables, m)."""

    columns: tuple[tuple[ShardingType, int], ...]
    valid: np.ndarray  # allowed, shape ok, largest shard fits in memory
    allowed: np.ndarray  # allowed by constraints and the table's shape, memory ignored
    max_cost: np.ndarray  # seconds of the largest shard (the even split the search emits)
    total: np.ndarray  # seconds summed over all shards (W replicas for data-parallel)
    # bytes the largest shard needs on its rank, with what the placement adds to every rank
    # (`CostModel.everywhere_bytes`: row-wise pieces' low-precision copies; less for a replica)
    max_memory: np.ndarray


def _pinned_per_host(pins: tuple[int, ...], world: int, host: int) -> int:
    counts = np.bincount(np.array(pins, dtype=np.int64) // host, minlength=world // host)
    return int(counts.max()) if len(pins) else host


def enumerate_candidates(
    tables: Sequence[Table],
    model: CostModel,
    constraints: Sequence[TableConstraint | None],
    shard_capacity: float,
) -> Candidates:
    """Prices every candidate of every table; `shard_capacity` is the memory a rank has for shards."""
    topo = model.topology
    world, host = topo.world_size, int(topo.ranks_per_host or 1)
    arrays = TableArrays.of(tables)
    t2 = TableArrays(*(a[:, None] for a in arrays))
    n = len(tables)
    units = np.array([column_unit(t.embedding_dim) for t in tables], dtype=np.float64)[:, None]
    max_cw = int(min(world, max((t.embedding_dim // column_unit(t.embedding_dim)) for t in tables)))
    max_rw = int(min(world, max(t.num_embeddings for t in tables)))
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
    ks = np.arange(2, max_rw + 1, dtype=np.float64)[None, :]
    if ks.size:
        add(_T.ROW_WISE, ks, np.ceil(t2.rows / ks), t2.dim, t2.rows / ks, t2.dim,
            ks <= t2.rows)  # fmt: skip
    dp = model.shard(_T.DATA_PARALLEL, t2, t2.rows, t2.dim, one)
    dp_needs = dp.memory + model.everywhere_bytes(_T.DATA_PARALLEL, t2, one)
    blocks.append((dp.total, dp.total * world, dp_needs, np.ones((n, 1), bool)))
    columns.append((_T.DATA_PARALLEL, world))

    max_cost, total, max_mem, shape_ok = (
        np.concatenate([b[i] for b in blocks], axis=1) for i in range(4)
    )
    allowed = shape_ok & _constraint_mask(columns, constraints, world, host)
    return Candidates(
        columns=tuple(columns),
        valid=allowed & (max_mem <= shard_capacity),
        allowed=allowed,
        max_cost=max_cost,
        total=total,
        max_memory=max_mem,
    )


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
        mask[i] = row
    return mask


def lower_bound(c: Candidates, world_size: int) -> float:
    """The smallest T with f(T) <= W * T (Note [the lower bound]); inf if a table has no candidate."""
    cost = np.where(c.valid, c.max_cost, np.inf)
    if not np.all(np.isfinite(cost.min(axis=1))):
        return float("inf")
    low = float(cost.min(axis=1).max())
    points = np.unique(cost[np.isfinite(cost) & (cost >= low)])

    def work(t: float) -> float:
        return float(np.where(cost <= t, c.total, np.inf).min(axis=1).sum())

    lo, hi = 0, len(points) - 1
    if work(points[hi]) > world_size * points[hi]:
        return work(points[hi]) / world_size
    while lo < hi:  # first breakpoint where the total work fits under W * T
        mid = (lo + hi) // 2
        if work(points[mid]) <= world_size * points[mid]:
            hi = mid
        else:
            lo = mid + 1
    if lo == 0:
        return float(points[0])
    return float(min(points[lo], work(points[lo - 1]) / world_size))


def select(c: Candidates, target: float) -> np.ndarray:
    """Per table, the cheapest-in-total valid candidate whose largest shard is <= `target`
    (or, where none is, the valid candidate with the smallest largest shard)."""
    ok = c.valid & (c.max_cost <= target)
    choice = np.where(ok, c.total, np.inf).argmin(axis=1)
    fallback = np.where(c.valid, c.max_cost, np.inf).argmin(axis=1)
    return np.where(ok.any(axis=1), choice, fallback)
