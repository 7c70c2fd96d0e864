"""The device-independent parts of prefetch on CUDA (Note [prefetch on a side stream] in
modular/routing/prefetcher.py), checked on CPU: where a module's prefetches run, and that the
hand-over to the consuming stream records every tensor of an input dist's result. The CUDA runs
themselves are in tests/gpu/test_cuda_prefetch.py (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from modular.sequence.sequence_part import Sequences
from modular.routing.prefetcher import Overlap, hand_over, overlap_for
from modular.routing.received import Received
from modular.sequence.output import Placement


@pytest.mark.parametrize(
    "device_type, backend, spans_world, world, local, expected",
    [
        ("cpu", "gloo", True, 2, False, Overlap.SIDE_GROUP),  # as before CUDA got a side stream
        ("cpu", "gloo", True, 1, False, Overlap.SIDE_GROUP),
        ("cpu", "gloo", False, 2, False, Overlap.AT_ONCE),  # a subgroup cannot make a new group
        ("cpu", None, True, 2, False, Overlap.AT_ONCE),  # no CPU backend
        ("cpu", "gloo", True, 1, True, Overlap.AT_ONCE),  # a one-process module
        ("cuda", "nccl", True, 1, False, Overlap.THREAD),  # a world of one runs no collective
        ("cuda", "gloo", True, 2, False, Overlap.SIDE_GROUP),  # two ranks on one GPU over gloo
        ("cuda", "nccl", True, 2, False, Overlap.AT_ONCE),  # NCCL from two threads could deadlock
        ("cuda", "gloo", False, 2, False, Overlap.AT_ONCE),
        ("meta", "gloo", True, 2, False, Overlap.AT_ONCE),
    ],
)
def test_where_prefetches_run(device_type, backend, spans_world, world, local, expected) -> None:
    got = overlap_for(
        device_type=device_type, backend=backend, spans_world=spans_world, world=world, local=local
    )
    assert got is expected


class _Stream:
    def __init__(self) -> None:
        self.waited: list[object] = []

    def wait_event(self, event: object) -> None:
        self.waited.append(event)


@pytest.fixture
def recorded(monkeypatch) -> list[tuple[int, object]]:
    """Every `Tensor.record_stream(stream)` call, as (data_ptr, stream); CPU tensors cannot
    record a CUDA stream, so the call is recorded instead of made."""
    calls: list[tuple[int, object]] = []
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: calls.append((t.data_ptr(), s)))
    return calls


def _kjt() -> KeyedJaggedTensor:
    return KeyedJaggedTensor(
        keys=["a", "b"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 0, 2, 0]),
        weights=torch.tensor([0.5, 1.0, 2.0]), stride=2,
    )  # fmt: skip


def test_hand_over_waits_then_records_every_tensor_of_an_ebc_input_dist(recorded) -> None:
    kjt, local = _kjt(), _kjt()
    received = Received(
        batch_size=2, kjt=kjt, lengths=torch.tensor([[1, 2]]), values=torch.tensor([4, 5, 6]),
        weights=torch.tensor([1.0, 1.0, 1.0]), local=local, extra=None, part=None,
    )  # fmt: skip
    stream, done = _Stream(), object()
    assert hand_over(received, done, stream) is received
    assert stream.waited == [done]
    expected = [kjt.values(), kjt.weights(), kjt.lengths(), received.lengths, received.values,
                received.weights, local.values(), local.weights(), local.lengths()]  # fmt: skip
    assert sorted(recorded) == sorted((t.data_ptr(), stream) for t in expected)


def test_hand_over_records_the_tensors_nested_in_an_ec_input_dist(recorded) -> None:
    placement = Placement(counts=[3], index=torch.tensor([2, 0, 1]), rows_per_output=[1, 2], numel=3, width=1)
    kjt = _kjt()
    per_source = torch.tensor([[1, 1]])
    received = Received(
        batch_size=2, kjt=kjt, lengths=torch.tensor([[1, 1]]), values=torch.tensor([7, 8]),
        weights=None, local=None, extra=Sequences(per_source, placement), part=None,
    )  # fmt: skip
    stream = _Stream()
    hand_over(received, "done", stream)
    expected = [kjt.values(), kjt.weights(), kjt.lengths(), received.lengths, received.values,
                per_source, placement.index]  # fmt: skip
    assert sorted(recorded) == sorted((t.data_ptr(), stream) for t in expected)


