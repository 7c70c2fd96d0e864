"""Issue 48, checkpoints: a save that fails on one rank fails on every rank, at once.

A directory that cannot be created (a path under a regular file: NotADirectoryError from rank 0's
mkdir, which left rank 1 in a barrier), or files that one rank cannot hash after writing, raise
`CheckpointError` on every rank naming the path and the rank within seconds, and leave the last
good checkpoint intact; a peer killed mid-save gives its survivors `CollectiveError`, not gloo's
raw "Connection reset by peer" (Note [saves fail together] in modular/checkpoint/_together.py).
"""

from __future__ import annotations

import copy
import hashlib
import os
import signal
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import modular
import modular.checkpoint as ckpt
from tests.dist import run_on_ranks
from tests.faults.helpers import COLLECTIVE_TIMEOUT_S, MARGIN_S, VICTIM, spawn, survive
from tests.faults.state import assert_unchanged, snapshot
from tests.modular.ebc_cases import make_batch, make_ebc, plan_for

TIMEOUT_S = 90
FAST_S = 10.0  # far below the pool's collective timeout (60 s)


def trained(rank: int, world: int):
    ref = make_ebc(False)
    ebc = modular.shard(copy.deepcopy(ref), plan_for("mixed", ref, world))
    opt = torch.optim.Adagrad(modular.local_parameters(ebc), lr=0.1)
    ebc(make_batch(ref, seed=rank)).values().pow(2).sum().backward()
    opt.step()
    return ebc, opt


def tree_digest(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.rglob("*")) if p.is_file()}


def shared_dir() -> Path:
    box = [tempfile.mkdtemp(prefix="fail_together_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0])


def _save_fails(fault: str) -> tuple[str, str, float, bool]:
    rank, world = dist.get_rank(), dist.get_world_size()
    ebc, opt = trained(rank, world)
    root = shared_dir()
    good = root / "good"
    ckpt.save(good, ebc, opt)
    kept = tree_digest(good)
    before = snapshot(ebc, opt)
    target = good
    if fault == "under_a_file":
        if rank == 0:
            (root / "a_file").write_text("not a directory")
        dist.barrier()
        target = root / "a_file" / "step_2"
    original = ckpt.hash_rank_files
    if fault == "hash_fails" and rank == VICTIM:
        def broken(directory, r):
            raise PermissionError(13, "Permission denied (injected)", str(directory))
        ckpt.hash_rank_files = broken
    start = time.monotonic()
    try:
        ckpt.save(target, ebc, opt)
    except Exception as e:  # the error under test
        got = (type(e).__name__, str(e), time.monotonic() - start)
    else:
        raise AssertionError(f"rank {rank}: the save with {fault} returned")
    finally:
        ckpt.hash_rank_files = original
    assert_unchanged(before, snapshot(ebc, opt), f"rank {rank}")
    dist.barrier()
    intact = tree_digest(good) == kept
    ckpt.load(good, ebc, opt)  # the last good checkpoint still loads
    return (*got, str(target), intact)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fault", ["under_a_file", "hash_fails"])
def test_a_save_that_fails_on_one_rank_raises_checkpoint_error_on_every_rank(fault: str) -> None:
    got = run_on_ranks(2, _save_fails, fault, timeout=TIMEOUT_S)
    failing = 0 if fault == "under_a_file" else VICTIM
    for rank, (kind, message, seconds, target, intact) in enumerate(got):
        assert kind == "CheckpointError" and seconds < FAST_S, (rank, kind, seconds, message)
        assert intact, f"rank {rank}: the last good checkpoint changed"
        mine = f"saving checkpoint {target!r} failed on rank {failing} while "
        if rank == failing:
            assert message.startswith(mine), message
        else:
            assert message.startswith(f"rank {failing} failed, so every rank stops: {mine}"), message
    if fault == "under_a_file":
        assert "NotADirectoryError" in got[0][1], got[0][1]
    else:
        assert "PermissionError" in got[VICTIM][1], got[VICTIM][1]


def _peer_killed_mid_save():
    rank, world = dist.get_rank(), dist.get_world_size()
    ebc, opt = trained(rank, world)
    root = shared_dir()
    if rank == VICTIM:  # dies after writing its files, before the digests' gather
        ckpt.hash_rank_files = lambda directory, r: os.kill(os.getpid(), signal.SIGKILL)
    return survive(lambda: ckpt.save(root / "step_1", ebc, opt))


@pytest.mark.timeout(180)
def test_a_peer_killed_mid_save_gives_collective_error() -> None:
    outcomes = spawn(2, _peer_killed_mid_save)
    assert outcomes[VICTIM].exitcode == -signal.SIGKILL, outcomes[VICTIM]
    peer = outcomes[1 - VICTIM]
    assert not peer.timed_out and peer.error is None and peer.result is not None, peer
    s = peer.result
    assert s.exc_type in ("CollectiveError", "CheckpointError"), s
    assert "of saving checkpoint" in s.message or "saving checkpoint" in s.message, s
    assert s.seconds < COLLECTIVE_TIMEOUT_S + MARGIN_S, s
