"""FSDP2 for the dense part of a `modular`-sharded model.

    tables_opt = modular.fuse_optimizer(model, "exact_rowwise_adagrad", lr=0.1)  # 0. optional
    modular.shard(model, plan)                                # 1. tables
    modular.apply_fully_shard(model, modules={MLP})           # 2. dense towers (or apply_ddp)
    opt = torch.optim.Adam(modular.local_parameters(model), lr=1e-3)  # 3. the dense optimizer

# Note [order of sharding calls]
Each call changes the model in place and returns it. `fuse_optimizer` comes first: it only marks
each collection, so `shard` builds each rank's shards fused directly (Note [fusing at shard] in
modular/optim.py; fusing an already sharded module would hold its shards twice while its kernels
are swapped, so it is refused). `shard` runs
before the dense wrappers: FSDP and DDP must be told which parameters to leave alone, and only
once the tables are `ShardedTensor`s and self-reducing data-parallel copies can those be found
(`ignored_params`). FSDP then replaces the dense parameters by DTensors, so the optimizer is
built last. Only the tables may be on `meta` when `shard` runs: FSDP2 needs materialised dense
parameters (`apply_fully_shard` says which are not). Every table
stays outside FSDP and DDP: sharded tables are communicated by their module, data-parallel tables
all-reduce-mean their own gradients, fused tables update inside backward; a second reduction by
the wrapper would be wasted work at best. Gradients of all three parts follow the same convention
(Note [grad scaling across ranks]): the mean over ranks of per-rank losses, like DDP and FSDP.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any, Optional, Union

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from modular.compose.params import ignored_params
from modular.sharded_types import SHARDED_COLLECTIONS
from modular.errors import ShardingError

__all__ = ["ModuleSelector", "apply_fully_shard", "dense_modules", "refuse_meta_dense"]

ModuleSelector = Union[Collection[type[nn.Module]], Callable[[nn.Module], bool]]


def dense_modules(model: nn.Module, modules: ModuleSelector) -> list[nn.Module]:
    """The submodules of `model` picked by `modules`, in `.modules()` order, outside sharded EBCs.

    `modules` is a collection of classes (like FSDP's ModuleWrapPolicy) or a predicate. The root
    is never included (it is always fully sharded last), and the walk never enters a
    `ShardedEmbeddingBagCollection`, so nothing of a sharded table's subtree can be picked.
    """
    if isinstance(modules, type):
        raise TypeError(
            f"modules must be a collection of module classes or a predicate, got the class "
            f"{modules.__name__}; pass {{{modules.__name__}}}"
        )
    if callable(modules):
        picks = modules
    else:
        classes = tuple(modules)
        picks = lambda m: isinstance(m, classes)  # noqa: E731
    found: list[nn.Module] = []
    seen: set[int] = {id(model)}

    def walk(module: nn.Module) -> None:
        for child in module.children():
            if id(child) in seen or isinstance(child, SHARDED_COLLECTIONS):
                continue
            seen.add(id(child))
            if picks(child):
                found.append(child)
            walk(child)

    walk(model)
    return found


def apply_fully_shard(
    model: nn.Module,
    *,
    modules: ModuleSelector,
    mesh: Optional[DeviceMesh] = None,
    **fully_shard_kwargs: Any,
) -> nn.Module:
    """Applies FSDP2's `fully_shard` to the dense part of a `modular`-sharded model; returns it.

    Call it after `modular.shard` and before building the optimizer (Note [order of sharding
    calls]), on every rank:

        model = modular.apply_fully_shard(
            model, modules={MLP}, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        )

    Each module picked by `modules` (see `dense_modules`) gets its own `fully_shard` call, bottom
    up (reverse `.modules()` order, so a picked module inside another picked module is sharded
    first), then the root gets one for the parameters left over. These, the picked modules plus
    the root, are the fully sharded modules: each owns one all-gather / reduce-scatter pair. Every
    call ignores the tables of sharded EBCs (`modular.ignored_params`) along with any
    `ignored_params` you pass. `mesh` (1-D for FSDP, 2-D ("replicate", "shard") for HSDP) and the
    other keyword arguments (`mp_policy`, `reshard_after_forward`, ...) go to every call.
    """
    if isinstance(model, SHARDED_COLLECTIONS):
        raise ShardingError(
            f"apply_fully_shard was given a {type(model).__name__}: it has no dense "
            "parameters to shard; call it on the model that contains the EBC"
        )
    ignored = ignored_params(model) | set(fully_shard_kwargs.pop("ignored_params", None) or ())
    refuse_meta_dense(model, ignored, "apply_fully_shard")
    for module in reversed(dense_modules(model, modules)):
        fully_shard(module, mesh=mesh, ignored_params=ignored, **fully_shard_kwargs)
    fully_shard(model, mesh=mesh, ignored_params=ignored, **fully_shard_kwargs)
    return model


def refuse_meta_dense(model: nn.Module, ignored: set, call: str) -> None:
    """Raises naming the dense parameters still on `meta`: only the tables may stay there until
    `modular.shard` (Note [order of sharding calls]); FSDP2 and DDP need the others materialised."""
    skip = {id(p) for p in ignored}  # the tables: ShardedTensors answer no tensor query
    on_meta = [n for n, p in model.named_parameters() if id(p) not in skip and p.is_meta]
    if on_meta:
        shown = ", ".join(repr(n) for n in on_meta[:5]) + (" ..." if len(on_meta) > 5 else "")
        raise ShardingError(
            f"{call}: {len(on_meta)} dense parameters are on the meta device ({shown}). Only "
            "the embedding tables may be on meta (modular.shard allocates each rank's shards); "
            "build the dense towers on a real device, e.g. torchrec's DLRM(..., "
            "dense_device=torch.device('cpu')), or call model.to_empty(device=...) on them and "
            "initialise them before this call"
        )
