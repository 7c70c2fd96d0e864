"""`PlanError`, the planner's one error type, in a leaf module that every other one may import.

`planners/types.py` (the plan) and `planners/assumptions.py` (what a plan is priced for, which
the plan records) both raise it, and the plan imports the assumptions: so neither may hold it.
Import it from `planners` or `planners.types`, as before.
"""

from __future__ import annotations

__all__ = ["PlanError"]


class PlanError(ValueError):
    """A plan that cannot be applied: the message names the module, table or rank and the fix."""
