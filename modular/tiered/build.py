"""A tiered kernel group's stores and kernel, as `FusedTables.kernel` builds them (Note [tiered
tables] in modular/tiered/__init__.py)."""

from __future__ import annotations

import os
import tempfile

from modular.tables.layout import KernelGroup, RankLayout
from modular.tiered.kernel import TieredKernel, cache_rows_for
from modular.tiered.store import HostStore, RowStore

__all__ = ["tiered_kernel"]


def tiered_kernel(
    group: KernelGroup, sizes: list[tuple[int, int]], *, at: RankLayout, config, steps
) -> TieredKernel:
    """The kernel of one tiered group: on CPU a store per shard in a new directory under the
    module's `tier_dir` (one per rank and module, so that ranks and models sharing it never
    share a file), on a GPU in pinned host memory; caches sized by each table's
    `cache_load_factor`."""
    layout, kind = at.layout, config.optimizer
    module = at.module or "model"
    on_cpu = at.device.type == "cpu"  # else: host memory under the GPU's cache
    directory = tempfile.mkdtemp(prefix=f"rank{at.global_rank}.{module}.", dir=at.tier_dir) if on_cpu else None
    stores, cache_rows, policies, tables = [], [], [], []
    for (table, j), (rows, cols) in zip(group.shards, sizes):
        placement = layout.placements[layout.table_index(table)]
        shapes = {n: (rows,) if kind.row_state(n) else (rows, cols) for n in kind.state_names()}
        if on_cpu:
            stores.append(RowStore(os.path.join(directory, f"{table}.{j}"), rows, cols, shapes))
        else:
            stores.append(HostStore(rows, cols, shapes))
        cache_rows.append(cache_rows_for(rows, placement.cache_load_factor))
        policies.append(placement.cache_policy)
        tables.append(table)
    return TieredKernel(
        group, sizes, at.device, config, tables=tables, cache_rows=cache_rows, stores=stores,
        policies=policies, steps=steps,
    )  # fmt: skip
