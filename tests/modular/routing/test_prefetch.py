"""`modular.prefetch` (Note [prefetched input dist]): the next batch's input dist runs in the
background on a second process group, and the forward that takes it gives the unsharded model's
outputs and gradients; bad batches still raise on every rank, at that forward."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import modular
from modular.routing.prefetcher import MAX_PENDING
from tests.dist import expect_errors_on_all_ranks, run_on_ranks
from tests.modular.collectives import no_collectives
from tests.modular.compare import close, local_blocks
from tests.modular.ebc_cases import BATCH, global_batch, make_batch, make_ebc, plan_for, rank_batches

TIMEOUT_S = 100


def _train_with_prefetch(case: str, weighted: bool, steps: int = 4) -> int:
    """Steps of SGD where each step prefetches the next batch before its own forward; outputs
    and gradients against the unsharded EBC on the global batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = make_ebc(weighted)
    ebc = modular.shard(copy.deepcopy(ref), plan_for(case, ref, world))
    opt = torch.optim.SGD(modular.local_parameters(ebc), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_params = dict(ref.named_parameters())
    batches = [rank_batches(ref, world, step) for step in range(steps)]
    modular.prefetch(ebc, batches[0][rank])
    assert ebc._prefetcher.overlaps, "gloo on CPU should prefetch in the background"
    mine = slice(rank * BATCH, (rank + 1) * BATCH)
    compared = 0
    for step in range(steps):
        if step + 1 < steps:
            modular.prefetch(ebc, batches[step + 1][rank])
        assert id(batches[step][rank]) in ebc._prefetcher._pending, "this step's batch was not prefetched"
        opt.zero_grad()
        ref_opt.zero_grad()
        out = ebc(batches[step][rank]).values()
        expected = ref(global_batch(batches[step])).values()
        close(out, expected[mine], f"{case}: step {step} output")
        target = torch.randn(expected.shape, generator=torch.Generator().manual_seed(step))
        (out * target[mine]).sum().backward()
        ((expected * target).sum() / world).backward()
        for name, param in ebc.named_parameters():
            for tensor, rows, cols in local_blocks(param):
                close(tensor.grad, ref_params[name].grad[rows, cols], f"{case}: step {step} grad of {name}")
                compared += 1
        opt.step()
        ref_opt.step()
    assert not ebc._prefetcher._pending, "every prefetched batch was used"
    return compared


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case, weighted", [("mixed", False), ("mixed", True), ("row_wise", False), ("table_wise", False)])
def test_prefetched_steps_match_the_unsharded_model(case: str, weighted: bool) -> None:
    compared = run_on_ranks(2, _train_with_prefetch, case, weighted, timeout=TIMEOUT_S)
    assert all(n > 0 for n in compared), compared


@pytest.mark.timeout(120)
def test_prefetch_over_three_ranks() -> None:
    compared = run_on_ranks(3, _train_with_prefetch, "mixed", True, timeout=TIMEOUT_S)
    assert all(n > 0 for n in compared), compared


def _out_of_order_and_bad_batches() -> list[str]:
    """A forward of another batch than the prefetched one, then a prefetched bad batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = make_ebc(False)
    ebc = modular.shard(copy.deepcopy(ref), plan_for("mixed", ref, world))
    mine = slice(rank * BATCH, (rank + 1) * BATCH)
    first, second = rank_batches(ref, world, 0), rank_batches(ref, world, 1)
    modular.prefetch(ebc, second[rank])
    modular.prefetch(ebc, second[rank])  # twice: still one input dist
    # `first` was not prefetched: its forward runs input dist itself, on the module's own group,
    # while `second`'s runs on the other.
    close(ebc(first[rank]).values(), ref(global_batch(first)).values()[mine], "not prefetched")
    close(ebc(second[rank]).values(), ref(global_batch(second)).values()[mine], "prefetched")
    bad = make_batch(ref, seed=rank)
    if rank == 1:  # 'f_a' feeds a 7-row table
        jts = bad.to_dict()
        values = jts["f_a"].values().clone()
        values[0] = 7
        jts["f_a"] = type(jts["f_a"])(values=values, lengths=jts["f_a"].lengths())
        bad = type(bad).from_jt_dict(jts)
    modular.prefetch(ebc, bad)  # does not raise here: the error is the forward's
    messages = []
    try:
        ebc(bad)
    except modular.InputError as e:
        messages.append(str(e))
    third = rank_batches(ref, world, 2)  # and the module still works afterwards
    modular.prefetch(ebc, third[rank])
    close(ebc(third[rank]).values(), ref(global_batch(third)).values()[mine], "after a bad batch")
    return messages


@pytest.mark.timeout(120)
def test_prefetched_bad_batch_raises_at_its_forward_on_every_rank() -> None:
    messages = run_on_ranks(2, _out_of_order_and_bad_batches, timeout=TIMEOUT_S)
    assert "has id 7, outside table" in messages[1][0], messages
    assert messages[0][0].startswith("rank 1 rejected its batch for module ''"), messages


def _prefetched_misuse() -> list[str]:
    """Rank 1 prefetches a batch whose weights require grad, rank 0 one whose weights do not:
    it raises at its forward on every rank (the background input dist runs the same agreement,
    Note [learned per-sample weights]), and the module still works
    afterwards. Then rank 1 prefetches an empty batch, which is not refused (Note [a batch size
    per rank]): rank 1's output has 0 rows, the other's its batch's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = slice(rank * BATCH, (rank + 1) * BATCH)
    messages = []
    for weighted in (True, False):
        ref = make_ebc(weighted)
        ebc = modular.shard(copy.deepcopy(ref), plan_for("mixed", ref, world))
        bad = make_batch(ref, seed=rank)
        if rank == 1 and weighted:
            bad = KeyedJaggedTensor(keys=bad.keys(), values=bad.values(), lengths=bad.lengths(), weights=bad.weights().clone().requires_grad_())
        elif rank == 1:
            bad = KeyedJaggedTensor(keys=bad.keys(), values=bad.values()[:0], lengths=bad.lengths()[:0], stride=0)
        modular.prefetch(ebc, bad)
        assert ebc._prefetcher.overlaps
        if not weighted:
            rows = ebc(bad).values().shape[0]
            if rows != (0 if rank == 1 else BATCH):
                raise AssertionError(f"rank {rank}: {rows} output rows for a prefetched batch")
            continue
        try:
            ebc(bad)
        except modular.InputError as e:
            messages.append(str(e))
        else:
            raise AssertionError(f"rank {rank}: a prefetched bad batch on rank 1 was accepted")
        good = rank_batches(ref, world, 1)
        modular.prefetch(ebc, good[rank])
        close(ebc(good[rank]).values(), ref(global_batch(good)).values()[mine], "after a bad batch")
    return messages


@pytest.mark.timeout(120)
def test_prefetched_weights_learning_on_one_rank_raise_on_every_rank_and_an_empty_batch_runs() -> None:
    messages = run_on_ranks(2, _prefetched_misuse, timeout=TIMEOUT_S)
    assert messages[0] == messages[1] == [
        "per-sample weights for module '' require grad on ranks [1] but not on ranks [0]: in a step, every rank's weights must require grad (learned, e.g. by a PositionWeightedModule) or none's (pass weights.detach() on every rank)",
    ], messages


def _armed_until_the_module_waits() -> int:
    """prefetch itself starts no collective: the batch goes to the thread at the module's next
    output all-to-all, or when a forward asks for it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = make_ebc(False)
    ebc = modular.shard(copy.deepcopy(ref), plan_for("mixed", ref, world))
    mine = slice(rank * BATCH, (rank + 1) * BATCH)
    steps = [rank_batches(ref, world, s) for s in range(3)]
    ebc(steps[0][rank])  # the side group exists from the first prefetch on; make it here
    modular.prefetch(ebc, steps[1][rank])
    ebc(steps[1][rank])
    with no_collectives():
        modular.prefetch(ebc, steps[2][rank])
    assert [f for f, _ in ebc._prefetcher._armed] == [steps[2][rank]]
    out = ebc(steps[1][rank])  # not prefetched: its own input dist; releases steps[2] at output dist
    assert not ebc._prefetcher._armed
    close(out.values(), ref(global_batch(steps[1])).values()[mine], "between")
    close(ebc(steps[2][rank]).values(), ref(global_batch(steps[2])).values()[mine], "released")
    return 1


@pytest.mark.timeout(120)
def test_prefetch_starts_no_collective_until_the_module_waits() -> None:
    assert run_on_ranks(2, _armed_until_the_module_waits, timeout=TIMEOUT_S) == [1, 1]


def _too_many_pending() -> str:
    world = dist.get_world_size()
    ref = make_ebc(False)
    ebc = modular.shard(copy.deepcopy(ref), plan_for("table_wise", ref, world))
    batches = [make_batch(ref, seed=s) for s in range(MAX_PENDING + 1)]
    for b in batches[:-1]:
        modular.prefetch(ebc, b)
    try:
        modular.prefetch(ebc, batches[-1])
    except RuntimeError as e:
        message = str(e)
    else:
        raise AssertionError("a ninth pending prefetch did not raise")
    for b in batches[:-1]:  # they are all still usable, in any order
        ebc(b)
    return message


@pytest.mark.timeout(120)
def test_prefetching_batches_no_forward_uses_is_refused() -> None:
    messages = run_on_ranks(2, _too_many_pending, timeout=TIMEOUT_S)
    # Usually not a loop that forgets its batches but forwards of copies of them: say so.
    assert all("8 prefetched batches that no forward has used. A forward uses a prefetched batch only when given that same KeyedJaggedTensor object, not a copy" in m for m in messages), messages


def test_prefetch_on_one_process_runs_input_dist_at_once() -> None:
    ref = make_ebc(False)
    ebc = modular.ShardedEmbeddingBagCollection.unsharded(copy.deepcopy(ref), module="")
    batch = make_batch(ref, seed=3)
    modular.prefetch(ebc, batch)
    assert not ebc._prefetcher.overlaps and id(batch) in ebc._prefetcher._pending
    close(ebc(batch).values(), ref(batch).values(), "unsharded prefetch")
    assert not ebc._prefetcher._pending


def test_prefetch_needs_a_sharded_model_and_a_kjt() -> None:
    with pytest.raises(ValueError, match="no sharded EmbeddingBagCollection"):
        modular.prefetch(nn.Linear(2, 2), make_batch(make_ebc(False), seed=0))
    ebc = modular.ShardedEmbeddingBagCollection.unsharded(make_ebc(False), module="")
    with pytest.raises(TypeError, match="takes a KeyedJaggedTensor, got dict"):
        modular.prefetch(ebc, {})


@pytest.mark.parametrize(
    "config, device_type, backend",
    [
        ("gloo", "cpu", "gloo"),
        ("nccl", "cuda", "nccl"),
        ("cpu:gloo,cuda:nccl", "cpu", "gloo"),  # init_process_group() with no backend, on a GPU machine
        ("cpu:gloo,cuda:nccl", "cuda", "nccl"),
        ("cpu:gloo", "cpu", "gloo"),  # ... on a CPU-only machine
        ("cpu:gloo", "cuda", None),
    ],
)
def test_backend_for_reads_the_groups_backend_config(config: str, device_type: str, backend) -> None:
    from modular.comm import backend_for

    assert backend_for(device_type, config) == backend


def _overlaps_under_config(config: str) -> bool:
    """Whether prefetch overlaps for a module whose group reports `config` as its backend config
    (what `init_process_group()` with no backend reports), and one prefetched step still matches."""
    import modular.routing.prefetcher as prefetch_module

    rank, world = dist.get_rank(), dist.get_world_size()
    ref = make_ebc(False)
    ebc = modular.shard(copy.deepcopy(ref), plan_for("mixed", ref, world))
    real = prefetch_module.dist.get_backend_config, prefetch_module.dist.get_backend
    # What torch reports for such a group: its backend "undefined" when the config names one
    # per device.
    prefetch_module.dist.get_backend_config = lambda group=None: config
    prefetch_module.dist.get_backend = lambda group=None: "undefined" if ":" in config else config
    try:
        batches = rank_batches(ref, world, 0)
        modular.prefetch(ebc, batches[rank])
        overlaps = ebc._prefetcher.overlaps
    finally:
        prefetch_module.dist.get_backend_config, prefetch_module.dist.get_backend = real
    out = ebc(batches[rank]).values()
    close(out, ref(global_batch(batches)).values()[rank * BATCH : (rank + 1) * BATCH], f"{config}: output")
    return overlaps


@pytest.mark.timeout(60)
def test_a_world_made_without_a_backend_prefetches_in_the_background() -> None:
    # `init_process_group()` with no backend reports "undefined" from get_backend but runs CPU
    # collectives on gloo: prefetch must overlap there as it does for "gloo", and not for NCCL.
    assert run_on_ranks(2, _overlaps_under_config, "cpu:gloo,cuda:nccl", timeout=TIMEOUT_S) == [True, True]
    assert run_on_ranks(2, _overlaps_under_config, "cpu:gloo", timeout=TIMEOUT_S) == [True, True]
    assert run_on_ranks(2, _overlaps_under_config, "nccl", timeout=TIMEOUT_S) == [False, False]


def _prefetch_skipped_on_rank_1() -> str:
    """Both ranks prefetch step 0's batch; at step 1 rank 1 does not. The ranks then wait on
    different groups (rank 0's background thread on the prefetch group, rank 1 on the module's),
    so neither collective can complete: both time out after the module group's timeout."""
    from datetime import timedelta

    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=3))
    ref = make_ebc(False)
    ebc = modular.shard(copy.deepcopy(ref), plan_for("mixed", ref, world), process_group=group)
    batches = [rank_batches(ref, world, step)[rank] for step in range(2)]
    modular.prefetch(ebc, batches[0])
    ebc(batches[0])
    if rank == 0:
        modular.prefetch(ebc, batches[1])
    ebc(batches[1])
    return "no error"


@pytest.mark.timeout(60)
def test_prefetch_skipped_on_one_rank_times_out_naming_prefetch() -> None:
    messages = expect_errors_on_all_ranks(2, _prefetch_skipped_on_rank_1, timeout=40)
    for rank, message in enumerate(messages):
        assert "CollectiveError" in message or "failed on rank" in message, (rank, message)
        assert "modular.prefetch on every rank" in message, (rank, message)
