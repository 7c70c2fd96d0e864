"""Checkpoints that survive a new plan or a new world size, and export to one process.

    modular.checkpoint.save("ckpt/step_1000", model, opt)      # every rank calls it
    ...                                                        # later, any plan, any world size
    model = modular.shard(build_model(), new_plan)
    modular.checkpoint.load("ckpt/step_1000", model, opt)

    sd = modular.checkpoint.export(model)                      # rank 0: plain tensors
    if sd is not None:
        single_process_model.load_state_dict(sd, strict=True)

See docs/checkpointing.md, Note [checkpoint layout] and Note [checkpoint keys].
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Union

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from modular.checkpoint._apply import load_all_or_nothing, local_tensors, part_loads
from modular.checkpoint._export import export, load_unsharded
from modular.checkpoint._directory import (
    SafeLoadPlanner,
    SafeReader,
    agree,
    commit,
    hash_rank_files,
    new_token,
    read_manifest,
    read_metadata,
    refuse_save_target,
    resolve,
    tmp_dir,
    verify_file,
)
from modular.checkpoint._collisions import read_collisions
from modular.checkpoint._one_writer import drop_replica_copies
from modular.checkpoint._together import agree_on_load, failed, save_collective
from modular.checkpoint._staging import check_loaded, stage
from modular.checkpoint._entries import MODEL, model_state, optimizer_parts, optimizer_state
from modular.errors import CheckpointError
from modular.mc.table_state import SAVE
from modular.optim import fuse_marked
from modular.profiling import CHECKPOINT_LOAD, CHECKPOINT_SAVE, labelled
from modular.tables.deprecation import quietly

__all__ = ["CheckpointError", "export", "load", "load_unsharded", "save"]


def __dir__() -> list[str]:
    return sorted(__all__)

PathLike = Union[str, os.PathLike]


@labelled(CHECKPOINT_SAVE)  # Note [profiler labels] in modular/profiling.py
@quietly  # Note [ShardedTensor warnings]
def save(path: PathLike, model: nn.Module, optimizer: Optional[Any] = None) -> None:
    """Saves the model (and optimizer) state to the directory `path`, atomically. Collective.

    Sharded tables, data-parallel tables, FSDP2 params and optimizer state are written by DCP
    under plan-independent keys (Note [checkpoint keys]), so `load` accepts any later plan and
    world size. `path` is replaced only once every rank has written everything; an interrupted
    save leaves the previous checkpoint at `path` intact (Note [checkpoint layout]). `path` must be
    new, an empty directory or a checkpoint: anything else (a directory of other files, a file)
    raises `CheckpointError` on every rank before anything is written. `optimizer`
    may be any optimizer with torch's `state_dict()`/`load_state_dict()` over
    `modular.local_parameters(model)`, or one whose state is keyed by parameter FQN.
    A 2D-sharded model's tables are written by its first replica group only (Note [one replica
    group writes]): under replica_sync="periodic", call `modular.sync_replicas` first to save the
    average rather than that group's copy.
    """
    path = Path(path)
    fuse_marked(model)  # a one-process model's fused tables (Note [fusing at shard])
    rank, world = dist.get_rank(), dist.get_world_size()
    state, error = None, None
    try:  # a rank that cannot describe its state must not leave the others in a collective
        state = model_state(model, SAVE)  # Note [a collision table in a checkpoint]
        if optimizer is not None:
            state.update(optimizer_state(model, optimizer))
        prefixes = [p for p, _ in optimizer_parts(optimizer)] if optimizer is not None else []
        state = drop_replica_copies(model, state, prefixes)  # Note [one replica group writes]
    except TypeError as e:
        error = str(e)
    except Exception as e:  # Note [saves fail together]
        error = failed(path, rank, "describing the model and optimizer state", e)
    if error is None and rank == 0:  # the filesystem is shared: rank 0 looks for all of them
        error = refuse_save_target(path)
    with save_collective(path, "the agreement before writing"):
        agree(error)
        tmp = tmp_dir(path, new_token())
    if rank == 0:
        try:
            tmp.mkdir(parents=True)
        except OSError as e:  # e.g. NotADirectoryError: a path under a regular file
            error = failed(path, rank, f"creating the directory {str(tmp)!r}", e)
    with save_collective(path, "the agreement on the temporary directory"):
        agree(error)  # in place of a barrier: a rank that could not create it says so
    try:
        with save_collective(path, "DCP's save"):
            dcp.save(
                state,
                storage_writer=FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True),
                planner=DefaultSavePlanner(flatten_state_dict=False),
            )
    except CheckpointException as e:  # a BaseException: `except Exception` would not see it
        raise CheckpointError(
            f"saving checkpoint {str(path)!r} failed while writing {str(tmp)!r}: {e}; the "
            f"previous checkpoint at {str(path)!r}, if any, is untouched"
        ) from e
    try:
        mine: object = hash_rank_files(tmp, rank)
    except OSError as e:  # the error travels in the digests' gather
        mine = failed(path, rank, f"hashing the files it wrote in {str(tmp)!r}", e)
    digests: list[Optional[dict]] = [None] * world
    with save_collective(path, "the gather of the written files' digests"):
        dist.all_gather_object(digests, mine)
    broken = [(r, d) for r, d in enumerate(digests) if isinstance(d, str)]
    error = None
    if broken:
        error = broken[0][1] if broken[0][0] == rank else (
            f"rank {broken[0][0]} failed, so every rank stops: {broken[0][1]}"
        )
        raise CheckpointError(error)
    if rank == 0:
        files = {name: d for per_rank in digests for name, d in per_rank.items()}
        try:  # the other ranks must learn that the checkpoint was not committed
            commit(path, tmp, files, world)
        except OSError as e:
            error = f"could not commit checkpoint {str(path)!r} from {str(tmp)!r} on rank 0: {e}"
    with save_collective(path, "the agreement on the commit"):
        agree(error)


@labelled(CHECKPOINT_LOAD)
@quietly
def load(
    path: PathLike, model: nn.Module, optimizer: Optional[Any] = None, *,
    convert_dtypes: bool = False,
) -> None:
    """Loads a checkpoint written by `save` into `model` (and `optimizer`). Collective.

    The model may be sharded by any plan over any number of ranks: each rank reads just the
    slices its shards need. Before anything changes, every file is checked against the sha256
    recorded at save time and every entry's name, global shape and dtype against the whole
    model's; any problem raises `CheckpointError` on every rank naming the file or table. The
    state is read into fresh buffers and put into the model and optimizer only after every rank
    has read all of it; a failure while putting it in (the model's own `load_state_dict`, or an
    optimizer's, raising) puts every weight and the optimizer state back on every rank (Note [all
    or nothing]). So a failed load leaves the model and optimizer as they were. Tables (and every
    model entry) keep their dtype: an entry saved in another dtype (FP32 into an FP16 table, or
    back) is refused naming it, unless `convert_dtypes=True` converts it. Every rank must pass
    the same `path` (the same checkpoint, on a file system they share) and `convert_dtypes`:
    where one differs, every rank raises `CheckpointError` naming it (Note [a load's options]).
    """
    fuse_marked(model)  # a one-process model's fused tables (Note [fusing at shard])
    rank, world = dist.get_rank(), dist.get_world_size()
    error, manifest = None, None
    try:
        found = resolve(Path(path))
        manifest = read_manifest(found)
    except CheckpointError as e:
        error = str(e)
    agree_on_load(Path(path), convert_dtypes, error, manifest)  # Note [a load's options]
    names = sorted(manifest["files"])
    problems = [verify_file(found, n, manifest["files"][n]) for n in names[rank::world]]
    agree(next((p for p in problems if p is not None), None))
    staged, error = None, None
    try:  # TypeError: an optimizer over tensors that are not the model's (it names them)
        staged, error = stage(read_metadata(found), model, optimizer, str(found), convert_dtypes)
    except (CheckpointError, TypeError) as e:
        error = str(e)
    agree(error)
    try:
        dcp.load(staged.buffers, storage_reader=SafeReader(found), planner=SafeLoadPlanner())
    except CheckpointException as e:  # DCP raises it on every rank
        raise CheckpointError(
            f"reading checkpoint {str(found)!r} failed: {e}; nothing was loaded (the files passed "
            "their sha256 check, so look for one changed or removed while loading)"
        ) from e
    agree(check_loaded(staged))
    model_values = {k[len(MODEL):]: local_tensors(staged.buffers[k]) for k in staged.model_keys}
    source = f"checkpoint {str(found)!r}"
    collisions, error = read_collisions(staged.collisions, model_values, source=source)
    agree(error)
    load_all_or_nothing(model, model_values, part_loads(staged), source=source, collisions=collisions)
