"""Rebalancing a sharded model while it trains (issue 39): measure each feature's pooling factor
from the batches the run sees, ask `planners.replan` for a plan near the current one within a
budget of moved bytes, and `modular.reshard` to it when the priced gain is worth it.
examples/train_dlrm.py --rebalance-every N uses it; docs/resharding.md, "Rebalancing while
training", shows its log.

Note [rebalancing while training]
Every rank must take the same decision, or the ranks would block in different collectives: each
rank counts the ids and bags of each feature in its own batches (`PoolingMeter.add`, on the
device, no sync), and at a check one all-reduce of those counts gives every rank the same pooling
factors (ids per bag over the whole global batch). `replan` is deterministic, so every rank then
gets the same plan and the same priced gain; `modular.reshard` checks that the ranks agree on
the plan anyway (Note [agreeing on the plan]) before anything moves. The check runs between two
steps (after `optimizer.step()`, before the next forward), where `reshard` wants it. Only the
tables whose placement changes are rebuilt; what the rest of the step holds stays valid: a fused
optimizer finds the rebuilt tables itself, a dense optimizer over dense parameters never held
the tables, and a batch prefetched for the old layout is dropped and routed again (a torch
optimizer over `modular.local_parameters` of unfused tables would have to be rebuilt).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

import modular
import planners
from planners.units import format_seconds

__all__ = ["PoolingMeter", "Rebalance", "RebalanceSettings", "planned_pooling", "rebalance"]


@dataclass(frozen=True, kw_only=True)
class RebalanceSettings:
    """When and how far to rebalance; every rank must get the same value."""

    every: int  # steps between checks; 0: never
    max_moved_bytes: int  # weights and optimizer state that may change rank at one check
    threshold: float  # reshard only when the slowest rank gets at least this much faster (0.05: 5%)

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"--rebalance-every must be >= 0 steps (0: never), got {self.every}")
        if self.max_moved_bytes < 0:
            raise ValueError(f"--rebalance-budget must be 0 bytes or more, got {self.max_moved_bytes}")
        if not 0 <= self.threshold < 1:
            raise ValueError(
                f"--rebalance-threshold is a relative gain in [0, 1) (0.05: the slowest rank 5% "
                f"faster), got {self.threshold}"
            )


class PoolingMeter:
    """Ids and bags per feature of the batches this rank has seen since the last `take`."""

    def __init__(self, features: Sequence[str], device: torch.device) -> None:
        self.features = list(features)
        self.counts = torch.zeros(2, len(self.features), dtype=torch.float64, device=device)

    def add(self, kjt) -> None:
        """Counts one batch (a KeyedJaggedTensor with these features, in this order)."""
        if list(kjt.keys()) != self.features:
            raise ValueError(
                f"the batch's features {list(kjt.keys())} are not the ones the model reads "
                f"{self.features}, in that order; build the batch with the model's feature names"
            )
        lengths = kjt.lengths().view(len(self.features), -1)
        self.counts[0] += lengths.sum(dim=1).to(torch.float64)
        self.counts[1] += lengths.shape[1]

    def take(self) -> dict[str, float]:
        """Every rank's counts summed (collective: call on every rank): {feature: mean ids per
        bag}, features seen in no bag left out; the counts start again from zero."""
        counts = self.counts.clone()
        dist.all_reduce(counts)
        self.counts.zero_()
        ids, bags = counts.cpu().tolist()
        return {f: i / b for f, i, b in zip(self.features, ids, bags) if b > 0}


@dataclass(frozen=True)
class Rebalance:
    """What one check found and did; the same on every rank."""

    step: int  # the check ran after this many steps
    pooling: Mapping[str, float]  # measured, per feature
    changed: tuple[tuple[str, float, float], ...]  # (feature, priced before, measured) >10% apart
    old_cost: float  # seconds of the slowest rank: the current plan on the measured tables
    new_cost: float  # the best plan within the budget
    moves: tuple[planners.TableMove, ...]  # what replan moves (moved or not: `resharded`)
    received: tuple[int, ...]  # per rank, bytes it receives
    sent: tuple[int, ...]
    resharded: bool
    why: str

    @property
    def gain(self) -> float:
        return 1.0 - self.new_cost / self.old_cost if self.old_cost > 0 else 0.0

    @property
    def moved_bytes(self) -> int:
        return sum(self.received) if self.resharded else 0

    def format(self, world_size: int) -> str:
        head = f"rebalance after step {self.step}: "
        drift = ", ".join(f"{f} {a:.2f} -> {b:.2f}" for f, a, b in self.changed[:6])
        more = f" and {len(self.changed) - 6} more" if len(self.changed) > 6 else ""
        lines = [head + (f"pooling factors moved: {drift}{more}" if drift else
                         "no pooling factor moved by more than 10%")]  # fmt: skip
        lines.append(f"  slowest rank {format_seconds(self.old_cost)} -> "
                     f"{format_seconds(self.new_cost)} ({-100 * self.gain + 0.0:+.1f}%): "
                     f"{self.why}")  # fmt: skip
        if self.resharded:
            for m in self.moves:
                lines.append(f"  moved {m.name}: {m.before.describe(world_size)} -> "
                             f"{m.after.describe(world_size)}, {planners.format_bytes(m.bytes)}")  # fmt: skip
            lines.append("  per rank received / sent: " + ", ".join(
                f"{r}: {planners.format_bytes(a)} / {planners.format_bytes(b)}"
                for r, (a, b) in enumerate(zip(self.received, self.sent)) if a or b))  # fmt: skip
        return "\n".join(lines)


def rebalance(
    model: nn.Module,
    plan: planners.ShardingPlan,
    tables: Mapping[str, Sequence],
    topology: planners.Topology,
    *,
    step: int,
    pooling: Mapping[str, float],
    priced: Mapping[str, float],
    settings: RebalanceSettings,
    batch_size: int,
    optimizer: str,
    column_wise_statistic: str,
    comm_dtype: str,
) -> tuple[planners.ShardingPlan, Rebalance]:
    """One check (collective: every rank, the same arguments, between two steps): replans
    `tables` ({EBC FQN: configs}) with the measured `pooling` factors from `plan` within the
    budget, and reshards `model` when the slowest rank gets faster by more than the threshold.
    Returns the plan the model now has and what happened. `priced`: the pooling factors `plan`
    was made for (for the log)."""
    result = planners.replan(
        plan, tables, topology, batch_size=batch_size, max_moved_bytes=settings.max_moved_bytes,
        pooling_factors=pooling, optimizer=optimizer, column_wise_statistic=column_wise_statistic,
        comm_dtype=comm_dtype,
    )  # fmt: skip
    changed = tuple(
        (f, priced.get(f, 1.0), p) for f, p in pooling.items()
        if abs(p - priced.get(f, 1.0)) > 0.1 * priced.get(f, 1.0)
    )  # fmt: skip
    old, new = result.old_stats.max_cost, result.stats.max_cost
    gain = 1.0 - new / old if old > 0 else 0.0
    budget = planners.format_bytes(settings.max_moved_bytes)
    if not result.moves:
        why = f"nothing moved: no plan within {budget} is faster"
    elif gain <= settings.threshold:
        why = (f"nothing moved: moving {planners.format_bytes(result.moved_bytes)} would gain "
               f"{100 * gain:.1f}%, not above the threshold of {100 * settings.threshold:.1f}%")  # fmt: skip
    else:
        why = (f"resharded, moving {planners.format_bytes(result.moved_bytes)} of weights and "
               f"optimizer state (budget {budget})")  # fmt: skip
    resharded = bool(result.moves) and gain > settings.threshold
    if resharded:
        modular.reshard(model, result.plan)
    report = Rebalance(step, dict(pooling), changed, old, new, result.moves, result.received,
                       result.sent, resharded, why)  # fmt: skip
    return (result.plan if resharded else plan), report


def planned_pooling(features: Sequence[str], pooling: Optional[Mapping[str, float]] = None) -> dict[str, float]:
    """The pooling factors a plan was priced with: `pooling`, 1.0 for the features it leaves out
    (as `planners.plan` prices a model's features)."""
    return {f: float((pooling or {}).get(f, 1.0)) for f in features}
