"""What a fused optimizer is: its kind and its live hyperparameters (Note [fused tables] in
modular/fused/choice.py)."""

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
    # The Adam family: Note [fused Adam and LAMB] in modular/fused/adam.py.
    ADAM = "adam"
    PARTIAL_ROWWISE_ADAM = "partial_rowwise_adam"
    LAMB = "lamb"
    PARTIAL_ROWWISE_LAMB = "partial_rowwise_lamb"

    @classmethod
    def parse(cls, name: str | FusedOptimizerKind) -> FusedOptimizerKind:
        """A member, its name, or the planner's name for it (`planners.Optimizer`: "sgd",
        "adagrad", "rowwise_adagrad"; the Adam family's are the same), so a plan's optimizer and
        the fused one are spelt alike."""
        if isinstance(name, cls):
            return name
        supported = ", ".join(repr(k.value) for k in cls)
        try:
            fused = Optimizer.parse(name).fused_name
        except PlanError:
            fused = None
        if fused is None:
            raise ValueError(
                f"fused optimizer {name!r} is not supported; fuse_optimizer takes {supported} "
                "(the planner's 'sgd', 'adagrad' and 'rowwise_adagrad' name the first three; "
                "train other optimizers unfused, from modular.local_parameters(model))"
            )
        return cls(fused)

    def fbgemm_type(self) -> EmbOptimType:
        return EmbOptimType[self.name]

    def state_names(self) -> tuple[str, ...]:
        """The state tensors it keeps per table (Note [fused tables] in modular/fused/choice.py), as
        fbgemm's `get_optimizer_state` names them."""
        if self.adam_family():
            return ("exp_avg", "exp_avg_sq")
        name = self.state_name()
        return () if name is None else (name,)

    def state_name(self) -> Optional[str]:
        """The one state of the Adagrads (None for SGD, and for the Adam family, whose two are
        in `state_names`)."""
        return {
            FusedOptimizerKind.EXACT_ADAGRAD: "sum",
            FusedOptimizerKind.EXACT_ROWWISE_ADAGRAD: "row_sum",
        }.get(self)

    def row_state(self, name: str) -> bool:
        """Whether state `name` keeps one value per row (else one per weight)."""
        return name == "row_sum" or (name == "exp_avg_sq" and self.partial_rowwise())

    def rowwise(self) -> bool:
        """Row-wise Adagrad: the kind with `column_wise_statistic` (Note [fused tables])."""
        return self is FusedOptimizerKind.EXACT_ROWWISE_ADAGRAD

    def adam_family(self) -> bool:
        """Adam, LAMB and their partial_rowwise forms: two moments and a step count."""
        return self in _ADAM_FAMILY

    def partial_rowwise(self) -> bool:
        """The second moment is one value per row: the mean of grad**2 over its columns."""
        return self in (
            FusedOptimizerKind.PARTIAL_ROWWISE_ADAM, FusedOptimizerKind.PARTIAL_ROWWISE_LAMB
        )

    def trust_ratio(self) -> bool:
        """LAMB: each row's update is scaled by ||w_row|| / ||update_row||."""
        return self in (FusedOptimizerKind.LAMB, FusedOptimizerKind.PARTIAL_ROWWISE_LAMB)

    def whole_row_statistics(self) -> bool:
        """Whether a row's update reads statistics of the whole row, which a table cut into
        column pieces combines across them (Note [row statistics across column shards])."""
        return self.rowwise() or self.partial_rowwise() or self.trust_ratio()


_ADAM_FAMILY = frozenset(
    {
        FusedOptimizerKind.ADAM,
        FusedOptimizerKind.PARTIAL_ROWWISE_ADAM,
        FusedOptimizerKind.LAMB,
        FusedOptimizerKind.PARTIAL_ROWWISE_LAMB,
    }
)


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

    @property
    def betas(self) -> tuple[float, float]:
        """The Adam family's (beta1, beta2)."""
        b1, b2 = self.param_group["betas"]
        return float(b1), float(b2)
