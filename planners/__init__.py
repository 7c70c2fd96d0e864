"""Planning: which sharding type and ranks each embedding table gets.

Pure Python (plus numpy for the search): nothing here imports torch.distributed.
"""

from planners.types import (
    PlanError,
    ShardingPlan,
    ShardingType,
    ShardSpec,
    TablePlacement,
    even_split,
)

__all__ = [
    "PlanError",
    "ShardSpec",
    "ShardingPlan",
    "ShardingType",
    "TablePlacement",
    "even_split",
]
