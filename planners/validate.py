"""Whether a plan places exactly the given tables on a topology (`validate_plan`)."""

from __future__ import annotations

from planners.inputs import Topology
from planners.model_tables import TableSet, TablesLike, as_table_set, display_name
from planners.types import PlanError, ShardingPlan, ShardingType, check_one_host

__all__ = ["check_placements", "validate_plan"]


def validate_plan(
    plan: ShardingPlan, tables: TablesLike, topology: Topology, *, module_fqn: str = ""
) -> None:
    """Raises PlanError unless `plan` places every table exactly once on this topology.

        validate_plan(plan, tables, Topology(8))   # tables: as `plan` takes them, or a model

    Checks: world sizes agree; every table has a placement and the plan has no others; shards
    cover every row and column exactly (TablePlacement.shards); table-row-wise stays on a host.
    """
    check_placements(plan, as_table_set(tables, module_fqn), topology)


def check_placements(plan: ShardingPlan, table_set: TableSet, topology: Topology) -> None:
    """`validate_plan` of tables already read as a table set."""
    if plan.world_size != topology.world_size:
        raise PlanError(
            f"the plan is for {plan.world_size} ranks but the topology has "
            f"{topology.world_size}; plan again for this world size"
        )
    expected = {(fqn, t.name) for fqn, t in table_set}
    for fqn, tables in plan.modules.items():
        for name in tables:
            if (fqn, name) not in expected:
                raise PlanError(
                    f"the plan places table {display_name(fqn, name)!r}, which is not among "
                    "the tables given; pass the tables the plan was made for"
                )
    for fqn, table in table_set:
        placement = plan.placement(fqn, table.name)
        where = f"table {display_name(fqn, table.name)!r}"
        placement.shards(num_embeddings=table.num_embeddings, embedding_dim=table.embedding_dim,
                         world_size=topology.world_size, table=where)  # fmt: skip
        if placement.sharding_type is ShardingType.TABLE_ROW_WISE:
            check_one_host(placement.ranks, int(topology.ranks_per_host or 1), where)
