"""What `modular.shard` built, in words, on the "modular" logger (a child of it: this module's).

At INFO, once per sharded module and rank (`log_built`, called by `shard`): the tables this rank
holds shards of, with their sharding types and bytes, the bytes of its shards and of the fused
optimizer's state, and its kernels. At DEBUG, each kernel choice as it is made
(`logs_kernel_choice` on `LocalShards._kernel`): which kernel class a kernel group got. Both run
while a module is built, never in a step. Turn them on with
`logging.getLogger("modular").setLevel(logging.INFO)` (README.md, "Reading a trace").
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, TypeVar

from torch import nn

from modular.kernels.base import Kernel
from modular.tables.layout import KernelGroup, Layout
from planners.types import ShardingType

__all__ = ["describe_built", "log_built", "logs_kernel_choice"]

logger = logging.getLogger(__name__)

_Choose = TypeVar("_Choose", bound=Callable[..., Kernel])


def log_built(fqn: str, module: nn.Module) -> None:
    """Logs at INFO what `shard` built for the sharded collection at `fqn` on this rank."""
    if logger.isEnabledFor(logging.INFO):
        logger.info("%s", describe_built(fqn, module))


def describe_built(fqn: str, module: Any) -> str:
    """One line on a sharded collection (`ShardedCollectionModule`) as this rank holds it."""
    layout: Layout = module.layout
    rank, world = layout.rank, layout.world_size
    weights: dict[str, int] = {}
    for (table, _), view in module.local_shard_views().items():
        weights[table] = weights.get(table, 0) + view.numel() * view.element_size()
    tables = [
        f"{t.name} ({p.sharding_type.value}, {weights[t.name]:,} bytes{_tier(p)})"
        for t, p in zip(layout.tables, layout.placements)
        if t.name in weights
    ]
    where = f"rank {rank} of {world}"
    replicas = module.replicas
    if replicas is not None:
        where += f", replica group {replicas.index} of {replicas.size} ({replicas.sync.value})"
    held = f"{sum(weights.values()):,} bytes of shards"
    fused = module.fused_tables
    if fused is not None:
        states = [t for per_shard in fused.states().values() for t in per_shard.values()]
        state = sum(t.numel() * t.element_size() for t in states)
        held += f" and {state:,} bytes of fused {fused.config.optimizer.value} state"
    kernels = [
        f"{type(k).__name__} [{_tables_of(k.group, layout)}]"
        for k in (*module._kernels, *module._local_kernels)
    ]
    return (
        f"modular.shard built module {fqn!r} on {where}: {len(tables)} of its "
        f"{len(layout.tables)} tables have shards here: {', '.join(tables) or 'none'}; {held}; "
        f"kernels: {', '.join(kernels) or 'none'}"
    )


def _tier(placement) -> str:
    """Where a tiered table's bytes are (Note [tiered tables] in modular/tiered/__init__.py)."""
    factor = getattr(placement, "cache_load_factor", None)
    if factor is None:
        return ""
    return f" in files under tier_dir, an {placement.cache_policy.upper()} cache of {factor:g} of its rows"


def logs_kernel_choice(choose: _Choose) -> _Choose:
    """Decorates `LocalShards._kernel(group, is_local)`: logs at DEBUG which kernel each kernel
    group got and why (`choose_kernel` in modular/fused/choice.py), or that it was adopted from
    the module before a reshard."""

    @functools.wraps(choose)
    def logged(shards: Any, group: KernelGroup, is_local: bool) -> Kernel:
        made = len(shards.choices)
        kernel = choose(shards, group, is_local)
        if logger.isEnabledFor(logging.DEBUG):
            at = shards.at
            why = (
                "adopted from the module before reshard" if id(kernel) in shards.adopted
                else shards.choices[made][1].describe() if len(shards.choices) > made
                else "?"
            )  # fmt: skip
            logger.debug(
                "module %r on rank %d of %d: kernel group [%s] (%s, %s%s) -> %s (%s)",
                at.module, at.rank, at.world, _tables_of(group, at.layout), group.pooling.name,
                group.dtype, ", data-parallel" if is_local else "", type(kernel).__name__, why,
            )  # fmt: skip
        return kernel

    return logged  # type: ignore[return-value]


def _tables_of(group: KernelGroup, layout: Layout) -> str:
    """A kernel group's tables by name, `name#j` for shard j of a table cut into several."""
    names = []
    for name, j in group.shards:
        t = layout.table_index(name)
        whole = layout.placements[t].sharding_type is ShardingType.DATA_PARALLEL  # or a replica
        names.append(name if whole or len(layout.shards[t]) == 1 else f"{name}#{j}")
    return ", ".join(names)
