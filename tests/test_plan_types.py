"""Properties of the plan types (planners/types.py): pure, single process, no torch.

Hypothesis draws table shapes, world sizes and placements; every valid placement must tile its
table exactly, every plan must survive JSON, and every invalid placement must say what is wrong
with the numbers in the message.
"""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planners.types import (
    PlanError,
    ShardingPlan,
    ShardingType,
    ShardSpec,
    TablePlacement,
    check_one_host,
    even_split,
)

PROPERTY = settings(max_examples=200, deadline=None)

ROW_SPLIT = (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE)


# -- strategies --------------------------------------------------------------------------------------


@st.composite
def compositions(draw, total: int, parts: int) -> tuple[int, ...]:
    """`parts` positive integers summing to `total` (total >= parts)."""
    cuts = sorted(draw(st.sets(st.integers(1, total - 1), min_size=parts - 1, max_size=parts - 1))) if parts > 1 else []
    bounds = [0, *cuts, total]
    return tuple(b - a for a, b in zip(bounds, bounds[1:]))


@st.composite
def placements(draw, world: int, rows: int, dim: int) -> TablePlacement:
    """A placement that is valid for a rows x dim table over `world` ranks."""
    kind = draw(st.sampled_from(list(ShardingType)))
    if kind is ShardingType.DATA_PARALLEL:
        return TablePlacement(kind)
    if kind is ShardingType.TABLE_WISE:
        return TablePlacement(kind, ranks=(draw(st.integers(0, world - 1)),))
    total = dim if kind is ShardingType.COLUMN_WISE else rows
    if kind is ShardingType.COLUMN_WISE:  # a rank may hold several column shards
        n = draw(st.integers(1, min(total, 2 * world)))
        ranks = tuple(draw(st.lists(st.integers(0, world - 1), min_size=n, max_size=n)))
    else:
        n = draw(st.integers(1, min(total, world)))
        ranks = tuple(draw(st.permutations(range(world)))[:n])
    if kind is not ShardingType.TABLE_ROW_WISE and n == world and ranks == tuple(range(world)) and draw(st.booleans()):
        ranks = ()  # the default: all ranks, in order
    sizes = draw(st.none() | compositions(total, n)) if ranks else None
    return TablePlacement(kind, ranks=ranks, sizes=sizes)


@st.composite
def tables(draw) -> tuple[int, int, int, TablePlacement]:
    world = draw(st.integers(1, 8))
    rows = draw(st.integers(1, 40))
    dim = draw(st.integers(1, 12))
    return world, rows, dim, draw(placements(world, rows, dim))


NAMES = st.text(alphabet="abcdefgh_0123456789", min_size=1, max_size=8)
FQNS = st.sampled_from(["", "ebc", "sparse.ebc", "tower.sparse.ebc", "model.über.ebc"])


@st.composite
def plans(draw) -> ShardingPlan:
    world = draw(st.integers(1, 6))
    modules = {}
    for fqn in draw(st.lists(FQNS, max_size=3, unique=True)):
        names = draw(st.lists(NAMES, min_size=1, max_size=4, unique=True))
        modules[fqn] = {name: draw(placements(world, rows=40, dim=12)) for name in names}
    return ShardingPlan(world_size=world, modules=modules)


# -- shards tile their table -------------------------------------------------------------------------


def _cells(specs: tuple[ShardSpec, ...], rows: int, dim: int) -> list[list[int]]:
    grid = [[0] * dim for _ in range(rows)]
    for s in specs:
        assert s.num_rows > 0 and s.num_cols > 0, s
        assert s.row_offset >= 0 and s.row_offset + s.num_rows <= rows, s
        assert s.col_offset >= 0 and s.col_offset + s.num_cols <= dim, s
        for r in range(s.row_offset, s.row_offset + s.num_rows):
            for c in range(s.col_offset, s.col_offset + s.num_cols):
                grid[r][c] += 1
    return grid


@PROPERTY
@given(tables())
def test_shards_cover_each_table_exactly(table: tuple[int, int, int, TablePlacement]) -> None:
    world, rows, dim, placement = table
    specs = placement.shards(num_embeddings=rows, embedding_dim=dim, world_size=world, table="t")
    kind = placement.sharding_type
    assert [s.rank for s in specs] == list(placement.shard_ranks(world))
    assert all(0 <= s.rank < world for s in specs)
    if kind is ShardingType.DATA_PARALLEL:  # one full copy per rank
        assert specs == tuple(ShardSpec(r, 0, rows, 0, dim) for r in range(world))
        return
    grid = _cells(specs, rows, dim)
    assert all(count == 1 for line in grid for count in line), "a cell is missing or held twice"
    # Shards follow the rank order of the placement, along one axis, in the given sizes.
    along = [s.num_cols if kind is ShardingType.COLUMN_WISE else s.num_rows for s in specs]
    total = dim if kind is ShardingType.COLUMN_WISE else rows
    if kind is ShardingType.TABLE_WISE:
        expected = (rows,)
    else:
        expected = placement.sizes or even_split(total, len(specs))
    assert tuple(along) == tuple(expected)
    offsets = [s.col_offset if kind is ShardingType.COLUMN_WISE else s.row_offset for s in specs]
    assert offsets == [sum(along[:i]) for i in range(len(along))]


@PROPERTY
@given(st.integers(0, 10_000), st.integers(1, 64))
def test_even_split(total: int, parts: int) -> None:
    sizes = even_split(total, parts)
    assert len(sizes) == parts and sum(sizes) == total
    assert max(sizes) - min(sizes) <= 1
    assert list(sizes) == sorted(sizes, reverse=True)  # larger ones first
    assert sizes == tuple([total // parts + 1] * (total % parts) + [total // parts] * (parts - total % parts))


@pytest.mark.parametrize("parts", [0, -1])
def test_even_split_needs_a_positive_number_of_parts(parts: int) -> None:
    with pytest.raises(PlanError, match=rf"cannot split 10 into {parts} parts"):
        even_split(10, parts)


# -- serialisation -----------------------------------------------------------------------------------


@PROPERTY
@given(plans())
def test_json_round_trip(plan: ShardingPlan) -> None:
    text = plan.to_json()
    back = ShardingPlan.from_json(text)
    assert back == plan and hash(back) == hash(plan)
    assert back.to_dict() == plan.to_dict() == json.loads(text)
    assert back.digest() == plan.digest()
    assert ShardingPlan.from_dict(plan.to_dict()) == plan
    for fqn, placements_ in plan.modules.items():
        assert dict(back.modules[fqn]) == dict(placements_)  # TablePlacement equality, sizes included


@PROPERTY
@given(plans(), st.randoms(use_true_random=False))
def test_digest_ignores_the_order_of_modules_and_tables(plan: ShardingPlan, rng) -> None:
    modules = list(plan.modules.items())
    rng.shuffle(modules)
    shuffled = {}
    for fqn, tables_ in modules:
        items = list(tables_.items())
        rng.shuffle(items)
        shuffled[fqn] = dict(items)
    other = ShardingPlan(world_size=plan.world_size, modules=shuffled)
    assert other.digest() == plan.digest() and other == plan


@PROPERTY
@given(plans())
def test_digest_changes_with_any_placement(plan: ShardingPlan) -> None:
    for fqn, tables_ in plan.modules.items():
        for name, placement in tables_.items():
            swapped = (
                TablePlacement(ShardingType.TABLE_WISE, ranks=(0,))
                if placement.sharding_type is not ShardingType.TABLE_WISE
                else TablePlacement(ShardingType.DATA_PARALLEL)
            )
            changed = {f: dict(t) for f, t in plan.modules.items()}
            changed[fqn][name] = swapped
            assert ShardingPlan(world_size=plan.world_size, modules=changed).digest() != plan.digest()
    bigger = ShardingPlan(world_size=plan.world_size + 1, modules=plan.modules)
    assert bigger.digest() != plan.digest()


def _golden_plan() -> ShardingPlan:
    return ShardingPlan(
        world_size=4,
        ranks_per_host=2,
        modules={
            "": {
                "t_user": TablePlacement(ShardingType.ROW_WISE, ranks=(0, 1, 2, 3)),
                "t_item": TablePlacement(ShardingType.TABLE_WISE, ranks=(3,)),
            },
            "sparse.ebc": {
                "t_cat": TablePlacement(ShardingType.COLUMN_WISE, ranks=(1, 1, 0), sizes=(4, 4, 8)),
                "t_ctx": TablePlacement(ShardingType.DATA_PARALLEL),
                "t_host": TablePlacement(ShardingType.TABLE_ROW_WISE, ranks=(2, 3), sizes=(10, 5)),
            },
        },
    )


def test_digest_and_json_are_stable() -> None:
    # Plans are compared across ranks and stored next to checkpoints by digest: changing the
    # serialisation silently would make every stored plan look different.
    plan = _golden_plan()
    assert plan.digest() == "37b8ff8189b338acffc2fa5e64d92b02703d9f982788d966bebb4c6238821a6f"
    assert plan.to_json(indent=None) == (
        '{"format": 1, "world_size": 4, "ranks_per_host": 2, "modules": {"": {"t_user": '
        '{"sharding_type": "row_wise", "ranks": [0, 1, 2, 3]}, "t_item": {"sharding_type": '
        '"table_wise", "ranks": [3]}}, "sparse.ebc": {"t_cat": {"sharding_type": "column_wise", '
        '"ranks": [1, 1, 0], "sizes": [4, 4, 8]}, "t_ctx": {"sharding_type": "data_parallel", '
        '"ranks": []}, "t_host": {"sharding_type": "table_row_wise", "ranks": [2, 3], "sizes": '
        "[10, 5]}}}}"
    )


def test_plan_is_frozen() -> None:
    plan = _golden_plan()
    with pytest.raises(TypeError):
        plan.modules["x"] = {}  # type: ignore[index]
    with pytest.raises(TypeError):
        plan.modules[""]["t_new"] = TablePlacement(ShardingType.DATA_PARALLEL)  # type: ignore[index]


# -- errors ------------------------------------------------------------------------------------------


@PROPERTY
@given(st.integers(1, 16), st.data())
def test_a_rank_at_or_beyond_the_world_size_is_refused(world: int, data) -> None:
    bad = data.draw(st.integers(world, world + 20))
    kind = data.draw(st.sampled_from([k for k in ShardingType if k is not ShardingType.DATA_PARALLEL]))
    ranks = (bad,) if kind is ShardingType.TABLE_WISE else (*range(min(world, 2)), bad)
    if kind is ShardingType.COLUMN_WISE:
        ranks = (bad, 0)
    placement = TablePlacement(kind, ranks=ranks)
    expected = f"table 't_x' of module 'ebc' is placed on rank {bad} but the plan's world size is {world}; use ranks in [0, {world - 1}]"
    with pytest.raises(PlanError, match=re.escape(expected)):
        ShardingPlan(world_size=world, modules={"ebc": {"t_x": placement}})
    expected = f"table 't_x' is placed on rank {bad} but the world size is {world}; use ranks in [0, {world - 1}]"
    with pytest.raises(PlanError, match=re.escape(expected)):
        placement.shards(num_embeddings=100, embedding_dim=100, world_size=world, table="t_x")


@PROPERTY
@given(st.sampled_from([ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE, ShardingType.COLUMN_WISE]), st.integers(1, 6), st.data())
def test_sizes_that_do_not_sum_say_so_with_the_arithmetic(kind: ShardingType, n: int, data) -> None:
    total = data.draw(st.integers(n, 50))
    sizes = tuple(data.draw(st.lists(st.integers(1, 20), min_size=n, max_size=n).filter(lambda s: sum(s) != total)))
    placement = TablePlacement(kind, ranks=tuple(range(n)), sizes=sizes)
    axis = "columns" if kind is ShardingType.COLUMN_WISE else "rows"
    rows, dim = (100, total) if kind is ShardingType.COLUMN_WISE else (total, 100)
    expected = (
        f"{kind.value} shards of 't_x' ({total:_} {axis}) over ranks {tuple(range(n))} must sum to "
        f"{total:_}, got {' + '.join(map(str, sizes))} = {sum(sizes):_}"
    )
    with pytest.raises(PlanError, match=re.escape(expected)):
        placement.shards(num_embeddings=rows, embedding_dim=dim, world_size=n, table="t_x")


@PROPERTY
@given(st.sampled_from([ShardingType.ROW_WISE, ShardingType.COLUMN_WISE]), st.integers(2, 8), st.data())
def test_more_shards_than_rows_or_columns_is_refused(kind: ShardingType, world: int, data) -> None:
    total = data.draw(st.integers(1, world - 1))
    axis = "columns" if kind is ShardingType.COLUMN_WISE else "rows"
    rows, dim = (100, total) if kind is ShardingType.COLUMN_WISE else (total, 100)
    expected = f"table 't_x' has {total} {axis} but is {kind.value} over {world} ranks {tuple(range(world))}; use at most {total} ranks"
    with pytest.raises(PlanError, match=re.escape(expected)):
        TablePlacement(kind).shards(num_embeddings=rows, embedding_dim=dim, world_size=world, table="t_x")


@PROPERTY
@given(st.integers(1, 4), st.integers(2, 8), st.data())
def test_table_row_wise_over_two_hosts_is_refused(per_host: int, n: int, data) -> None:
    ranks = tuple(data.draw(st.permutations(range(per_host * 4)))[:n])
    hosts = sorted({r // per_host for r in ranks})
    placement = TablePlacement(ShardingType.TABLE_ROW_WISE, ranks=ranks)
    if len(hosts) == 1:
        ShardingPlan(world_size=per_host * 4, ranks_per_host=per_host, modules={"": {"t": placement}})
        return
    expected = (
        f"table 't' of module '' is table_row_wise over ranks {ranks}, which span hosts {hosts} "
        f"({per_host} ranks per host); pick ranks of one host or use row_wise"
    )
    with pytest.raises(PlanError, match=re.escape(expected)):
        ShardingPlan(world_size=per_host * 4, ranks_per_host=per_host, modules={"": {"t": placement}})
    with pytest.raises(PlanError, match=re.escape(expected.replace(" of module ''", ""))):
        check_one_host(ranks, per_host, "table 't'")


BAD_PLACEMENTS = [
    (lambda: TablePlacement(ShardingType.TABLE_WISE), r"table_wise placement needs exactly one rank, got ranks=\(\)"),
    (lambda: TablePlacement(ShardingType.TABLE_WISE, ranks=(0, 1)), r"table_wise placement needs exactly one rank, got ranks=\(0, 1\)"),
    (lambda: TablePlacement(ShardingType.DATA_PARALLEL, ranks=(0,)), r"data_parallel tables have a copy on every rank; drop ranks=\(0,\)"),
    (lambda: TablePlacement(ShardingType.ROW_WISE, ranks=(0, -1)), r"row_wise placement has a negative rank in \(0, -1\)"),
    (lambda: TablePlacement(ShardingType.ROW_WISE, ranks=(1, 0, 1)), r"row_wise placement lists a rank twice: ranks=\(1, 0, 1\)"),
    (lambda: TablePlacement(ShardingType.TABLE_ROW_WISE, ranks=(2, 2)), r"table_row_wise placement lists a rank twice: ranks=\(2, 2\)"),
    (lambda: TablePlacement(ShardingType.TABLE_ROW_WISE), r"table_row_wise placement needs the ranks of one host, got none"),
    (lambda: TablePlacement(ShardingType.ROW_WISE, ranks=(0, 1), sizes=(5,)), r"row_wise placement has 1 shard sizes \(5,\) for 2 ranks \(0, 1\); give one size per rank"),
    (lambda: TablePlacement(ShardingType.COLUMN_WISE, sizes=(2, 2)), r"column_wise placement has 2 shard sizes \(2, 2\) for 0 ranks \(\); give one size per rank"),
    (lambda: TablePlacement(ShardingType.COLUMN_WISE, ranks=(0, 1), sizes=(4, 0)), r"column_wise shard sizes must be positive, got \(4, 0\)"),
    (lambda: TablePlacement(ShardingType.TABLE_WISE, ranks=(0,), sizes=(4,)), r"table_wise placement takes no shard sizes, got \(4,\)"),
    (lambda: TablePlacement(ShardingType.DATA_PARALLEL, sizes=()), r"data_parallel placement takes no shard sizes, got \(\)"),
    (lambda: TablePlacement(ShardingType.ROW_WISE, ranks="01"), r"ranks must be a sequence of integers, got '01'"),
    (lambda: TablePlacement(ShardingType.ROW_WISE, ranks=(0, True)), r"ranks must be a sequence of integers, got \(0, True\)"),
    (lambda: TablePlacement(ShardingType.ROW_WISE, ranks=(0, 1), sizes=(1.5, 2)), r"sizes must be a sequence of integers, got \(1\.5, 2\)"),
    (lambda: TablePlacement("diagonal"), r"unknown sharding type 'diagonal'; expected one of: data_parallel, table_wise, row_wise, column_wise, table_row_wise"),
    (lambda: ShardingPlan(world_size=0), r"world_size must be a positive integer, got 0"),
    (lambda: ShardingPlan(world_size=True), r"world_size must be a positive integer, got True"),
    (lambda: ShardingPlan(world_size="2"), r"world_size must be a positive integer, got '2'"),
    (lambda: ShardingPlan(world_size=2, ranks_per_host=0), r"ranks_per_host must be a positive integer, got 0"),
    (lambda: ShardingPlan(world_size=2, ranks_per_host=True), r"ranks_per_host must be a positive integer, got True"),
    (lambda: ShardingPlan.from_dict({"world_size": 2, "ranks_per_hosts": 1, "modules": {}}), r"unknown fields \['ranks_per_hosts'\] in the plan"),
    (lambda: ShardingPlan(world_size=2, modules={"": {"t": "row_wise"}}), r"table 't' of module '' must be a TablePlacement, got str"),
    (lambda: ShardingPlan(world_size=2, modules={1: {}}), r"module FQNs must be strings, got 1"),
    (lambda: ShardingPlan(world_size=2).placement("ebc", "t"), r"the plan has no placement for table 't' of 'ebc'"),
    (lambda: ShardingPlan.from_json("{"), r"plan is not valid JSON: "),
    (lambda: ShardingPlan.from_dict({"modules": {}}), r"a plan needs 'world_size' and 'modules'"),
    (lambda: ShardingPlan.from_dict({"format": 2, "world_size": 1}), r"plan format 2 is not supported \(expected 1\)"),
    (lambda: ShardingPlan.from_dict({"world_size": 1, "modules": {"": {"t": {"ranks": [0]}}}}), r"a table placement needs a 'sharding_type', got \{'ranks': \[0\]\}"),
    (lambda: TablePlacement.from_dict({"sharding_type": "row_wise", "ranks": None}), r"ranks must be a sequence of integers, got None"),
    (lambda: TablePlacement.from_dict({"sharding_type": "row_wise", "ranks": 3}), r"ranks must be a sequence of integers, got 3"),
    (lambda: TablePlacement.from_dict({"sharding_type": "row_wise", "ranks": [0, 1], "sizes": 5}), r"sizes must be a sequence of integers, got 5"),
    (
        lambda: ShardingPlan.from_dict({"world_size": 1, "modules": {"": {"t": {"sharding_type": "row_wise", "rank": [0]}}}}),
        r"unknown fields \['rank'\] in table placement",
    ),
]


@pytest.mark.parametrize("make, message", BAD_PLACEMENTS, ids=[m[:40] for _, m in BAD_PLACEMENTS])
def test_invalid_placements_and_plans_say_why(make, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        make()


@pytest.mark.parametrize("text", ["row_wise", "ROW_WISE", " Row_Wise ", ShardingType.ROW_WISE])
def test_sharding_type_parses_values_and_names(text) -> None:
    assert ShardingType.parse(text) is ShardingType.ROW_WISE
    assert TablePlacement(text, ranks=(0,)).sharding_type is ShardingType.ROW_WISE
