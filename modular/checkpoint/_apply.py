"""Putting what was read into the model and the optimizer: all of it on every rank, or none of it.

# Note [all or nothing]
`load` and `load_unsharded` never leave a model half-loaded. Everything that can be checked
without writing is checked first, on every rank, and agreed: the files, every name, global shape
and dtype of the source against the whole model (`stage` in _staging.py, `_read_unsharded` in
_export.py). What can fail only while writing runs next, under a snapshot; what cannot fail runs
last:

1. This rank clones what the fallible steps may change: the model's entries other than the
   sharded tables (replicated params, buffers, data-parallel tables, its chunk of each FSDP2
   param; "dense" below) and the state of each optimizer part the call loads. A split
   managed-collision table needs no copy: a load gives it a new shard, so it keeps the old one.
2. The fallible steps: the dense entries go through the model's own `load_state_dict`, which may
   be a user's override (it may raise, or leave keys unloaded); then each optimizer part's
   `load_state_dict` (the fused one refuses state that does not fit its tables).
3. After each step every rank says how it went (one all-gather), since a step may be collective
   (the fused optimizer all-reduces the row state of column-wise tables) and no rank may start
   one that another skips. If any rank failed, every rank copies its snapshot back (each
   optimizer part through its own `load_state_dict`, in order, on every rank) and raises
   `CheckpointError`, naming the rank, the step and its error.
4. Only then are the sharded tables' local shards copied in place: copies of checked shapes into
   tensors of checked dtypes, which cannot fail, so the tables (by far the largest state) need no
   snapshot; and split managed-collision tables that a checkpoint load read and checked apart
   take their new shards (Note [a collision table in a checkpoint] in modular/mc/table_state.py).

The dense entries are loaded with `model.load_state_dict(dense, strict=False)`, the call that every
override keeps from `nn.Module`, so module hooks (FSDP2's, `set_extra_state`) and a model's own
override run as in an ordinary load; strict=False because the tables are not in `dense`. It is
never called with `assign=`: torch's `set_model_state_dict` passes it, and an override written
without it (torchrec's `TwoTowerRetrieval.load_state_dict(self, state_dict, strict=True)`) raises
TypeError. What the call returns is checked instead: a dense key it reports missing or unexpected
was not loaded (an override that renamed or dropped it), and fails step 2. The model's snapshot
is put back by copying tensors in place, not through `load_state_dict`: the override may be what
failed. An optimizer's goes back through its own `load_state_dict`: it is the state it had.

The price: while loading, one copy of this rank's dense entries and optimizer state, beside the
buffers read from the source.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch._dynamo.eval_frame import OptimizedModule
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.nn.parallel import DistributedDataParallel

from modular.checkpoint._collisions import collision_entries
from modular.checkpoint._directory import any_rank_error
from modular.checkpoint._staging import PartPlan, Staged, part_name
from modular.checkpoint._entries import PARAM_GROUPS, like_sharded, state_key
from modular.errors import CheckpointError
from modular.mc.table_state import LAYOUT, split_state
from modular.tables.forms import is_sharded, local_pieces


# The wrappers whose child `get_model_state_dict` leaves out of FQNs, and the child's name.
_WRAPPERS = ((OptimizedModule, "_orig_mod"), (DistributedDataParallel, "module"))


class PartLoad(NamedTuple):
    """One optimizer part and the state to hand its `load_state_dict`."""

    name: str  # how an error names it: `optimizer 'dense' (Adam)`
    optimizer: Any
    state: dict[str, Any]


@torch.no_grad()
def load_all_or_nothing(
    model: nn.Module, values: dict[str, Any], parts: list[PartLoad], *, source: str,
    collisions: Sequence[tuple[Any, tuple]] = (),
) -> None:
    """Puts checked `values` (a sharded table's value: its local shards' tensors) and each part's
    state into `model` and the optimizer, on every rank or on none (Note [all or nothing]).
    Collective: one all-gather per step. `source` names what is loaded in errors. `collisions`:
    split managed-collision tables read apart (`read_collisions`), put in last; whole ones in
    `values` load with the dense entries (Note [a collision table in a checkpoint])."""
    with split_state(LAYOUT):  # no collision table gathered
        live = get_model_state_dict(model)
    held = collision_entries(live)
    tables = {fqn: v for fqn, v in values.items() if is_sharded(live[fqn]) and fqn not in held}
    dense = {fqn: v for fqn, v in values.items() if fqn not in tables}
    kept_dense = {fqn: _clone(live[fqn]) for fqn in dense if fqn not in held}
    # a collision table's load puts in new objects: the old ones are its snapshot
    kept_collisions = [(m, m.snapshot()) for m in {id(m): m for m, _ in held.values()}.values()]
    kept_parts = [(part.optimizer, _clone(part.optimizer.state_dict())) for part in parts]

    # Named by the class that defines it: the user's override, not FSDP2's `FSDP<cls>` subclass.
    owner = next(c for c in type(model).__mro__ if "load_state_dict" in vars(c))
    loader = f"{owner.__qualname__}.load_state_dict"
    steps: list[tuple[str, Callable[[], Optional[str]], str]] = [(
        loader, lambda: _load_dense(model, dense),
        f"fix {loader} (or a load hook it runs): it is called as load_state_dict(state_dict, "
        f"strict=False) with the model's {len(dense)} entries other than sharded tables, and "
        "must load every one",
    )]  # fmt: skip
    for part in parts:
        steps.append((
            f"{part.name}.load_state_dict",
            lambda part=part: part.optimizer.load_state_dict(part.state),
            "load without the optimizer, or build the one the checkpoint was saved with",
        ))  # fmt: skip
    for name, run, fix in steps:
        try:
            why = run()
        except Exception as e:  # code we do not control: whatever it raises, put everything back
            why = f"{type(e).__name__}: {e}"
        error = None if why is None else (
            f"loading {source} failed on rank {dist.get_rank()} in {name}: {why}; every rank "
            f"put back the weights and optimizer state it had, so nothing was loaded; {fix}"
        )  # fmt: skip
        # Agreed after every step: a step may be collective (the fused optimizer's all-reduces
        # the row state of column-wise tables), so no rank may start one that another skips.
        error = any_rank_error(error)
        if error is not None:
            _put_back(model, kept_dense)
            for module, kept in kept_collisions:
                module.restore(kept)
            for optimizer, state in kept_parts:  # every part, in order, on every rank
                optimizer.load_state_dict(state)
            raise CheckpointError(error)
    for fqn, shards in tables.items():
        for mine, loaded in zip(local_pieces(live[fqn]), shards, strict=True):
            mine.tensor.copy_(loaded)
    for module, prepared in collisions:
        module.take_split(prepared)


def _load_dense(model: nn.Module, dense: dict[str, Any]) -> Optional[str]:
    """Why `model.load_state_dict` did not load all of `dense`, or None."""
    if not dense:
        return None
    own = _state_dict_keys(model)
    result = model.load_state_dict({own[fqn]: v for fqn, v in dense.items()}, strict=False)
    if result is None:  # an override that does not return super()'s result: nothing to check
        return None
    unloaded = sorted(set(result.missing_keys) & {own[fqn] for fqn in dense})
    if not unloaded and not result.unexpected_keys:
        return None
    quoted = lambda keys: ", ".join(map(repr, sorted(keys)))  # noqa: E731
    whys = []
    if unloaded:
        whys.append(
            f"it left {len(unloaded)} of the {len(dense)} entries it was given unloaded "
            f"({quoted(unloaded)})"
        )
    if result.unexpected_keys:
        whys.append(f"it reported keys the model does not have ({quoted(result.unexpected_keys)})")
    return " and ".join(whys) + " (does it rename or drop keys?)"


def _state_dict_keys(model: nn.Module) -> dict[str, str]:
    """The model's own `state_dict` key of each FQN `get_model_state_dict` gives, which leaves out
    the child that a wrapper adds (torch.compile's `_orig_mod`, DDP's `module`): a model passed
    as `torch.compile(model)` loads too."""
    keys = {}
    with split_state(LAYOUT):  # keys only: no collision table gathered
        names = list(model.state_dict())
    for key in names:
        module: Optional[nn.Module] = model
        kept: list[str] = []
        *path, leaf = key.split(".")
        for name in path:  # a module may save keys below it that are not submodules: kept
            if not any(isinstance(module, cls) and name == child for cls, child in _WRAPPERS):
                kept.append(name)
            module = None if module is None else dict(module.named_children()).get(name)
        keys[".".join([*kept, leaf])] = key
    return keys


def _clone(value: Any) -> Any:
    """A copy of a state value (tensors in nested dicts and lists) that loading cannot touch."""
    if is_sharded(value):
        return like_sharded(value, [p.tensor.clone() for p in local_pieces(value)])
    if isinstance(value, torch.Tensor):  # an FSDP2 DTensor clones its local chunk
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clone(v) for v in value]
    return value


def _put_back(model: nn.Module, kept: dict[str, Any]) -> None:
    """Copies the snapshot into the model's entries in place, without calling its code."""
    with split_state(LAYOUT):
        live = get_model_state_dict(model)
    for fqn, value in kept.items():
        if isinstance(value, torch.Tensor):
            live[fqn].copy_(value)
        else:  # `<module>._extra_state`, kept from get_extra_state()
            model.get_submodule(fqn.rpartition(".")[0]).set_extra_state(value)


def local_tensors(value: Any) -> Any:
    """What `load_all_or_nothing` takes for an entry DCP read: a sharded table's local tensors."""
    if is_sharded(value):
        return [p.tensor for p in local_pieces(value)]
    return value


def part_loads(staged: Staged) -> list[PartLoad]:
    """Each optimizer part of `staged`, with the torch-style state dict to load into it."""
    return [
        PartLoad(
            part_name(plan.prefix, plan.optimizer), plan.optimizer,
            _part_state(plan, staged.buffers),
        )  # fmt: skip
        for plan in staged.optimizer_parts
    ]


def _part_state(plan: PartPlan, values: dict[str, Any]) -> dict[str, Any]:
    current = plan.optimizer.state_dict()
    groups = values[plan.prefix + PARAM_GROUPS]
    param_groups = [
        {**saved, "params": g["params"]} for saved, g in zip(groups, current["param_groups"])
    ]
    state: dict[Any, dict[str, Any]] = {}
    if plan.keyed_by_fqn:
        for fqn, name in plan.entries:
            state.setdefault(fqn, {})[name] = values[state_key(plan.prefix, fqn, name)]
    else:
        for index, (slot, names) in enumerate(plan.entries):
            for name in names:
                value = values[state_key(plan.prefix, slot.fqn, name)]
                if is_sharded(value):
                    value = local_pieces(value)[slot.shard].tensor
                elif slot.shard is not None:
                    value = value.clone()  # a scalar shared by several shards
                state.setdefault(index, {})[name] = value
    return {"state": state, "param_groups": param_groups}
