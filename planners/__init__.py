"""Planning: which sharding type and ranks each embedding table gets.

Pure Python (plus numpy for the search): nothing here imports torch.distributed.

    import planners
    tables = [planners.Table("t_user", 10_000_000, 128, features=("user_id",), pooling_factor=1.0)]
    topology = planners.Topology(64, ranks_per_host=8, device_memory=80 * 2**30)
    plan = planners.plan(tables, topology, batch_size=512)
    print(planners.plan_stats(plan, tables, topology, batch_size=512).format())

The cost model, the search and the lower bound are described in docs/planner.md.
"""

from planners.api import PlanOptions, PlanResult, plan, plan_with_stats
from planners.cost import CostModel
from planners.explain import NoPlanError
from planners.files import FileFormatError
from planners.inputs import (
    ColumnWiseStatistic,
    DataType,
    EvictionPolicy,
    ManagedCollision,
    Optimizer,
    Table,
    TableConstraint,
    Topology,
    format_bytes,
    parse_bytes,
)
from planners.model_tables import tables_from_configs, tables_from_model
from planners.replan import ReplanResult, TableMove, move_bytes, replan
from planners.evaluate import plan_stats, validate_plan
from planners.stats import PlanStats, RankStats, ShardStats, TableStats
from planners.torchrec_interop import TorchRecLayoutWarning, from_torchrec, to_torchrec
from planners.types import (
    PlanAssumptions,
    PlanError,
    ShardingPlan,
    ShardingType,
    ShardSpec,
    TablePlacement,
    block_split,
    even_split,
)

__all__ = [
    "ColumnWiseStatistic",
    "CostModel",
    "DataType",
    "EvictionPolicy",
    "FileFormatError",
    "ManagedCollision",
    "NoPlanError",
    "Optimizer",
    "PlanAssumptions",
    "PlanError",
    "PlanOptions",
    "PlanResult",
    "PlanStats",
    "RankStats",
    "ReplanResult",
    "ShardSpec",
    "ShardStats",
    "ShardingPlan",
    "ShardingType",
    "Table",
    "TableConstraint",
    "TableMove",
    "TablePlacement",
    "TableStats",
    "Topology",
    "TorchRecLayoutWarning",
    "block_split",
    "even_split",
    "format_bytes",
    "move_bytes",
    "parse_bytes",
    "plan",
    "plan_stats",
    "plan_with_stats",
    "replan",
    "tables_from_configs",
    "tables_from_model",
    "validate_plan",
    "from_torchrec",
    "to_torchrec",
]

