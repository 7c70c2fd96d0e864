"""What a fused optimizer is: its kind and its live hyperparameters (Note [fused tables] in
modular/optim.py)."""

from __future__ import annotations

import enum
from typing import Any, Optional

from fbgemm_gpu.split_embedding_configs import EmbOptimType

# Row-wise Adagrad's per-row statistic on a table cut into column pieces (Note [fused tables]);
# the planner's enum, so that a plan can be priced for what the model was fused with. The
# optimizer's name goes through the planner's `Optimizer` too: one vocabulary for both.
from planners.inputs import ColumnWiseStatistic, Optimizer
from planners.types import PlanError

__all__ = ["ColumnWiseStatistic", "FusedConfig", "FusedOptimizerKind"]


class FusedOptimizerKind(enum.Enum):
    EXACT_SGD = "exact_sgd"
    EXACT_ADAGRAD = "exact_adagrad"
    EXACT_ROWWISE_ADAGRAD = "exact_rowwise_adagrad"

    @classmethod
    def parse(cls, name: str | FusedOptimizerKind) -> FusedOptimizerKind:
        """A member, its name, or the planner's name for it (`planners.Optimizer`: "sgd",
        "adagrad", "rowwise_adagrad"), so a plan's optimizer and the fused one are spelt alike."""
        if isinstance(name, cls):
            return name
        supported = ", ".join(repr(k.value) for k in cls)
        try:
            fused = Optimizer.parse(name).fused_name
        except PlanError:
            fused = None
        if fused is None:  # unknown, or a planner optimizer without a fused kernel (adam)
            raise ValueError(
                f"fused optimizer {name!r} is not supported; fbgemm's fused kernels support "
                f"{supported} (the planner's 'sgd', 'adagrad' and 'rowwise_adagrad' name the same "
                "three; train other optimizers unfused, from modular.local_parameters(model))"
            )
        return cls(fused)

    def fbgemm_type(self) -> EmbOptimType:
        return {
            FusedOptimizerKind.EXACT_SGD: EmbOptimType.EXACT_SGD,
            FusedOptimizerKind.EXACT_ADAGRAD: EmbOptimType.EXACT_ADAGRAD,
            FusedOptimizerKind.EXACT_ROWWISE_ADAGRAD: EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        }[self]

    def state_name(self) -> Optional[str]:
        return {
            FusedOptimizerKind.EXACT_SGD: None,
            FusedOptimizerKind.EXACT_ADAGRAD: "sum",
            FusedOptimizerKind.EXACT_ROWWISE_ADAGRAD: "row_sum",
        }[self]

    def rowwise(self) -> bool:
        return self is FusedOptimizerKind.EXACT_ROWWISE_ADAGRAD


class FusedConfig:
    """What every fused kernel of a model reads: the kind, the column-wise statistic and the
    live param group (lr, eps). `modular.shard` and the meta path carry this object itself."""

    def __init__(
        self,
        optimizer: FusedOptimizerKind,
        param_group: dict[str, Any],
        *,
        column_wise_statistic: ColumnWiseStatistic = ColumnWiseStatistic.EXACT,
        stochastic_rounding: bool = True,
    ) -> None:
        self.optimizer = optimizer
        self.param_group = param_group
        self.column_wise_statistic = column_wise_statistic
        # fbgemm's rounding of FP16/BF16 updates (Note [low-precision tables]).
        self.stochastic_rounding = stochastic_rounding

    @property
    def per_shard_rows(self) -> bool:
        """Whether each column piece keeps its own row statistic (row-wise Adagrad only)."""
        return (
            self.optimizer.rowwise()
            and self.column_wise_statistic is ColumnWiseStatistic.PER_SHARD
        )

    @property
    def lr(self) -> float:
        return float(self.param_group["lr"])

    @property
    def eps(self) -> float:
        return float(self.param_group["eps"])

    @property
    def weight_decay(self) -> float:
        return float(self.param_group.get("weight_decay", 0.0))
