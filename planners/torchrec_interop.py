"""Plans both ways between ours and TorchRec's `ShardingPlan`.

`to_torchrec` lets our planner drive TorchRec's DistributedModelParallel; `from_torchrec` lets
TorchRec's planner's plans be priced by `plan_stats`, under the same cost model as ours.

This is the one module of `planners` that imports torchrec (and so torch.distributed); the rest
of the package stays free of it, so it is imported only when one of these is called.

Note [row-wise layouts in TorchRec]
TorchRec's row-wise sharding has one shard per rank of the world (table-row-wise: per rank of
the host), in rank order, and bucketizes ids by the shards' row offsets; a shard may have 0
rows. Our placements may use a subset of the ranks, so `to_torchrec` pads the missing ranks
with 0-row shards and `from_torchrec` drops them again. For that the row blocks must follow
rank order, which is how the planner writes them (`ranks` increasing).
"""

from __future__ import annotations

from typing import Any, Mapping

from planners.model_tables import TableSet, TablesLike, as_table_set, display_name
from planners.types import (
    PlanError, ShardingPlan, ShardingType, TablePlacement, check_one_host, even_split,
)  # fmt: skip

__all__ = ["from_torchrec", "to_torchrec"]

_T = ShardingType
_FROM_TORCHREC = {
    "data_parallel": _T.DATA_PARALLEL,
    "table_wise": _T.TABLE_WISE,
    "row_wise": _T.ROW_WISE,
    "column_wise": _T.COLUMN_WISE,
    "table_column_wise": _T.COLUMN_WISE,  # column shards on chosen ranks: our COLUMN_WISE
    "table_row_wise": _T.TABLE_ROW_WISE,
}


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
) -> Any:
    """Our plan as a `torchrec.distributed.types.ShardingPlan` for DistributedModelParallel.

        tr_plan = to_torchrec(plan, tables, device_type="cuda")
        model = DistributedModelParallel(model, plan=tr_plan, ...)

    Shards use the fused kernel (data-parallel tables the dense one). `ranks_per_host`
    defaults to the plan's. Raises PlanError for a row-wise placement whose row blocks are not
    in rank order (Note [row-wise layouts in TorchRec]).
    """
    from torch.distributed._shard.sharding_spec import EnumerableShardingSpec, ShardMetadata
    from torchrec.distributed.types import EmbeddingModuleShardingPlan, ParameterSharding
    from torchrec.distributed.types import ShardingPlan as TorchRecPlan

    table_set = as_table_set(tables, module_fqn)
    world = plan.world_size
    host = ranks_per_host or plan.ranks_per_host or world
    out: dict[str, Any] = {}
    for fqn, table in table_set:
        p = plan.placement(fqn, table.name)
        where = f"table {display_name(fqn, table.name)!r}"
        kind = p.sharding_type
        if kind is _T.DATA_PARALLEL:
            sharding = ParameterSharding(sharding_type=kind.value, compute_kernel="dense",
                                         ranks=list(range(world)), sharding_spec=None)  # fmt: skip
        else:
            shards = p.shards(num_embeddings=table.num_embeddings,
                              embedding_dim=table.embedding_dim, world_size=world, table=where)  # fmt: skip
            blocks = [(s.rank, s.row_offset, s.num_rows, s.col_offset, s.num_cols) for s in shards]
            if kind in (_T.ROW_WISE, _T.TABLE_ROW_WISE):
                blocks = _pad_rows(kind, blocks, table.embedding_dim, world, host, where)
            spec = EnumerableShardingSpec([
                ShardMetadata(shard_offsets=[ro, co], shard_sizes=[nr, nc],
                              placement=_device(device_type, r, host))
                for r, ro, nr, co, nc in blocks
            ])  # fmt: skip
            sharding = ParameterSharding(sharding_type=kind.value, compute_kernel="fused",
                                         ranks=[b[0] for b in blocks], sharding_spec=spec)  # fmt: skip
        out.setdefault(fqn, EmbeddingModuleShardingPlan())[table.name] = sharding
    return TorchRecPlan(plan=out)


def _pad_rows(kind, blocks, dim, world, host, where) -> list[tuple[int, int, int, int, int]]:
    ranks = [b[0] for b in blocks]
    if ranks != sorted(ranks):
        raise PlanError(
            f"{where} is {kind.value} over ranks {tuple(ranks)} whose row blocks are not in rank "
            "order, which TorchRec cannot express; list the ranks in increasing order"
        )
    if kind is _T.TABLE_ROW_WISE:
        check_one_host(tuple(ranks), host, where)
        first = ranks[0] // host * host
        span = range(first, first + host)
    else:
        span = range(world)
    by_rank = {b[0]: b for b in blocks}
    out, offset = [], 0
    for r in span:
        _, _, rows, _, _ = by_rank.get(r, (r, offset, 0, 0, dim))
        out.append((r, offset, rows, 0, dim))
        offset += rows
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

    Shard sizes are kept only where they differ from the even split; 0-row shards are dropped
    (Note [row-wise layouts in TorchRec]). `tables`, when given, restricts the result to those
    tables (e.g. to skip modules other than EBCs). Raises PlanError for sharding types we do not
    have (grid_shard) or kernels that are not on the device.
    """
    wanted: TableSet | None = as_table_set(tables) if tables is not None else None
    keep = {(f, t.name) for f, t in wanted} if wanted is not None else None
    modules: dict[str, dict[str, TablePlacement]] = {}
    for fqn, module_plan in torchrec_plan.plan.items():
        for name, ps in module_plan.items():
            if keep is not None and (fqn, name) not in keep:
                continue
            where = f"table {display_name(fqn, name)!r}"
            modules.setdefault(fqn, {})[name] = _placement_from(ps, where)
    return ShardingPlan(world_size, modules, ranks_per_host=ranks_per_host)


def _placement_from(ps: Any, where: str) -> TablePlacement:
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
    axis = 1 if kind is _T.COLUMN_WISE else 0
    shards = sorted((s for s in shards if s.shard_sizes[axis] > 0), key=lambda s: s.shard_offsets[axis])
    ranks = tuple(s.placement.rank() for s in shards)
    sizes = tuple(int(s.shard_sizes[axis]) for s in shards)
    even = even_split(sum(sizes), len(sizes))
    return TablePlacement(kind, ranks, None if sizes == even else sizes)


def placements_by_table(plan: ShardingPlan) -> Mapping[tuple[str, str], TablePlacement]:
    """{(module FQN, table): placement}, handy when comparing two plans."""
    return {(f, n): p for f, tables in plan.modules.items() for n, p in tables.items()}
