"""The options of `shard` that change what a collective does, agreed on with the plan (issue 48).

# Note [agreeing on options]
Two ranks that shard the same plan with different options build different collectives: a
DTensor and a ShardedTensor table make different collectives while the shards are built (one
rank returned while its peer hung or aborted), a fused table's backward runs its own collectives
where a dense one runs none or others (row-wise Adagrad against exact SGD hung at the first
backward; fused on one rank only raised torch's "ShardedTensor requires_grad property does not
match" after the shards were built), and output and comm dtypes, the column-wise statistic and
the replicas' sync change the bytes each collective moves. So `shard` folds these options
(`settings`) into the digest of Note [agreeing on the plan]: a good call costs no collective more.
Only when the digests differ do the ranks gather their settings (`raise_if_settings_differ`, one
`all_gather_object` every rank reaches, since every rank sees the same digests) and raise
`ShardingError` naming each option that differs, with the ranks and their values. `fuse_optimizer`
runs before `shard` and may run without a process group, so it agrees on nothing itself: it
records its config on each module, and `shard` agrees on that.
"""

from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist
from torch.distributed import ProcessGroup

from modular.errors import ShardingError


def fused_settings(fused: Optional[Any]) -> dict[str, str]:
    """What a module's fused optimizer config (a `FusedConfig`, or None: not fused) changes in
    the collectives: its kind, which hyper-parameters it has (weight decay picks another kernel
    on CPU) and the column-wise statistic (the exact one exchanges a float per id)."""
    if fused is None:
        return {"fused optimizer": "none (not fused)"}
    present = sorted(
        k for k, v in fused.param_group.items() if k != "params" and v not in (0, 0.0, None, ())
    )
    return {
        "fused optimizer": fused.optimizer.value,
        "fused hyper-parameters set": ", ".join(present),
        "column_wise_statistic": fused.column_wise_statistic.value,
    }


def shard_settings(
    modules: dict[str, dict[str, str]], *, tensor_type: Optional[str], replica_sync: Optional[str]
) -> dict[str, str]:
    """`shard`'s settings, flat: "tensor_type" (`reshard` has one per module instead),
    "replica_sync" (under a 2D mesh) and, per planned module, "<option> of module 'fqn'" for each
    of its own (`modules[fqn]`)."""
    settings = {} if tensor_type is None else {"tensor_type": tensor_type}
    if replica_sync is not None:
        settings["replica_sync"] = replica_sync
    for fqn, options in modules.items():
        for name, value in options.items():
            settings[f"{name} of module {fqn!r}"] = value
    return settings


# What `raise_if_settings_differ` tells `shard`'s caller to do; other calls pass their own `fix`.
SHARD_FIX = "call {call} (and modular.fuse_optimizer before it) with the same options"


def settings_that_differ(gathered: list[dict[str, str]]) -> list[str]:
    """Each setting whose value is not the same in every rank's `gathered` settings, as "name:
    ranks [0] 'a', ranks [1] 'b'" (a rank without it holds 'absent'); pure, no collective."""
    names = sorted({n for s in gathered for n in s}, key=lambda n: (n != "tensor_type", n))
    differing = []
    for name in names:
        held: dict[str, list[int]] = {}
        for rank, s in enumerate(gathered):
            held.setdefault(s.get(name, "absent"), []).append(rank)
        if len(held) > 1:
            differing.append(
                f"{name}: " + ", ".join(f"ranks {ranks} {value!r}" for value, ranks in held.items())
            )
    return differing


def disagreement(
    call: str, differing: list[str], fix: str = SHARD_FIX, note: str = "Note [agreeing on options]"
) -> str:
    """The message every rank raises when `settings_that_differ` found `differing`; `note`
    is the Note that says how `call` agrees."""
    return (
        f"ranks disagree on options of {call} that change what its collectives do ("
        + "; ".join(differing)
        + f"); every rank must {fix.format(call=call)} ({note})"
    )


def raise_if_settings_differ(
    settings: dict[str, str], group: Optional[ProcessGroup], call: str, fix: str = SHARD_FIX
) -> None:
    """Gathers every rank's `settings` and raises `ShardingError` naming each that differs, with
    the ranks holding each value; returns if none does. Collective: call it on every rank."""
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, settings, group=group)
    differing = settings_that_differ(gathered)
    if differing:
        raise ShardingError(disagreement(call, differing, fix))
