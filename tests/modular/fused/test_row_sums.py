"""Pass 1 of the exact column statistic through a pooling kernel (Note [row statistics from a
pooling kernel], modular/fused/row_sums.py), against the gradient written out in torch: one
process, no collective."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import modular.fused.row_sums as row_sums
from modular.kernels.lookups import Lookup
from modular.fused.row_sums import RowGradSquares
from modular.tables.layout import KernelGroup, Pooling


def _group(ftm: tuple[int, ...], width: int, pooling: Pooling) -> KernelGroup:
    routes = tuple(SimpleNamespace(shard=SimpleNamespace(num_cols=width)) for _ in ftm)
    shards = tuple((f"t{t}", 0) for t in sorted(set(ftm)))
    return KernelGroup(pooling=pooling, routes=routes, shards=shards, feature_table_map=ftm)


def _reference(rows: list[int], ftm, width, bags, indices, offsets, grad, weights, pooling):
    """Each (table, row)'s mean over columns of its gradient squared, by a loop over ids."""
    g = {}
    for bag in range(len(offsets) - 1):
        route, b = divmod(bag, bags)
        lo, hi = int(offsets[bag]), int(offsets[bag + 1])
        for i in range(lo, hi):
            scale = 1.0 if weights is None else float(weights[i])
            if pooling is Pooling.MEAN:
                scale /= hi - lo
            key = (ftm[route], int(indices[i]))
            g[key] = g.get(key, 0) + scale * grad[b, route * width : (route + 1) * width].double()
    first = [sum(rows[:t]) for t in range(len(rows))]
    return {first[t] + r: float((v * v).mean()) for (t, r), v in g.items()}


@pytest.mark.parametrize("chunk", [1 << 20, 8], ids=["one-piece", "pieces"])
@pytest.mark.parametrize(
    "ftm, pooling, weighted",
    [
        ((0, 1, 2), Pooling.SUM, False),
        ((0, 0, 1), Pooling.SUM, True),  # table 0 read by two features
        ((0, 1, 1, 2), Pooling.MEAN, False),
    ],
)
def test_row_grad_squares_match_the_written_out_gradient(monkeypatch, chunk, ftm, pooling, weighted) -> None:
    monkeypatch.setattr(row_sums, "CHUNK", chunk)
    g = torch.Generator().manual_seed(len(ftm) + chunk)
    width, bags = 4, 5
    rows = [7, 3, 11][: len(set(ftm))]
    lengths = torch.randint(0, 4, (len(ftm) * bags,), generator=g)
    lengths[1] = 0  # an empty bag
    indices = torch.cat([
        torch.randint(0, rows[ftm[r]], (int(lengths[r * bags : (r + 1) * bags].sum()),), generator=g)
        for r in range(len(ftm))
    ]).int()  # fmt: skip
    offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths).int()
    grad = torch.randn(bags, len(ftm) * width, generator=g)
    weights = torch.rand(indices.numel(), generator=g) if weighted else None

    kernel = RowGradSquares(_group(ftm, width, pooling), [(r, width) for r in rows], torch.device("cpu"))
    keys, s, inverse, order, id_keys = kernel(Lookup(grad, indices, offsets, weights))

    want = _reference(rows, ftm, width, bags, indices, offsets, grad, weights, pooling)
    assert keys.tolist() == sorted(want)
    torch.testing.assert_close(s.double(), torch.tensor([want[k] for k in sorted(want)], dtype=torch.double), rtol=1e-5, atol=1e-7)
    # `order` sorts the ids by key and `inverse` names each one's key.
    first = torch.tensor([sum(rows[:t]) for t in range(len(rows))])
    route_of_id = torch.repeat_interleave(torch.arange(len(ftm)), lengths.view(len(ftm), bags).sum(1))
    assert torch.equal(keys[inverse].long(), id_keys[order])
    assert id_keys.dtype == torch.int64 and torch.equal(id_keys, first[torch.tensor(ftm)[route_of_id]] + indices.long())


def test_routes_of_different_widths_are_refused() -> None:
    routes = (SimpleNamespace(shard=SimpleNamespace(num_cols=4)), SimpleNamespace(shard=SimpleNamespace(num_cols=8)))
    group = KernelGroup(pooling=Pooling.SUM, routes=routes, shards=(("a", 0), ("b", 0)), feature_table_map=(0, 1))
    assert not RowGradSquares.supports(group)
    with pytest.raises(ValueError, match="one width is needed"):
        RowGradSquares(group, [(3, 4), (3, 8)], torch.device("cpu"))
