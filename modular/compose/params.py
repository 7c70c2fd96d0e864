"""Which tensors a plain torch optimizer, DDP and FSDP should see in a `modular`-sharded model.

    opt = torch.optim.Adam(modular.local_parameters(model), lr=1e-3)

# Note [sharded tables and torch optimizers]
A sharded table is registered under its unsharded name as a `ShardedTensor`, a wrapper whose
`.grad` stays None: its gradient lives on the local shards (`ShardView`s). A torch optimizer given
the wrapper, e.g. through `model.parameters()`, would skip it on every step and the table would
silently never train. So `local_parameters` hands out the local shards instead, and importing
`modular` installs a global optimizer step pre-hook (`torch.optim.optimizer.
register_optimizer_step_pre_hook`) that raises on the first `step()` of any optimizer holding a
ShardedTensor, before anything is updated. The same hook catches an optimizer built before
`shard`: `shard` records the parameters it replaces (`lifecycle.retire`, Note [lifecycle state]),
which no forward reads any more; and one built before `modular.reshard`, which replaces the
tables it rebuilds in the same way. `remove_optimizer_check` takes the hook out.
Either finding is always a bug, so the hook cannot fire on a correct program. It reads every
parameter only when something it could find may have changed: at an optimizer's first step, after
its param groups change (a group added, a group's list replaced or resized), and after `shard`
replaced more tensors. Other steps cost one comparison per param group, so the step path holds no
per-table Python (issue 29; tests/modular/test_step_python.py).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import Optimizer, register_optimizer_step_pre_hook

from modular import lifecycle
from modular.sharded_types import SHARDED_COLLECTIONS
from modular.tables.forms import is_sharded, local_pieces

__all__ = ["ignored_params", "local_parameters", "remove_optimizer_check"]


def _sharded(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, SHARDED_COLLECTIONS)]


def ignored_params(model: nn.Module) -> set[torch.Tensor]:
    """The parameters DDP and FSDP must leave alone: every table of every sharded EBC.

    Sharded tables are ShardedTensors that modular communicates itself, data-parallel tables
    all-reduce their own gradients, and fused tables update inside backward; an outer wrapper that
    touched any of them would reduce twice. `modular.apply_fully_shard` and `modular.apply_ddp`
    pass this set for you; by hand:

        fully_shard(model, ignored_params=modular.ignored_params(model))
    """
    return {p for m in _sharded(model) for p in m.parameters()}


def local_parameters(model: nn.Module) -> list[torch.Tensor]:
    """Every tensor a plain torch optimizer must update on this rank, in `named_parameters()` order.

    Build the optimizer from it after all sharding calls (`shard`, then `apply_fully_shard` or
    `apply_ddp`), because FSDP replaces parameters by DTensors:

        opt = torch.optim.Adam(modular.local_parameters(model), lr=1e-3)

    It holds the local shards of sharded tables (not the ShardedTensor wrappers, see
    Note [sharded tables and torch optimizers]), the data-parallel tables' copies, FSDP's DTensor
    parameters and every other parameter that requires grad. Tables of a module fused with its
    optimizer (`module.fused`) are left out: they update inside backward and have no gradients.
    """
    fused = {
        id(p)
        for m in _sharded(model)
        if m.fused is not None
        for p in m.parameters()
    }
    fused |= {  # marked by fuse_optimizer, fused when sharded or first used (Note [fusing at shard])
        id(p) for m in model.modules() if lifecycle.pending_fuse(m) is not None for p in m.parameters()
    }
    out = []
    for _, p in model.named_parameters():
        if id(p) in fused:
            continue
        if is_sharded(p):
            out.extend(piece.tensor for piece in local_pieces(p) if piece.tensor.requires_grad)
        elif p.requires_grad:
            out.append(p)
    return out


# optimizer -> what its last full check saw (`_signature`).
_CHECKED: weakref.WeakKeyDictionary[Optimizer, tuple] = weakref.WeakKeyDictionary()


def _signature(optimizer: Optimizer) -> tuple:
    groups = optimizer.param_groups
    return (
        lifecycle.retired_count(),
        tuple((id(g["params"]), len(g["params"])) for g in groups),
    )


def _reject_sharded_tensors(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
    """Global step pre-hook; see Note [sharded tables and torch optimizers]."""
    signature = _signature(optimizer)
    if _CHECKED.get(optimizer) == signature:
        return
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            replaced = lifecycle.replaced_table(p)
            if replaced is not None:
                raise TypeError(_replaced_message(optimizer, g, i, replaced))
            if is_sharded(p):
                raise TypeError(
                    f"{type(optimizer).__name__} param group {g}, parameter {i} is a "
                    f"{type(p).__name__} "
                    f"of size {tuple(p.size())}: a table sharded by modular, whose gradient lives "
                    "on its local shards, so this optimizer would silently never update it. Build "
                    "the optimizer from modular.local_parameters(model), not model.parameters()"
                )
    _CHECKED[optimizer] = signature


def _replaced_message(optimizer: Optimizer, g: int, i: int, replaced: lifecycle.Retired) -> str:
    where = f"{type(optimizer).__name__} param group {g}, parameter {i} is table {replaced.what}"
    if replaced.by == "modular.reshard":  # Note [resharding in memory]
        return (
            f"{where}, whose shards modular.reshard has since rebuilt under the new plan: this "
            "optimizer holds the old layout's tensors, which no forward reads any more, and "
            "would silently never update the table. Rebuild the optimizer after modular.reshard, "
            "from modular.local_parameters(model)"
        )
    return (
        f"{where}, which modular.shard has since replaced: this optimizer was built before "
        "sharding and would silently never update the sharded table. Build optimizers after "
        "modular.shard, from modular.local_parameters(model)"
    )


_HOOK = register_optimizer_step_pre_hook(_reject_sharded_tensors)


def remove_optimizer_check() -> None:
    """Takes out the global optimizer step pre-hook that `import modular` installs.

        modular.compose.params.remove_optimizer_check()

    The hook (Note [sharded tables and torch optimizers]) raises only on an optimizer that would
    silently never train a table, so a correct program behaves the same without it. Remove it
    only where something else in the process steps a torch optimizer over ShardedTensors (or
    DTensors of LocalShardsWrappers) on purpose, whose updates it handles itself: the hook would
    refuse those steps. Every later step of every optimizer in the process then goes unchecked;
    there is no call to put the hook back. Calling this twice is harmless. README.md, "What
    `import modular` changes", lists every global hook.
    """
    _HOOK.remove()
