"""`modular.tier_stats`: per tiered table, what its cache did since the last call (Note [tiered
tables] in modular/tiered/__init__.py)."""

from __future__ import annotations

from torch import nn

from modular.sharding import sharded_modules
from modular.tiered.kernel import TieredKernel

__all__ = ["tier_stats"]


def tier_stats(model: nn.Module) -> dict[str, dict[str, int]]:
    """Per tiered table of `model` (this rank's shards of it, summed): cache_rows, hits, misses,
    rows_fetched, rows_written_back, bytes_fetched, bytes_written_back since the last call
    (empty when no table is tiered; docs/tiered_tables.md)."""
    out: dict[str, dict[str, int]] = {}
    for fqn, module in sharded_modules(model):
        fused = module.fused_tables
        for kernel in () if fused is None else fused.kernels:
            if isinstance(kernel, TieredKernel):
                for table, counts in kernel.take_stats().items():
                    mine = out.setdefault(f"{fqn}.{table}" if fqn else table, dict.fromkeys(counts, 0))
                    for key, n in counts.items():  # a rank's shards of one table, summed
                        mine[key] += n
    return out
