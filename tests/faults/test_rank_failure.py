"""A rank that dies or raises mid-step: its peers raise within the collective timeout, not hang.

The step is forward + backward of a sharded EBC ("mixed" plan: every sharding type). The victim
breaks in input dist (before its metadata all-to-all: peers wait there) or in backward (a hook on
the pooled output fires before the backward all-to-all: peers wait there). A killed victim closes
its sockets, so gloo fails its peers at once; a victim that raises stays alive and silent, so its
peers fail when the collective times out. Checkpoint saves are in test_checkpoint_faults.py.
"""

from __future__ import annotations

import copy

import pytest
import torch.distributed as dist

import modular
from tests.faults.helpers import (
    COLLECTIVE_TIMEOUT_S,
    VICTIM,
    Survived,
    break_victim,
    check_survivors,
    check_victim,
    spawn,
    survive,
)
from tests.modular.ebc_cases import make_batch, make_ebc, plan_for


def _step_with_fault(where: str, how: str) -> Survived | None:
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = make_ebc(False)
    ebc = modular.shard(copy.deepcopy(ref), plan_for("mixed", ref, world))
    batch = make_batch(ref, seed=rank, batch_size=4)
    ebc(batch).values().sum().backward()  # one good step first: the fault is mid-training
    victim = rank == VICTIM
    if victim and where == "input_dist":
        original = ebc.input_dist

        def broken_input_dist(features):
            break_victim(how, where)
            return original(features)

        ebc.input_dist = broken_input_dist

    def step() -> None:
        out = ebc(batch).values()
        if victim and where == "backward":
            out.register_hook(lambda grad: break_victim(how, where))
        out.sum().backward()

    if victim:
        step()
        raise AssertionError("the victim's step did not fail")
    return survive(step)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["killed", "raises"])
@pytest.mark.parametrize("where", ["input_dist", "backward"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_peers_of_a_failed_rank_raise_within_the_collective_timeout(world_size: int, where: str, how: str) -> None:
    outcomes = spawn(world_size, _step_with_fault, where, how)
    check_victim(outcomes[VICTIM], how)
    survived = check_survivors(outcomes)
    assert len(survived) == world_size - 1
    # modular names the collective that failed and points at the peer (modular/comm.py).
    label = {"input_dist": "the input-dist agreement of module ''",
             "backward": "the backward all-to-all of pooled-embedding gradients"}[where]
    for s in survived:
        assert s.exc_type == "CollectiveError", s
        assert s.message.startswith(f"{label} failed on rank "), s
        assert "Another rank most likely died or raised before reaching it" in s.message, s
    if how == "killed":  # a closed socket is noticed at once, not after the timeout
        assert all(s.seconds < COLLECTIVE_TIMEOUT_S / 2 for s in survived), survived
