"""What `modular.shard` checks of a plan's tiered tables (Note [tiered tables] in
modular/tiered/__init__.py)."""

from __future__ import annotations

import os
import shutil
from typing import Optional

import torch
import torch.distributed as dist

from modular.errors import ShardingError
from modular.fused.choice import emulation_reason
from planners.types import ShardingType

__all__ = ["check_tiers", "tiered_tables"]

_RESIDENT = 'drop cache_load_factor from its constraints to train it resident'
# Turns on the tier on CUDA ranks (a GPU cache over pinned host memory): written, not yet run on
# a GPU (tests/gpu/test_cuda_tiered.py, `scripts/gpu/run.sh tiered`).
CUDA_TIERS = "MODULAR_CUDA_TIERS"


def tiered_tables(plan, fqns: list[str]) -> list[str]:
    """'fqn.table' (or 'table') of every placement in `plan` with a cache_load_factor."""
    return [
        f"{fqn}.{name}" if fqn else name
        for fqn in fqns
        for name, p in sorted(plan.modules[fqn].items())
        if getattr(p, "cache_load_factor", None) is not None
    ]


def check_tiers(
    plan, targets: list[tuple[str, object]], resolved: dict, device: torch.device,
    tier_dir: Optional[str], *, fused_of, read_tables, replicated: bool, rank: int,
) -> None:  # fmt: skip
    """Raises ShardingError (inside `shard`'s agreement, so on every rank) naming a tiered table
    that cannot be built as planned: without `tier_dir` on CPU, off CPU, unfused, under an
    optimizer or a kernel that the tier does not wrap (fbgemm's fused CPU kernels only),
    data-parallel, in a 2D layout, or not FP32. `resolved[fqn]` is (placements, shards);
    `fused_of(module)` its FusedConfig or None; `read_tables(fqn, module)` its TableInfos."""
    fqns = [fqn for fqn, _ in targets]
    tables = tiered_tables(plan, fqns)
    if not tables:
        return
    named = ", ".join(tables)
    if device.type == "cpu" and tier_dir is None:
        raise ShardingError(
            f"the plan puts tables {named} on a tier (cache_load_factor), whose rows CPU ranks "
            "keep in files: pass modular.shard(..., tier_dir=DIR), a directory on local disk"
        )
    if device.type == "cpu":
        _check_dir(tier_dir)
    if device.type != "cpu" and not (device.type == "cuda" and os.environ.get(CUDA_TIERS) == "1"):
        raise ShardingError(
            f"the plan puts tables {named} on a tier (cache_load_factor), which modular builds on "
            f"CPU ranks only so far (docs/tiered_tables.md), not on {device.type}; the CUDA path "
            f"(a GPU cache over host memory) is written but has not run on a GPU: {CUDA_TIERS}=1 "
            "turns it on (scripts/gpu/run.sh tiered)"
        )
    if replicated:
        raise ShardingError(
            f"the plan puts tables {named} on a tier (cache_load_factor), which a 2D layout does "
            "not take yet (docs/tiered_tables.md): shard over one group"
        )
    needed = 0  # bytes of this rank's stores
    for fqn, module in targets:
        placements, shards = resolved[fqn]
        infos = {t.name: t for t in read_tables(fqn, module)}
        for name, p in sorted(placements.items()):
            if getattr(p, "cache_load_factor", None) is None:
                continue
            fused = fused_of(module)
            _check_table(f"{fqn}.{name}" if fqn else name, p, shards[name], infos[name], fused, device.type)
            kind = fused.optimizer
            for spec in shards[name]:
                if spec.rank == rank:
                    per_row = spec.num_cols + sum(1 if kind.row_state(n) else spec.num_cols for n in kind.state_names())
                    needed += 4 * spec.num_rows * per_row
    if device.type != "cpu":  # host memory, not files
        return
    free = shutil.disk_usage(tier_dir).free
    if needed > free:
        raise ShardingError(
            f"tier_dir {tier_dir!r} on rank {rank} has {free / 2**30:.1f} GiB free, and this rank's "
            f"tiered shards ({named}) need {needed / 2**30:.1f} GiB of files there (weights and "
            "fused state, 4 bytes a value); free space, or pass another tier_dir"
        )


def _check_dir(tier_dir: str) -> None:
    """`tier_dir` exists (made if missing) and takes files, on this rank."""
    try:
        os.makedirs(tier_dir, exist_ok=True)
        if not os.access(tier_dir, os.W_OK | os.X_OK):
            raise PermissionError("not writable")
    except OSError as e:
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise ShardingError(
            f"tier_dir {tier_dir!r} cannot hold the tiered tables' files on rank {rank}: {e}; "
            "pass a writable directory on local disk"
        ) from e


def _check_table(table: str, placement, shards, info, fused, device_type: str) -> None:
    def refuse(why: str) -> None:
        raise ShardingError(f"tiered table {table!r}: {why} (docs/tiered_tables.md); {_RESIDENT}")

    if fused is None:
        refuse("its rows and their update live in the cache, so it trains with a fused optimizer: "
               "call modular.fuse_optimizer(model, ...) before shard")  # fmt: skip
    if placement.sharding_type is ShardingType.DATA_PARALLEL:
        refuse("a data-parallel table is a copy on every rank, not shards a tier can hold")
    if info.dtype != torch.float32:
        refuse(f"tiers hold FP32 tables so far, not {info.dtype}")
    emulated = emulation_reason(
        device_type=device_type, optimizer=fused.optimizer, weight_decay=fused.weight_decay,
        widths=tuple(s.num_cols for s in shards), deferred=None,
    )  # fmt: skip
    if emulated is not None and not fused.optimizer.adam_family():  # the Adam family's is wrapped
        refuse(f"the tier wraps fbgemm's fused CPU kernels (exact_sgd, exact_adagrad, "
               f"exact_rowwise_adagrad) and the Adam family's, and this table would take the "
               f"torch emulation of {fused.optimizer.value}: {emulated}")  # fmt: skip
    pieces = placement.sharding_type is ShardingType.COLUMN_WISE and len(shards) > 1
    if pieces and fused.optimizer.whole_row_statistics() and not fused.per_shard_rows:
        per_shard = "pass column_wise_statistic='per_shard' to fuse_optimizer, or " if fused.optimizer.rowwise() else ""
        refuse(f"its column pieces share whole rows' statistic under {fused.optimizer.value}, "
               f"which the tier does not wrap yet; {per_shard}plan it table-wise or row-wise")  # fmt: skip
