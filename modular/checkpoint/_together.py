"""A save that fails on one rank fails on every rank (issue 48).

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

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from modular.comm import raise_failed


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
