"""What `modular.shard` checks of a plan's tiered tables (Note [tiered tables] in
modular/tiered/__init__.py)."""

from __future__ import annotations

from typing import Optional

import torch

from modular.errors import ShardingError

__all__ = ["check_tiers", "tiered_tables"]


def tiered_tables(plan, fqns: list[str]) -> list[str]:
    """'fqn.table' (or 'table') of every placement in `plan` with a cache_load_factor."""
    return [
        f"{fqn}.{name}" if fqn else name
        for fqn in fqns
        for name, p in sorted(plan.modules[fqn].items())
        if getattr(p, "cache_load_factor", None) is not None
    ]


def check_tiers(plan, fqns: list[str], device: torch.device, tier_dir: Optional[str]) -> None:
    """Raises ShardingError (inside `shard`'s agreement, so on every rank) naming the tiered
    tables: without `tier_dir` on CPU; and, until the tiered kernel is built by `shard`, always
    (docs/tiered_tables.md, "Not done yet") rather than train them resident behind the user's
    back."""
    tables = tiered_tables(plan, fqns)
    if not tables:
        return
    named = ", ".join(tables)
    if device.type == "cpu" and tier_dir is None:
        raise ShardingError(
            f"the plan puts tables {named} on a tier (cache_load_factor), whose rows CPU ranks "
            "keep in files: pass modular.shard(..., tier_dir=DIR), a directory on local disk"
        )
    raise ShardingError(
        f"the plan puts tables {named} on a tier (cache_load_factor), which modular.shard does not "
        "build yet (docs/tiered_tables.md); drop cache_load_factor from their constraints"
    )
