"""Compose `modular.shard` with PyTorch's own data parallelism for the dense part of a model.

    model = modular.shard(model, plan)                    # 1. tables
    model = modular.apply_fully_shard(model, modules={MLP}) # 2. dense towers (or apply_ddp)
    opt = torch.optim.Adam(modular.local_parameters(model), lr=1e-3)

# Note [order of sharding calls]
`shard` runs first: FSDP and DDP must be told which parameters to leave alone, and only once the
tables are `ShardedTensor`s and self-reducing replicas can those be found (`ignored_params`).
FSDP then replaces the dense parameters by DTensors, so the optimizer is built last. Every table
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
from torch.nn.parallel import DistributedDataParallel

from modular.embedding_bag import ShardedEmbeddingBagCollection, ShardingError
from modular.params import ignored_params

__all__ = ["apply_ddp", "apply_fully_shard", "dense_modules"]

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
            if id(child) in seen or isinstance(child, ShardedEmbeddingBagCollection):
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
    if isinstance(model, ShardedEmbeddingBagCollection):
        raise ShardingError(
            "apply_fully_shard was given a ShardedEmbeddingBagCollection: it has no dense "
            "parameters to shard; call it on the model that contains the EBC"
        )
    ignored = ignored_params(model) | set(fully_shard_kwargs.pop("ignored_params", None) or ())
    for module in reversed(dense_modules(model, modules)):
        fully_shard(module, mesh=mesh, ignored_params=ignored, **fully_shard_kwargs)
    fully_shard(model, mesh=mesh, ignored_params=ignored, **fully_shard_kwargs)
    return model


def apply_ddp(model: nn.Module, **ddp_kwargs: Any) -> DistributedDataParallel:
    """Wraps a `modular`-sharded model in DistributedDataParallel that leaves every table alone.

    Call it after `modular.shard` (Note [order of sharding calls]); build the optimizer from the
    unwrapped model's `modular.local_parameters(ddp.module)` (the same tensors either way):

        ddp = modular.apply_ddp(model)
        loss = loss_fn(ddp(dense, sparse), labels)

    DDP all-reduces (averages) only the other parameters: the FQNs of every parameter and buffer
    under a sharded EBC are added to the ones DDP ignores, so data-parallel tables, which average
    their own gradients, are not reduced a second time. `ddp_kwargs` go to DistributedDataParallel.
    The wrapper prefixes names with `module.`; save and load `ddp.module.state_dict()`.
    """
    names = set(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
    for prefix, module in model.named_modules():
        if isinstance(module, ShardedEmbeddingBagCollection):
            dot = f"{prefix}." if prefix else ""
            names.update(f"{dot}{n}" for n, _ in module.named_parameters())
            names.update(f"{dot}{n}" for n, _ in module.named_buffers())
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, sorted(names))
    return DistributedDataParallel(model, **ddp_kwargs)
