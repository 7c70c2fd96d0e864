"""The flat state a checkpoint holds, and how it is checked, staged and put back into the model.

# Note [checkpoint keys]
A checkpoint is one flat DCP state dict whose keys never mention a sharding type or a rank:

    model.<fqn>                 every entry of `get_model_state_dict(model)`: sharded tables as
                                ShardedTensors, data-parallel tables and replicated dense params as
                                plain tensors (saved once), FSDP2 params as DTensors
    optim.state.<fqn>.<name>    one optimizer state of the parameter `<fqn>`; laid out like the
                                weight when it has the weight's shape (Adagrad's `sum`, Adam's
                                `exp_avg`), a plain tensor otherwise (`step`)
    optim.param_groups          the optimizer's hyperparameters, one dict per group, no params

A CombinedOptimizer's parts are saved under `optim.<part>.` (`optim.tables.state.<fqn>.sum`), each
by the rules above. Torch optimizers key their state by parameter index; the index is mapped to
the FQN (and shard) of the model parameter it updates. The fused optimizer keys it by FQN already.

DCP stores every tensor by its global shape and its saved chunks, and reads any other chunking
of the same global shape, so a checkpoint loads under any plan and world size: a row-wise table
may come back column-wise, table-wise or as a data-parallel replica, and the other way round.
Optimizer state moves with its weight because its key and global shape do not depend on the plan.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import torch
from torch import nn
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from modular._fused_state import column_statistic_mismatch
from modular.optim import FusedOptimizer, FusedOptimizerKind

MODEL = "model."
OPTIM = "optim."
PARAM_GROUPS = "param_groups"  # after the optimizer's prefix

# Keys torch's LR schedulers add to param groups: a checkpoint saved with a scheduler attached
# loads into an optimizer that has none yet, and the other way round.
SCHEDULER_KEYS = frozenset({"initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum"})


def describe(fqn: str) -> str:
    """How an error names a state entry: by its table when it is one."""
    parts = fqn.split(".")
    if len(parts) >= 3 and parts[-3] == "embedding_bags" and parts[-1] == "weight":
        return f"table {parts[-2]!r} ({fqn})"
    return repr(fqn)


def state_key(prefix: str, fqn: str, name: str) -> str:
    return f"{prefix}state.{fqn}.{name}"


# -- building the state to save ------------------------------------------------------------------


def model_state(model: nn.Module) -> dict[str, Any]:
    """`model.<fqn>` -> the live tensors (ShardedTensor / DTensor / Tensor), nothing copied."""
    return {MODEL + k: v for k, v in get_model_state_dict(model).items()}


class Slot(NamedTuple):
    """Where one tensor an optimizer updates sits in the model."""

    fqn: str
    weight: torch.Tensor  # the model's parameter: ShardedTensor, DTensor or Tensor
    shard: Optional[int]  # index among weight.local_shards() when the weight is sharded


def _slots(model: nn.Module) -> dict[int, Slot]:
    slots = {}
    for fqn, p in model.named_parameters():
        if isinstance(p, ShardedTensor):
            for i, s in enumerate(p.local_shards()):
                slots[id(s.tensor)] = Slot(fqn, p, i)
        else:
            slots[id(p)] = Slot(fqn, p, None)
    return slots


def _keyed_by_fqn(sd: dict[str, Any]) -> bool:
    """True for optimizers that key state by FQN (the fused one), False for torch's by-index."""
    return bool(sd["state"]) and all(isinstance(k, str) for k in sd["state"])


def optimizer_parts(optimizer: Any) -> list[tuple[str, Any]]:
    """(key prefix, optimizer) of each optimizer with a torch-style `state_dict()` inside
    `optimizer`: a CombinedOptimizer's parts under their names, else the optimizer itself."""
    parts = getattr(optimizer, "optimizers", None)
    if isinstance(parts, dict):
        return [(f"{OPTIM}{name}.", part) for name, part in parts.items()]
    return [(OPTIM, optimizer)]


def _index_slots(model: nn.Module, optimizer: Any) -> list[Slot]:
    """Slot of each parameter index of a torch optimizer's state_dict (param_groups order)."""
    slots = _slots(model)
    out = []
    for g in optimizer.param_groups:
        for p in g["params"]:
            slot = slots.get(id(p))
            if slot is None:
                raise TypeError(
                    f"the optimizer updates a tensor of shape {tuple(p.shape)} that is not a "
                    "parameter of the model (nor a local shard of one); build it over "
                    "modular.local_parameters(model)"
                )
            out.append(slot)
    return out


def optimizer_state(model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """The optimizer entries of Note [checkpoint keys], for every part of `optimizer`."""
    out: dict[str, Any] = {}
    for prefix, part in optimizer_parts(optimizer):
        out.update(_part_state(model, prefix, part))
    return out


def _part_state(model: nn.Module, prefix: str, optimizer: Any) -> dict[str, Any]:
    sd = optimizer.state_dict()
    groups = [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
    out: dict[str, Any] = {prefix + PARAM_GROUPS: groups}
    if _keyed_by_fqn(sd):
        for fqn, states in sd["state"].items():
            for name, value in states.items():
                out[state_key(prefix, fqn, name)] = value
        return out
    slots = _index_slots(model, optimizer)
    per_shard: dict[str, tuple[ShardedTensor, dict[int, torch.Tensor]]] = {}
    for index, states in sd["state"].items():
        slot = slots[index]
        for name, value in states.items():
            key = state_key(prefix, slot.fqn, name)
            if not isinstance(slot.weight, ShardedTensor) or value.dim() == 0:
                out.setdefault(key, value)  # a scalar (`step`) is the same for every shard
                continue
            shard = slot.weight.local_shards()[slot.shard]
            if value.shape != shard.tensor.shape:
                raise TypeError(
                    f"optimizer state {name!r} of {describe(slot.fqn)} has shape "
                    f"{tuple(value.shape)}, neither a scalar nor the shard's "
                    f"{tuple(shard.tensor.shape)}; only such states can be resharded"
                )
            per_shard.setdefault(key, (slot.weight, {}))[1][slot.shard] = value
    for key, (weight, tensors) in per_shard.items():
        if len(tensors) != len(weight.local_shards()):
            raise TypeError(
                f"the optimizer updates {len(tensors)} of this rank's "
                f"{len(weight.local_shards())} shards behind {key}; give it all of "
                "modular.local_parameters(model)"
            )
        out[key] = like_sharded(weight, [tensors[i] for i in range(len(tensors))])
    return out


def like_sharded(
    weight: ShardedTensor, tensors: list[torch.Tensor], dtype: Optional[torch.dtype] = None
) -> ShardedTensor:
    """A ShardedTensor laid out like `weight` whose local shards are `tensors` (no collective)."""
    meta = weight.metadata()
    dtype = dtype or (tensors[0].dtype if tensors else meta.tensor_properties.dtype)
    props = dataclasses.replace(meta.tensor_properties, dtype=dtype, requires_grad=False)
    meta = dataclasses.replace(meta, tensor_properties=props)
    shards = [Shard(t.detach(), s.metadata) for t, s in zip(tensors, weight.local_shards())]
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        shards, meta, process_group=weight._process_group
    )


def empty_like(value: Any, dtype: Optional[torch.dtype] = None) -> Any:
    """A fresh buffer with the layout of `value`, for DCP to read into."""
    if isinstance(value, ShardedTensor):
        dtype = dtype or value.metadata().tensor_properties.dtype
        tensors = [
            torch.empty(s.tensor.shape, dtype=dtype, device=s.tensor.device)
            for s in value.local_shards()
        ]
        return like_sharded(value, tensors, dtype)
    if isinstance(value, torch.Tensor):  # DTensor stays a DTensor
        return torch.empty_like(value.detach(), dtype=dtype)
    return value  # a non-tensor entry: DCP replaces it


def global_shape(value: Any) -> tuple[int, ...]:
    return tuple(value.size()) if isinstance(value, ShardedTensor) else tuple(value.shape)


# -- checking against the checkpoint and staging ---------------------------------------------


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


def stage(
    metadata: Metadata, model: nn.Module, optimizer: Optional[Any], path: str
) -> tuple[Optional[Staged], Optional[str]]:
    """Checks names and global shapes against `metadata`; returns buffers to load or the error."""
    saved = metadata.state_dict_metadata
    live = model_state(model)
    buffers: dict[str, Any] = {}
    problems: list[str] = []

    def check(key: str, value: Any, owner: str) -> None:
        md = saved.get(key)
        if isinstance(value, torch.Tensor) or isinstance(value, ShardedTensor):
            if not isinstance(md, TensorStorageMetadata):
                problems.append(f"{owner}: missing from the checkpoint")
                return
            if tuple(md.size) != global_shape(value):
                problems.append(
                    f"{owner}: the checkpoint holds shape {tuple(md.size)}, the model "
                    f"{global_shape(value)}"
                )
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
    return Staged(buffers, [k for k in live if k in buffers], plans), None


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
    if _keyed_by_fqn(sd):
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
    for index, slot in enumerate(_index_slots(model, optimizer)):
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
    modular/optim.py: its shape tells them apart before anything is read)."""
    if not isinstance(optimizer, FusedOptimizer) or not isinstance(md, TensorStorageMetadata):
        return None
    if not optimizer.kind.rowwise() or weight is None:
        return None
    return column_statistic_mismatch(
        owner, tuple(md.size), global_shape(value), optimizer.column_wise_statistic,
        global_shape(weight)[-1],
    )  # fmt: skip


def _other_fused_kind(saved, prefix: str, optimizer: Any, sd: dict[str, Any]) -> Optional[str]:
    """Why a checkpoint of another fused optimizer kind cannot load into this one, or None.

    Each kind keeps its own state per table (Note [fused tables] in modular/optim.py: none for
    SGD, `sum`, `row_sum`), so the state names in the metadata tell the kind it was saved with
    before anything is read. Adagrad's state loaded into SGD (which has none to look for) would
    otherwise pass every check here and fail in `load_state_dict`, after the weights were copied;
    the other mismatches would be reported as missing state, without the reason."""
    mine = {name for states in sd["state"].values() for name in states}
    theirs = {key.rpartition(".")[2] for key in saved if key.startswith(prefix + "state.")}
    if mine == theirs:
        return None
    kind = sd["param_groups"][0].get("optimizer")
    this = f"fused {kind!r}" if kind else "this optimizer"
    saved_by = [k.value for k in FusedOptimizerKind if {k.state_name()} - {None} == theirs]
    that = f"fused {saved_by[0]!r}" if saved_by else "another optimizer"
    modules = ", ".join(
        f"module {m!r}" if m else "the root module"
        for m in sorted({fqn.rpartition("embedding_bags.")[0].rstrip(".") for fqn in sd["state"]})
    )
    fix = f"fuse with {saved_by[0]!r} to load it" if saved_by else "use the one it was saved with"
    return (
        f"{part_name(prefix, optimizer)}: the checkpoint was saved by {that} (state "
        f"{sorted(theirs)} per table), but the fused tables of {modules} are updated by {this} "
        f"(state {sorted(mine)}); {fix}, or load without the optimizer"
    )


# -- putting staged values into the model -------------------------------------------------------


@torch.no_grad()
def apply_model(model: nn.Module, values: dict[str, Any]) -> None:
    """Copies loaded values into the model. A sharded table's value is the list of its local
    shards' tensors, copied in place (through to the lookup kernels); the rest goes through
    `set_model_state_dict`, so FSDP2 and module hooks see an ordinary `load_state_dict`."""
    live = get_model_state_dict(model)
    rest = {}
    for fqn, value in values.items():
        target = live[fqn]
        if isinstance(target, ShardedTensor):
            for mine, loaded in zip(target.local_shards(), value):
                mine.tensor.copy_(loaded)
        else:
            rest[fqn] = value
    set_model_state_dict(model, rest, options=StateDictOptions(strict=False))


def local_tensors(value: Any) -> Any:
    """What `apply_model` takes for an entry read by DCP: a ShardedTensor's local tensors."""
    if isinstance(value, ShardedTensor):
        return [s.tensor for s in value.local_shards()]
    return value


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


def apply_optimizer(staged: Staged) -> None:
    for plan in staged.optimizer_parts:
        _apply_part(plan, staged.buffers)


def _apply_part(plan: PartPlan, values: dict[str, Any]) -> None:
    current = plan.optimizer.state_dict()
    groups = values[plan.prefix + PARAM_GROUPS]
    param_groups = [{**saved, "params": g["params"]} for saved, g in zip(groups, current["param_groups"])]
    state: dict[Any, dict[str, Any]] = {}
    if plan.keyed_by_fqn:
        for fqn, name in plan.entries:
            state.setdefault(fqn, {})[name] = values[state_key(plan.prefix, fqn, name)]
    else:
        for index, (slot, names) in enumerate(plan.entries):
            for name in names:
                value = values[state_key(plan.prefix, slot.fqn, name)]
                if isinstance(value, ShardedTensor):
                    value = value.local_shards()[slot.shard].tensor
                elif slot.shard is not None:
                    value = value.clone()  # a scalar shared by several shards
                state.setdefault(index, {})[name] = value
    plan.optimizer.load_state_dict({"state": state, "param_groups": param_groups})
