"""`RowGather` (Note [gathering rows without a loop over routes] in modular/sequence/output.py)
against the per-route loop it replaced, in one process: forward and backward, bit for bit.

The reference slices each route's rows of each source out of its kernel's output and
concatenates them source by source, route by route (what the former `send_rows` and the per-route views of
the lookup did); autograd's slicing gives padding rows a zero gradient. Cases: bags-of-one and
`nobag` kernels, routes of unequal widths (column pieces), empty routes and empty (route,
source) pairs, padded bags (data-parallel copies), and a world of one.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from modular.sequence.output import RowGather


def _kernel(widths: list[int], nobag: bool) -> SimpleNamespace:
    routes = tuple(SimpleNamespace(shard=SimpleNamespace(num_cols=w)) for w in widths)
    return SimpleNamespace(group=SimpleNamespace(routes=routes), nobag=nobag)


def _reference(kernels, outs, n: torch.Tensor) -> torch.Tensor:
    """Source by source, route by route: the rows of (route, source), sliced out of the outputs."""
    rows = []  # per route: its (count, width) rows, sources in order
    first = 0
    for k, out in zip(kernels, outs):
        widths = [r.shard.num_cols for r in k.group.routes]
        counts = n[first : first + len(widths)].sum(1).tolist()
        if k.nobag:
            rows.extend(out.split(counts))
        else:
            col = 0
            for w, c in zip(widths, counts):
                rows.append(out[:c, col : col + w])
                col += w
        first += len(widths)
    cuts = [r.split(n[h].tolist()) for h, r in enumerate(rows)]
    pieces = [cuts[h][s].reshape(-1) for s in range(n.shape[1]) for h in range(len(rows))]
    return torch.cat(pieces) if pieces else torch.zeros(0)


def _case(seed: int, sources: int, pad: bool):
    rng = random.Random(seed)
    kernels, outs = [], []
    routes = 0
    for _ in range(rng.randint(1, 3)):
        nobag = rng.random() < 0.4
        if nobag:  # one width per NONE kernel
            w = rng.choice([4, 8])
            widths = [w] * rng.randint(1, 3)
        else:
            widths = [rng.choice([4, 8, 12]) for _ in range(rng.randint(1, 4))]
        kernels.append(_kernel(widths, nobag))
        routes += len(widths)
    n = torch.tensor([[rng.choice([0, 0, 1, 2, 5]) for _ in range(sources)] for _ in range(routes)])
    first = 0
    for k in kernels:
        widths = [r.shard.num_cols for r in k.group.routes]
        counts = n[first : first + len(widths)].sum(1)
        if k.nobag:
            rows = int(counts.sum())
        else:
            rows = max(int(counts.max()), 1) + (rng.randint(1, 3) if pad else 0)
        cols = widths[0] if k.nobag else sum(widths)  # NONE: (ids, width) rows
        outs.append(torch.randn(rows, cols, dtype=torch.float32, requires_grad=True))
        first += len(widths)
    return kernels, outs, n


@pytest.mark.parametrize("sources", [1, 2, 3])
@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("seed", range(12))
def test_row_gather_equals_the_per_route_slices(seed: int, sources: int, pad: bool) -> None:
    kernels, outs, n = _case(seed, sources, pad)
    gather = RowGather(kernels)
    got, splits = gather(outs, n)
    want = _reference(kernels, outs, n)
    assert torch.equal(got, want)

    widths = torch.tensor([r.shard.num_cols for k in kernels for r in k.group.routes])
    assert splits == (n * widths.view(-1, 1)).sum(0).tolist()

    grad = torch.randn_like(want)
    got_grads = torch.autograd.grad(got, outs, grad)
    want_grads = torch.autograd.grad(want, outs, grad, allow_unused=True)
    for g, w, out in zip(got_grads, want_grads, outs):
        assert torch.equal(g, torch.zeros_like(out) if w is None else w)  # padding rows: zeros


def test_a_rank_holding_no_routes_sends_nothing() -> None:
    gather = RowGather([])
    send, splits = gather([], torch.zeros(0, 3, dtype=torch.int64))
    assert send.numel() == 0 and splits == [0, 0, 0]


@pytest.mark.parametrize("sources", [1, 2])
def test_row_gather_of_kernels_without_padding(sources: int) -> None:
    # Every route of a bags-of-one kernel has as many ids as the kernel has rows (the common
    # table-wise case): no padding rows, so the gather and its backward take the plain path.
    kernels = [_kernel([4, 8, 4], False), _kernel([8], False), _kernel([4, 4], True)]
    n = torch.tensor([[3, 2][:sources]] * 3 + [[1, 4][:sources]] + [[2, 0][:sources]] * 2)
    rows = [int(n[0].sum()), int(n[3].sum()), int(n[4:].sum())]
    outs = [torch.randn(r, c, requires_grad=True) for r, c in zip(rows, (16, 8, 4))]
    got, _ = RowGather(kernels)(outs, n)
    want = _reference(kernels, outs, n)
    assert torch.equal(got, want)
    grad = torch.randn_like(want)
    for g, w in zip(torch.autograd.grad(got, outs, grad), torch.autograd.grad(want, outs, grad)):
        assert torch.equal(g, w)
