"""Loading a checkpoint: staging what is read, checked before anything changes (Note [checkpoint
keys] in _entries.py). _apply.py puts it into the model and the optimizer."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)

from modular.tables.forms import dtype_of
from modular.checkpoint._entries import (
    MODEL,
    OPTIM,
    PARAM_GROUPS,
    SCHEDULER_KEYS,
    index_slots,
    keyed_by_fqn,
    describe,
    dtype_problem,
    empty_like,
    global_shape,
    model_state,
    optimizer_parts,
    state_key,
)
from modular.checkpoint._collisions import collision_entries
from modular.fused.config import FusedOptimizerKind
from modular.mc.table_state import LAYOUT
from modular.optim import FusedOptimizer
from modular.fused.state import column_statistic_mismatch


class PartPlan(NamedTuple):
    """How to hand one optimizer part its loaded state."""

    prefix: str
    optimizer: Any
    keyed_by_fqn: bool
    entries: list[Any]  # (fqn, name) if keyed by FQN, else (slot, state names) per param index
    group_keys: list[frozenset[str]]  # each live param group's hyperparameter names


class Staged(NamedTuple):
    """Fresh buffers to read into, and how to put them back once every rank read them."""

    buffers: dict[str, Any]
    model_keys: list[str]
    optimizer_parts: list[PartPlan]
    # (module, key) of each split managed-collision column, by FQN (Note [a collision table in a
    # checkpoint] in modular/mc/table_state.py)
    collisions: dict[str, tuple[Any, str]]


def stage(
    metadata: Metadata, model: nn.Module, optimizer: Optional[Any], path: str,
    convert_dtypes: bool = False,
) -> tuple[Optional[Staged], Optional[str]]:
    """Checks names, global shapes and (unless `convert_dtypes`) the model's dtypes against
    `metadata`; returns buffers to load or the error."""
    saved = metadata.state_dict_metadata
    live = model_state(model, LAYOUT)  # no collision table gathered: Note [a collision table in a checkpoint]
    buffers: dict[str, Any] = {}
    problems: list[str] = []

    def check(key: str, value: Any, owner: str) -> None:
        md = saved.get(key)
        if isinstance(value, torch.Tensor):  # ShardedTensors and DTensors are Tensors too
            if not isinstance(md, TensorStorageMetadata):
                problems.append(f"{owner}: missing from the checkpoint")
                return
            if tuple(md.size) != global_shape(value):
                problems.append(
                    f"{owner}: the checkpoint holds shape {tuple(md.size)}, the model "
                    f"{global_shape(value)}"
                )
                return
            if key.startswith(MODEL) and not convert_dtypes:
                problem = dtype_problem(owner, md.properties.dtype, dtype_of(value), "the checkpoint")
                if problem is not None:
                    problems.append(problem)
                    return
            buffers[key] = empty_like(value, md.properties.dtype)
        elif key in saved:
            buffers[key] = value

    for key, value in live.items():
        check(key, value, describe(key[len(MODEL):]))
    saved_model = sorted(k[len(MODEL):] for k in saved if k.startswith(MODEL))
    unexpected = [k for k in saved_model if MODEL + k not in live]
    if unexpected:
        problems.append(
            "the checkpoint holds "
            + ", ".join(describe(k) for k in unexpected)
            + ", which the model does not have"
        )

    plans = []
    if optimizer is not None:
        for prefix, part in optimizer_parts(optimizer):
            plan, part_problems = _stage_optimizer(
                saved, prefix, model, part, buffers, check, live
            )
            plans.append(plan)
            problems += part_problems
    if problems:
        tables = [describe(k) for k in saved_model]
        return None, (
            f"checkpoint {path!r} does not match the model; nothing was loaded (a new plan or "
            "world size is fine, but table names and shapes must be those it was saved with):\n  "
            + "\n  ".join(problems)
            + f"\nthe checkpoint's model entries are: {', '.join(tables)}"
        )
    collisions = {k[len(MODEL):]: c for k, c in collision_entries(live).items() if k in buffers}
    return Staged(buffers, [k for k in live if k in buffers], plans, collisions), None


def part_name(prefix: str, optimizer: Any) -> str:
    """How an error names one optimizer part: `optimizer 'dense' (Adam)`."""
    name = f"optimizer {prefix[len(OPTIM):-1]!r}" if prefix != OPTIM else "optimizer"
    return f"{name} ({type(optimizer).__name__})"


def _stage_optimizer(
    saved, prefix, model, optimizer, buffers, check, live
) -> tuple[Any, list[str]]:
    problems: list[str] = []
    if not isinstance(saved.get(prefix + PARAM_GROUPS), BytesStorageMetadata):
        where = part_name(prefix, optimizer)
        return None, [f"{where}: the checkpoint holds no state for it; load without it"]
    sd = optimizer.state_dict()
    buffers[prefix + PARAM_GROUPS] = sd["param_groups"]
    group_keys = [frozenset(g) - {"params"} for g in sd["param_groups"]]
    if keyed_by_fqn(sd):
        other_kind = _other_fused_kind(saved, prefix, optimizer, sd)
        if other_kind is not None:
            return None, [other_kind]
        keys = []
        for fqn, states in sd["state"].items():
            for name, value in states.items():
                key = state_key(prefix, fqn, name)
                owner = f"optimizer state {name!r} of {describe(fqn)}"
                weight = live.get(MODEL + fqn)
                pieces = _other_column_pieces(saved.get(key), value, owner, optimizer, weight)
                pieces = pieces or _other_second_moment(saved.get(key), value, owner, optimizer)
                if pieces is not None:
                    problems.append(pieces)
                    continue
                check(key, value, owner)
                keys.append((fqn, name))
        return PartPlan(prefix, optimizer, True, keys, group_keys), problems
    names_of: dict[str, list[str]] = {}
    for key in saved:
        if key.startswith(prefix + "state."):
            fqn, _, name = key[len(prefix + "state."):].rpartition(".")
            names_of.setdefault(fqn, []).append(name)
    per_index = []
    for index, slot in enumerate(index_slots(model, optimizer)):
        names = names_of.get(slot.fqn, [])
        missing = sorted(set(sd["state"].get(index, {})) - set(names))
        if missing:
            problems.append(
                f"optimizer state {missing} of {describe(slot.fqn)}: missing from the checkpoint"
            )
        for name in names:
            key = state_key(prefix, slot.fqn, name)
            md = saved[key]
            if key in buffers:
                continue
            if tuple(md.size) == global_shape(slot.weight):
                buffers[key] = empty_like(slot.weight, md.properties.dtype)
            else:
                buffers[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        per_index.append((slot, names))
    return PartPlan(prefix, optimizer, False, per_index, group_keys), problems


def _other_column_pieces(
    md: Any, value: Any, owner: str, optimizer: Any, weight: Any
) -> Optional[str]:
    """Why row-wise Adagrad state saved with another column-wise statistic (or for another cut
    of the table into column pieces) cannot load, or None (Note [fused tables] in
    modular/fused/choice.py: its shape tells them apart before anything is read)."""
    if not isinstance(optimizer, FusedOptimizer) or not isinstance(md, TensorStorageMetadata):
        return None
    if not optimizer.kind.rowwise() or weight is None:
        return None
    return column_statistic_mismatch(
        owner, tuple(md.size), global_shape(value), optimizer.column_wise_statistic,
        global_shape(weight)[-1],
    )  # fmt: skip


def _other_second_moment(md: Any, value: Any, owner: str, optimizer: Any) -> Optional[str]:
    """Why an Adam-family `exp_avg_sq` of one value per weight cannot load where one per row is
    kept, or the other way round (Note [fused Adam and LAMB]), or None."""
    if not isinstance(optimizer, FusedOptimizer) or not isinstance(md, TensorStorageMetadata):
        return None
    got, keeps = tuple(md.size), global_shape(value)
    if not optimizer.kind.adam_family() or got[:1] != keeps[:1] or len(got) == len(keeps):
        return None
    if len(got) == 2:
        saved, fix = "one value per weight: adam or lamb", "fuse with 'adam' or 'lamb'"
    else:
        saved = "one value per row: a partial_rowwise kind"
        fix = "fuse with its partial_rowwise kind"
    return f"{owner} has shape {got}, {saved}, but this optimizer keeps {keeps}; {fix} to load it"


def _other_fused_kind(saved, prefix: str, optimizer: Any, sd: dict[str, Any]) -> Optional[str]:
    """Why a checkpoint of another fused optimizer kind cannot load into this one, or None.

    Each kind keeps its own state per table (Note [fused tables] in modular/fused/choice.py: none for
    SGD, `sum`, `row_sum`, the Adam family's `exp_avg`, `exp_avg_sq` and `step`), so the state
    names in the metadata tell the kind it was saved with (within the Adam family, the saved
    param group does, in `FusedOptimizer.load_state_dict`)
    before anything is read. Adagrad's state loaded into SGD (which has none to look for) would
    otherwise pass every check here and fail in `load_state_dict`, after the weights were copied;
    the other mismatches would be reported as missing state, without the reason."""
    mine = {name for states in sd["state"].values() for name in states}
    theirs = {key.rpartition(".")[2] for key in saved if key.startswith(prefix + "state.")}
    if mine == theirs:
        return None
    kind = sd["param_groups"][0].get("optimizer")
    this = f"fused {kind!r}" if kind else "this optimizer"
    saved_by = [k.value for k in FusedOptimizerKind if _saved_names(k) == theirs]
    that = " or ".join(f"fused {k!r}" for k in saved_by) if saved_by else "another optimizer"
    modules = ", ".join(
        f"module {m!r}" if m else "the root module"
        for m in sorted({fqn.rsplit(".", 3)[0] if fqn.count(".") >= 3 else "" for fqn in sd["state"]})
    )
    fix = "use the one it was saved with"
    if saved_by:
        fix = f"fuse with {' or '.join(map(repr, saved_by))} to load it"
    return (
        f"{part_name(prefix, optimizer)}: the checkpoint was saved by {that} (state "
        f"{sorted(theirs)} per table), but the fused tables of {modules} are updated by {this} "
        f"(state {sorted(mine)}); {fix}, or load without the optimizer"
    )


def _saved_names(kind: FusedOptimizerKind) -> set[str]:
    """The state names a fused optimizer of `kind` saves per table."""
    return set(kind.state_names()) | ({"step"} if kind.adam_family() else set())


# -- what can only be checked once read ----------------------------------------------------------


def check_loaded(staged: Staged) -> Optional[str]:
    """What can only be checked once read (the hyperparameters are not in the metadata)."""
    for plan in staged.optimizer_parts:
        saved = staged.buffers[plan.prefix + PARAM_GROUPS]
        current = plan.group_keys
        if not isinstance(saved, list) or len(saved) != len(current):
            count = len(saved) if isinstance(saved, list) else type(saved).__name__
            return (
                f"the checkpoint's optimizer has {count} param groups, this one has "
                f"{len(current)}; build the optimizer with the same groups. Nothing was loaded"
            )
        for i, (group, mine) in enumerate(zip(saved, current)):
            # Optimizers that create their state at the first step (SGD's momentum, Adam) pass
            # every check of the metadata; their hyperparameters tell them apart.
            lack = sorted(mine - set(group) - SCHEDULER_KEYS)
            have = sorted(set(group) - mine - SCHEDULER_KEYS)
            if lack or have:
                differences = [f"lack {lack}, which this optimizer's have"] if lack else []
                differences += [f"have {have}, which this optimizer's lack"] if have else []
                return (
                    f"{part_name(plan.prefix, plan.optimizer)}: the checkpoint's param group {i} "
                    f"was saved by another optimizer (or torch version): its keys "
                    f"{', and '.join(differences)}; build the optimizer it was saved with, or load "
                    "without it. Nothing was loaded"
                )
    return None
