"""The sharded EmbeddingCollection: input dist -> lookup -> output dist, for sequences.

A `ShardedEmbeddingCollection` replaces a torchrec `EmbeddingCollection` in place under the same
contract as the sharded EBC (modular/embedding_bag.py): the unsharded parameter names
(`embeddings.<table>.weight`, ShardedTensors or data-parallel replicas), the same input dist
(modular/routing/: checks, router, the ids' exchange), the same kernels (modular/kernels/: fbgemm's
sequence kernels where they take it, each id a bag of one elsewhere, Note [sequence lookups] in
modular/sequence/lookup.py) and an output dist that returns each id's row to its sample's rank
(Note [sequence output dist] in modular/sequence/output.py).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torchrec.modules.embedding_modules import EmbeddingCollection, EmbeddingCollectionInterface
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from modular.comm import pooled_all_to_all, raise_failed
from modular.routing.exchange import IdsExchange
from modular.routing.permute import Permutation, permute
from modular.routing.prefetcher import Prefetcher
from modular.routing.router import INT32_MAX, Router
from modular.errors import InputError
from modular.fused.config import FusedConfig
from modular.kernels.precision import check_table_dtypes
from modular.local_shards import LocalShards
from modular.sequence.lookup import lookup_kernels
from modular.sequence.output import Placement, RowGather, RowPlacer, place_rows
from modular.sequence.tables import AsBags, sequence_table_infos, weights_device
from modular.tables.layout import RankLayout
from modular.tables.weights import check_widths_off_cpu

__all__ = ["ShardedEmbeddingCollection"]


class SequenceReceived(NamedTuple):
    """What the input dist hands to lookup and output dist."""

    kjt: KeyedJaggedTensor  # this rank's batch, its features in the module's order
    values: torch.Tensor  # ids of this rank's routes: route by route, source rank by source rank
    per_source: list[list[int]]  # for each route on this rank, the ids each rank sent
    placement: Placement  # where this rank's ids' rows land in the output


class ShardedEmbeddingCollection(EmbeddingCollectionInterface):
    """A torchrec EmbeddingCollection whose tables are spread over a process group.

    Built by `modular.shard`; `forward(kjt)` returns what the unsharded EmbeddingCollection
    returns on this rank's batch (the same keys in the same order, each a JaggedTensor of the
    feature's rows and lengths). Gradients follow Note [grad scaling across ranks].
    """

    def __init__(
        self, ec: EmbeddingCollection, at: RankLayout, *, fused: Optional[FusedConfig] = None
    ) -> None:
        super().__init__()
        self._at = at  # the tables' layout from the plan, seen from this rank
        module, process_group, device = at.module, at.group, at.device
        self._module_fqn, self._pg, self._local_only, self._device = module, process_group, at.local, device
        self.layout, self._world, self._rank = self._at.layout, self._at.world, self._at.rank
        self._alone = self._world == 1  # as the EBC's: a world of one sends nothing
        self._configs = ec.embedding_configs()
        self._need_indices = ec.need_indices()
        self._embedding_dim = ec.embedding_dim()
        self._names_by_table = ec.embedding_names_by_table()
        check_table_dtypes(self.layout.tables, module, device)
        if device.type != "cpu":
            check_widths_off_cpu(self.layout, module, device)
        self._router = Router(self.layout, module=module, is_weighted=False, device=device)
        self._placer = RowPlacer(self.layout)  # Note [placing rows without a loop over routes]
        self._shards = LocalShards(at=self._at, fused=fused)
        self.fused_tables = self._shards.fused_tables  # Note [fused tables]
        self._kernels, self._local_kernels = self._shards.kernels, self._shards.local_kernels
        # Note [gathering rows without a loop over routes]
        self._gather, self._local_gather = RowGather(self._kernels), RowGather(self._local_kernels)
        self._local_features = Permutation([r.feature for r in self.layout.local])
        self._exchange = None if self._alone else self.make_exchange(process_group)
        self._prefetcher: Optional[Prefetcher] = None  # Note [prefetched input dist]

        self.embeddings = nn.ModuleDict(  # collective: fills the shards, makes the weights
            self._shards.build_tables(AsBags(ec), global_rank=self._at.global_rank)
        )

    @classmethod
    def unsharded(
        cls, ec: EmbeddingCollection, *, module: str, fused: Optional[FusedConfig] = None
    ) -> ShardedEmbeddingCollection:
        """A single-process stand-in for `ec` (every table local, no communication), with `ec`'s
        weights: what `fuse_optimizer` makes of a materialised EmbeddingCollection."""
        tables = sequence_table_infos(ec, module)
        at = RankLayout.one_process(tables, module=module, device=weights_device(ec))
        return cls(ec, at, fused=fused)

    # Where this module lives and what it fuses, read as the sharded EBC's are (`RankLayout`).
    is_local = property(lambda self: self._at.local, doc="A one-process module (`unsharded`).")
    device = property(lambda self: self._at.device, doc="The device of this rank's shards.")
    process_group = property(lambda self: self._at.group, doc="The group the tables span.")
    module_fqn = property(lambda self: self._at.module, doc="This module's FQN in the model.")
    fused = property(
        lambda self: None if self.fused_tables is None else self.fused_tables.config,
        doc="The fused optimizer's config, or None (Note [fused tables]).",
    )

    # -- the three steps --------------------------------------------------------------------

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        received = self._prefetcher.take(features) if self._prefetcher is not None else None
        if received is None:
            received = self.input_dist(features)
        rows, local_rows = self.lookup(received)
        return self.output_dist(rows, local_rows, received)

    def prefetch(self, features: KeyedJaggedTensor) -> None:
        """Prefetches `features` for a later `forward(features)`, as the sharded EBC's
        `prefetch` (Note [prefetched input dist]); call it on every rank, in the same order."""
        if self._prefetcher is None:
            self._prefetcher = Prefetcher(self._input_dist, self.make_exchange, at=self._at)
        self._prefetcher.start(features)

    def make_exchange(self, group: Optional[ProcessGroup]) -> IdsExchange:
        """The input dist's exchange of ids on `group`: the module's, or the prefetch thread's."""
        return IdsExchange(group, self._rank, self._router, self._device, False)

    def input_dist(self, features: KeyedJaggedTensor) -> SequenceReceived:
        """Checks the batch, then sends each id to the rank that owns its row (Note [routes])."""
        return self._input_dist(features)

    def _input_dist(
        self, features: KeyedJaggedTensor, exchange: Optional[IdsExchange] = None
    ) -> SequenceReceived:
        batch, world = features.stride(), self._world
        rejection, kjt, routed = self._router.accept(features, alone=self._alone)
        exchange = exchange or self._exchange
        if self._alone:
            routes = len(self.layout.routes)
            per_source = routed.lengths.view(routes, batch).sum(1).view(routes, 1).tolist()
            return self._received(kjt, routed.values, per_source)
        wide = routed is not None and routed.values.numel() > INT32_MAX
        what = f"the input-dist agreement of module {self._module_fqn!r}"
        if self._prefetcher is not None:
            what = self._prefetcher.describe(what, exchange.group)
        got = exchange.exchange(routed, rejection, batch, wide, what)
        if rejection is not None:  # unreachable: the exchange raised it
            raise InputError(rejection.message)
        mine = self._router.routes_per_rank[self._rank]
        if not self.layout.routes or mine == 0:
            return self._received(kjt, got.values, [])
        lengths, values = got.lengths.view(world * mine, batch), got.values
        per_source = lengths.view(world, mine, batch).sum(2).t().tolist()
        if world > 1:  # arrivals are (source rank, route); the kernels want (route, source rank)
            perm = torch.arange(world * mine, device=self._device, dtype=torch.int32)
            perm = perm.view(world, mine).t().reshape(-1)
            _, values, _ = torch.ops.fbgemm.permute_2D_sparse_data(
                perm, lengths, values, None, values.numel()
            )
        return self._received(kjt, values, per_source)

    def _received(self, kjt, values, per_source) -> SequenceReceived:
        placement = self._placer(kjt.values(), kjt.length_per_key())
        return SequenceReceived(kjt, values, per_source, placement)

    def lookup(self, received: SequenceReceived) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each route's rows for every rank's ids it received, then this rank's data-parallel
        routes' rows for its own batch (Note [sequence lookups])."""
        counts = self._per_source(received).sum(1).tolist()
        rows = lookup_kernels(self._kernels, received.values, counts)
        local_rows: list[torch.Tensor] = []
        if self.layout.local:
            kjt = permute(received.kjt, self._local_features)
            local_counts = kjt.length_per_key()
            local_rows = lookup_kernels(
                self._local_kernels, kjt.values().long(), local_counts,
                bags=self._replica_bags(local_counts),
            )  # fmt: skip
        return rows, local_rows

    def _per_source(self, received: SequenceReceived) -> torch.Tensor:
        """(routes on this rank, ranks): the ids of each route each rank sent (one C call)."""
        return torch.tensor(received.per_source, dtype=torch.int64).view(-1, self._world)

    def _replica_bags(self, counts: list[int]) -> Optional[int]:
        """Bags per route of the replicas: the longest route on any rank (replicas gather every
        rank's bags in equal shapes, Note [sequence lookups])."""
        if self._alone:
            return None
        longest = torch.tensor([max(counts, default=0)], dtype=torch.int64)
        try:
            dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=self._pg)
        except RuntimeError as e:
            raise_failed(f"the replicas' batch agreement of module {self._module_fqn!r}", self._pg, e)
        return max(int(longest), 1)

    def output_dist(
        self, rows: list[torch.Tensor], local_rows: list[torch.Tensor], received: SequenceReceived
    ) -> dict[str, JaggedTensor]:
        """Sends each rank its ids' rows and puts them in place (Note [sequence output dist])."""
        placement = received.placement
        if self._prefetcher is not None:  # this thread waits next: the prefetched batch may go
            self._prefetcher.release()
        parts = []
        if self.layout.routes:
            send, in_splits = self._gather(rows, self._per_source(received))
            if not self._alone:
                send = pooled_all_to_all(
                    send.to(self._device), input_splits=in_splits,
                    output_splits=placement.arriving, group=self._pg, grad_scale=1.0 / self._world,
                )  # fmt: skip
            parts.append(send)
        if self.layout.local:
            local_counts = torch.tensor(placement.counts[len(self.layout.routes):]).view(-1, 1)
            parts.append(self._local_gather(local_rows, local_counts)[0])
        flat = parts[0] if len(parts) == 1 else torch.cat(parts) if parts else torch.zeros(0)
        out = place_rows(flat, placement)
        if self.fused_tables is not None and self.fused_tables.end_of_backward is not None:
            self.fused_tables.end_of_backward.arm(out)  # the deferred updates (Note [fused tables])
        return self._jagged(out.view(-1, self._embedding_dim), received)

    def _jagged(self, out: torch.Tensor, received: SequenceReceived) -> dict[str, JaggedTensor]:
        """The output as torchrec's EC returns it.

        # Note [low-precision sequences]
        torchrec's unsharded EC returns an FP16 table's rows in FP32 (torchrec 1.8.0: its
        forward widens each nn.Embedding lookup with `.float()`). fbgemm's kernels widen every
        row to FP32 too (Note [low-precision tables] in modular/kernels/precision.py), and a
        sequence row is a row, not a sum, so ours are the same bits, FP32 on the wire and out.
        Backward differs in rounding only: torchrec rounds each row's gradient to FP16 before
        its embedding backward adds them up; the kernels add a row's FP32 gradients in FP32 and
        round once (into the FP16 `.grad`, or into a fused update with FP32 state)."""
        kjt = received.kjt
        features = kjt.to_dict()
        values = out.split(received.placement.rows_per_output)
        result = {}
        for o, rows in zip(self.layout.outputs, values):
            jt = features[o.feature]
            result[o.key] = JaggedTensor(
                values=rows,
                lengths=jt.lengths(),
                weights=jt.values() if self._need_indices else None,
            )
        return result

    # -- the fused optimizer's state (modular/fused/state.py) -------------------------------

    def table_weights(self) -> dict[str, torch.Tensor]:
        """Each table's registered weight (ShardedTensor or replica), by table name."""
        return {n: holder._parameters["weight"] for n, holder in self.embeddings.items()}

    # -- what torchrec's EmbeddingCollection also offers ------------------------------------

    def embedding_configs(self):
        return self._configs

    def need_indices(self) -> bool:
        return self._need_indices

    def embedding_dim(self) -> int:
        return self._embedding_dim

    def embedding_names_by_table(self) -> list[list[str]]:
        return self._names_by_table
