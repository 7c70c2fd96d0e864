"""Breaking ranks on purpose: where a rank dies or raises, and what its peers must then say.

Tests spawn fresh ranks (`tests.dist.spawn_ranks`) with a short gloo collective timeout
(`COLLECTIVE_TIMEOUT_S`) and break rank `VICTIM` at a chosen point. Each survivor runs its part
under `survive`, which returns how long it took to raise and what it raised, so a test can check
that every survivor failed (did not hang, did not return) within the timeout plus `MARGIN_S`.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any, Callable, NamedTuple

from tests.dist import RankOutcome, spawn_ranks

COLLECTIVE_TIMEOUT_S = 8.0
MARGIN_S = 4.0  # the collective's own bookkeeping on 2 busy cores
SPAWN_TIMEOUT_S = 90.0  # far above the collective timeout: a hang shows up as `timed_out`
VICTIM = 1

# What gloo says when a peer is gone (its socket closed) or silent (the collective timed out).
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Timed out waiting", "timed out", "Timeout")


class InjectedFault(RuntimeError):
    """The error a test makes the victim raise."""


class Survived(NamedTuple):
    """What a surviving rank raised, and how long after starting the step."""

    exc_type: str
    message: str
    seconds: float


def break_victim(how: str, where: str) -> None:
    """On the victim: die at once (as the OOM killer or a lost node would), or raise."""
    if how == "killed":
        os.kill(os.getpid(), signal.SIGKILL)
    raise InjectedFault(f"injected failure in {where} on rank {VICTIM}")


def survive(step: Callable[[], Any]) -> Survived | None:
    """Runs `step` and returns what it raised; None if it returned (a survivor must not)."""
    start = time.monotonic()
    try:
        step()
    except Exception as e:  # the survivor's error is the result under test
        return Survived(type(e).__name__, str(e), time.monotonic() - start)
    return None


def spawn(world_size: int, fn: Callable[..., Any], *args: Any) -> list[RankOutcome]:
    return spawn_ranks(world_size, fn, *args, timeout=SPAWN_TIMEOUT_S, collective_timeout=COLLECTIVE_TIMEOUT_S)


def check_victim(outcome: RankOutcome, how: str) -> None:
    if how == "killed":
        assert outcome.exitcode == -signal.SIGKILL, outcome
    else:
        assert outcome.error is not None and outcome.error.exc_type == "InjectedFault", outcome


def check_survivors(outcomes: list[RankOutcome]) -> list[Survived]:
    """Every rank but the victim raised in time, with an error naming the lost peer."""
    survived = []
    for o in outcomes:
        if o.rank == VICTIM:
            continue
        assert not o.timed_out, f"rank {o.rank} hung:\n{o.output}"
        assert o.error is None, f"rank {o.rank} failed outside the step: {o.error}"
        s = o.result
        assert s is not None, f"rank {o.rank} finished its step although rank {VICTIM} failed"
        assert s.seconds < COLLECTIVE_TIMEOUT_S + MARGIN_S, f"rank {o.rank} took {s.seconds:.1f} s: {s}"
        assert any(p in s.message for p in PEER_LOST), s
        survived.append(s)
    return survived
