"""Modular's collectives leave no gloo work holding a tensor that Python let go of (issue 40,
Note [collectives release their tensors] in modular/comm.py).

On gloo a collective runs on a `pt_gloo_runloop` thread, and its work holds the tensors it was
handed until that thread drops it, which can be after the caller's `wait()` returned: the thread
may be descheduled right after it completed the work. A real gloo thread cannot be made late on
purpose, so `_LateGloo` stands in for one around torch's collectives: it runs the real gloo
collective, then holds the tensors it was handed for `HOLD_S` more in a thread of its own, as a
descheduled gloo thread holds its work. Each of modular's collectives must return only once the
stand-in has let go; returning earlier, as they did before issue 40, fails these tests.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Iterator

import torch
import torch.distributed as dist

import modular
from modular import comm
from planners.types import ShardingPlan, ShardingType, TablePlacement
from tests.dist import run_on_ranks
from tests.modular.ebc_cases import rank_batches
from tests.modular.fused_reference import FUSED_LR, fused_ebc

HOLD_S = 0.05
# Every torch collective modular's comm.py calls.
_TORCH_COLLECTIVES = ("all_to_all_single", "all_gather_single", "all_reduce", "broadcast", "isend", "irecv")


class _LateGloo:
    """Holds every tensor a torch collective was handed for `HOLD_S` after the collective
    returned, in a thread of its own; `holding` counts the collectives not let go of yet."""

    def __init__(self) -> None:
        self.holding = 0
        self.calls = 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def around_torch(self) -> Iterator[None]:
        saved = {name: getattr(dist, name) for name in _TORCH_COLLECTIVES}
        for name, real in saved.items():
            setattr(dist, name, self._late(real))
        try:
            yield
        finally:
            for name, real in saved.items():
                setattr(dist, name, real)

    def _late(self, real: Callable) -> Callable:
        def collective(*args, **kwargs):
            work = real(*args, **kwargs)
            handed = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            with self._lock:
                self.holding += 1
                self.calls += 1
            threading.Thread(target=self._hold, args=(handed,), daemon=True).start()
            return work

        return collective

    def _hold(self, handed: list[torch.Tensor]) -> None:
        time.sleep(HOLD_S)
        with self._lock:  # counted as let go just before it is: the caller may wake at once
            self.holding -= 1
        handed.clear()


def _each_collective() -> list[str]:
    """Runs every collective of modular/comm.py under the stand-in; checks its result, and that
    the stand-in had let go of its tensors when it returned. Returns the ones that had not."""
    rank, world = dist.get_rank(), dist.get_world_size()
    late = _LateGloo()
    early: list[str] = []

    def check(what: str) -> None:
        if late.holding:
            early.append(what)

    with late.around_torch():
        sent = torch.arange(4, dtype=torch.float32) + 10 * rank
        got = comm.all_to_all(sent, input_splits=[2, 2], output_splits=[2, 2], group=None)
        check("all_to_all")
        assert got.tolist() == [float(v) for v in (2 * rank, 2 * rank + 1, 10 + 2 * rank, 11 + 2 * rank)], got
        buffers = comm.KeptBuffers()
        into = buffers.empty("kept", 4, sent)
        comm.all_to_all(sent, input_splits=[2, 2], output_splits=[2, 2], group=None, out=into)
        check("all_to_all into a kept buffer")
        assert torch.equal(into, got), (into, got)
        kept, into = into.data_ptr(), None
        # Nothing holds the buffer once the all-to-all returned: the next step gets it again.
        assert buffers.empty("kept", 4, sent).data_ptr() == kept, "the kept buffer was still in use"
        gathered = comm.all_gather(torch.full((2, 3), float(rank)), group=None, world=world)
        check("all_gather")
        assert gathered.shape == (world, 2, 3) and gathered[:, 0, 0].tolist() == list(map(float, range(world)))
        assert comm.all_gather_bytes(bytes([rank, 7]), width=2, group=None) == [bytes([r, 7]) for r in range(world)]
        check("all_gather_bytes")
        total = torch.full((3,), float(rank + 1))
        comm.all_reduce(total, group=None, what="a test all-reduce")
        check("all_reduce")
        assert total.tolist() == [world * (world + 1) / 2] * 3, total
        shared = torch.full((2,), float(rank))
        comm.broadcast(shared, src=world - 1, group=None, what="a test broadcast")
        check("broadcast")
        assert shared.tolist() == [float(world - 1)] * 2, shared
        piece = torch.full((3,), 5.0 + rank)
        if rank == 0:
            comm.send(piece, dst=1, group=None, what="a test send")
            check("send")
        elif rank == 1:
            comm.recv(piece, src=0, group=None, what="a test receive")
            check("recv")
            assert piece.tolist() == [5.0] * 3, piece
        pooled = torch.arange(4, dtype=torch.float32, requires_grad=True)
        moved = comm.pooled_all_to_all(pooled, input_splits=[2, 2], output_splits=[2, 2], group=None, grad_scale=0.5)
        check("pooled_all_to_all (forward)")
        moved.sum().backward()
        check("pooled_all_to_all (backward)")
        assert pooled.grad.tolist() == [0.5] * 4, pooled.grad
    assert late.calls == 9, late.calls  # the stand-in saw every collective
    return early


def test_each_collective_returns_only_after_gloo_let_go_of_its_tensors() -> None:
    early = run_on_ranks(2, _each_collective)
    assert early == [[], []], f"collectives that returned while gloo still held their tensors, by rank: {early}"


# The shapes of the job in one EBC: fused data-parallel copies on fbgemm's kernel (t_sum, width 8) and
# on the emulation (t_small, width 5), a column-wise table with the exact statistic (t_big, 8 + 8
# columns), and a row-wise one.
PLAN = ShardingPlan(world_size=2, modules={"": {
    "t_sum": TablePlacement(ShardingType.DATA_PARALLEL),
    "t_small": TablePlacement(ShardingType.DATA_PARALLEL),
    "t_big": TablePlacement(ShardingType.COLUMN_WISE, ranks=(0, 1)),
    "t_mean": TablePlacement(ShardingType.ROW_WISE, ranks=(1, 0)),
}})  # fmt: skip


def _fused_step(late_gloo: bool) -> tuple[int, int, torch.Tensor]:
    """One fused step, then a forward of the next batch (its output shows the update): the
    collectives still holding tensors when backward returned, those that ran, and that output."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ebc = fused_ebc()
    modular.fuse_optimizer(ebc, "exact_rowwise_adagrad", lr=FUSED_LR)
    modular.shard(ebc, PLAN)
    first, second = rank_batches(ebc, world, step=1)[rank], rank_batches(ebc, world, step=3)[rank]
    late = _LateGloo()
    with late.around_torch() if late_gloo else contextlib.nullcontext():
        loss = ebc(first).values().square().sum()
        loss.backward()  # the update at its end: the data-parallel copies' gathers, the statistics' all-to-all
        held = late.holding
    return held, late.calls, ebc(second).values().detach()


def _fused_step_with_and_without_late_gloo() -> tuple[int, int]:
    held, calls, late_output = _fused_step(late_gloo=True)
    _, _, output = _fused_step(late_gloo=False)
    assert torch.equal(late_output, output), (late_output - output).abs().max()
    return held, calls


def test_a_fused_step_leaves_no_work_holding_its_tensors() -> None:
    results = run_on_ranks(2, _fused_step_with_and_without_late_gloo)
    for rank, (held, calls) in enumerate(results):
        assert calls >= 5, f"rank {rank}: only {calls} collectives in the step; the plan lost a shape"
        assert held == 0, f"rank {rank}: {held} collectives still held tensors when backward returned"
