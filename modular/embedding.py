"""The sharded EmbeddingCollection: input dist -> lookup -> output dist, for sequences.

A `ShardedEmbeddingCollection` replaces a torchrec `EmbeddingCollection` in place under the same
contract as the sharded EBC (modular/embedding_bag.py): the unsharded parameter names
(`embeddings.<table>.weight`, ShardedTensors or data-parallel replicas), the same input dist
(modular/routing/: checks, router, the ids' exchange), the same kernels (modular/kernels/, each id a
bag of one: Note [sequence lookups as bags of one] in modular/sequence/lookup.py) and an output
dist that returns each id's row to its sample's rank (Note [sequence output dist] in
modular/sequence/output.py).
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
from modular.kernels.base import Kernel
from modular.kernels.dense import DenseKernel
from modular.fused.config import FusedConfig
from modular.fused.tables import FusedTables
from modular.sequence.lookup import lookup_routes
from modular.sequence.output import Placement, place_rows, send_rows
from modular.sequence.tables import AsBags, sequence_table_infos, weights_device
from modular.tables.init import agree_on_init, fill_local_shards
from modular.tables.layout import KernelGroup, RankLayout, build_layout, kernel_groups
from modular.tables.weights import ShardedTable, check_widths_off_cpu, table_weight
from planners.types import ShardingType, ShardSpec, TablePlacement

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
        self,
        ec: EmbeddingCollection,
        placements: dict[str, TablePlacement],
        shards: dict[str, tuple[ShardSpec, ...]],
        *,
        module: str,
        process_group: Optional[ProcessGroup],
        device: torch.device,
        local: bool = False,
        fused: Optional[FusedConfig] = None,
    ) -> None:
        super().__init__()
        tables = sequence_table_infos(ec, module)
        self._module_fqn = module
        self._pg = process_group
        self._local_only = local
        self._world = 1 if local else dist.get_world_size(process_group)
        self._alone = self._world == 1
        self._rank = 0 if local else dist.get_rank(process_group)
        self._global_rank = (
            self._rank if local or process_group is None
            else dist.get_global_rank(process_group, self._rank)
        )  # fmt: skip
        self._device = device
        self._configs = ec.embedding_configs()
        self._need_indices = ec.need_indices()
        self._embedding_dim = ec.embedding_dim()
        self._names_by_table = ec.embedding_names_by_table()
        self.layout = build_layout(
            tables,
            tuple(placements[t.name] for t in tables),
            tuple(shards[t.name] for t in tables),
            world_size=self._world,
            rank=self._rank,
        )
        self._at = RankLayout(
            layout=self.layout, module=module, rank=self._rank, world=self._world,
            group=process_group, device=device, local=local,
        )  # fmt: skip
        if device.type != "cpu":
            check_widths_off_cpu(self.layout, module, device)
        self._router = Router(self.layout, module=module, is_weighted=False, device=device)
        self.fused_tables = None if fused is None else FusedTables(fused, at=self._at)
        self._kernels = [self._make_kernel(g, False) for g in kernel_groups(self.layout.routes_to(self._rank))]
        self._local_kernels = [self._make_kernel(g, True) for g in kernel_groups(self.layout.local)]
        if self.fused_tables is not None:
            self.fused_tables.attach(self._kernels, self._local_kernels)
        self._local_features = Permutation([r.feature for r in self.layout.local])
        self._exchange = None if self._alone else self.make_exchange(process_group)
        self._prefetcher: Optional[Prefetcher] = None  # Note [prefetched input dist]

        self.embeddings = nn.ModuleDict()
        views = self._local_views()
        self._init_weights(ec, views)
        for t, table in enumerate(tables):  # collective, in table order on every rank
            weight = table_weight(t, views, at=self._at, global_rank=self._global_rank)
            self.embeddings[table.name] = ShardedTable(weight)
        if not self._alone:
            for k in self._local_kernels:
                if isinstance(k, DenseKernel):
                    k.replicate(self._pg, self._world)

    @classmethod
    def unsharded(
        cls, ec: EmbeddingCollection, *, module: str, fused: Optional[FusedConfig] = None
    ) -> ShardedEmbeddingCollection:
        """A single-process stand-in for `ec` (every table local, no communication), with `ec`'s
        weights: what `fuse_optimizer` makes of a materialised EmbeddingCollection."""
        placements = {
            c.name: TablePlacement(ShardingType.DATA_PARALLEL) for c in ec.embedding_configs()
        }
        shards = {
            c.name: (ShardSpec(0, 0, c.num_embeddings, 0, c.embedding_dim),)
            for c in ec.embedding_configs()
        }
        return cls(
            ec, placements, shards, module=module, process_group=None,
            device=weights_device(ec), local=True, fused=fused,
        )  # fmt: skip

    @property
    def is_local(self) -> bool:
        return self._local_only

    @property
    def fused(self) -> Optional[FusedConfig]:
        """The fused optimizer's config, or None (Note [fused tables])."""
        return None if self.fused_tables is None else self.fused_tables.config

    # -- construction -----------------------------------------------------------------------

    def _make_kernel(self, group: KernelGroup, is_local: bool) -> Kernel:
        sizes = []
        for table, j in group.shards:
            spec = self.layout.shards[self.layout.table_index(table)][j]
            sizes.append((spec.num_rows, spec.num_cols))
        if self.fused_tables is not None:
            return self.fused_tables.kernel(group, sizes, is_local=is_local)
        return DenseKernel(group, sizes, self._device)

    def _local_views(self) -> dict[tuple[str, int], torch.Tensor]:
        views = {}
        for k in (*self._kernels, *self._local_kernels):
            for key, view in zip(k.group.shards, k.views):
                views[key] = view
        return views

    @torch.no_grad()
    def _init_weights(self, ec: EmbeddingCollection, views: dict) -> None:
        """As the sharded EBC's: copies or init_fn, agreed on every rank (Note [agreeing on the
        shards' init]); data-parallel replicas start as rank 0's."""
        bags = AsBags(ec)
        failure: Optional[BaseException] = None
        try:
            fill_local_shards(bags, views, layout=self.layout, module=self._module_fqn)
        except Exception as e:
            failure = e
        if self._local_only:
            if failure is not None:
                raise failure
            return
        copied = [
            t.name
            for t, p in zip(self.layout.tables, self.layout.placements)
            if p.sharding_type is not ShardingType.DATA_PARALLEL
        ]
        agree_on_init(failure, self._module_fqn, self._pg, bags, copied)
        source = 0 if self._pg is None else dist.get_global_rank(self._pg, 0)
        for k in self._local_kernels:
            for view in k.views:
                dist.broadcast(view.data, src=source, group=self._pg)

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
            self._prefetcher = Prefetcher(
                self._input_dist, self.make_exchange, module=self._module_fqn, group=self._pg,
                device=self._device, local=self._local_only,
            )  # fmt: skip
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
        exchange = exchange or self._exchange
        rejection, kjt = self._router.normalise(features)
        routed = None
        if rejection is None:
            rejection, routed = self._router.check_and_route(kjt)
        batch = features.stride()
        world = self._world
        if self._alone:
            if rejection is not None:
                raise InputError(rejection.message)
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
        placement = place_rows(self.layout, kjt.values(), kjt.length_per_key())
        return SequenceReceived(kjt, values, per_source, placement)

    def lookup(self, received: SequenceReceived) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each route's rows for every rank's ids it received, then this rank's data-parallel
        routes' rows for its own batch (Note [sequence lookups as bags of one])."""
        counts = [sum(n) for n in received.per_source]
        rows = lookup_routes(self._kernels, received.values, counts)
        local_rows: list[torch.Tensor] = []
        if self.layout.local:
            kjt = permute(received.kjt, self._local_features)
            local_counts = kjt.length_per_key()
            local_rows = lookup_routes(
                self._local_kernels, kjt.values().long(), local_counts,
                bags=self._replica_bags(local_counts),
            )  # fmt: skip
        return rows, local_rows

    def _replica_bags(self, counts: list[int]) -> Optional[int]:
        """Bags per route of the replicas: the longest route on any rank (replicas gather every
        rank's bags in equal shapes, Note [sequence lookups as bags of one])."""
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
        if self._alone or not self.layout.routes:
            arrived = [r.reshape(-1) for r in rows]
        else:
            send, in_splits = send_rows(rows, received.per_source, self._world)
            out_splits = [0] * self._world
            for r, n in zip(self.layout.routes, placement.counts):
                out_splits[r.shard.rank] += n * r.shard.num_cols
            arrived = [
                pooled_all_to_all(
                    send.to(self._device), input_splits=in_splits, output_splits=out_splits,
                    group=self._pg, grad_scale=1.0 / self._world,
                )  # fmt: skip
            ]
        flat = torch.cat([*arrived, *(r.reshape(-1) for r in local_rows)])
        out = flat.new_zeros(placement.numel).index_copy(0, placement.index, flat)
        if self.fused_tables is not None and self.fused_tables.end_of_backward is not None:
            self.fused_tables.end_of_backward.arm(out)  # the deferred updates (Note [fused tables])
        return self._jagged(out.view(-1, self._embedding_dim), received)

    def _jagged(self, out: torch.Tensor, received: SequenceReceived) -> dict[str, JaggedTensor]:
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

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def process_group(self) -> Optional[ProcessGroup]:
        return self._pg

    @property
    def module_fqn(self) -> str:
        return self._module_fqn
