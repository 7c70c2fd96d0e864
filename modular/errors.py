"""Every error a user of `modular` is expected to catch, in one place.

    try:
        model = modular.shard(model, plan)
    except modular.ShardingError as e:
        ...

All are exported from `modular` itself. `PlanError` (a plan that is wrong on its own, whatever the
model) is the planner's, re-exported here for one-stop imports. `PlanMismatchWarning` is a
warning, not an error: a plan priced for other settings than it runs under (Note [a plan's
assumptions] in modular/plan_assumptions.py).
"""

from __future__ import annotations

from planners.types import PlanError

__all__ = [
    "CheckpointError", "CollectiveError", "InputError", "PlanError", "PlanMismatchWarning",
    "ShardingError",
]


class ShardingError(ValueError):
    """A plan that does not fit the model or the process group; names the module, table or rank."""


class PlanMismatchWarning(UserWarning):
    """`modular.shard` (or `reshard`) runs a plan under settings that change only its price, not
    its layout: another optimizer, comm dtype or replica sync than it was priced for. Names the
    setting, both values and the fix; warned once per process for each such pair. To make it an
    error: `warnings.simplefilter("error", modular.PlanMismatchWarning)`."""


class InputError(ValueError):
    """A batch that a sharded module cannot look up; the message names the feature and table."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved or loaded: names the file, table or key and the fix."""


class CollectiveError(RuntimeError):
    """A collective of a sharded module failed, almost always because a peer rank died or raised.

    # Note [a failed peer]
    A rank that dies closes its sockets, and gloo fails its peers' pending collectives at once; a
    rank that raises stays alive and silent, and its peers fail when the collective times out
    (the `timeout` given to `init_process_group`). Either way torch's message names only a socket
    or a timeout, so the collectives here re-raise it saying which collective, on which rank, and
    where to look: the rank that failed first says why in its own error.
    """
