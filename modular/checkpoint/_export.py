"""Between a sharded model and one process: `export` (gather) and `load_unsharded` (scatter).

# Note [export memory]
`export` walks the model's state one entry at a time, in the same order on every rank. A sharded
table is sent shard by shard to the destination, which receives each one straight into its slice
of the final tensor (or, for a column shard, which is not contiguous there, into one shard-sized
buffer first). So the destination holds the result gathered so far plus at most one shard in
flight, never a gather list of world_size x the largest shard as `ShardedTensor.gather` would
allocate. FSDP2 params are all-gathered with `full_tensor()`, one parameter at a time.
"""

from __future__ import annotations

import os
import pickle
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from modular.comm import collective_device
from modular.checkpoint._directory import MANIFEST, agree
from modular.errors import CheckpointError
from modular.mc.table_state import LAYOUT, SAVE, collision_of, split_state
from modular.checkpoint._apply import load_all_or_nothing
from modular.checkpoint._one_writer import state_prefix
from modular.checkpoint._entries import describe, dtype_problem, global_shape
from modular.optim import fuse_marked
from modular.sharding import sharded_modules
from modular.tables.deprecation import quietly
from modular.tables.forms import dtype_of, global_pieces, global_size, is_sharded, local_pieces


@quietly  # Note [ShardedTensor warnings]
def export(model: nn.Module, *, rank: int = 0) -> Optional[dict[str, Any]]:
    """The whole model as an unsharded state dict of CPU tensors on `rank`; None on other ranks.

    Collective: every rank calls it. The result has the unsharded model's keys and loads with
    `load_state_dict(strict=True)` into it. `rank` is a global rank, and in the process group of
    every sharded module (which holds a subgroup's shards; any rank of a 2D mesh, Note [export
    in 2D]); anything else raises `CheckpointError` on every rank before a shard is sent. See
    Note [export memory].
    """
    fuse_marked(model)  # a one-process model's fused tables (Note [fusing at shard])
    _check_destination(model, rank)
    me = dist.get_rank()
    out: Optional[dict[str, Any]] = {} if me == rank else None
    elsewhere = _other_replica_groups(model, rank)
    with split_state(SAVE):  # a collision table gathered on `rank` only (Note [a collision table in a checkpoint])
        state = get_model_state_dict(model)
    for fqn, value in state.items():
        if is_sharded(value) and fqn.startswith(elsewhere):
            continue  # the destination's replica group sends this table (Note [export in 2D])
        full = gather(value, rank)
        if out is not None:
            out[fqn] = full
    return out


def _check_destination(model: nn.Module, rank: int) -> None:
    """Raises unless `rank` receives every shard. Each rank checks alone, before its first send,
    and all reach the same verdict: a destination that never receives would leave every sender
    waiting in the collective until its timeout."""
    world = dist.get_world_size()
    if not (isinstance(rank, int) and 0 <= rank < world):
        raise CheckpointError(
            f"export(model, rank={rank!r}): rank must be a global rank from 0 to {world - 1} "
            f"(world size {world}); pass the rank that should receive the state dict"
        )
    for fqn, module in sharded_modules(model):
        if module.is_local:  # an unsharded (fused) module: every rank holds all of it
            continue
        pg = module.process_group
        group = range(world) if pg is None else dist.get_process_group_ranks(pg)
        if module.replicas is not None:  # its replica groups span every rank (modular/mesh.py)
            continue
        if rank not in group:
            raise CheckpointError(
                f"export(model, rank={rank}): rank {rank} is not in the process group of module "
                f"{fqn!r} (global ranks {list(group)}), so it would never receive that module's "
                "shards; export to one of those ranks"
            )


def _other_replica_groups(model: nn.Module, dst: int) -> tuple[str, ...]:
    """# Note [export in 2D]
    A 2D collection's tables are sharded alike in every replica group, and the 2D mesh spans
    every rank, so any global rank may receive them: its own replica group (the shard group that
    holds `dst`) sends every shard, as a 1D model's group would, and the other groups send
    nothing (their copies are the same tables). Every member of a shard group reaches the same
    verdict, so no group enters a collective (a DTensor table's shard list) that a member skips.
    Returns the state-dict prefixes of the collections whose shards this rank does not send."""
    prefixes = []
    for name, module in sharded_modules(model):
        if module.is_local or module.replicas is None:
            continue
        if dst not in dist.get_process_group_ranks(module.process_group):
            prefixes.append(state_prefix(model, name))
    return tuple(prefixes)


def gather(value: Any, dst: int) -> Any:
    """The full tensor of one state entry on global rank `dst` (CPU), None elsewhere."""
    me = dist.get_rank()
    if is_sharded(value):
        return _gather_sharded(value, dst)
    if isinstance(value, DTensor):
        full = value.full_tensor()
        return full.cpu() if me == dst else None
    if isinstance(value, torch.Tensor):  # a data-parallel copy or dense param: whole on every rank
        return value.detach().cpu().clone() if me == dst else None
    return value if me == dst else None


def _gather_sharded(st: torch.Tensor, dst: int) -> Optional[torch.Tensor]:
    me = dist.get_rank()
    device = collective_device(None)  # send / recv below run on the world group
    local = {p.offsets: p.tensor for p in local_pieces(st)}
    full = torch.empty(global_size(st), dtype=dtype_of(st)) if me == dst else None
    # The global shard list, the same on every rank; owners are global ranks, also over a
    # subgroup (Note [table tensor types]: a DTensor's list is gathered, a collective). Tables
    # are 2-D, a split collision table's columns 1-D.
    for owner, offsets, sizes in global_pieces(st):
        where = tuple(slice(o, o + n) for o, n in zip(offsets, sizes))
        if me == owner == dst:
            full[where].copy_(local[offsets])
        elif me == owner:
            dist.send(local[offsets].detach().contiguous().to(device), dst)
        elif me == dst:
            region = full[where]
            if device.type == "cpu" and region.is_contiguous():
                dist.recv(region, owner)
            else:
                buf = torch.empty(sizes, dtype=full.dtype, device=device)
                dist.recv(buf, owner)
                region.copy_(buf)
    return full


@quietly
def load_unsharded(
    model: nn.Module, state_dict_or_path: Union[dict[str, torch.Tensor], str, os.PathLike], *,
    convert_dtypes: bool = False,
) -> None:
    """Initialises a sharded model from a single-process `state_dict` (or a `torch.save` file).

    Every rank calls it with the same source; each copies only its own slices (a file is memory-
    mapped, so a rank reads just the pages of its shards). The file is read, and names, shapes
    and types checked strictly against the whole model, on every rank before any weight changes;
    a file that cannot be read or does not match raises `CheckpointError` on every rank naming
    the file and the table. A tensor of another dtype than the model's (an FP32 table into an
    FP16 one, or back) is refused unless `convert_dtypes=True`. The entries other than sharded
    tables go through the model's own `load_state_dict(state_dict, strict=False)` (an override
    without `assign` is fine); if it raises on any rank, every rank puts its weights back and
    raises `CheckpointError` (Note [all or nothing]).
    """
    fuse_marked(model)  # a one-process model's fused tables (Note [fusing at shard])
    with split_state(LAYOUT):  # a collision table's shape only, not gathered
        live = get_model_state_dict(model)
    source, error = _read_unsharded(state_dict_or_path, live, convert_dtypes)
    agree(error)
    what = _described(state_dict_or_path)
    values = {}
    for fqn, target in live.items():
        full = source[fqn]
        if is_sharded(target) and collision_of(target) is None:  # a collision table loads whole
            slices = []
            for (r0, c0), (rows, cols), _ in local_pieces(target):
                slices.append(full[r0 : r0 + rows, c0 : c0 + cols])
            values[fqn] = slices
        elif isinstance(target, DTensor):
            values[fqn] = distribute_tensor(
                full.to(target.device), target.device_mesh, target.placements, src_data_rank=None
            )
        else:
            values[fqn] = full
    load_all_or_nothing(model, values, [], source=what)


def _described(state_dict_or_path: Union[dict[str, torch.Tensor], str, os.PathLike]) -> str:
    if isinstance(state_dict_or_path, (str, os.PathLike)):
        return f"the unsharded state dict {str(state_dict_or_path)!r}"
    return "the unsharded state dict"


def _read_unsharded(
    state_dict_or_path: Union[dict[str, torch.Tensor], str, os.PathLike], live: dict[str, Any],
    convert_dtypes: bool = False,
) -> tuple[Optional[dict[str, Any]], Optional[str]]:
    """(the state dict, None) if it matches the model's state `live`, else (None, why not)."""
    source, what = state_dict_or_path, _described(state_dict_or_path)
    if isinstance(source, (str, os.PathLike)):
        why = None
        if os.path.exists(os.path.join(source, MANIFEST)):
            why = "it is a checkpoint directory: load it with modular.checkpoint.load"
        elif os.path.isdir(source):
            why = "it is a directory"
        else:
            try:
                source = torch.load(source, map_location="cpu", weights_only=True, mmap=True)
            except (OSError, RuntimeError, pickle.UnpicklingError) as e:
                why = str(e)
        if why is not None:
            return None, (
                f"cannot read {str(state_dict_or_path)!r} as a torch.save file of the unsharded "
                f"model's state dict: {why}; nothing was loaded"
            )
    if not isinstance(source, dict):
        return None, (
            f"{what} is a {type(source).__name__}, not a dict of the unsharded model's tensors by "
            "name (as state_dict() returns); nothing was loaded"
        )
    problems = []
    for fqn, target in live.items():
        if fqn not in source:
            problems.append(f"{describe(fqn)}: missing from the state dict")
        elif isinstance(target, torch.Tensor):
            value = source[fqn]
            if not isinstance(value, torch.Tensor):
                problems.append(
                    f"{describe(fqn)}: the state dict holds a {type(value).__name__}, not a tensor"
                )
            elif tuple(value.shape) != global_shape(target):
                problems.append(
                    f"{describe(fqn)}: the state dict holds shape {tuple(value.shape)}, "
                    f"the model {global_shape(target)}"
                )
            elif not convert_dtypes and (
                why := dtype_problem(describe(fqn), value.dtype, dtype_of(target), "the state dict")
            ):
                problems.append(why)
    unexpected = [k for k in source if k not in live]
    if unexpected:
        problems.append(
            "the state dict holds " + ", ".join(describe(k) for k in unexpected)
            + ", which the model does not have"
        )
    if problems:
        return None, (
            f"{what} does not match the model; nothing was loaded:\n  " + "\n  ".join(problems)
        )
    return source, None


__all__ = ["CheckpointError", "export", "load_unsharded"]
