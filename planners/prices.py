"""Every table's shard price as an affine function of the shard's size, for the search.

The search places, moves and resizes shards millions of times at 10,000 tables; it reads each
price from here instead of calling the cost model. `CostModel.shard` is affine in a shard's rows
and columns, so two evaluations per (type, shard count) give a + b * size exactly; they are made
for all tables at once the first time a (type, shard count) is asked for.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from planners.cost import CostModel, TableArrays
from planners.types import ShardingType

__all__ = ["Affine", "ShardPrices"]

_T = ShardingType


class Affine(NamedTuple):
    """A shard of `size` rows (or columns) costs a + b * size seconds and am + bm * size bytes;
    sizes move in multiples of `step` (4 columns, or 1 row)."""

    a: float
    b: float
    am: float
    bm: float
    step: int


class ShardPrices:
    """Per (type, shard count), the `Affine` price of one shard of every table."""

    def __init__(self, model: CostModel, arrays: TableArrays) -> None:
        self.model = model
        self.arrays = arrays
        self._affine: dict[tuple[ShardingType, int], list[Affine]] = {}
        self._bytes: dict[tuple[ShardingType, int], tuple[np.ndarray, np.ndarray]] = {}
        self._everywhere: dict[tuple[ShardingType, int], list[float]] = {}

    def of(self, kind: ShardingType, k: int) -> list[Affine]:
        """The price of a shard of each table placed as `kind` in `k` shards.

        A column-wise shard's price depends on k only through k > 1 (a piece of a split table:
        the cost model's row statistics), and a table-wise table is a column-wise one in one
        piece, so `of(COLUMN_WISE, 1)` is every table whole. Row-wise prices do not depend on k;
        table-row-wise ones do (the intra-host reduce-scatter)."""
        key = self._key(kind, k)
        if key not in self._affine:
            self._affine[key] = self._price(*key)
        return self._affine[key]

    def bytes_of(self, kind: ShardingType, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(am, bm) of `of(kind, k)` as arrays over the tables."""
        key = self._key(kind, k)
        if key not in self._bytes:
            fits = self.of(kind, k)
            self._bytes[key] = (np.array([f.am for f in fits]), np.array([f.bm for f in fits]))
        return self._bytes[key]

    @staticmethod
    def _key(kind: ShardingType, k: int) -> tuple[ShardingType, int]:
        if kind in (_T.TABLE_WISE, _T.COLUMN_WISE):
            return (_T.COLUMN_WISE, min(k, 2) if kind is _T.COLUMN_WISE else 1)
        return (kind, k) if kind is _T.TABLE_ROW_WISE else (kind, 1)

    def affine(self, index: int, kind: ShardingType, k: int) -> Affine:
        return self.of(kind, k)[index]

    def _price(self, kind: ShardingType, k: int) -> list[Affine]:
        t, model = self.arrays, self.model
        if kind is _T.DATA_PARALLEL:
            c = model.shard(kind, t, t.rows, t.dim, 1)
            return [Affine(a, 0.0, am, 0.0, 1) for a, am in zip(c.total.tolist(), c.memory.tolist())]
        if kind is _T.COLUMN_WISE:
            # a table-wise table is a column-wise table with one shard: same formulas
            step = np.where(t.dim % 4 == 0, 4.0, 1.0)
            full = t.dim
            lo = model.shard(kind, t, t.rows, step, k)
            hi = model.shard(kind, t, t.rows, full, k)
        else:
            step, full = np.ones_like(t.rows), t.rows
            lo = model.shard(kind, t, 1.0, t.dim, k)
            hi = model.shard(kind, t, t.rows, t.dim, k)
        span = np.where(full - step == 0, 1.0, full - step)
        b = (hi.total - lo.total) / span
        bm = (hi.memory - lo.memory) / span
        a, am = lo.total - b * step, lo.memory - bm * step
        return [Affine(*x) for x in zip(a.tolist(), b.tolist(), am.tolist(), bm.tolist(),
                                        step.astype(np.int64).tolist())]  # fmt: skip

    def everywhere(self, index: int, kind: ShardingType, k: int) -> float:
        """Bytes that table `index` placed as `kind` in `k` shards adds to every rank, beyond
        the batch buffers' reserve (`CostModel.everywhere_bytes`; Note [wire copies] in cost.py)."""
        if self.model.wire_bytes == 0:
            return 0.0  # FP32 comms: no copies, nothing reserved for them
        key = (kind, k)
        if key not in self._everywhere:
            self._everywhere[key] = self.model.everywhere_bytes(kind, self.arrays, float(k)).tolist()
        return self._everywhere[key][index]
