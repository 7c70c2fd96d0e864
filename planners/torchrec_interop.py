"""Plans both ways between ours and TorchRec's `ShardingPlan`.

`to_torchrec` lets our planner drive TorchRec's DistributedModelParallel; `from_torchrec` lets
TorchRec's planner's plans be priced by `plan_stats`, under the same cost model as ours.

This is the one module of `planners` that uses torchrec (and so torch.distributed); it imports
it inside the two functions, so that importing `planners` stays free of torch.

Note [row-wise layouts in TorchRec]
TorchRec's row-wise sharding does not route an id by the shard sizes in its plan. It has one
shard per rank of the world (table-row-wise: per rank of the host), shard i on rank i (local rank
i), and its input dist sends id `x` of an `N`-row table over `n` such ranks to rank
x // ceil(N / n) -- the "block split": ceil(N / n) rows on every rank but the last ones, whose
shards may have fewer rows or none (1000 rows over 3 ranks: 334/334/332). Under any other shard
sizes TorchRec accepts the plan and then looks up wrong rows. Our placements may use fewer ranks,
another order or other sizes (the planner splits 1000 rows 334/333/333); all of them compute the
same model, so `to_torchrec` gives TorchRec its block split of the table over the same kind of
ranks and warns (`TorchRecLayoutWarning`) when that moves rows, saying which placement would
keep them. `from_torchrec` refuses a TorchRec plan whose row shards are not the block split (DMP
computes wrong lookups under it) and drops the 0-row shards of one that is.

Note [column pieces in TorchRec]
TorchRec's fused kernel (fbgemm's TBE) refuses a shard that is not a multiple of 4 columns wide,
on CPU too, whatever the sharding type. Column pieces are concatenated in column order whatever
their ranks, so their widths change no lookup: `to_torchrec` moves each cut between pieces to the
nearest multiple of 4 (and warns) when the table's width allows it, and otherwise raises
PlanError. The dense kernel takes any width.

Note [tiered tables in TorchRec]
A tiered placement (`cache_load_factor`, `cache_policy`) is TorchRec's UVM caching: the shard's
rows in host memory (UVM) behind an HBM cache of that fraction of its rows, with fbgemm's LRU or
LFU, `EmbeddingComputeKernel.FUSED_UVM_CACHING` with `CacheParams(load_factor=,
algorithm=)`. `to_torchrec` gives a tiered table that kernel whatever `compute_kernel` says (the
cache is the tier's point), and `from_torchrec` reads a FUSED_UVM_CACHING table back as tiered,
its load factor from its `cache_params` (a PlanError where the plan leaves it to the sharder's
fused_params, which the plan does not carry). Other kernels read back as resident.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Mapping

from planners.model_tables import TableSet, TablesLike, as_table_set, display_name
from planners.types import (
    PlanError, ShardingPlan, ShardingType, TablePlacement, block_split, check_one_host, even_split,
)  # fmt: skip

__all__ = ["TorchRecLayoutWarning", "from_torchrec", "to_torchrec"]

_T = ShardingType
_FROM_TORCHREC = {
    "data_parallel": _T.DATA_PARALLEL,
    "table_wise": _T.TABLE_WISE,
    "row_wise": _T.ROW_WISE,
    "column_wise": _T.COLUMN_WISE,
    "table_column_wise": _T.COLUMN_WISE,  # column shards on chosen ranks: our COLUMN_WISE
    "table_row_wise": _T.TABLE_ROW_WISE,
}
_KERNELS = ("fused", "dense")
_UVM_CACHING = "fused_uvm_caching"  # torchrec's EmbeddingComputeKernel.FUSED_UVM_CACHING.value
_Block = tuple[int, int, int, int, int]  # (rank, row offset, rows, column offset, columns)


class TorchRecLayoutWarning(UserWarning):
    """`to_torchrec` gave a table other shard boundaries than the plan's, ones TorchRec computes
    correctly with; the model computes the same, only where rows or columns live differs.
    `warnings.simplefilter("error", planners.TorchRecLayoutWarning)` makes it an error."""


def _device(device_type: str, rank: int, ranks_per_host: int) -> str:
    if device_type == "cpu":
        return f"rank:{rank}/cpu"
    return f"rank:{rank}/{device_type}:{rank % ranks_per_host}"


def to_torchrec(
    plan: ShardingPlan,
    tables: TablesLike,
    *,
    device_type: str = "cuda",
    module_fqn: str = "",
    ranks_per_host: int | None = None,
    compute_kernel: str = "fused",
) -> Any:
    """Our plan as a `torchrec.distributed.types.ShardingPlan` for DistributedModelParallel.

        tr_plan = to_torchrec(plan, model, device_type="cuda")
        model = DistributedModelParallel(model, plan=tr_plan, ...)

    `tables` as for `planners.plan`: the model, its EBC, a list of `Table` or of torchrec
    `EmbeddingBagConfig`. Shards use `compute_kernel` ("fused": the optimizer in the sharder's
    fused_params updates them in backward; "dense": your optimizer does); data-parallel tables
    always use "dense"; a tiered table (`cache_load_factor`) "fused_uvm_caching" with its
    cache's `CacheParams` (Note [tiered tables in TorchRec]). `ranks_per_host` defaults to the
    plan's; TorchRec takes its own host size from LOCAL_WORLD_SIZE, which must agree for
    table-row-wise tables.

    DMP then computes what `modular.shard` computes with `plan`. Where TorchRec cannot hold a
    table the plan's way, it gets boundaries TorchRec routes correctly and a
    `TorchRecLayoutWarning` names the table and the placement that would keep them: row-wise
    and table-row-wise rows become TorchRec's block split (Note [row-wise layouts in
    TorchRec]); under the fused kernel, column cuts move to multiples of 4 (Note [column
    pieces in TorchRec]). Raises PlanError for what no TorchRec plan runs: a table whose width
    is not a multiple of 4 under the fused kernel, more column pieces than it has 4-column
    groups, a block of 0 rows under the fused kernel on CPU (fbgemm fails on it), and
    table-row-wise on a world that is not whole hosts.
    """
    from torch.distributed._shard.sharding_spec import EnumerableShardingSpec, ShardMetadata
    from torchrec.distributed.types import (
        CacheAlgorithm, CacheParams, EmbeddingModuleShardingPlan, ParameterSharding,
    )  # fmt: skip
    from torchrec.distributed.types import ShardingPlan as TorchRecPlan

    if compute_kernel not in _KERNELS:
        raise PlanError(f"compute_kernel must be one of {_KERNELS}, got {compute_kernel!r}")
    table_set = as_table_set(tables, module_fqn)
    world = plan.world_size
    host = ranks_per_host or plan.ranks_per_host or world
    out: dict[str, Any] = {}
    moved: list[str] = []
    for fqn, table in table_set:
        p = plan.placement(fqn, table.name)
        where = f"table {display_name(fqn, table.name)!r}"
        kind = p.sharding_type
        kernel, cache = compute_kernel, None
        if p.cache_load_factor is not None:  # Note [tiered tables in TorchRec]
            algorithm = getattr(CacheAlgorithm, p.cache_policy.upper())
            kernel, cache = _UVM_CACHING, CacheParams(load_factor=p.cache_load_factor, algorithm=algorithm)
        if kind is _T.DATA_PARALLEL:
            sharding = ParameterSharding(sharding_type=kind.value, compute_kernel="dense",
                                         ranks=list(range(world)), sharding_spec=None)  # fmt: skip
        else:
            shards = p.shards(num_embeddings=table.num_embeddings,
                              embedding_dim=table.embedding_dim, world_size=world, table=where)  # fmt: skip
            blocks = [(s.rank, s.row_offset, s.num_rows, s.col_offset, s.num_cols) for s in shards]
            if kernel != "dense":
                _check_width(where, table.embedding_dim)
            if kind in (_T.ROW_WISE, _T.TABLE_ROW_WISE):
                blocks = _torchrec_rows(kind, blocks, table.embedding_dim, world, host, where, moved)
                if device_type == "cpu" and kernel != "dense":
                    _check_no_empty_rows(kind, blocks, where)
            elif kind is _T.COLUMN_WISE and kernel != "dense":
                blocks = _torchrec_columns(blocks, table.embedding_dim, where, moved)
            spec = EnumerableShardingSpec([
                ShardMetadata(shard_offsets=[ro, co], shard_sizes=[nr, nc],
                              placement=_device(device_type, r, host))
                for r, ro, nr, co, nc in blocks
            ])  # fmt: skip
            sharding = ParameterSharding(sharding_type=kind.value, compute_kernel=kernel,
                                         ranks=[b[0] for b in blocks], sharding_spec=spec,
                                         cache_params=cache)  # fmt: skip
        out.setdefault(fqn, EmbeddingModuleShardingPlan())[table.name] = sharding
    if moved:
        warnings.warn(
            f"to_torchrec gave {len(moved)} table(s) other shard boundaries than the plan's, ones "
            "TorchRec computes correctly with; the model computes the same, only where rows or "
            "columns live (and each rank's memory) differs:\n" + "\n".join(moved),
            TorchRecLayoutWarning, stacklevel=2,
        )  # fmt: skip
    return TorchRecPlan(plan=out)


def _check_width(where: str, dim: int) -> None:
    if dim % 4:
        raise PlanError(
            f"{where} is {dim} columns wide, but TorchRec's fused kernel needs every shard to be "
            f"a multiple of 4 columns wide, so no TorchRec layout of it runs fused; pass "
            "compute_kernel='dense' (your optimizer then updates the table) or give the table "
            f"a width that is a multiple of 4 (e.g. {dim + 4 - dim % 4})"
        )


def _torchrec_rows(
    kind: ShardingType, blocks: list[_Block], dim: int, world: int, host: int, where: str,
    moved: list[str],
) -> list[_Block]:
    """One shard per rank of the world (TWRW: of the host), in the block split; appends a line
    to `moved` when that is not the plan's layout."""
    ranks = tuple(b[0] for b in blocks)
    if kind is _T.TABLE_ROW_WISE:
        check_one_host(ranks, host, where)
        if world % host:
            raise PlanError(
                f"{where} is table_row_wise with {host} ranks per host, but the world has {world} "
                f"ranks, not a multiple of {host}; TorchRec's table-row-wise needs whole hosts: "
                "pass the ranks_per_host you launch with (LOCAL_WORLD_SIZE)"
            )
        first = ranks[0] // host * host
        span = tuple(range(first, first + host))
    else:
        span = tuple(range(world))
    rows = sum(b[2] for b in blocks)
    sizes = block_split(rows, len(span))
    out, offset = [], 0
    for r, n in zip(span, sizes):
        out.append((r, offset, n, 0, dim))
        offset += n
    ours = [(r, ro, nr) for r, ro, nr, _, _ in sorted(blocks)]
    theirs = [(r, ro, nr) for r, ro, nr, _, _ in out if nr]
    if ours != theirs:
        moved.append(
            f"- {where} is {kind.value} with rows {_rows_by_rank(ours)}, but TorchRec routes "
            f"{kind.value} ids in blocks of ceil({rows} / {len(span)}) = {sizes[0]} rows over "
            f"ranks {span[0]}-{span[-1]}: it gets rows "
            f"{_rows_by_rank(theirs)}; to keep one layout in both, place it as "
            + _placement_text(kind, tuple(r for r, _, _ in theirs), tuple(n for _, _, n in theirs))
        )  # fmt: skip
    return out


def _placement_text(kind: ShardingType, ranks: tuple[int, ...], sizes: tuple[int, ...]) -> str:
    shown = "" if sizes == even_split(sum(sizes), len(sizes)) else f", sizes={sizes}"
    return f"TablePlacement({kind.name}, ranks={ranks}{shown})"


def _check_no_empty_rows(kind: ShardingType, blocks: list[_Block], where: str) -> None:
    empty = [b[0] for b in blocks if not b[2]]
    if empty:
        rows, n = sum(b[2] for b in blocks), len(blocks)
        raise PlanError(
            f"{where} has {rows} rows, and TorchRec's {kind.value} puts blocks of ceil({rows} / "
            f"{n}) = {blocks[0][2]} rows on ranks {blocks[0][0]}-{blocks[-1][0]}, which leaves "
            f"rank(s) {empty} with 0 rows; fbgemm's fused CPU kernel fails on a 0-row shard. On "
            "CPU place it table_wise, column_wise or data_parallel, or pass compute_kernel='dense'"
        )


def _rows_by_rank(shards: list[tuple[int, int, int]]) -> str:
    """'0-333 on rank 0, 334-667 on rank 1, 668 on rank 2', in row order."""
    return ", ".join(
        f"{ro}{f'-{ro + nr - 1}' if nr > 1 else ''} on rank {r}"
        for r, ro, nr in sorted(shards, key=lambda s: s[1])
    )


def _torchrec_columns(blocks: list[_Block], dim: int, where: str, moved: list[str]) -> list[_Block]:
    """Column cuts moved to the nearest multiples of 4, keeping each piece's rank and order."""
    widths = [b[4] for b in blocks]
    if all(w % 4 == 0 for w in widths):
        return blocks
    units, k = dim // 4, len(widths)
    if k > units:
        raise PlanError(
            f"{where} ({dim} columns) is cut into {k} column pieces {tuple(widths)}, but TorchRec's "
            f"fused kernel needs pieces that are multiples of 4 columns wide, so at most {units}; "
            f"use at most {units} ranks (e.g. sizes={tuple(4 * u for u in even_split(units, min(k, units)))}) "
            "or compute_kernel='dense'"
        )  # fmt: skip
    new, cut, acc = [], 0, 0
    for i, w in enumerate(widths[:-1]):
        acc += w
        nearest = min(max((acc + 2) // 4, cut + 1), units - (k - 1 - i))
        new.append(4 * (nearest - cut))
        cut = nearest
    new.append(4 * (units - cut))
    ranks = tuple(b[0] for b in blocks)
    moved.append(
        f"- {where} is column_wise over ranks {ranks} with widths {tuple(widths)}, but TorchRec's "
        f"fused kernel needs pieces that are multiples of 4 columns wide: it gets widths {tuple(new)}; to keep one layout in both, place it as "
        + _placement_text(_T.COLUMN_WISE, ranks, tuple(new))
    )  # fmt: skip
    out, offset = [], 0
    for (r, ro, nr, _, _), w in zip(blocks, new):
        out.append((r, ro, nr, offset, w))
        offset += w
    return out


def from_torchrec(
    torchrec_plan: Any,
    *,
    world_size: int,
    ranks_per_host: int | None = None,
    tables: TablesLike | None = None,
) -> ShardingPlan:
    """A TorchRec `ShardingPlan` (of EmbeddingBagCollections) as our `ShardingPlan`.

        ours = from_torchrec(planner.plan(model, sharders), world_size=64, ranks_per_host=8)
        stats = plan_stats(ours, tables, topology, batch_size=512)

    Every shard keeps the boundaries TorchRec computes with; sizes are written only where they
    differ from the even split, and row-wise 0-row shards are dropped (Note [row-wise layouts
    in TorchRec]). `tables`, when given, restricts the result to those tables (e.g. to skip
    modules other than EBCs). A table under UVM caching comes back tiered (Note [tiered tables
    in TorchRec]). Raises PlanError for sharding types we do not have
    (grid_shard), and for row shards that are not TorchRec's block split, under which
    DistributedModelParallel looks up wrong rows.
    """
    wanted: TableSet | None = as_table_set(tables) if tables is not None else None
    keep = {(f, t.name) for f, t in wanted} if wanted is not None else None
    modules: dict[str, dict[str, TablePlacement]] = {}
    for fqn, module_plan in torchrec_plan.plan.items():
        for name, ps in module_plan.items():
            if keep is not None and (fqn, name) not in keep:
                continue
            where = f"table {display_name(fqn, name)!r}"
            modules.setdefault(fqn, {})[name] = _placement_from(ps, where, world_size, ranks_per_host)
    return ShardingPlan(world_size, modules, ranks_per_host=ranks_per_host)


def _placement_from(ps: Any, where: str, world: int, host: int | None) -> TablePlacement:
    placement = _layout_from(ps, where, world, host)
    if str(ps.compute_kernel) != _UVM_CACHING:
        return placement
    cache = ps.cache_params  # Note [tiered tables in TorchRec]
    factor = None if cache is None else cache.load_factor
    if factor is None:
        raise PlanError(f"{where} uses {_UVM_CACHING} with no cache_params.load_factor in the "
                        "TorchRec plan (the sharder's fused_params would set it, which the plan "
                        "does not carry); give it ParameterSharding(cache_params=CacheParams("
                        "load_factor=...))")  # fmt: skip
    algorithm = getattr(cache.algorithm, "name", "LRU") if cache.algorithm is not None else "LRU"
    return dataclasses.replace(placement, cache_load_factor=float(factor),
                               cache_policy=algorithm.lower())  # fmt: skip


def _layout_from(ps: Any, where: str, world: int, host: int | None) -> TablePlacement:
    kind = _FROM_TORCHREC.get(str(ps.sharding_type))
    if kind is None:
        raise PlanError(
            f"{where} is {ps.sharding_type} in the TorchRec plan, which has no equivalent here; "
            f"constrain TorchRec's planner to {', '.join(sorted(_FROM_TORCHREC))}"
        )
    if kind is _T.DATA_PARALLEL:
        return TablePlacement(kind)
    shards = list(ps.sharding_spec.shards)
    if kind is _T.TABLE_WISE:
        return TablePlacement(kind, (shards[0].placement.rank(),))
    if kind in (_T.ROW_WISE, _T.TABLE_ROW_WISE):
        _check_block_split(kind, shards, where, world, host)
    axis = 1 if kind is _T.COLUMN_WISE else 0
    shards = sorted((s for s in shards if s.shard_sizes[axis] > 0), key=lambda s: s.shard_offsets[axis])
    ranks = tuple(s.placement.rank() for s in shards)
    sizes = tuple(int(s.shard_sizes[axis]) for s in shards)
    even = even_split(sum(sizes), len(sizes))
    return TablePlacement(kind, ranks, None if sizes == even else sizes)


def _check_block_split(kind: ShardingType, shards: list, where: str, world: int, host: int | None) -> None:
    """Raises unless shard i of the spec is on rank i of its span and holds block i of the rows."""
    n = world if kind is _T.ROW_WISE else host or len(shards)
    first = shards[0].placement.rank() // n * n if kind is _T.TABLE_ROW_WISE else 0
    rows = sum(int(s.shard_sizes[0]) for s in shards)
    expected = [(first + i, size) for i, size in enumerate(block_split(rows, n))]
    got = [(s.placement.rank(), int(s.shard_sizes[0])) for s in shards]
    offsets = [int(s.shard_offsets[0]) for s in shards if s.shard_sizes[0]]
    in_order = offsets == sorted(offsets)
    if got != expected or not in_order:
        raise PlanError(
            f"{where} is {kind.value} in the TorchRec plan with (rank, rows) shards {got}, but "
            f"TorchRec routes its ids in blocks of ceil({rows} / {n}) = {expected[0][1]} rows, "
            f"shard i on rank {first} + i: {expected}, so "
            "DistributedModelParallel looks up wrong rows under this plan; give the table "
            "TorchRec's block split (torchrec.distributed.sharding_plan.row_wise() and "
            "planners.to_torchrec do)"
        )


def placements_by_table(plan: ShardingPlan) -> Mapping[tuple[str, str], TablePlacement]:
    """{(module FQN, table): placement}, handy when comparing two plans."""
    return {(f, n): p for f, tables in plan.modules.items() for n, p in tables.items()}
