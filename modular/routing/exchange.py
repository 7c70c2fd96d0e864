"""The input dist's exchange of routed ids, whose header is the agreement.

# Note [ids with their header]
Before ids can move, each rank must know how many arrive from each peer (`all_to_all_single`
takes the split sizes), and every rank must hear whether a peer rejected its batch, so that a
bad batch raises on every rank instead of hanging the others (`BatchChecks.raise_if_rejected`).
A small all-to-all of counts ahead of the ids' own does both, but it is a round trip a step: on
gloo each one wakes the receiving rank's TCP thread and then its main thread. Skipping it was
worth about 1 ms of an 18 ms tw/fused step on 2 CPU ranks (docs/benchmarks.md, "Where a tw/fused
step's CPU goes").

So each rank sends each peer a slot whose size both sides know in advance: a header of six int64
(ids for that peer, batch size, `Problem` code, feature, wide ids (its second bit: the
rank's weights require grad, Note [learned per-sample weights]), spill), then as much of the
peer's payload (its lengths, its ids, Note [routes], and in a weighted module the bits of their
float32 weights) as the slot holds. The slot of the pair (s, d) holds `grow(n)` payload
elements, n being what s sent d in the last exchange on this process group: s knows n because it
sent it, d because the header told it. Every rank reads every peer's header, so all see the same
rejections, batch sizes, wide flags (Note [ids on the wire]) and spill flags (some payload of
that sender did not fit its slot). Then all raise alike, or all run a second all-to-all with
what did not fit (when some rank's ids need int64: every payload again, in int64). A steady
batch moves its ids in one all-to-all; the first step, and one whose payload to some peer grew
by more than `grow`'s eighth, takes two, as every step did before. The slots cost bytes: the
header, and the padding of what a payload leaves empty (up to an eighth in a steady step, more
on the step after a batch that shrank; a slot follows the last payload, so one step later it
fits again). Never more all-to-alls than before.

Only CPU modules fill the slots: the sender must read its counts on the host before it sends,
which on a GPU is one more host sync a step (Note [host syncs per step]) to save a NCCL launch.
Elsewhere every slot is a header alone and the payload always takes the second all-to-all.

The slots are kept per process group, since the prefetch thread's input dists (Note [prefetched
input dist]) run on a group of their own, in an order only that group's collectives fix. A step
that raises (a rejected batch) raises on every rank, from the same headers,
before any slot changes: the ranks keep agreeing on them.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch.distributed import ProcessGroup

from modular.errors import InputError
from modular.routing.checks import Rejection
from modular.comm import KeptBuffers, all_to_all
from modular.routing.router import Routed, Router

# The header's int64 fields, one row per peer.
HEADER = 6
IDS, BATCH, PROBLEM, FEATURE, WIDE, SPILL = range(HEADER)


def _starts(sizes: list[int]) -> list[int]:
    out = [0]
    for n in sizes[:-1]:
        out.append(out[-1] + n)
    return out


def _span(views: list[torch.Tensor], start: int, stop: int) -> list[torch.Tensor]:
    """The views covering elements [start, stop) of the concatenation of 1-D `views`."""
    out, at = [], 0
    for v in views:
        n = v.numel()
        if start < at + n and stop > at:
            out.append(v[max(start - at, 0):min(stop - at, n)])
        at += n
    return out


def _agree_on_learning(learns: list[int], module: str) -> None:
    """Raises on every rank, from the same headers, when some ranks' per-sample weights require
    grad and others' do not: their gradients travel in a collective of backward that every rank
    must run (Note [learned per-sample weights] in modular/routing/learned_weights.py)."""
    if len(set(learns)) > 1:
        on = [r for r, x in enumerate(learns) if x]
        off = [r for r, x in enumerate(learns) if not x]
        raise InputError(
            f"per-sample weights for module {module!r} require grad on ranks {on} but not on "
            f"ranks {off}: in a step, every rank's weights must require grad (learned, e.g. by a "
            "PositionWeightedModule) or none's (pass weights.detach() on every rank)"
        )


def grow(n: int) -> int:
    """The slot for a pair whose payload was `n` elements last time: an eighth more."""
    return n + n // 8


class Exchanged(NamedTuple):
    lengths: torch.Tensor  # (world * routes on this rank * batch,), source rank by source rank
    values: torch.Tensor  # the ids, source rank by source rank, route by route
    weights: Optional[torch.Tensor]  # one float32 per id, in the ids' order (weighted modules)
    sent: list[int]  # ids this rank sent each rank
    received: list[int]  # ids each rank sent this rank
    # (world, features) bags of each rank's features, when some rank's batch has a variable batch
    # per feature (Note [variable batch per feature]); None otherwise
    strides: Optional[torch.Tensor] = None


class IdsExchange:
    """One process group's exchange of routed ids (Note [ids with their header])."""

    def __init__(
        self,
        group: Optional[ProcessGroup],
        rank: int,
        router: Router,
        device: torch.device,
        weighted: bool = False,
    ) -> None:
        """`router`: the module's, whose routes, wire dtype and checks the exchange follows."""
        self.group = group
        self._router = router
        self._weighted = weighted
        self._per_id = 2 if weighted else 1  # payload elements per id: itself, its weight's bits
        self._routes = router.routes_per_rank
        self._world = len(self._routes)
        self._mine = self._routes[rank]
        self._rank = rank
        self._wire = router.ids_dtype
        self._device = device
        self._speculate = device.type == "cpu"
        self._sends_ids = any(self._routes)
        self._out = [0] * self._world  # payload slot this rank sends each rank
        self._in = [0] * self._world  # payload slot each rank sends this rank
        self._padding = torch.zeros(0, dtype=self._wire, device=device)
        self.buffers = KeptBuffers()  # Note [kept receive buffers]
        # A module that takes variable-batch KJTs sends its strides in the header, with a flag
        # (Note [variable batch per feature]); `_routes_of` counts each rank's routes by feature.
        self._header = HEADER
        if router.variable_batch:
            nf = len(router.features)
            self._header = HEADER + 1 + nf
            features = router.route_features
            owner = torch.repeat_interleave(torch.arange(self._world), torch.tensor(self._routes))
            self._routes_of = torch.zeros(self._world, nf, dtype=torch.int64)
            self._routes_of.index_put_((owner, features), torch.ones_like(features), accumulate=True)

    def _payloads(self, bags: list[int], counts: list[int]) -> list[int]:
        """Payload elements per pair: `bags[i]` lengths, `counts[i]` ids (and their weights)."""
        return [b + c * self._per_id for b, c in zip(bags, counts)]

    def exchange(
        self,
        routed: Optional[Routed],
        rejection: Optional[Rejection],
        batch: int,
        wide: bool,
        what: str,
        strides: Optional[list[int]] = None,
        learned: bool = False,
    ) -> Exchanged:
        """Sends `routed` (None if this rank rejected its batch) and receives the peers'; raises
        on every rank what the router's `raise_if_rejected` finds in the headers. `wide`: this
        rank's ids need int64 on the wire this step. `what` names the first all-to-all in its
        errors. `strides`: each feature's bags, for a variable-batch batch. `learned`: this rank's
        weights require grad, which every rank's must then (Note [learned per-sample weights])."""
        world, wire = self._world, self._wire
        h = self._header * 8 // wire.itemsize  # the header in wire elements
        wide = wide and wire != torch.int64
        counts_dev = routed.counts if routed is not None else self._router.zero_counts
        sent = torch.empty(world, self._header, dtype=torch.int64, device=self._device)
        sent[:, IDS] = counts_dev
        bags_out = [r * batch for r in self._routes]
        if self._header > HEADER:
            sent[:, HEADER] = int(strides is not None)
            sent[:, HEADER + 1:] = (
                batch if strides is None else torch.tensor(strides, device=self._device)
            )
            if strides is not None:
                bags_out = (self._routes_of @ torch.tensor(strides)).tolist()
        problem = rejection.problem if rejection is not None else 0
        feature = rejection.feature if rejection is not None else -1
        for column, value in ((BATCH, batch), (PROBLEM, int(problem)), (FEATURE, feature),
                              (WIDE, int(wide) | 2 * learned)):  # fmt: skip
            sent[:, column] = value
        counts: Optional[list[int]] = None
        fit = [0] * world  # payload elements this rank puts in each slot
        if self._speculate:  # on CPU, reading the counts costs nothing
            counts = counts_dev.tolist()
            n_out = self._payloads(bags_out, counts)
            if routed is not None and not wide:  # int64 ids go in the second all-to-all
                fit = [min(n, s) for n, s in zip(n_out, self._out)]
            sent[:, SPILL] = int(routed is not None and fit != n_out)
        else:
            sent[:, SPILL] = int(self._sends_ids)
        header = sent.view(wire).view(world, h)

        pieces: list[torch.Tensor] = []
        regions = self._regions(routed, bags_out, counts) if any(fit) else None
        for d in range(world):
            pieces.append(header[d])
            if fit[d]:
                pieces.extend(_span(regions[d], 0, fit[d]))
            if self._out[d] > fit[d]:
                pieces.append(self._pad(self._out[d] - fit[d]))
        in_splits = [h + s for s in self._out]
        out_splits = [h + s for s in self._in]
        send = torch.cat(pieces, out=self.buffers.empty("ids send", sum(in_splits), header))
        recv = all_to_all(
            send, input_splits=in_splits, output_splits=out_splits, group=self.group, what=what,
            out=self.buffers.empty("ids", sum(out_splits), header),
        )  # fmt: skip
        starts = _starts(out_splits)
        heads = torch.cat([recv[o:o + h] for o in starts]).view(torch.int64)
        # One read on the host: this rank's counts with every peer's header.
        both = torch.cat([sent[:, IDS], heads]).cpu()
        meta = both[world:].view(world, self._header)
        self._router.raise_if_rejected(meta[:, PROBLEM], meta[:, FEATURE], rejection)
        if self._weighted:  # WIDE's second bit: the rank's weights require grad
            _agree_on_learning((meta[:, WIDE] >> 1).tolist(), self._router.module)
            meta[:, WIDE] &= 1
        if counts is None:
            counts = both[:world].tolist()
            n_out = self._payloads(bags_out, counts)
        received = meta[:, IDS].tolist()
        bags_in, all_strides = [self._mine * batch] * world, None
        if self._header > HEADER and bool(meta[:, HEADER].any()):
            all_strides = meta[:, HEADER + 1:]
            bags_in = (all_strides @ self._routes_of[self._rank]).tolist()
        elif batch == 0 or bool((meta[:, BATCH] != batch).any()):  # Note [a batch size per rank]
            batches = meta[:, BATCH]
            all_strides = batches.view(world, 1).expand(world, len(self._router.features)).clone()
            bags_in = (batches * self._mine).tolist()
        n_in = self._payloads(bags_in, received)
        wide_any = bool(meta[:, WIDE].any())
        fit_in = [0 if wide_any else min(n, s) for n, s in zip(n_in, self._in)]
        payloads = [recv[o + h:o + h + f] for o, f in zip(starts, fit_in)]
        if wide_any or bool(meta[:, SPILL].any()):
            if wide_any:
                fit = [0] * world
            payloads = self._second(routed, bags_out, counts, n_out, fit, n_in, fit_in,
                                    payloads, torch.int64 if wide_any else wire)  # fmt: skip
        if self._speculate:
            self._out = [grow(n) for n in n_out]
            self._in = [grow(n) for n in n_in]
        weights = None
        if self._weighted:  # the float32 weights' bits, in the wire dtype
            bits = torch.cat([p[b + c:] for p, b, c in zip(payloads, bags_in, received)])
            bits = bits if bits.dtype == torch.int32 else bits.to(torch.int32)
            weights = bits.view(torch.float32)
        return Exchanged(
            lengths=torch.cat([p[:b] for p, b in zip(payloads, bags_in)]),
            values=torch.cat([p[b:b + c] for p, b, c in zip(payloads, bags_in, received)]),
            weights=weights,
            sent=counts,
            received=received,
            strides=all_strides,
        )

    def _second(self, routed, bags_out, counts, n_out, fit_out, n_in, fit_in, first, wire):
        """The second all-to-all: what did not fit the slots, in `wire` (when that is int64
        for some rank's ids, every payload whole again: `fit_in`, `fit_out` are zero)."""
        rest_out = [n - f for n, f in zip(n_out, fit_out)]
        rest_in = [n - f for n, f in zip(n_in, fit_in)]
        regions = self._regions(routed, bags_out, counts) if any(rest_out) else None
        pieces = []
        for d in range(self._world):
            if rest_out[d]:
                pieces.extend(_span(regions[d], fit_out[d], n_out[d]))
        like = torch.empty(0, dtype=wire, device=self._device)
        send = torch.cat(pieces, out=self.buffers.empty("ids send 2", sum(rest_out), like)) \
            if pieces else like
        recv = all_to_all(
            send, input_splits=rest_out, output_splits=rest_in, group=self.group,
            out=self.buffers.empty("ids 2", sum(rest_in), like),
        )  # fmt: skip
        out = []
        for head, tail, f in zip(first, recv.split(rest_in), fit_in):
            out.append(tail if f == 0 else head if tail.numel() == 0 else torch.cat([head, tail]))
        return out

    def _regions(self, routed: Routed, bags: list[int], counts: list[int]) -> list[list[torch.Tensor]]:
        """Each rank's payload from this rank as the views that make it up: its lengths (`bags`
        per rank), its ids and (weighted modules) its weights' bits."""
        lengths = routed.lengths.split(bags)
        parts = [lengths, routed.values.split(counts)]
        if self._weighted:  # float32 (the checks saw to it): its bits travel as integers
            parts.append(routed.weights.contiguous().view(torch.int32).split(counts))
        return [list(views) for views in zip(*parts)]

    def _pad(self, n: int) -> torch.Tensor:
        if self._padding.numel() < n:
            self._padding = torch.zeros(grow(n), dtype=self._wire, device=self._device)
        return self._padding[:n]
