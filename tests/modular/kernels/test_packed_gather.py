"""`all_gather_packed` (Note [one gather per batch] in modular/kernels/lookups.py): every rank's
pieces of mixed dtypes and lengths in one all-gather, read back bit for bit. The parity tests of
2D and data-parallel tables (test_2d.py, test_fused.py, test_dense_grads.py) train through it;
this pins what they cannot see: one collective per call, alignment of odd-length pieces of
every width, NaN payloads and -0.0 kept, empty pieces, and the bytes sent."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from modular.comm import KeptBuffers
from modular.kernels.lookups import all_gather_packed
from tests.dist import run_on_ranks


def _pieces(rank: int, case: int) -> list[torch.Tensor]:
    """Rank `rank`'s pieces in `case`: the same dtypes on every rank, lengths of its own."""
    g = torch.Generator().manual_seed(100 * case + rank)
    n = 3 + 2 * rank + case  # odd and even lengths, different per rank
    bits = torch.tensor([0x7FC00001, -0x80000000, 0x7F800000], dtype=torch.int32)
    weird = bits.view(torch.float32)
    ids = torch.int32 if case == 2 else torch.int64  # the widest element 4 bytes, or 8
    bound = 2**30 if case == 2 else 2**40
    return [
        torch.randint(-bound, bound, (n,), generator=g, dtype=ids),
        torch.cat([weird, torch.randn(n, generator=g)]),  # NaN with a payload, -0.0, inf
        torch.randint(0, 2**31 - 1, (2 * n + 1,), generator=g, dtype=torch.int32),
        torch.randn(n, generator=g).to(torch.bfloat16),
        torch.zeros(0 if rank == 0 else case, dtype=torch.uint8).add_(rank),
    ]


def _gather_cases() -> list[tuple[int, int]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    calls: list[int] = []
    original = dist.all_gather_single

    def counting(out, inp, *args, **kwargs):
        calls.append(inp.numel())
        return original(out, inp, *args, **kwargs)

    dist.all_gather_single = counting
    kept = KeptBuffers()
    sent = []
    try:
        for case in range(3):
            every = [[p.numel() for p in _pieces(r, case)] for r in range(world)]
            got = all_gather_packed(_pieces(rank, case), every, None, world, what="a test gather",
                                    kept=kept if case else None)  # fmt: skip
            for r in range(world):
                for i, (a, b) in enumerate(zip(got[r], _pieces(r, case))):
                    same = torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                    assert a.dtype == b.dtype and same, (case, r, i)
            sent.append((len(calls), calls[-1]))
    finally:
        dist.all_gather_single = original
    return sent


@pytest.mark.timeout(60)
def test_pieces_of_every_dtype_arrive_bit_for_bit_in_one_gather() -> None:
    # bytes per rank: the longest rank's (rank 1: n = 5 + case) total, rounded up to the
    # widest element
    def longest(case: int) -> int:
        n, width = 5 + case, 4 if case == 2 else 8
        total = n * width + (n + 3) * 4 + (2 * n + 1) * 4 + n * 2 + case
        return -(-total // width) * width

    expected = [(case + 1, longest(case)) for case in range(3)]
    assert run_on_ranks(2, _gather_cases, timeout=50) == [expected, expected]
