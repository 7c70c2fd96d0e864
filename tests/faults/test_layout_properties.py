"""Shard-boundary arithmetic, end to end: random tables, world sizes and placements.

tests/test_plan_types.py proves that a placement's shards tile its table. Here the shards go
through `build_layout` (the routes every rank derives) and `Router.route` (where each id goes):
every (output, row, column) is looked up exactly once across ranks, every rank derives the same
routes, and every id lands in exactly the route whose shard holds its row, shifted to the shard's
first row. Pure: no process group.
"""

from __future__ import annotations

from collections import Counter

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from modular.routing.router import Router
from modular.tables.layout import ROW_SPLIT, Layout, Pooling, TableInfo, build_layout, kernel_groups
from planners.types import ShardingType, TablePlacement
from tests.test_plan_types import placements

PROPERTY = settings(max_examples=150, deadline=None)
FEATURES = ("fa", "fb", "fc", "fd")


@st.composite
def sharded_ebcs(draw) -> tuple[int, tuple[TableInfo, ...], tuple[TablePlacement, ...]]:
    """A world size and an EBC's tables (features may be shared) with valid placements."""
    world = draw(st.integers(1, 4))
    n = draw(st.integers(1, 4))
    tables, chosen = [], []
    for i in range(n):
        rows, dim = draw(st.integers(1, 30)), draw(st.integers(1, 9))
        features = tuple(draw(st.lists(st.sampled_from(FEATURES), min_size=1, max_size=2, unique=True)))
        tables.append(TableInfo(f"t{i}", rows, dim, features, draw(st.sampled_from(list(Pooling)))))
        chosen.append(draw(placements(world, rows, dim)))
    return world, tuple(tables), tuple(chosen)


def _layouts(world: int, tables, chosen) -> list[Layout]:
    shards = tuple(
        p.shards(num_embeddings=t.num_embeddings, embedding_dim=t.embedding_dim, world_size=world, table=t.name)
        for t, p in zip(tables, chosen)
    )
    return [build_layout(tables, chosen, shards, world_size=world, rank=r) for r in range(world)]


@PROPERTY
@given(sharded_ebcs())
def test_routes_look_up_every_output_cell_exactly_once(ebc) -> None:
    world, tables, chosen = ebc
    layouts = _layouts(world, tables, chosen)
    assert all(lay.routes == layouts[0].routes for lay in layouts), "ranks derived different routes"
    lay = layouts[0]
    for i, o in enumerate(lay.outputs):
        t = lay.table_index(o.table)
        rows, dim = tables[t].num_embeddings, tables[t].embedding_dim
        every_cell = Counter((r, c) for r in range(rows) for c in range(dim))
        dp = chosen[t].sharding_type is ShardingType.DATA_PARALLEL
        looked_up = Counter()
        for r in lay.routes:
            if r.output == i:
                assert not dp and r.feature == lay.features.index(o.feature), r
                looked_up.update((row, c) for row in range(r.shard.row_offset, r.shard.row_offset + r.shard.num_rows)
                                 for c in range(r.shard.col_offset, r.shard.col_offset + r.shard.num_cols))  # fmt: skip
        if dp:  # each rank looks the whole table up from its own copy
            for rank, rl in enumerate(layouts):
                mine = [r for r in rl.local if r.output == i]
                assert len(mine) == 1 and mine[0].shard.rank == rank and mine[0].shard.sizes == (rows, dim), mine
        else:
            assert looked_up == every_cell, f"output {o.key}: cells looked up {looked_up} != each once"
    # Arriving columns add into each output column once per row shard: the partial sums are whole.
    for rank, rl in enumerate(layouts):
        got = Counter(rl.output_columns())
        for i, o in enumerate(rl.outputs):
            t = rl.table_index(o.table)
            row_split = chosen[t].sharding_type in ROW_SPLIT
            want = sum(1 for r in rl.routes if r.output == i) if row_split else 1
            assert all(got[c] == want for c in range(o.col, o.col + o.dim)), (rank, o, got)
        assert sum(rl.dims_per_rank()) == sum(r.shard.num_cols for r in rl.routes)


@PROPERTY
@given(sharded_ebcs(), st.integers(1, 4), st.data())
def test_every_id_goes_to_the_route_that_holds_its_row(ebc, batch: int, data) -> None:
    world, tables, chosen = ebc
    lay = _layouts(world, tables, chosen)[0]
    router = Router(lay, module="m", is_weighted=False, device=torch.device("cpu"))
    bound = {f: min(t.num_embeddings for t in tables if f in t.features) for f in lay.features}
    ids = {  # feature -> per sample, its ids
        f: [data.draw(st.lists(st.integers(0, bound[f] - 1), max_size=4)) for _ in range(batch)]
        for f in lay.features
    }
    kjt = KeyedJaggedTensor(
        keys=list(lay.features),
        values=torch.tensor([v for f in lay.features for s in ids[f] for v in s], dtype=torch.int64),
        lengths=torch.tensor([len(s) for f in lay.features for s in ids[f]], dtype=torch.int64),
        stride=batch,
    )
    assert router.check(kjt) is None
    routed = router.route(kjt)
    lengths = routed.lengths.view(len(lay.routes), batch).tolist()
    values = routed.values.tolist()
    assert sum(routed.values_per_rank) == len(values) == sum(map(sum, lengths))
    pos = 0
    for i, r in enumerate(lay.routes):
        lo, hi = r.shard.row_offset, r.shard.row_offset + r.shard.num_rows
        for s in range(batch):
            got = values[pos : pos + lengths[i][s]]
            pos += lengths[i][s]
            want = [v - lo for v in ids[lay.features[r.feature]][s] if lo <= v < hi]
            assert Counter(got) == Counter(want), (r, s, got, want)
    per_rank = Counter()
    for i, r in enumerate(lay.routes):
        per_rank[r.shard.rank] += sum(lengths[i])
    assert routed.values_per_rank == [per_rank[k] for k in range(world)]


@PROPERTY
@given(sharded_ebcs())
def test_each_kernel_tables_routes_are_consecutive(ebc) -> None:
    """fbgemm's CPU backward takes a kernel table's rows as the step of `hash_size_cumsum` from
    one route to the next: routes of two tables interleaved (a rank holding two column pieces of
    a table that two features read) skip rows or update them wrongly."""
    world, tables, chosen = ebc
    for lay in _layouts(world, tables, chosen):
        for routes in (lay.routes_to(lay.rank), lay.local):
            for group in kernel_groups(routes):
                ftm = list(group.feature_table_map)
                assert ftm == sorted(ftm), (lay.rank, group)
