"""The router's specification: `ReferenceRouter`, what the fast `Router` must equal bit for bit.

The previous per-id router (a searchsorted over (slot, row) keys and a stable sort by route),
kept as the specification of modular.routing.router.Router: tests/modular/routing/test_router.py holds
the two equal on every plan (`routers`, `assert_same_routes`), and benchmarks/router.py times one
against the other. It lives here, beside the benchmark, so that no benchmark imports a test
module; the tests import it from here.
"""

from __future__ import annotations

from typing import Optional

import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from modular.routing.checks import Problem, Rejection
from modular.routing.router import Routed, Router
from modular.tables.layout import ROW_SPLIT, Layout, build_layout
from modular.tables.weights import table_infos
from planners.types import TablePlacement

_SLOT_SHIFT = 40  # ids are < 2**40, so (slot << 40) + id orders by slot, then id


class ReferenceRouter:
    """The per-id router: each id is copied once per slot of its feature, its route found by a
    searchsorted over (slot << 40) + row keys, and the ids stably sorted by route."""

    def __init__(self, layout: Layout, *, module: str, is_weighted: bool, device: torch.device):
        self.module = module
        self.is_weighted = is_weighted
        self.features = layout.features
        self.num_routes = len(layout.routes)
        self.routes_per_rank = layout.routes_per_rank()
        # The checks' tables and bounds are shared with Router (its structure checks too).
        self._structure = Router(layout, module=module, is_weighted=is_weighted, device=device)
        self.feature_tables = self._structure.feature_tables
        self.id_bound = self._structure.id_bound

        # Each id of feature f is copied into one slot per (output, column shard); a slot holds
        # one route, or all row-split routes of an output, told apart by the id's row.
        slots: dict[tuple, int] = {}
        slot_feature: list[int] = []
        keys, key_route, row_offset = [], [], []
        for i, r in enumerate(layout.routes):
            row_split = layout.placements[layout.table_index(r.table)].sharding_type in ROW_SPLIT
            slot_key = (r.output,) if row_split else (r.output, r.shard_index)
            if slot_key not in slots:
                slots[slot_key] = len(slots)
                slot_feature.append(r.feature)
            keys.append((slots[slot_key] << _SLOT_SHIFT) + r.shard.row_offset)
            key_route.append(i)
            row_offset.append(r.shard.row_offset)
        # Slots are renumbered so that a feature's slots are consecutive.
        order = sorted(range(len(slot_feature)), key=lambda s: (slot_feature[s], s))
        renumber = {old: new for new, old in enumerate(order)}
        keys = [
            (renumber[k >> _SLOT_SHIFT] << _SLOT_SHIFT) + (k & ((1 << _SLOT_SHIFT) - 1)) for k in keys
        ]
        by_key = sorted(zip(keys, key_route))
        nf = len(layout.features)
        copies = [0] * nf
        for f in slot_feature:
            copies[f] += 1
        first_slot = [0] * nf
        for f in range(1, nf):
            first_slot[f] = first_slot[f - 1] + copies[f - 1]
        as_long = dict(dtype=torch.int64, device=device)
        self.copies = torch.tensor(copies, **as_long)
        self.first_slot = torch.tensor(first_slot, **as_long)
        self.boundary_keys = torch.tensor([k for k, _ in by_key], **as_long)
        self.boundary_route = torch.tensor([r for _, r in by_key], **as_long)
        self.route_row_offset = torch.tensor(row_offset, **as_long)
        self.single_copy = all(c == 1 for c in copies)
        ends = [0]
        for n in self.routes_per_rank:
            ends.append(ends[-1] + n)
        self.rank_route_ends = torch.tensor(ends, **as_long)

    def check(self, kjt: KeyedJaggedTensor) -> Optional[Rejection]:
        """Finds the first problem in a batch whose features are already in order."""
        # Dtypes and lengths are checked by the same code on both sides (no fast path there).
        rejection = self._structure._check_structure(kjt)
        if rejection is not None:
            return rejection
        values, lengths, weights = kjt.values(), kjt.lengths(), kjt.weights_or_none()
        if values.numel() == 0:
            return None
        fidx = self.feature_of_values(lengths, kjt.stride())
        bad = (values < 0) | (values >= self.id_bound[fidx])
        if bool(bad.any()):
            pos = int(bad.nonzero()[0, 0])
            f = int(fidx[pos])
            tables = ", ".join(repr(t) for t in self.feature_tables[f])
            return Rejection(
                Problem.ID_RANGE,
                f,
                f"feature {self.features[f]!r} of module {self.module!r} has id "
                f"{int(values[pos])}, outside table {tables} (valid ids are 0 to "
                f"{int(self.id_bound[f]) - 1}); {int(bad.sum())} ids are out of range",
            )
        if self.is_weighted and weights is not None:
            bad = ~torch.isfinite(weights)
            if bool(bad.any()):
                pos = int(bad.nonzero()[0, 0])
                f = int(fidx[pos])
                tables = ", ".join(repr(t) for t in self.feature_tables[f])
                return Rejection(
                    Problem.WEIGHTS,
                    f,
                    f"feature {self.features[f]!r} (table {tables}) of module {self.module!r} "
                    f"has a non-finite per-sample weight ({float(weights[pos])}); "
                    f"{int(bad.sum())} weights are NaN or inf",
                )
        return None

    def feature_of_values(self, lengths: torch.Tensor, batch_size: int) -> torch.Tensor:
        nf = len(self.features)
        per_feature = lengths.view(nf, batch_size).sum(1)
        return torch.repeat_interleave(
            torch.arange(nf, device=lengths.device), per_feature, output_size=int(per_feature.sum())
        )

    # -- routing ----------------------------------------------------------------------------

    def route(self, kjt: KeyedJaggedTensor) -> Routed:
        """Copies each id into its routes, shifted to the shard's first row, ordered by route."""
        values = kjt.values().long()
        lengths = kjt.lengths().long()
        weights = kjt.weights() if self.is_weighted else None
        batch = kjt.stride()
        num_bags = lengths.numel()
        bag = torch.repeat_interleave(
            torch.arange(num_bags, device=values.device), lengths, output_size=values.numel()
        )
        fidx = torch.div(bag, batch, rounding_mode="floor")
        sample = bag - fidx * batch
        if self.single_copy:
            slot = self.first_slot[fidx]
            src = None
        else:
            copies = self.copies[fidx]
            total = int(copies.sum())
            src = torch.repeat_interleave(
                torch.arange(values.numel(), device=values.device), copies, output_size=total
            )
            start = torch.cumsum(copies, 0) - copies
            within = torch.arange(total, device=values.device) - torch.repeat_interleave(
                start, copies, output_size=total
            )
            slot = self.first_slot[fidx[src]] + within
            values, sample = values[src], sample[src]
            if weights is not None:
                weights = weights[src]
        key = (slot << _SLOT_SHIFT) + values
        route = self.boundary_route[torch.searchsorted(self.boundary_keys, key, right=True) - 1]
        ids = values - self.route_row_offset[route]
        # A stable sort of int16 keys is a few times faster on CPU than of int64 ones (a radix
        # sort: 3.5 vs 14-20 ms for 163,840 ids), and route numbers are small.
        narrow = torch.int16 if self.num_routes <= torch.iinfo(torch.int16).max else torch.int32
        order = torch.argsort(route.to(narrow), stable=True)
        route_lengths = torch.bincount(
            route * batch + sample, minlength=self.num_routes * batch
        )
        per_route = route_lengths.view(self.num_routes, batch).sum(1)
        cumulative = torch.cat([per_route.new_zeros(1), torch.cumsum(per_route, 0)])
        return Routed(
            lengths=route_lengths,
            values=ids[order],
            weights=None if weights is None else weights[order],
            counts=torch.diff(cumulative[self.rank_route_ends]),
        )


def routers(
    configs: list[EmbeddingBagConfig],
    placements: dict[str, TablePlacement],
    world: int,
    weighted: bool,
) -> tuple[Router, ReferenceRouter]:
    """The router of `configs` under `placements` on rank 0 of `world`, and its reference."""
    # the tables as sharding reads them (unweighted here: the router takes `weighted` itself)
    tables = table_infos(EmbeddingBagCollection(tables=configs, device=torch.device("meta")), "m")
    shards = tuple(
        placements[t.name].shards(
            num_embeddings=t.num_embeddings, embedding_dim=t.embedding_dim, world_size=world,
            table=t.name,
        )
        for t in tables
    )  # fmt: skip
    layout = build_layout(
        tables, tuple(placements[t.name] for t in tables), shards, world_size=world, rank=0
    )
    kwargs = dict(module="m", is_weighted=weighted, device=torch.device("cpu"))
    return Router(layout, **kwargs), ReferenceRouter(layout, **kwargs)


def assert_same_routes(got: Routed, want: Routed) -> None:
    """The fast router's output equals the reference's, bit for bit."""
    assert got.values_per_rank == want.values_per_rank
    for name in ("lengths", "values", "weights"):
        a, b = getattr(got, name), getattr(want, name)
        if b is None:
            assert a is None, name
            continue
        assert a is not None, name
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape, b.shape)
        # Bit for bit (weights included: NaN-free, compared as raw bits).
        if a.is_floating_point():
            a, b = a.view(torch.int32), b.view(torch.int32)
        assert torch.equal(a, b), name
