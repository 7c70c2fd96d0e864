"""Row-wise candidates in closed form answer what every shard count priced explicitly answered
(Note [row-wise candidates in closed form] in planners/row_wise.py; issue 38): the valid shard
counts, the cheapest count under a target, the choice per table and the lower bound, bit for bit.
The reference below is the (tables, W) enumeration the planner used before, on small worlds."""

from __future__ import annotations

import numpy as np
import pytest

from planners import DataType, ShardingType, Table, TableConstraint, Topology
from planners.cost import CostModel, TableArrays
from planners.options import enumerate_candidates, lower_bound, select
from tests.planners.helpers import synthetic

T = ShardingType


def _explicit_row_wise(c, tables, model, constraints, capacity):
    """(max_cost, total, valid) of row-wise over k = 2..W for every table, as (n, W - 1)
    arrays, priced as the explicit columns were."""
    world = model.topology.world_size
    t2 = TableArrays(*(a[:, None] for a in TableArrays.of(tables)))
    ks = np.arange(2, world + 1, dtype=np.float64)[None, :]
    big = model.shard(T.ROW_WISE, t2, np.ceil(t2.rows / ks), t2.dim, ks)
    mean = model.shard(T.ROW_WISE, t2, t2.rows / ks, t2.dim, ks)
    needs = big.memory + model.everywhere_bytes(T.ROW_WISE, t2, ks)
    ok = np.broadcast_to(ks <= t2.rows, big.total.shape).copy()
    for i, con in enumerate(constraints):
        if con is None:
            continue
        if not con.allows(T.ROW_WISE):
            ok[i] = False
        ok[i] &= ks[0] >= con.min_shards
        if con.max_shards is not None:
            ok[i] &= ks[0] <= con.max_shards
        if con.ranks:
            ok[i] &= ks[0] <= len(con.ranks)
    return big.total, mean.total * ks, ok & (needs <= capacity)


def _reference_bound(costs, totals, world):
    """The breakpoint bisection of the planner before issue 38, over explicit arrays."""
    cost = np.where(np.isfinite(costs), costs, np.inf)
    if not np.all(np.isfinite(cost.min(axis=1))):
        return float("inf")
    low = float(cost.min(axis=1).max())
    points = np.unique(cost[np.isfinite(cost) & (cost >= low)])

    def work(t):
        return float(np.where(cost <= t, totals, np.inf).min(axis=1).sum())

    lo, hi = 0, len(points) - 1
    if work(points[hi]) > world * points[hi]:
        return work(points[hi]) / world
    while lo < hi:
        mid = (lo + hi) // 2
        if work(points[mid]) <= world * points[mid]:
            hi = mid
        else:
            lo = mid + 1
    if lo == 0:
        return float(points[0])
    return float(min(points[lo], work(points[lo - 1]) / world))


def _cases():
    tight = [Table(f"s{i}", 40 + 7 * i, 8, pooling_factor=3.0) for i in range(6)]  # few rows
    for world, per_host, comm, memory in [(16, 8, "fp32", "80GiB"), (24, 4, "fp16", "2GiB"),
                                          (7, 7, "bf16", "1GiB"), (32, 8, "fp32", "3GiB")]:  # fmt: skip
        tables = synthetic(40, seed=world, max_rows=3e7) + tight
        cons = {"t0": TableConstraint(sharding_types=(T.ROW_WISE,), min_shards=5),
                "t1": TableConstraint(max_shards=3), "t2": TableConstraint(ranks=(0, 1, 2, 3)),
                "t3": TableConstraint(sharding_types=(T.TABLE_WISE, T.COLUMN_WISE))}  # fmt: skip
        yield pytest.param(tables, Topology(world, ranks_per_host=per_host, device_memory=memory),
                           comm, cons, 512, id=f"{world}-{comm}-{memory}")  # fmt: skip
    # FP16 comms where each row-wise piece's copies on every rank rule out the larger k
    wide = [Table(f"a{i}", 998 + 37 * i, 256, features=(f"a{i}", f"b{i}", f"c{i}"),
                  pooling_factor=2.0, dtype=DataType.FP16) for i in range(4)]  # fmt: skip
    yield pytest.param(wide + synthetic(8, seed=1, max_rows=1e5),
                       Topology(32, ranks_per_host=4, device_memory="48MiB"), "fp16", {}, 128,
                       id="32-fp16-copies-limit-k")  # fmt: skip


def _candidates(tables, topology, comm, cons, batch):
    model = CostModel(topology, batch, comm_dtype=comm)
    constraints = [cons.get(t.name) for t in tables]
    capacity = topology.capacity - model.batch_buffer_bytes(TableArrays.of(tables))
    return enumerate_candidates(tables, model, constraints, capacity), model, constraints, capacity


@pytest.mark.parametrize("tables,topology,comm,cons,batch", list(_cases()))
def test_closed_form_matches_every_shard_count_priced(tables, topology, comm, cons, batch):
    c, model, constraints, capacity = _candidates(tables, topology, comm, cons, batch)
    rw = c.row_wise
    costs, totals, valid = _explicit_row_wise(c, tables, model, constraints, capacity)
    world, rows = topology.world_size, np.arange(len(tables))
    ks = np.arange(2, world + 1)

    if topology.device_memory == 48 * 2**20:  # the case is what it says
        assert any(row.any() and not row[min(world, t.num_embeddings) - 2]
                   for row, t in zip(valid, tables))  # fmt: skip
    # the valid shard counts, and their prices
    for i in rows:
        got = rw.valid(np.full(len(ks), i), ks)
        assert got.tolist() == valid[i].tolist(), f"table {tables[i].name}"
        assert rw.cost(np.full(len(ks), i), ks).tolist() == costs[i].tolist()
        assert rw.total(np.full(len(ks), i), ks).tolist() == totals[i].tolist()

    # the smallest valid k under a target, at every breakpoint and between them
    points = np.unique(costs[valid])
    for target in [*points[:: max(1, len(points) // 40)], *(points[:40] * (1 + 1e-9)), np.inf]:
        under = valid & (costs <= target)
        want = np.where(under.any(axis=1), ks[under.argmax(axis=1)], 0)
        assert rw.smallest_under(rows, float(target)).tolist() == want.tolist(), target
        over = valid & (costs > target)
        last = np.where(over.any(axis=1), ks[len(ks) - 1 - over[:, ::-1].argmax(axis=1)], 0)
        assert rw.largest_over(rows, float(target)).tolist() == last.tolist(), target

    # the lower bound and the choices, against explicit row-wise columns between TWRW and DP
    explicit_cost = np.where(c.valid, c.max_cost, np.inf)
    dp = len(c.columns) - 1
    all_cost = np.concatenate([explicit_cost[:, :dp], np.where(valid, costs, np.inf),
                               explicit_cost[:, dp:]], axis=1)  # fmt: skip
    all_total = np.concatenate([c.total[:, :dp], totals, c.total[:, dp:]], axis=1)
    bound = lower_bound(c, world)
    assert bound == _reference_bound(all_cost, all_total, world)
    codes = [(j, None) for j in range(dp)] + [(None, k) for k in ks] + [(dp, None)]
    for factor in (1.0, 1.01, 1.1, 1.7, 3.0, np.inf):
        ok = np.isfinite(all_cost) & (all_cost <= bound * factor)
        want = np.where(ok, all_total, np.inf).argmin(axis=1)
        got = select(c, bound * factor)
        for i in rows:
            j, k = codes[want[i]]
            assert c.option(int(got[i])) == (c.columns[j] if k is None else (T.ROW_WISE, int(k)))


def _by_total_one_k_at_a_time(c, i):
    """`Candidates.by_total` as it was written before its row-wise prices were vectorised and
    kept: one price per shard count, merged with the explicit candidates by total."""
    rw = c.row_wise
    explicit = sorted((float(c.total[i, j]), j) for j in np.flatnonzero(c.valid[i])
                      if c.columns[j][0] is not T.DATA_PARALLEL)  # fmt: skip
    one, k, ks, pos = np.array([i]), int(rw.lo[i]), int(rw.hi[i]), 0
    while pos < len(explicit) or k <= ks:
        if k <= ks and not rw.fits(one, np.array([k]))[0]:
            k += 1
            continue
        rw_total = float(rw.total(one, np.array([k]))[0]) if k <= ks else np.inf
        if pos < len(explicit) and explicit[pos][0] <= rw_total:
            yield c.columns[explicit[pos][1]]
            pos += 1
        else:
            yield (T.ROW_WISE, k)
            k += 1


@pytest.mark.parametrize("tables,topology,comm,cons,batch", list(_cases()))
def test_candidates_by_total_in_the_same_order_as_priced_one_at_a_time(tables, topology, comm, cons, batch):
    c = _candidates(tables, topology, comm, cons, batch)[0]
    for i in range(len(tables)):
        want = list(_by_total_one_k_at_a_time(c, i))
        assert list(c.by_total(i)) == want, tables[i].name
        assert list(c.by_total(i)) == want  # again, from the kept prices


def test_largest_shard_is_the_largest_of_the_shard_sizes():
    from planners.search import largest_shard, shard_sizes

    for table in [Table("a", 1000, 64), Table("b", 7, 12), Table("c", 10**6 + 3, 256), Table("d", 33, 4)]:
        for kind in (T.TABLE_WISE, T.COLUMN_WISE, T.ROW_WISE, T.TABLE_ROW_WISE):
            for k in range(1, 12):
                if kind is T.COLUMN_WISE and k > table.embedding_dim // 4:
                    continue
                assert largest_shard(table, kind, k) == max(shard_sizes(table, kind, k)), (table.name, kind, k)
