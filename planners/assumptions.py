"""What a plan is priced for: the optimizer, the column-wise statistic, the comm dtype and the
replica sync, each given to `planners.plan` and again to `modular.fuse_optimizer` or
`modular.shard`. The enums are the one vocabulary of both sides: modular takes the planner's
`ColumnWiseStatistic`, and `Optimizer.fused_name` is the one table between the planner's
optimizer names and `modular.fuse_optimizer`'s.

Pure Python, a leaf: it imports only `PlanError`, so that planners/types.py may import it.
`planners.inputs` and `planners.replicas` re-export the enums.
"""

from __future__ import annotations

import enum
from typing import Any

from planners.errors import PlanError

__all__ = ["ColumnWiseStatistic", "DataType", "Optimizer", "ReplicaSync"]


class DataType(enum.Enum):
    """The element type of a table's weights."""

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"

    @property
    def num_bytes(self) -> int:
        return 4 if self is DataType.FP32 else 2

    @classmethod
    def parse(cls, value: str | DataType) -> DataType:
        """Accepts a member, "fp32"/"FP32", or torchrec's DataType (by its name)."""
        if isinstance(value, cls):
            return value
        text = str(getattr(value, "name", value)).strip().lower()
        for member in cls:
            if text == member.value:
                return member
        raise PlanError(
            f"unknown dtype {value!r}; expected one of: {', '.join(m.value for m in cls)}"
        )


def _parse_member(cls: Any, value: Any, what: str) -> Any:
    """The member of enum `cls` named by `value` (a member, or its value in any case)."""
    if isinstance(value, cls):
        return value
    text = str(value).strip().lower()
    for member in cls:
        if text == member.value:
            return member
    raise PlanError(f"unknown {what} {value!r}; expected one of: {', '.join(m.value for m in cls)}")


class Optimizer(enum.Enum):
    """The fused embedding optimizer; it decides the optimizer state kept per row.

    State bytes per row of a shard with `c` columns: sgd 0, rowwise_adagrad 4 (one fp32 per row),
    adagrad 4*c, adam and lamb 8*c (two fp32 moments per element), partial_rowwise_adam and
    partial_rowwise_lamb 4*c + 4 (fp32 first moments, one fp32 second moment per row).

    One vocabulary with `modular.fuse_optimizer`: `parse` accepts its names too
    ("exact_rowwise_adagrad" is ROWWISE_ADAGRAD), and `fused_name` gives them back; the Adam
    family's names are the same in both.
    """

    SGD = "sgd"
    ROWWISE_ADAGRAD = "rowwise_adagrad"
    ADAGRAD = "adagrad"
    ADAM = "adam"
    PARTIAL_ROWWISE_ADAM = "partial_rowwise_adam"
    LAMB = "lamb"
    PARTIAL_ROWWISE_LAMB = "partial_rowwise_lamb"

    def state_bytes_per_row(self, cols: Any) -> Any:
        """Optimizer state bytes for one row of `cols` columns (works on numpy arrays)."""
        if self is Optimizer.SGD:
            return 0 * cols
        if self is Optimizer.ROWWISE_ADAGRAD:
            return 4 + 0 * cols
        if self is Optimizer.ADAGRAD:
            return 4 * cols
        if self in (Optimizer.PARTIAL_ROWWISE_ADAM, Optimizer.PARTIAL_ROWWISE_LAMB):
            return 4 * cols + 4
        return 8 * cols

    @property
    def fused_name(self) -> str:
        """The name `modular.fuse_optimizer` takes for this optimizer."""
        if self in (Optimizer.SGD, Optimizer.ADAGRAD, Optimizer.ROWWISE_ADAGRAD):
            return f"exact_{self.value}"
        return self.value

    @classmethod
    def parse(cls, value: str | Optimizer) -> Optimizer:
        """Accepts a member, its value, or modular's name for it ("exact_rowwise_adagrad")."""
        if isinstance(value, cls):
            return value
        text = str(value).strip().lower()
        for member in cls:
            if text in (member.value, member.fused_name):
                return member
        names = ", ".join(
            m.value if m.fused_name == m.value else f"{m.value} ({m.fused_name})" for m in cls
        )
        raise PlanError(f"unknown optimizer {value!r}; expected one of: {names}")


class ColumnWiseStatistic(enum.Enum):
    """Which row statistic row-wise Adagrad keeps on a table cut into column pieces, as
    `modular.fuse_optimizer(..., column_wise_statistic=...)` was told (Note [fused tables] in
    modular/optim.py); the planner prices what that choice costs (docs/planner.md, "Column
    pieces under row-wise Adagrad").

    EXACT (the default): the whole row's, as unsharded; each piece runs its backward twice,
    keeps a scratch statistic per row and exchanges one fp32 per id with the table's other
    pieces. PER_SHARD: each piece its own columns' (TorchRec's approximation); one plain pass.
    Only row-wise Adagrad keeps a row statistic: under the other optimizers both price the same.
    modular uses this enum itself (`modular.fused.config.ColumnWiseStatistic`): planners imports no
    torch, modular imports planners.
    """

    EXACT = "exact"
    PER_SHARD = "per_shard"

    @classmethod
    def parse(cls, value: str | ColumnWiseStatistic) -> ColumnWiseStatistic:
        """Accepts a member or its value, "exact" or "per_shard" (any case)."""
        return _parse_member(cls, value, "column_wise_statistic")


class ReplicaSync(enum.Enum):
    """How replica groups stay in step, as given to `modular.shard(..., replica_sync=...)`."""

    EXACT = "exact"
    PERIODIC = "periodic"

    @classmethod
    def parse(cls, value: str | ReplicaSync) -> ReplicaSync:
        """Accepts a member or its value, "exact" or "periodic" (any case)."""
        return _parse_member(cls, value, "replica_sync")
