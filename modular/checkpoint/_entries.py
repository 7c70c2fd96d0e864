"""The flat state a checkpoint holds, and how it is checked, staged and put back into the model.

# Note [checkpoint keys]
A checkpoint is one flat DCP state dict whose keys never mention a sharding type or a rank:

    model.<fqn>                 every entry of `get_model_state_dict(model)`: sharded tables as
                                ShardedTensors, data-parallel tables and replicated dense params as
                                plain tensors (saved once), FSDP2 params as DTensors, a split
                                managed-collision table's columns as 1-D ShardedTensors (Note [a
                                collision table in a checkpoint] in modular/mc/table_state.py)
    optim.state.<fqn>.<name>    one optimizer state of the parameter `<fqn>`; laid out like the
                                weight when it has the weight's shape (Adagrad's `sum`, Adam's
                                `exp_avg`), a plain tensor otherwise (`step`)
    optim.param_groups          the optimizer's hyperparameters, one dict per group, no params

A CombinedOptimizer's parts are saved under `optim.<part>.` (`optim.tables.state.<fqn>.sum`), each
by the rules above. Torch optimizers key their state by parameter index; the index is mapped to
the FQN (and shard) of the model parameter it updates. The fused optimizer keys it by FQN already.

DCP stores every tensor by its global shape and its saved chunks, and reads any other chunking
of the same global shape, so a checkpoint loads under any plan and world size: a row-wise table
may come back column-wise, table-wise or as a data-parallel copy, and the other way round.
Optimizer state moves with its weight because its key and global shape do not depend on the plan.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from modular.kinds import KINDS
from modular.mc.table_state import split_state
from modular.tables.forms import global_size, is_sharded, laid_out_like, local_pieces
from modular.tiered.store import file_backed_like

MODEL = "model."
OPTIM = "optim."
PARAM_GROUPS = "param_groups"  # after the optimizer's prefix

# Keys torch's LR schedulers add to param groups: a checkpoint saved with a scheduler attached
# loads into an optimizer that has none yet, and the other way round.
SCHEDULER_KEYS = frozenset({"initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum"})


# Where either kind of collection keeps its tables (Note [collection kinds] in modular/kinds.py).
_TABLES_ATTRS = frozenset(kind.tables_attr for kind in KINDS)


def describe(fqn: str) -> str:
    """How an error names a state entry: by its table when it is one."""
    parts = fqn.split(".")
    if len(parts) >= 3 and parts[-3] in _TABLES_ATTRS and parts[-1] == "weight":
        return f"table {parts[-2]!r} ({fqn})"
    return repr(fqn)


def state_key(prefix: str, fqn: str, name: str) -> str:
    return f"{prefix}state.{fqn}.{name}"


# -- building the state to save ------------------------------------------------------------------


def model_state(model: nn.Module, collisions: Optional[str] = None) -> dict[str, Any]:
    """`model.<fqn>` -> the live tensors (ShardedTensor / DTensor / Tensor), nothing copied.
    `collisions`: how split managed-collision tables appear, SAVE (this rank's range, sorted
    across ranks: collective) or LAYOUT (empty, for a load), else whole (Note [a collision table
    in a checkpoint] in modular/mc/table_state.py)."""
    with split_state(collisions):
        return {MODEL + k: v for k, v in get_model_state_dict(model).items()}


class Slot(NamedTuple):
    """Where one tensor an optimizer updates sits in the model."""

    fqn: str
    weight: torch.Tensor  # the model's parameter: ShardedTensor, DTensor or Tensor
    shard: Optional[int]  # index among weight.local_shards() when the weight is sharded


def _slots(model: nn.Module) -> dict[int, Slot]:
    slots = {}
    for fqn, p in model.named_parameters():
        if is_sharded(p):
            for i, piece in enumerate(local_pieces(p)):
                slots[id(piece.tensor)] = Slot(fqn, p, i)
        else:
            slots[id(p)] = Slot(fqn, p, None)
    return slots


def keyed_by_fqn(sd: dict[str, Any]) -> bool:
    """True for optimizers that key state by FQN (the fused one), False for torch's by-index."""
    return bool(sd["state"]) and all(isinstance(k, str) for k in sd["state"])


def optimizer_parts(optimizer: Any) -> list[tuple[str, Any]]:
    """(key prefix, optimizer) of each optimizer with a torch-style `state_dict()` inside
    `optimizer`: a CombinedOptimizer's parts under their names, else the optimizer itself."""
    parts = getattr(optimizer, "optimizers", None)
    if isinstance(parts, dict):
        return [(f"{OPTIM}{name}.", part) for name, part in parts.items()]
    return [(OPTIM, optimizer)]


def index_slots(model: nn.Module, optimizer: Any) -> list[Slot]:
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
    if keyed_by_fqn(sd):
        for fqn, states in sd["state"].items():
            for name, value in states.items():
                out[state_key(prefix, fqn, name)] = value
        return out
    slots = index_slots(model, optimizer)
    per_shard: dict[str, tuple[torch.Tensor, dict[int, torch.Tensor]]] = {}
    for index, states in sd["state"].items():
        slot = slots[index]
        for name, value in states.items():
            key = state_key(prefix, slot.fqn, name)
            if not is_sharded(slot.weight) or value.dim() == 0:
                out.setdefault(key, value)  # a scalar (`step`) is the same for every shard
                continue
            shard = local_pieces(slot.weight)[slot.shard]
            if value.shape != shard.tensor.shape:
                raise TypeError(
                    f"optimizer state {name!r} of {describe(slot.fqn)} has shape "
                    f"{tuple(value.shape)}, neither a scalar nor the shard's "
                    f"{tuple(shard.tensor.shape)}; only such states can be resharded"
                )
            per_shard.setdefault(key, (slot.weight, {}))[1][slot.shard] = value
    for key, (weight, tensors) in per_shard.items():
        if len(tensors) != len(local_pieces(weight)):
            raise TypeError(
                f"the optimizer updates {len(tensors)} of this rank's "
                f"{len(local_pieces(weight))} shards behind {key}; give it all of "
                "modular.local_parameters(model)"
            )
        out[key] = like_sharded(weight, [tensors[i] for i in range(len(tensors))])
    return out


def like_sharded(
    weight: torch.Tensor, tensors: list[torch.Tensor], dtype: Optional[torch.dtype] = None
) -> torch.Tensor:
    """A sharded tensor of `weight`'s form laid out like it whose local shards are `tensors` (no
    collective; Note [table tensor types] in modular/tables/forms.py)."""
    return laid_out_like(weight, tensors, dtype)


def empty_like(value: Any, dtype: Optional[torch.dtype] = None) -> Any:
    """A fresh buffer with the layout of `value`, for DCP to read into."""
    if is_sharded(value):
        tensors = [_fresh(p.tensor, p.sizes, dtype or p.tensor.dtype) for p in local_pieces(value)]
        return like_sharded(value, tensors, dtype)
    if isinstance(value, torch.Tensor):  # an FSDP2 DTensor stays a DTensor
        return torch.empty_like(value.detach(), dtype=dtype)
    return value  # a non-tensor entry: DCP replaces it


def _fresh(like: torch.Tensor, sizes, dtype: torch.dtype) -> torch.Tensor:
    """An empty buffer for one local piece; a tiered shard's in a file beside its store (Note
    [tiered tables]), so that a load never holds a whole tiered shard in memory."""
    backed = file_backed_like(like, tuple(sizes), dtype)
    return backed if backed is not None else torch.empty(sizes, dtype=dtype, device=like.device)


def dtype_problem(owner: str, saved: torch.dtype, live: torch.dtype, source: str) -> Optional[str]:
    """Why an entry of dtype `saved` does not load into the model's `live` one without
    `convert_dtypes=True` (None when they agree): a table saved in FP32 and loaded into FP16
    would lose precision silently, one saved in FP16 would look like FP32 training resumed."""
    if saved == live:
        return None
    name = lambda d: str(d).removeprefix("torch.")  # noqa: E731
    return (
        f"{owner}: {source} holds {name(saved)}, the model {name(live)}; pass "
        "convert_dtypes=True to convert it (every value rounded to the model's dtype), or build "
        f"the model with {name(saved)} tables"
    )


def global_shape(value: Any) -> tuple[int, ...]:
    return global_size(value) if is_sharded(value) else tuple(value.shape)


# -- checking against the checkpoint and staging ---------------------------------------------
