"""What `modular.shard` and `modular.reshard` do with what a plan was priced for.

# Note [a plan's assumptions]
A plan made by `planners.plan` records what it was priced for (`ShardingPlan.priced_for`, a
`planners.PlanAssumptions`): the batch size per rank, the fused optimizer, row-wise Adagrad's
column-wise statistic, the comm dtype, the replica groups and their sync. The same choices are
made again at run time, by `modular.fuse_optimizer` (called before `shard`, it never sees the
plan) and by `modular.shard`'s arguments. So `shard` is where both are known: it compares the
record with every planned module's fused config (which `fuse_optimizer` left for it: the pending
config of a meta EBC, `.fused` of a one-process module), its comm dtype and the mesh, on every
rank, before anything is built. `reshard` compares a new plan with the sharded modules the same
way. `check_priced_for` is the one comparison both call.

- A difference that changes the layout raises `ShardingError`, inside the plan's agreement
  (Note [agreeing on the plan]), so every rank raises it:
  * `replicas` against the mesh's "replicate" size (1 for a process group or a 1D mesh): a plan
    for R replica groups is the plan of one shard group of a job R times its size, its ranks'
    memory and traffic planned for that job;
  * `column_wise_statistic`, where the module is fused with row-wise Adagrad and the plan was
    priced for it (the one optimizer the statistic changes): it decides where the planner cuts
    tables into column pieces, and "per_shard" lays the pieces' `row_sum` out by the plan (Note
    [fused tables] in modular/fused/choice.py).
- A difference that changes only the price warns `PlanMismatchWarning`, once per process for
  each (what, planned, given): the placements apply and train exactly as under any plan, but
  the plan balanced its ranks for other costs.
  * `optimizer`: the module's fused kind, or none (an unfused module, trained by a torch
    optimizer over `modular.local_parameters`, keeps a gradient buffer that a plan priced for a
    fused optimizer did not count). A plan priced unfused ("unfused_sgd", "unfused_adagrad",
    "unfused_adam") matches any unfused module (which torch optimizer runs is not visible to
    `shard`) and warns for a fused one. One vocabulary: the planner's `Optimizer` parses
    `fuse_optimizer`'s names (`Optimizer.fused_name` is the one table between the two; the
    unfused members have none);
  * `comm_dtype`, per module (`shard`'s, None being FP32);
  * `replica_sync`, where both the plan and the mesh have replica groups.
- `batch_size` is recorded, never checked: `shard` never sees a batch, and steps may differ in
  theirs (an epoch's last batch, variable-batch features); another size changes only the price.
A plan that records nothing (`priced_for` None: written by hand, converted `from_torchrec`, or
saved before plans recorded it) is applied unchecked.
"""

from __future__ import annotations

import warnings
from typing import Mapping, Optional, Sequence

import torch
from torch import nn

from modular import lifecycle
from modular.errors import PlanMismatchWarning, ShardingError
from modular.fused.config import FusedConfig
from modular.sharded_types import SHARDED_COLLECTIONS
from planners.assumptions import ColumnWiseStatistic, DataType, Optimizer
from planners.types import ShardingPlan

__all__ = ["check_priced_for", "fused_config"]

# `shard`'s comm dtypes as the planner names them; None (the default) sends FP32.
_WIRE = {None: DataType.FP32, torch.float32: DataType.FP32, torch.float16: DataType.FP16,
         torch.bfloat16: DataType.BF16}  # fmt: skip
_TORCH_NAME = {DataType.FP32: "None", DataType.FP16: "torch.float16",
               DataType.BF16: "torch.bfloat16"}  # fmt: skip
# (what, planned, given) already warned in this process.
_WARNED: set[tuple[str, str, str]] = set()


def fused_config(module: nn.Module) -> Optional[FusedConfig]:
    """The `FusedConfig` `fuse_optimizer` gave `module` (a sharded or one-process module's own,
    or the one it recorded for a torchrec collection on meta), or None: not fused."""
    if isinstance(module, SHARDED_COLLECTIONS):
        return module.fused
    return lifecycle.pending_fuse(module)


def check_priced_for(
    plan: ShardingPlan,
    modules: Sequence[tuple[str, nn.Module]],
    comm_dtypes: Mapping[str, Optional[torch.dtype]],
    *,
    replicas: int,
    replica_sync: str,
    call: str,
    stacklevel: int,
) -> None:
    """Compares what `plan` was priced for with what `call` runs it under (Note [a plan's
    assumptions]): raises ShardingError for a difference in layout, warns PlanMismatchWarning
    (once per process for each pair) for one in price; a plan recording nothing passes.

        check_priced_for(plan, targets, comm_dtypes, replicas=1, replica_sync="exact",
                         call="modular.shard", stacklevel=2)

    `modules`: the planned modules by FQN (torchrec's, one-process fused or sharded);
    `comm_dtypes`: each one's comm dtype (None: FP32); `replicas`: the mesh's "replicate" size,
    1 without a 2D mesh; `replica_sync`: the sync mode's name; `stacklevel`: as `warnings.warn`'s,
    1 being the caller of this function.
    """
    priced = plan.priced_for
    if priced is None:
        return
    if priced.replicas != replicas:
        raise ShardingError(_replicas_message(priced.replicas, replicas, call))
    fused = [(fqn, fused_config(m)) for fqn, m in modules]
    rowwise = priced.optimizer is Optimizer.ROWWISE_ADAGRAD  # the one the statistic changes
    for fqn, config in fused:  # layout first: nothing is warned about a plan that is refused
        if rowwise and config is not None and config.optimizer.rowwise():
            statistic = config.column_wise_statistic
            if statistic is not priced.column_wise_statistic:
                raise ShardingError(_statistic_message(priced.column_wise_statistic, statistic, fqn, call))
    planned = priced.optimizer.fused_name or priced.optimizer.value
    for fqn, config in fused:
        if config is None:
            if not priced.optimizer.fused:  # priced unfused: the gradient buffer was counted
                continue
            _warn_once(("optimizer", planned, "unfused"), stacklevel, (
                f"{call}: the plan was priced for the fused optimizer {planned!r} but module "
                f"{fqn!r} is not fused (a torch optimizer over modular.local_parameters trains "
                "it, with a gradient buffer as large as its shards that the plan did not count); "
                f"its placements apply and train exactly: call modular.fuse_optimizer(model, "
                f"{planned!r}, lr=...) before modular.shard to run what was priced, plan with "
                "planners.plan(..., optimizer='unfused_sgd') (or 'unfused_adagrad', "
                "'unfused_adam': the torch optimizer) to price what runs, or ignore this "
                "if the unfused tables are what you want"))  # fmt: skip
        elif not priced.optimizer.fused:
            given = config.optimizer.value
            _warn_once(("optimizer", planned, given), stacklevel, (
                f"{call}: the plan was priced for unfused tables ({planned!r}: a gradient buffer "
                f"as large as the weights and a torch optimizer's state) but module {fqn!r} is "
                f"fused with {given!r} (modular.fuse_optimizer); its placements apply and train "
                f"exactly, balanced for the unfused tables' memory and update: plan with "
                f"planners.plan(..., optimizer={given!r}) to balance for what runs"))
        elif Optimizer.parse(config.optimizer.value) is not priced.optimizer:
            given = config.optimizer.value
            _warn_once(("optimizer", planned, given), stacklevel, (
                f"{call}: the plan was priced for the fused optimizer {planned!r} but module "
                f"{fqn!r} is fused with {given!r} (modular.fuse_optimizer); its placements apply "
                f"and train exactly, balanced for {planned!r}'s optimizer state and update: "
                f"plan with planners.plan(..., optimizer={given!r}) to balance for what runs"))
    for fqn, dtype in comm_dtypes.items():
        wire = _WIRE[dtype]
        if wire is not priced.comm_dtype:
            _warn_once(("comm_dtype", priced.comm_dtype.value, wire.value), stacklevel, (
                f"{call}: the plan was priced for comm_dtype {priced.comm_dtype.value} but module "
                f"{fqn!r} sends its outputs and their gradients in {wire.value}; its placements "
                "apply, balanced for the other dtype's output-dist bytes and copies: give "
                f"modular.shard comm_dtype={_TORCH_NAME[priced.comm_dtype]}, or plan with "
                f"planners.plan(..., comm_dtype={wire.value!r})"))  # fmt: skip
    if replicas > 1 and replica_sync != priced.replica_sync.value:
        _warn_once(("replica_sync", priced.replica_sync.value, replica_sync), stacklevel, (
            f"{call}: the plan was priced for replica_sync {priced.replica_sync.value!r} but the "
            f"mesh's {replicas} replica groups sync {replica_sync!r}; its placements apply, "
            f"balanced for the other mode's traffic across replica groups: give modular.shard "
            f"replica_sync={priced.replica_sync.value!r}, or plan with planners.plan(..., "
            f"replica_sync={replica_sync!r})"))  # fmt: skip


def _replicas_message(planned: int, given: int, call: str) -> str:
    have = ("it runs without replica groups (a process group or a 1D mesh: 1)" if given == 1
            else f"the mesh has {given} (mesh['replicate'].size() == {given})")  # fmt: skip
    want = ("a 2D mesh ('replicate', 'shard') with mesh['replicate'].size() == "
            f"{planned}" if planned > 1 else "no 2D mesh")  # fmt: skip
    return (
        f"{call}: the plan was priced for {planned} replica group{'s' if planned > 1 else ''} "
        f"(planners.plan(..., replicas={planned})) but {have}; a plan for R replica groups is "
        "one shard group of a job R times its size. Run it on "
        f"{want}, or plan for this one with planners.plan(..., replicas={given}) and the whole "
        "job's topology"
    )


def _statistic_message(planned: ColumnWiseStatistic, given: ColumnWiseStatistic, fqn: str,
                       call: str) -> str:  # fmt: skip
    return (
        f"{call}: the plan was priced for column_wise_statistic {planned.value!r} but module "
        f"{fqn!r} is fused with column_wise_statistic={given.value!r} (modular.fuse_optimizer); "
        "under row-wise Adagrad it decides which tables are cut into column pieces and how "
        f"their row_sum is laid out: fuse with column_wise_statistic={planned.value!r}, or plan "
        f"with planners.plan(..., column_wise_statistic={given.value!r})"
    )


def _warn_once(key: tuple[str, str, str], stacklevel: int, message: str) -> None:
    if key in _WARNED:
        return
    _WARNED.add(key)
    # +2: this function and check_priced_for
    warnings.warn(message, PlanMismatchWarning, stacklevel=stacklevel + 2)
