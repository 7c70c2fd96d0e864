"""A save that fails on one rank fails on every rank, and a load's ranks agree on what they load
(issue 48).

# Note [saves fail together]
Every step of `save` that can fail on one rank alone (describing the state, creating the
temporary directory, hashing the files written, committing) catches its error and hands it to
the next agreement that every rank joins (`agree`, the digests' gather), so each rank raises
`CheckpointError` naming the path and the rank that failed, at once, instead of that rank raising
and its peers waiting in the next collective. A peer that dies mid-save fails the collectives
its peers are in; gloo says only "Connection reset by peer", so those collectives raise
`CollectiveError` naming the save (Note [a failed peer]). Nothing at `path` changes until the
commit, so the last good checkpoint stays intact (Note [checkpoint layout]).
"""

from __future__ import annotations

import hashlib
import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

import torch.distributed as dist

from modular.agreed_options import disagreement, settings_that_differ
from modular.comm import raise_failed
from modular.errors import CheckpointError


def failed(path: Path, rank: int, step: str, error: BaseException) -> str:
    """The message of a save that failed on `rank` while doing `step`."""
    return (
        f"saving checkpoint {str(path)!r} failed on rank {rank} while {step}: "
        f"{type(error).__name__}: {error}; the previous checkpoint at {str(path)!r}, if any, is "
        "untouched"
    )


@contextmanager
def save_collective(path: Path, what: str) -> Iterator[None]:
    """Raises `CollectiveError` naming the save's collective `what` where gloo raises its plain
    RuntimeError (a peer died); any other error passes through."""
    try:
        yield
    except RuntimeError as e:
        raise_failed(f"{what} of saving checkpoint {str(path)!r}", None, e)


def agree_on_load(
    path: Path, convert_dtypes: bool, error: Optional[str], manifest: Optional[dict[str, Any]]
) -> None:
    """Raises `CheckpointError` on every rank if the ranks load another path, convert dtypes
    differently or read different manifests, or if any rank has an `error`; one all-gather.

    # Note [a load's options]
    `load` reads its path and `convert_dtypes` on each rank: a rank that loads another checkpoint
    (another path, or its own copy where the file system is not shared) stages other entries and
    runs other reads, and one that converts dtypes where its peers refuse raises alone, after
    its peers entered DCP's collectives. So the first agreement of `load`, which every rank joins
    to share a missing or damaged checkpoint, carries both, with a digest of the manifest each
    rank read, and every rank raises `CheckpointError` naming the option, the ranks and their
    values before anything is read (Note [agreeing on options]): no collective more. The path is
    compared made absolute (`os.path.abspath`): ranks with other working directories would read
    other checkpoints under one relative path.
    """
    settings = {"path": os.path.abspath(path), "convert_dtypes": str(convert_dtypes)}
    read = None if manifest is None else hashlib.sha256(
        json.dumps(manifest, sort_keys=True).encode()
    ).hexdigest()[:16]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (settings, error, read))
    differing = settings_that_differ([s for s, _, _ in gathered])
    if differing:
        raise CheckpointError(disagreement("modular.checkpoint.load", differing, _LOAD_FIX, "Note [a load's options]"))
    failing = [(r, e) for r, (_, e, _) in enumerate(gathered) if e is not None]
    if error is not None:
        raise CheckpointError(error)
    if failing:
        raise CheckpointError(f"rank {failing[0][0]} failed, so every rank stops: {failing[0][1]}")
    manifests: dict[str, list[int]] = {}
    for r, (_, _, m) in enumerate(gathered):
        manifests.setdefault(m, []).append(r)
    if len(manifests) > 1:
        held = ", ".join(f"ranks {ranks} read manifest {m}" for m, ranks in manifests.items())
        raise CheckpointError(
            f"ranks read different checkpoints at {str(path)!r} ({held}, sha256 prefixes): the "
            "path must name one checkpoint on a file system every rank shares, as save writes "
            "it (Note [a load's options])"
        )


_LOAD_FIX = "call {call} with the same path and convert_dtypes"
