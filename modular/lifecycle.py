"""What `modular` remembers about a user's modules and tensors between its calls.

# Note [lifecycle state]
The public calls run in one order (`fuse_optimizer`, `shard`, `apply_fully_shard` or `apply_ddp`,
then the optimizer; Note [order of sharding calls] in modular/compose/fsdp.py), and an earlier
call leaves facts for a later one: a torchrec EBC on `meta` that `fuse_optimizer` saw is built
fused by `shard` (so a model too large for one rank is never materialised), and every parameter
`shard` replaced is remembered so that an optimizer built on it before sharding raises at its
first step instead of silently training a tensor no forward reads (Note [sharded tables and torch
optimizers] in modular/compose/params.py). These facts live here, in registries keyed weakly by
the module or tensor they describe (like FSDP2's `_composable_state`), never as attributes set on
torchrec's or torch's objects: nothing outlives its module, and nothing a user's module holds
changes.
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple, Optional

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

__all__ = [
    "Retired", "any_pending_fuse", "clear_pending_fuse", "pending_fuse", "place_of", "replace_module", "replaced_table", "retire",
    "retired_count", "set_pending_fuse",
]

# torchrec collection -> the FusedConfig `fuse_optimizer` gave it (Note [fusing at shard]).
_PENDING_FUSE: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()
# module `replace_module` took out of a model -> (weak reference to the model, its FQN there).
_PLACE: weakref.WeakKeyDictionary[nn.Module, tuple[Any, str]] = weakref.WeakKeyDictionary()
# tensor `shard` (or `reshard`) replaced -> which table it was and which call replaced it, for the
# optimizer hook's message.
_RETIRED = WeakIdKeyDictionary()
# How many times `retire` ran: a cache of "no optimizer holds a replaced tensor" is valid until it
# changes (the optimizer hook's, modular/compose/params.py).
_RETIRE_CALLS = 0


def set_pending_fuse(ebc: nn.Module, config: Any) -> None:
    """Records that `ebc` (a torchrec collection) is to be built fused with `config` (Note
    [fusing at shard] in modular/optim.py)."""
    _PENDING_FUSE[ebc] = config


def clear_pending_fuse(ebc: nn.Module) -> None:
    _PENDING_FUSE.pop(ebc, None)


def any_pending_fuse() -> bool:
    """Whether any collection is marked and not yet built (one check a step when none is)."""
    return len(_PENDING_FUSE) > 0


def pending_fuse(ebc: nn.Module) -> Optional[Any]:
    """The FusedConfig `fuse_optimizer` recorded for `ebc`, or None."""
    return _PENDING_FUSE.get(ebc)


class Retired(NamedTuple):
    """A tensor `shard` or `reshard` replaced: the table it was, and the call (`by`)."""

    what: str
    by: str


def retire(tensor: torch.Tensor, what: str, *, by: str = "modular.shard") -> None:
    """Records that `by` (`modular.shard` or `modular.reshard`) replaced `tensor`, which was
    table `what`."""
    global _RETIRE_CALLS
    _RETIRED[tensor] = Retired(what, by)
    _RETIRE_CALLS += 1


def retired_count() -> int:
    """How many tensors `retire` has recorded so far (it only grows)."""
    return _RETIRE_CALLS


def replaced_table(tensor: torch.Tensor) -> Optional[Retired]:
    """Which table `tensor` was and what replaced it, if `shard` or `reshard` did; else None."""
    return _RETIRED.get(tensor)


def replace_module(model: nn.Module, fqn: str, new: nn.Module) -> nn.Module:
    """Puts `new` at `fqn` in `model` and returns the object now there.

    At "" (the model is the module itself) the model becomes `new` in place, by taking `new`'s
    class and state: the public calls return the module they were given, and a caller holding
    `model` must hold the sharded module afterwards (`modular.shard(ebc, plan)` on a bare EBC).
    This is the one class swap in `modular`, and the only way to keep that promise for a root.
    """
    if fqn == "":
        model.__class__ = type(new)
        model.__dict__.clear()
        model.__dict__.update(new.__dict__)
        return model
    parent, _, name = fqn.rpartition(".")
    _PLACE[model.get_submodule(fqn)] = (weakref.ref(model), fqn)
    setattr(model.get_submodule(parent), name, new)
    return new


def place_of(module: nn.Module) -> Optional[tuple[Any, str]]:
    """(a weak reference to the model, the FQN) where `replace_module` took `module` out, or
    None: `model.get_submodule(fqn)` is what stands there now (a FusedOptimizer made on a
    collection that `shard` later replaced inside a larger model finds the sharded one)."""
    return _PLACE.get(module)
