"""The input dist's ids travel with their header (Note [ids with their header]): one all-to-all
in a steady step, two when a payload outgrows its slot or on the first step, and the same
results as the unsharded EBC whichever it took, through growing, shrinking and rejected batches.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import modular
import modular.collection as eb  # where the input dist reads INT32_MAX
from modular.routing.exchange import grow
from tests.dist import run_on_ranks
from tests.modular.compare import close
from tests.modular.ebc_cases import features_of, global_batch, id_bounds, make_ebc, plan_for

# (samples per rank, ids per bag) of each step; None: rank 1 sends a bad batch, and every rank
# must raise. Step 2 triples the payload (more than its slot's eighth of room: a second
# all-to-all for the rest), step 3 goes back (it fits, with padding), step 4 halves the batch.
STEPS = [(8, 2), (8, 2), (8, 6), (8, 2), (4, 2), None, (8, 2), (8, 2)]
# All-to-alls in each step's forward under table-wise and column-wise, whose payloads follow the
# lengths alone:
# the ids' (one or two) and the pooled output's; a rejected step stops after the first.
WHOLE_TABLE_ALL_TO_ALLS = [3, 2, 3, 2, 2, 1, 3, 2]


def _batch(ebc, seed: int, samples: int, per_bag: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    keys, bounds = features_of(ebc), id_bounds(ebc)
    lengths = torch.full((len(keys) * samples,), per_bag)
    values = torch.cat([torch.randint(0, bounds[f], (samples * per_bag,), generator=g) for f in keys])
    weights = torch.rand(values.numel(), generator=g) + 0.5 if ebc.is_weighted() else None
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, weights=weights)


def _run_steps(case: str, weighted: bool, mode: str) -> list[int]:
    """mode "slots": as on CPU; "headers_alone": the protocol of GPU modules, here on CPU;
    "rank0_wide": rank 0's ids count as too many for int32, so every payload goes as int64."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = make_ebc(weighted)
    ebc = modular.shard(copy.deepcopy(ref), plan_for(case, ref, world))
    ebc._exchange._speculate = mode != "headers_alone"
    saved = eb.INT32_MAX
    if mode == "rank0_wide" and rank == 0:
        eb.INT32_MAX = 0
    calls, original = [0], dist.all_to_all_single

    def counting(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    counts = []
    dist.all_to_all_single = counting
    try:
        for step, spec in enumerate(STEPS):
            calls[0] = 0
            if spec is None:
                batch = _batch(ref, 100 * step + rank, 8, 2)
                if rank == 1:  # two ids fewer than the lengths say
                    batch = KeyedJaggedTensor(
                        keys=batch.keys(), values=batch.values()[:-2], lengths=batch.lengths(),
                        weights=None if batch.weights_or_none() is None else batch.weights()[:-2],
                    )
                with pytest.raises(modular.InputError):
                    ebc(batch)
                counts.append(calls[0])
                continue
            batches = [_batch(ref, 100 * step + r, *spec) for r in range(world)]
            got = ebc(batches[rank]).values()
            counts.append(calls[0])
            samples = spec[0]
            want = ref(global_batch(batches)).values()[rank * samples:(rank + 1) * samples]
            close(got, want, f"rank {rank}, {case}, step {step} {spec}")
    finally:
        dist.all_to_all_single, eb.INT32_MAX = original, saved
    return counts


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["slots", "headers_alone", "rank0_wide"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("case", ["table_wise", "row_wise", "column_wise", "mixed"])
def test_ids_arrive_right_through_growing_shrinking_and_rejected_batches(
    case: str, weighted: bool, mode: str
) -> None:
    counts = run_on_ranks(2, _run_steps, case, weighted, mode, timeout=100)
    assert counts[0] == counts[1], counts
    # Weights travel in the ids' payload: no all-to-all of their own.
    expected = WHOLE_TABLE_ALL_TO_ALLS
    if mode != "slots":  # every step that sends ids takes two
        expected = [1 if n == 1 else 3 for n in WHOLE_TABLE_ALL_TO_ALLS]
    if case in ("table_wise", "column_wise") or mode != "slots":
        assert counts[0] == expected
    else:  # row-split payloads depend on the ids: only the first step is known to take two
        assert counts[0][0] == expected[0], counts[0]


def test_a_slot_has_room_for_an_eighth_more() -> None:
    assert [grow(n) for n in (0, 1, 7, 8, 800)] == [0, 1, 7, 9, 900]
