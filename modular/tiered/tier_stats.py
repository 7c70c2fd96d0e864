"""`modular.tier_stats`: per tiered table, what its cache did since the last call (Note [tiered
tables] in modular/tiered/__init__.py)."""

from __future__ import annotations

from torch import nn

from modular.sharding import sharded_modules
from modular.tiered.kernel import TieredKernel

__all__ = ["tier_stats"]


def tier_stats(model: nn.Module) -> dict[str, dict[str, int]]:
    """Per tiered table of `model`: cache_rows, hits, misses, rows_fetched, rows_written_back since
    the last call (empty when no table is tiered)."""
    out: dict[str, dict[str, int]] = {}
    for fqn, module in sharded_modules(model):
        fused = getattr(getattr(module, "shards", None), "fused_tables", None)
        for kernel in getattr(fused, "kernels", ()):
            if isinstance(kernel, TieredKernel):
                for table, counts in kernel.take_stats().items():
                    out[f"{fqn}.{table}" if fqn else table] = counts
    return out
