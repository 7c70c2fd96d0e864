"""DDP for the dense part of a `modular`-sharded model, in place (PyTorch's composable
`replicate`), leaving every table to modular."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed._composable import replicate

from modular.compose.fsdp import refuse_meta_dense
from modular.compose.params import ignored_params
from modular.sharded_types import SHARDED_COLLECTIONS
from modular.errors import ShardingError

__all__ = ["apply_ddp"]


def apply_ddp(model: nn.Module, **ddp_kwargs: Any) -> nn.Module:
    """Applies DDP to the dense part of a `modular`-sharded model, in place; returns `model`.

    Call it after `modular.shard` and before building the optimizer (Note [order of sharding
    calls] in modular/compose/fsdp.py), on every rank, like `apply_fully_shard`:

        modular.apply_ddp(model)
        opt = torch.optim.Adam(modular.local_parameters(model), lr=1e-3)
        loss = loss_fn(model(dense, sparse), labels)

    It is PyTorch's composable DDP (`torch.distributed._composable.replicate`): the module keeps
    its class, parameter names and `state_dict()` keys (no `module.` prefix), and backward
    all-reduces (averages) the gradients of every parameter outside the sharded EBCs, with the
    same buckets and hooks as `DistributedDataParallel`. The sharded EBCs are left alone: their
    tables are communicated by their module, data-parallel tables average their own gradients,
    fused tables update inside backward. `ddp_kwargs` go to DistributedDataParallel
    (`bucket_cap_mb`, `find_unused_parameters`, `device_id`, ...).
    """
    if isinstance(model, SHARDED_COLLECTIONS):
        raise ShardingError(
            f"apply_ddp was given a {type(model).__name__}: it has no dense parameters to "
            "replicate; call it on the model that contains the EBC"
        )
    refuse_meta_dense(model, ignored_params(model), "apply_ddp")
    sharded = [m for m in model.modules() if isinstance(m, SHARDED_COLLECTIONS)]
    replicate(model, ignored_modules=sharded, **ddp_kwargs)
    return model
