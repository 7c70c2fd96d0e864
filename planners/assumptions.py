"""What a plan is priced for: the optimizer, the column-wise statistic, the comm dtype, the replica
groups and their sync, and the batch size; and `PlanAssumptions`, the record of them a plan carries.

Each of these is given twice: to `planners.plan`, which prices the plan under it, and again to
`modular.fuse_optimizer` or `modular.shard`, which run under it. So the plan records what it was
priced for (`ShardingPlan.priced_for`), the way DCP's metadata carries what its planner assumed,
and `modular.shard` compares the record with what it is given (Note [a plan's assumptions] in
modular/plan_assumptions.py; docs/planner.md, "What a plan records"). The enums are the one
vocabulary of both sides: modular takes the planner's `ColumnWiseStatistic`, and
`Optimizer.fused_name` is the one table between the planner's optimizer names and
`modular.fuse_optimizer`'s.

Pure Python, a leaf below planners/types.py (which imports `PlanAssumptions`): it imports only
`PlanError`. `planners.inputs` and `planners.replicas` re-export the enums.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Mapping

from planners.errors import PlanError

__all__ = ["ColumnWiseStatistic", "DataType", "Optimizer", "PlanAssumptions", "ReplicaSync"]


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
    """The embedding optimizer; it decides the optimizer state kept per row, and whether the
    tables keep a gradient.

    Fused (`modular.fuse_optimizer`), state bytes per row of a shard with `c` columns: sgd 0,
    rowwise_adagrad 4 (one fp32 per row), adagrad 4*c, adam and lamb 8*c (two fp32 moments per
    element), partial_rowwise_adam and partial_rowwise_lamb 4*c + 4 (fp32 first moments, one fp32
    second moment per row); no gradient.

    Unfused (the model is not fused; a torch optimizer over `modular.local_parameters` steps the
    tables): unfused_sgd (torch.optim.SGD without momentum) keeps no state, unfused_adagrad one
    value per element ("sum"), unfused_adam two ("exp_avg", "exp_avg_sq"), each in the weights'
    dtype, as torch's optimizers make them (`zeros_like`/`full_like` of the parameter); and the
    dense kernel keeps a gradient buffer as large as the weights (Note [dense gradient buffer] in
    modular/kernels/dense.py). docs/planner.md, "Memory".

    One vocabulary with `modular.fuse_optimizer`: `parse` accepts its names too
    ("exact_rowwise_adagrad" is ROWWISE_ADAGRAD), and `fused_name` gives them back (None for the
    unfused members: fuse_optimizer has no such kind); the Adam family's names are the same in
    both.
    """

    SGD = "sgd"
    ROWWISE_ADAGRAD = "rowwise_adagrad"
    ADAGRAD = "adagrad"
    ADAM = "adam"
    PARTIAL_ROWWISE_ADAM = "partial_rowwise_adam"
    LAMB = "lamb"
    PARTIAL_ROWWISE_LAMB = "partial_rowwise_lamb"
    # Unfused: a torch optimizer steps the tables' shards (no fused name).
    UNFUSED_SGD = "unfused_sgd"
    UNFUSED_ADAGRAD = "unfused_adagrad"
    UNFUSED_ADAM = "unfused_adam"

    @property
    def fused(self) -> bool:
        """Whether `modular.fuse_optimizer` runs it (else a torch optimizer, unfused)."""
        return _FUSED_NAMES[self] is not None

    def state_bytes_per_row(self, cols: Any, elem: Any = 4) -> Any:
        """Optimizer state bytes for one row of `cols` columns (works on numpy arrays); `elem`,
        the bytes of a weight, matters only unfused (torch keeps its state in the weights' dtype;
        the fused state is fp32 whatever the table's)."""
        if self is Optimizer.UNFUSED_SGD:
            return 0 * cols
        if self is Optimizer.UNFUSED_ADAGRAD:
            return elem * cols
        if self is Optimizer.UNFUSED_ADAM:
            return 2 * elem * cols
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
    def fused_name(self) -> str | None:
        """The name `modular.fuse_optimizer` takes for this optimizer (`_FUSED_NAMES`); None for
        the unfused members."""
        return _FUSED_NAMES[self]

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
            m.value if m.fused_name in (None, m.value) else f"{m.value} ({m.fused_name})"
            for m in cls
        )
        raise PlanError(f"unknown optimizer {value!r}; expected one of: {names}")


# `modular.fuse_optimizer`'s name of each optimizer: the one table between the two vocabularies
# (`Optimizer.parse` reads it, and modular's `FusedOptimizerKind.parse` through it).
_FUSED_NAMES: dict[Optimizer, str | None] = {
    Optimizer.SGD: "exact_sgd",
    Optimizer.ROWWISE_ADAGRAD: "exact_rowwise_adagrad",
    Optimizer.ADAGRAD: "exact_adagrad",
    Optimizer.ADAM: "adam",
    Optimizer.PARTIAL_ROWWISE_ADAM: "partial_rowwise_adam",
    Optimizer.LAMB: "lamb",
    Optimizer.PARTIAL_ROWWISE_LAMB: "partial_rowwise_lamb",
    Optimizer.UNFUSED_SGD: None,
    Optimizer.UNFUSED_ADAGRAD: None,
    Optimizer.UNFUSED_ADAM: None,
}


class ColumnWiseStatistic(enum.Enum):
    """Which row statistic row-wise Adagrad keeps on a table cut into column pieces, as
    `modular.fuse_optimizer(..., column_wise_statistic=...)` was told (Note [fused tables] in
    modular/fused/choice.py); the planner prices what that choice costs (docs/planner.md, "Column
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


_FIELDS = ("batch_size", "optimizer", "column_wise_statistic", "comm_dtype", "replicas",
           "replica_sync")  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class PlanAssumptions:
    """What a plan was priced for. `planners.plan` fills `ShardingPlan.priced_for` with one:

        plan = planners.plan(tables, topology, batch_size=512, comm_dtype="fp16")
        plan.priced_for  # PlanAssumptions(batch_size=512, optimizer='rowwise_adagrad',
                         #   column_wise_statistic='exact', comm_dtype='fp16', replicas=1, ...)

    and `modular.shard` (and `modular.reshard`) compare it with what they are given, on every
    rank: a difference that changes the layout (`replicas` against the mesh's "replicate" size,
    `column_wise_statistic` against `fuse_optimizer`'s) raises `modular.ShardingError`; one that
    changes only the price (`optimizer`, `comm_dtype`, `replica_sync`) warns once with
    `modular.PlanMismatchWarning`; `batch_size` is recorded, not checked (`shard` never sees a
    batch). docs/planner.md, "What a plan records".

    Each field takes the enum member or its name, as `planners.plan` does. `batch_size` is the
    per-rank batch; `replicas` the replica groups of a 2D mesh (1: none), and `replica_sync` how
    they were priced to stay in step (it prices nothing when `replicas` is 1).
    """

    batch_size: int
    optimizer: Optimizer = Optimizer.ROWWISE_ADAGRAD
    column_wise_statistic: ColumnWiseStatistic = ColumnWiseStatistic.EXACT
    comm_dtype: DataType = DataType.FP32
    replicas: int = 1
    replica_sync: ReplicaSync = ReplicaSync.EXACT

    def __post_init__(self) -> None:
        for name, value in (("batch_size", self.batch_size), ("replicas", self.replicas)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                unit = "per rank" if name == "batch_size" else "replica groups"
                raise PlanError(f"{name} must be a positive integer ({unit}), got {value!r}")
        object.__setattr__(self, "optimizer", Optimizer.parse(self.optimizer))
        object.__setattr__(self, "column_wise_statistic",
                           ColumnWiseStatistic.parse(self.column_wise_statistic))  # fmt: skip
        object.__setattr__(self, "comm_dtype", DataType.parse(self.comm_dtype))
        object.__setattr__(self, "replica_sync", ReplicaSync.parse(self.replica_sync))

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.to_dict().items())
        return f"PlanAssumptions({fields})"

    def describe(self) -> str:
        """'batch 512 per rank, rowwise_adagrad (exact column statistic), fp32 comms, 1D'."""
        replicas = "1D" if self.replicas == 1 else (
            f"{self.replicas} replica groups ({self.replica_sync.value} sync)")  # fmt: skip
        return (f"batch {self.batch_size} per rank, {self.optimizer.value} "
                f"({self.column_wise_statistic.value} column statistic), "
                f"{self.comm_dtype.value} comms, {replicas}")  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        """The record as a plan file writes it: enums by their names."""
        return {
            "batch_size": self.batch_size, "optimizer": self.optimizer.value,
            "column_wise_statistic": self.column_wise_statistic.value,
            "comm_dtype": self.comm_dtype.value, "replicas": self.replicas,
            "replica_sync": self.replica_sync.value,
        }  # fmt: skip

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PlanAssumptions:
        """The record `to_dict` wrote; a field left out takes its default, as in the constructor."""
        if not isinstance(data, Mapping) or "batch_size" not in data:
            raise PlanError(f"a plan's 'priced_for' needs a 'batch_size', got {data!r}")
        unknown = sorted(set(data) - set(_FIELDS), key=str)
        if unknown:
            raise PlanError(f"unknown fields {unknown} in the plan's 'priced_for'; it has "
                            f"{', '.join(repr(f) for f in _FIELDS)}")  # fmt: skip
        return cls(**{name: data[name] for name in _FIELDS if name in data})
