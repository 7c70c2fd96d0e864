"""The sharded EmbeddingBagCollection: input dist -> lookup -> output dist.

A `ShardedEmbeddingBagCollection` replaces a torchrec `EmbeddingBagCollection` in place. It keeps
the unsharded module's parameter names (`embedding_bags.<table>.weight`): sharded tables are
`ShardedTensor`s whose local shards alias the lookup kernels' buffers, data-parallel tables are
plain replicated parameters that average their own gradients over ranks.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards
from torchrec.modules.embedding_modules import (
    EmbeddingBagCollection,
    EmbeddingBagCollectionInterface,
)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from modular._comm import KeptBuffers, pooled_all_to_all
from modular._tables import (
    ShardedTable,
    ShardingError,
    agree_on_init,
    check_widths_off_cpu,
    shard_seed,
    table_infos,
)
from modular._checks import InputError
from modular._input import INT32_MAX, Router
from modular._exchange import IdsExchange
from modular._fused import FusedTables
from modular._emulated import EmulatedFusedKernel
from modular._arrival import Arrival
from modular._kernels import DenseKernel, ShardView, pool
from modular._layout import KernelGroup, Layout, TableInfo, build_layout, kernel_groups
from modular._permute import Permutation, _permute
from modular._prefetch import agreement_name
from modular._lookups import batch_offsets
from planners.types import ShardingType, ShardSpec, TablePlacement

__all__ = [
    "ShardedEmbeddingBagCollection",
    "ShardedTable",
    "ShardingError",
    "replace_module",
    "table_infos",
]


# Why a compiled model runs this module's forward eagerly; dynamo shows it with the graph break.
EAGER_REASON = (
    "a modular ShardedEmbeddingBagCollection runs its forward (input dist -> lookup -> output "
    "dist: host reads of the batch, collectives, fbgemm kernels) eagerly, one deliberate graph "
    "break per call (Note [compiling a sharded model] in modular/compile.py); under "
    "fullgraph=True compile the dense modules instead (modular.apply_compile)"
)


class Received(NamedTuple):
    """What input dist hands to lookup."""

    batch_size: int
    lengths: torch.Tensor  # (routes on this rank, world * batch_size), route-major
    values: torch.Tensor  # rows of this rank's shards, int32 mostly (Note [ids on the wire])
    weights: Optional[torch.Tensor]
    local: Optional[KeyedJaggedTensor]  # this rank's own batch for data-parallel tables
    local_lengths: torch.Tensor  # (features, batch_size), for MEAN over row-split tables


class ShardedEmbeddingBagCollection(EmbeddingBagCollectionInterface, FusedTables):
    """A torchrec EmbeddingBagCollection whose tables are spread over a process group.

    Built by `modular.shard`; `forward(kjt)` returns the same KeyedTensor as the unsharded EBC on
    this rank's batch. Gradients follow Note [grad scaling across ranks].
    """

    def __init__(
        self,
        ebc: EmbeddingBagCollection,
        placements: dict[str, TablePlacement],
        shards: dict[str, tuple[ShardSpec, ...]],
        *,
        module: str,
        process_group: Optional[ProcessGroup],
        device: torch.device,
        local: bool = False,
        fused=None,
    ) -> None:
        super().__init__()
        tables = table_infos(ebc, module)
        self._module_fqn = module
        self._pg = process_group
        # A local module (see `unsharded`) is a world of one that never communicates.
        self._local_only = local
        self._world = 1 if local else dist.get_world_size(process_group)
        # A world of one sends nothing either: each all-to-all would copy a tensor onto itself
        # (four a step; on a GPU each costs a NCCL launch), and no peer needs the agreement.
        self._alone = self._world == 1
        self._rank = 0 if local else dist.get_rank(process_group)
        # ShardedTensor placements name global ranks, also when sharding over a subgroup.
        self._global_rank = (
            self._rank if local or process_group is None
            else dist.get_global_rank(process_group, self._rank)
        )
        self.fused = None  # a FusedConfig once modular.fuse_optimizer ran (Note [fused tables])
        self._emulated: list[EmulatedFusedKernel] = []
        # Whether backward ends with the fused module's own work (and collectives) on this rank.
        self._end_of_backward = False
        self._device = device
        self._is_weighted = ebc.is_weighted()
        self._configs = ebc.embedding_bag_configs()
        self.layout: Layout = build_layout(
            tables,
            tuple(placements[t.name] for t in tables),
            tuple(shards[t.name] for t in tables),
            world_size=self._world,
            rank=self._rank,
        )
        if device.type != "cpu":  # every rank raises alike, before any collective
            check_widths_off_cpu(self.layout, module, device)
        self._router = Router(
            self.layout, module=module, is_weighted=self._is_weighted, device=device
        )
        my_routes = self.layout.routes_to(self._rank)
        self._groups = kernel_groups(my_routes)
        self._local_groups = kernel_groups(self.layout.local)
        # With a fused config the fused kernels are built directly (no dense copy on the way).
        cw_rowwise = self._column_wise_rowwise_tables(fused) if fused is not None else ()
        self._kernels = [self._make_kernel(g, fused, cw_rowwise, False) for g in self._groups]
        self._local_kernels = [
            self._make_kernel(g, fused, cw_rowwise, True) for g in self._local_groups
        ]
        self._local_features = Permutation([r.feature for r in self.layout.local])
        self._recv_dims = self.layout.dims_per_rank()
        self._my_dim = self._recv_dims[self._rank]
        self._recv_buffers = KeptBuffers()  # Note [kept receive buffers]
        self._exchange = None if self._alone else self.make_exchange(process_group)
        self._prefetcher = None  # made by the first prefetch (Note [prefetched input dist])
        local_dim = sum(r.shard.num_cols for r in self.layout.local)
        self._arrival = Arrival(
            [*self._recv_dims, local_dim],
            self.layout.output_columns(),
            self.layout.output_dim,
            device,
        )
        self._mean_columns, self._mean_features = self._mean_column_maps()

        self.embedding_bags = nn.ModuleDict()
        views = self._local_views()
        self._init_weights(ebc, views)
        for t in tables:  # collective, in table order on every rank
            self.embedding_bags[t.name] = ShardedTable(self._table_weight(t, views))
        if fused is not None:
            self._mark_fused(fused, cw_rowwise)
        self._replicate_data_parallel_kernels()

    @classmethod
    def unsharded(cls, ebc: EmbeddingBagCollection, *, module: str) -> ShardedEmbeddingBagCollection:
        """A single-process stand-in for `ebc` (every table local, no communication), which
        `fuse_optimizer` uses to fuse an EBC that was never sharded; `modular.shard` accepts it."""
        names = [c.name for c in ebc.embedding_bag_configs()]
        placements = {n: TablePlacement(ShardingType.DATA_PARALLEL) for n in names}
        shards = {
            c.name: (ShardSpec(0, 0, c.num_embeddings, 0, c.embedding_dim),)
            for c in ebc.embedding_bag_configs()
        }
        device = next(iter(ebc.parameters())).device
        if device.type == "meta":
            device = torch.device("cpu")
        return cls(
            ebc, placements, shards, module=module, process_group=None, device=device, local=True
        )

    @property
    def is_local(self) -> bool:
        return self._local_only

    # -- construction -----------------------------------------------------------------------

    def _make_kernel(self, group: KernelGroup, fused, cw_rowwise, is_local: bool):
        sizes = []
        for table, j in group.shards:
            spec = self.layout.shards[self.layout.table_index(table)][j]
            sizes.append((spec.num_rows, spec.num_cols))
        if fused is not None:
            return self._fused_kernel(group, sizes, fused, cw_rowwise, is_local)
        return DenseKernel(group, sizes, self._device)

    def _local_views(self) -> dict[tuple[str, int], ShardView]:
        views = {}
        for k in (*self._kernels, *self._local_kernels):
            for key, view in zip(k.group.shards, k.views):
                views[key] = view
        return views

    @torch.no_grad()
    def _init_weights(self, ebc: EmbeddingBagCollection, views: dict) -> None:
        """Copies the unsharded weights into the local shards, or runs init_fn on meta tables;
        a failure on any rank is raised on every rank (Note [agreeing on the shards' init])."""
        failure: Optional[BaseException] = None
        try:
            self._init_local_shards(ebc, views)
        except Exception as e:
            failure = e
        if self._local_only:
            if failure is not None:
                raise failure
            return
        # Shards are copied from each rank's own copy of a table, replicas broadcast below.
        copied = [
            t.name
            for t, p in zip(self.layout.tables, self.layout.placements)
            if p.sharding_type is not ShardingType.DATA_PARALLEL
        ]
        agree_on_init(failure, self._module_fqn, self._pg, ebc, copied)
        source = 0 if self._pg is None else dist.get_global_rank(self._pg, 0)
        for k in self._local_kernels:  # replicas start equal everywhere
            for view in k.views:
                dist.broadcast(view.data, src=source, group=self._pg)

    def _init_local_shards(self, ebc: EmbeddingBagCollection, views: dict) -> None:
        for (table, j), view in views.items():
            t = self.layout.table_index(table)
            spec = self.layout.shards[t][j]
            source = ebc.embedding_bags[table].weight
            if source.is_meta:
                init_fn = self._configs[t].init_fn
                if init_fn is None:
                    raise ShardingError(f"table {table!r} of {self._module_fqn!r} has no init_fn")
                # Seeded per shard, then the caller's generators are restored: only the CPU's,
                # and the shard's CUDA device's (torch.manual_seed would reseed every GPU).
                seed = shard_seed(table, spec)
                on_cuda = view.device.type == "cuda"
                with torch.random.fork_rng(devices=[view.device] if on_cuda else [], device_type="cuda"):
                    torch.random.default_generator.manual_seed(seed)
                    if on_cuda:
                        torch.cuda.default_generators[view.device.index].manual_seed(seed)
                    try:
                        init_fn(view)
                    except Exception as e:
                        raise ShardingError(
                            f"init_fn of table {table!r} of module {self._module_fqn!r} failed on "
                            f"the shard of rows {spec.row_offset}:{spec.row_offset + spec.num_rows}"
                            f", columns {spec.col_offset}:{spec.col_offset + spec.num_cols} "
                            f"(shape {tuple(view.shape)}): {type(e).__name__}: {e}. init_fn is "
                            "called once per shard, with that shard's (rows, columns) tensor, "
                            "never the whole table"
                        ) from e
            else:
                view.copy_(
                    source[
                        spec.row_offset : spec.row_offset + spec.num_rows,
                        spec.col_offset : spec.col_offset + spec.num_cols,
                    ]
                )

    def _table_weight(self, table: TableInfo, views: dict) -> torch.Tensor:
        t = self.layout.table_index(table.name)
        if self.layout.placements[t].sharding_type is ShardingType.DATA_PARALLEL:
            return views[(table.name, self._rank_shard(t))]
        local = []
        for j, spec in enumerate(self.layout.shards[t]):
            if spec.rank != self._rank:
                continue
            meta = ShardMetadata(
                shard_offsets=[spec.row_offset, spec.col_offset],
                shard_sizes=[spec.num_rows, spec.num_cols],
                placement=f"rank:{self._global_rank}/{self._device}",
            )
            local.append(Shard(tensor=views[(table.name, j)], metadata=meta))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return init_from_local_shards(
                local, table.num_embeddings, table.embedding_dim, process_group=self._pg
            )

    def _replicate_data_parallel_kernels(self) -> None:
        if self._world == 1:
            return
        for k in self._local_kernels:
            if isinstance(k, DenseKernel):
                k.replicate(self._pg, self._world)

    def _mean_column_maps(self) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        cols, feats = [], []
        for i in self.layout.mean_outputs():
            o = self.layout.outputs[i]
            f = self.layout.features.index(o.feature)
            cols.extend(range(o.col, o.col + o.dim))
            feats.extend([f] * o.dim)
        if not cols:
            return None, None
        as_long = dict(dtype=torch.int64, device=self._device)
        return torch.tensor(cols, **as_long), torch.tensor(feats, **as_long)

    # -- the three steps --------------------------------------------------------------------

    @torch.compiler.disable(reason=EAGER_REASON)  # Note [compiling a sharded model]
    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        received = self._prefetcher.take(features) if self._prefetcher is not None else None
        if received is None:
            received = self.input_dist(features)
        remote, local = self.lookup(received)
        return self.output_dist(remote, local, received)

    @torch.compiler.disable(reason=EAGER_REASON)
    def prefetch(self, features: KeyedJaggedTensor) -> None:
        """Prefetches `features` for a later `forward(features)`: its input dist runs in the
        background from this module's next wait on (Note [prefetched input dist] in
        modular/_prefetch.py); call it on every rank, in the same order."""
        if self._prefetcher is None:
            from modular._prefetch import Prefetcher

            self._prefetcher = Prefetcher(self)
        self._prefetcher.start(features)

    def input_dist(self, features: KeyedJaggedTensor) -> Received:
        """Checks the batch, then sends each id to the rank that owns its row (Note [routes])."""
        return self._input_dist(features, self._exchange)

    def make_exchange(self, group: Optional[ProcessGroup]) -> IdsExchange:
        """The input dist's exchange of ids on `group`: the module's, or the prefetch thread's
        (each keeps its own slots, Note [ids with their header])."""
        return IdsExchange(group, self._rank, self._router, self._device, self._is_weighted)

    def _input_dist(self, features: KeyedJaggedTensor, exchange: Optional[IdsExchange]) -> Received:
        rejection, kjt = self._router.normalise(features)
        routed = None
        if rejection is None:
            rejection, routed = self._router.check_and_route(kjt)
        batch = features.stride()
        world = self._world
        if self._alone:
            if rejection is not None:
                raise InputError(rejection.message)
            return self._received(kjt, routed.lengths, routed.values, routed.weights, batch)
        # Every rank hears how much is coming and whether anyone failed (so a bad batch raises
        # on every rank instead of hanging the others) in the header of the ids' own all-to-all
        # (Note [ids with their header] in modular/_exchange.py).
        # Whether this rank needs its ids sent as int64 this step (Note [ids on the wire]).
        wide = routed is not None and routed.values.numel() > INT32_MAX
        got = exchange.exchange(routed, rejection, batch, wide, agreement_name(self, exchange.group))
        if rejection is not None:  # unreachable: the exchange raised it
            raise InputError(rejection.message)
        if not self.layout.routes:  # data-parallel tables only: no ids travel, on any rank
            return self._received(kjt, routed.lengths, routed.values, routed.weights, batch)
        mine = self._router.routes_per_rank[self._rank]
        lengths, values, weights = got.lengths.view(world * mine, batch), got.values, got.weights
        # Arrivals are (source rank, route); the kernels want (route, source rank).
        if world > 1 and mine > 0:
            perm = torch.arange(world * mine, device=self._device, dtype=torch.int32)
            perm = perm.view(world, mine).t().reshape(-1)
            lengths, values, weights = torch.ops.fbgemm.permute_2D_sparse_data(
                perm, lengths, values, weights, values.numel()
            )
        return self._received(kjt, lengths.reshape(mine, world * batch), values, weights, batch)

    def _received(self, kjt, lengths, values, weights, batch) -> Received:
        local = None
        if self.layout.local:
            local = _permute(kjt, self._local_features)
        return Received(
            batch_size=batch,
            lengths=lengths.reshape(-1, self._world * batch),
            values=values,
            weights=weights,
            local=local,
            local_lengths=kjt.lengths().view(len(self.layout.features), batch),
        )

    def lookup(self, received: Received) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Pools the received ids (for every rank's batch) and this rank's data-parallel ids."""
        rows = self._world * received.batch_size
        remote = torch.zeros(rows, 0, device=self._device)
        if self._kernels:
            values, offsets = batch_offsets(received.lengths.reshape(-1), received.values)
            remote = pool(self._kernels, values, offsets, received.weights, rows)
        local = None
        if received.local is not None:
            kjt = received.local
            local = pool(
                self._local_kernels,
                kjt.values().long(),
                kjt.offsets().long(),
                kjt.weights() if self._is_weighted else None,
                kjt.stride(),
            )
        return remote, local

    def output_dist(
        self, remote: torch.Tensor, local: Optional[torch.Tensor], received: Received
    ) -> KeyedTensor:
        """Sends each rank its samples' pooled columns and adds them into the output."""
        batch = received.batch_size
        if self._prefetcher is not None:  # this thread waits next: the prefetched batch may go
            self._prefetcher.release()
        if self._alone or not self.layout.routes:  # nothing to send (every rank agrees)
            arrived = remote.reshape(-1)
        else:
            arrived = pooled_all_to_all(
                remote,
                input_splits=[batch * self._my_dim] * self._world,
                output_splits=[batch * d for d in self._recv_dims],
                group=self._pg,
                grad_scale=1.0 / self._world,
                buffers=self._recv_buffers,
            )
        if local is not None:  # this rank's data-parallel columns come last
            local = local.reshape(-1)
            arrived = torch.cat([arrived, local]) if arrived.numel() else local
        out = self._arrival.arrange(arrived, batch)  # Note [arrival blocks]
        if self._mean_columns is not None:
            counts = received.local_lengths.index_select(0, self._mean_features).t()
            means = out.index_select(1, self._mean_columns) / counts.clamp(min=1).to(out.dtype)
            out = out.index_copy(1, self._mean_columns, means)
        if self._end_of_backward and out.requires_grad:
            out.register_hook(self._queue_emulated_updates)
        torch._dynamo.maybe_mark_dynamic(out, 0)  # the batch size (Note [compiling a sharded model])
        return KeyedTensor(
            keys=[o.key for o in self.layout.outputs],
            length_per_key=[o.dim for o in self.layout.outputs],
            values=out,
        )

    # -- what torchrec's EBC also offers ----------------------------------------------------

    def is_weighted(self) -> bool:
        return self._is_weighted

    def embedding_bag_configs(self):
        return self._configs

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def process_group(self) -> Optional[ProcessGroup]:
        return self._pg

    @property
    def module_fqn(self) -> str:
        return self._module_fqn


def replace_module(model: nn.Module, fqn: str, new: nn.Module) -> nn.Module:
    """Puts `new` at `fqn` in `model` and returns the object now there. At "" (the model is the
    module itself) the model becomes `new` in place, so the caller's reference stays valid."""
    if fqn == "":
        model.__class__ = type(new)
        model.__dict__.clear()
        model.__dict__.update(new.__dict__)
        return model
    parent, _, name = fqn.rpartition(".")
    setattr(model.get_submodule(parent), name, new)
    return new
