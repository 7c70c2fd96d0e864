"""The input dist picks one kind's part per step and hands it on (`Received.part`, modular/parts.py):
a sharded EBC's uniform batch goes through `PooledPart`, a step in which any rank's batch has its
own bags per feature through `VariableBags` (on every rank, a rank with a plain batch too). The
outputs of each path equal the
unsharded modules' (test_variable_batch.py, test_shard_parity.py, test_sequence_parity.py); this
pins which part runs, so that no stage after the input dist needs to ask."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import modular
from tests.dist import run_on_ranks
from tests.modular.ebc_cases import make_ebc, plan_for
from tests.modular.pooled.test_variable_batch import vbe_batch


def _parts_per_step() -> list[tuple[str, str]]:
    world, rank = dist.get_world_size(), dist.get_rank()
    ref = make_ebc(False)
    ebc = modular.shard(copy.deepcopy(ref), plan_for("mixed", ref, world))
    seen = []
    # Step 0: plain batches on every rank; step 1: VBE on rank 0 only; step 2: VBE everywhere.
    for step, vbe_ranks in enumerate(((), (0,), tuple(range(world)))):
        batches = [
            vbe_batch(ref, 10 * step + r, 2, plain=r not in vbe_ranks) for r in range(world)
        ]
        received = ebc.input_dist(batches[rank])
        out = ebc.output_dist(ebc.lookup(received), received)
        torch.testing.assert_close(out.values(), ref(batches[rank]).values(), atol=1e-5, rtol=0)
        seen.append((type(received.part).__name__, received.vbe is not None))
    return seen


def test_the_input_dist_picks_the_pooled_part_once_per_step() -> None:
    for seen in run_on_ranks(2, _parts_per_step):
        assert seen == [("PooledPart", False), ("VariableBags", True), ("VariableBags", True)]

