"""CUDA: `modular.prefetch` on a side stream (Note [prefetch on a side stream] in
modular/routing/prefetcher.py) trains exactly as the same model without prefetch.

Skipped where torch sees no CUDA device. Run on a machine with one as tests/gpu/test_cuda.py is
(`python -m pytest tests/gpu -q`): world 1 (NCCL, the background thread with no second group) and
world 2 with both ranks on the one GPU over gloo (the background thread on a second gloo group).
`MODULAR_GPU_TEST_DEVICE=cpu` runs the same bodies on CPU gloo ranks (no streams there: it checks
this file, not the stream discipline).

Two models from the same weights, under fused row-wise Adagrad, see the same batches; one
prefetches each next batch, the other does not. Their outputs, weights and optimizer states must
agree at every step (same GPU, same kernels: to ATOL). To give a missing wait or a missing
`record_stream` a chance to show as wrong numbers, the GPU is made to lag on purpose
(`torch.cuda._sleep`): the side stream sleeps before each prefetched input dist (a forward that
did not wait for it would read ids not yet written), and the current stream sleeps after each
forward (memory the side stream could reuse for the next prefetch is still to be read by this
backward). Batches either already on the GPU or on the CPU (then pinned and copied on the side
stream; the model without prefetch gets `kjt.to(device)`).

Written in a session with no GPU (2026-11-24): not run on a GPU yet (docs/gpu.md, "Prefetch on
CUDA"); its bodies pass on CPU gloo ranks with MODULAR_GPU_TEST_DEVICE=cpu.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist

import modular
from modular.routing import prefetcher
from planners.types import ShardingPlan
from tests.gpu.test_cuda import DEVICE_KIND, _close, _ebc, run_spawned
from tests.modular.ebc_cases import make_batch, placements_for
from tests.modular.fused_reference import FUSED_EPS as EPS, FUSED_LR as LR

pytestmark = pytest.mark.skipif(
    DEVICE_KIND == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device"
)

STEPS = 6
LAG_CYCLES = 20_000_000  # about 10 ms of an H100's clock: longer than a step of these tables
CASES = ("table_wise", "row_wise", "data_parallel", "mixed")


def _lag(stream: torch.cuda.Stream | None) -> None:
    """Keeps `stream` busy for a while (nothing on CPU)."""
    if stream is not None:
        with torch.cuda.stream(stream):
            torch.cuda._sleep(LAG_CYCLES)


def _model(ebc, case: str, device: torch.device):
    ebc = copy.deepcopy(ebc)
    world = dist.get_world_size()
    plan = ShardingPlan(world_size=world, modules={"": placements_for(case, ebc, world)})
    opt = modular.fuse_optimizer(ebc, "exact_rowwise_adagrad", lr=LR, eps=EPS)
    return modular.shard(ebc, plan, device=device), opt


def _parity(device: torch.device, case: str, weighted: bool, on_cpu: bool) -> dict[str, Any]:
    world, rank = dist.get_world_size(), dist.get_rank()
    ebc = _ebc(weighted)
    plain, plain_opt = _model(ebc, case, device)
    fetched, fetched_opt = _model(ebc, case, device)
    batches = [make_batch(ebc, seed=1000 * step + rank) for step in range(STEPS)]
    given = batches if on_cpu else [b.to(device) for b in batches]  # the prefetching model's
    cuda = device.type == "cuda"
    modular.prefetch(fetched, given[0])
    side = prefetcher._SIDE_STREAMS[device] if cuda else None
    assert (fetched._prefetcher._stream is side) and fetched._prefetcher.overlaps, (
        f"{case}: world {world} on {device} should prefetch in the background"
        + (" on the side stream" if cuda else "")
    )
    worst = 0.0
    for step in range(STEPS):
        if step + 1 < STEPS:
            _lag(side)  # the next input dist starts late on the side stream
            modular.prefetch(fetched, given[step + 1])
        outs = []
        for model, opt, kjt in ((plain, plain_opt, batches[step].to(device)), (fetched, fetched_opt, given[step])):
            out = model(kjt).values()
            _lag(torch.cuda.current_stream(device) if cuda else None)  # backward reads late
            target = torch.randn(out.shape, generator=torch.Generator().manual_seed(step))
            (out * target.to(device)).sum().backward()
            opt.step()
            opt.zero_grad()
            outs.append(out.detach())
        worst = max(worst, _close(outs[1], outs[0], f"{case} step {step}: output with prefetch"))
    assert not fetched._prefetcher._pending, f"{case}: every prefetched batch was used"
    fetched_state = fetched_opt.state_dict()["state"]
    for (name, p), (_, q) in zip(plain.named_parameters(), fetched.named_parameters()):
        for a, b in zip(_blocks(p), _blocks(q)):
            worst = max(worst, _close(b, a, f"{case}: {name} with prefetch"))
        for key, value in plain_opt.state_dict()["state"].get(name, {}).items():
            other = fetched_state[name][key]
            if isinstance(value, torch.Tensor):
                worst = max(worst, _close(_local(other), _local(value), f"{case}: {name} {key}"))
    return {"worst": worst}


def _blocks(p: torch.Tensor) -> list[torch.Tensor]:
    from tests.modular.compare import local_blocks

    return [t for t, _, _ in local_blocks(p)]


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if isinstance(t, ShardedTensor):
        shards = t.local_shards()
        return torch.cat([s.tensor.reshape(-1) for s in shards]) if shards else torch.zeros(0)
    return t


def _every_case(device: torch.device, on_cpu: bool) -> dict[str, Any]:
    out = {case: _parity(device, case, False, on_cpu) for case in CASES}
    out["row_wise, weighted"] = _parity(device, "row_wise", True, on_cpu)  # weights travel too
    return out


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("where", ["device", "cpu"])
def test_prefetch_on_a_side_stream_trains_as_without_it(world: int, where: str) -> None:
    results = run_spawned(world, _every_case, where == "cpu")
    assert len(results) == world and all(len(r) == len(CASES) + 1 for r in results)


def _bad_prefetched_batch(device: torch.device) -> str:
    """The last rank prefetches a batch from the CPU with an id past its table's end: every rank's
    forward of it raises (the side stream's input dist ran the checks), and the next batch trains
    as on the model without prefetch."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ebc = _ebc()
    plain, _ = _model(ebc, "row_wise", device)
    fetched, _ = _model(ebc, "row_wise", device)
    bad = make_batch(ebc, seed=rank)
    if rank == world - 1:  # 'f_a' feeds a 7-row table
        jts = bad.to_dict()
        values = jts["f_a"].values().clone()
        values[0] = 7
        jts["f_a"] = type(jts["f_a"])(values=values, lengths=jts["f_a"].lengths())
        bad = type(bad).from_jt_dict(jts)
    modular.prefetch(fetched, bad)
    try:
        fetched(bad)
    except modular.InputError as e:
        message = str(e)
    else:
        raise AssertionError(f"rank {rank}: a prefetched batch with id 7 in a 7-row table was accepted")
    good = make_batch(ebc, seed=100 + rank)
    modular.prefetch(fetched, good)
    _close(fetched(good).values(), plain(good.to(device)).values(), "the batch after a bad one")
    return message


@pytest.mark.parametrize("world", [1, 2])
def test_a_bad_prefetched_batch_raises_at_its_forward_and_the_next_one_trains(world: int) -> None:
    messages = run_spawned(world, _bad_prefetched_batch)
    assert "has id 7, outside table" in messages[-1], messages
    if world == 2:
        assert messages[0].startswith("rank 1 rejected its batch for module ''"), messages
