"""The sharded EmbeddingBagCollection: input dist -> lookup -> output dist.

A `ShardedEmbeddingBagCollection` replaces a torchrec `EmbeddingBagCollection` in place. It keeps
the unsharded module's parameter names (`embedding_bags.<table>.weight`): sharded tables are
`ShardedTensor`s whose local shards alias the lookup kernels' buffers, data-parallel tables are
plain replicated parameters that average their own gradients over ranks. The stages live in
their own packages: the layout and the tables' weights in modular/tables/, input and output dist
in modular/routing/, the kernels in modular/kernels/, the fused optimizer's part in modular/fused/.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torchrec.modules.embedding_modules import (
    EmbeddingBagCollection,
    EmbeddingBagCollectionInterface,
)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from modular.routing.arrival import Arrival
from modular.comm import KeptBuffers, pooled_all_to_all
from modular.routing.exchange import IdsExchange
from modular.routing.permute import Permutation, permute
from modular.routing.prefetcher import Prefetcher
from modular.routing.router import INT32_MAX, Received, Router
from modular.errors import InputError, ShardingError
from modular.kernels.base import pool
from modular.kernels.lookups import batch_offsets
from modular.fused.config import FusedConfig
from modular.kernels.precision import check_table_dtypes
from modular.local_shards import LocalShards
from modular.tables.layout import RankLayout
from modular.tables.forms import TensorType
from modular.tables.weights import check_widths_off_cpu, table_infos

__all__ = ["EAGER_REASON", "ShardedEmbeddingBagCollection"]

# Why a compiled model runs this module's forward eagerly; dynamo shows it with the graph break.
EAGER_REASON = (
    "a modular ShardedEmbeddingBagCollection runs its forward (input dist -> lookup -> output "
    "dist: host reads of the batch, collectives, fbgemm kernels) eagerly, one deliberate graph "
    "break per call (Note [compiling a sharded model] in modular/compose/compile.py); under "
    "fullgraph=True compile the dense modules instead (modular.apply_compile)"
)


class ShardedEmbeddingBagCollection(EmbeddingBagCollectionInterface):
    """A torchrec EmbeddingBagCollection whose tables are spread over a process group.

    Built by `modular.shard`; `forward(kjt)` returns the same KeyedTensor as the unsharded EBC on
    this rank's batch. Gradients follow Note [grad scaling across ranks].
    """

    def __init__(
        self,
        ebc: EmbeddingBagCollection,
        at: RankLayout,
        *,
        fused: Optional[FusedConfig] = None,
        output_dtype: torch.dtype = torch.float32,
        comm_dtype: Optional[torch.dtype] = None,
        tensor_type: TensorType = TensorType.SHARDED_TENSOR,
    ) -> None:
        super().__init__()
        # `at`: the tables' layout from the plan, seen from this rank (`RankLayout.build`).
        tables, module, device = at.layout.tables, at.module, at.device
        process_group, local = at.group, at.local
        check_table_dtypes(tables, module, device)
        # Note [low-precision tables] and Note [low-precision comms] (modular/comm.py): the
        # pooled outputs are FP32 unless `output_dtype` says otherwise; `comm_dtype` is the
        # output dist's wire dtype (None: the outputs' own, FP32).
        self.output_dtype = output_dtype
        self.comm_dtype = None if comm_dtype is torch.float32 else comm_dtype
        self._module_fqn = module
        self._pg = process_group
        # A local module (see `unsharded`) is a world of one that never communicates.
        self._local_only = local
        self._at = at
        self.layout = self._at.layout
        self._world, self._rank = self._at.world, self._at.rank
        # A world of one sends nothing: each all-to-all would copy a tensor onto itself (four a
        # step; on a GPU each costs a NCCL launch), and no peer needs the agreement.
        self._alone = self._world == 1
        self._global_rank = self._at.global_rank
        self._device = device
        self._is_weighted = ebc.is_weighted()
        self._configs = ebc.embedding_bag_configs()
        if device.type != "cpu":  # every rank raises alike, before any collective
            check_widths_off_cpu(self.layout, module, device)
        self._router = Router(
            self.layout, module=module, is_weighted=self._is_weighted, device=device
        )
        self._shards = LocalShards(at=self._at, fused=fused)
        self.fused_tables = self._shards.fused_tables  # Note [fused tables]
        self._kernels, self._local_kernels = self._shards.kernels, self._shards.local_kernels
        self._local_features = Permutation([r.feature for r in self.layout.local])
        self._recv_dims = self.layout.dims_per_rank()
        self._my_dim = self._recv_dims[self._rank]
        self._recv_buffers = KeptBuffers()  # Note [kept receive buffers]
        self._exchange = None if self._alone else self.make_exchange(process_group)
        self._prefetcher: Optional[Prefetcher] = None  # Note [prefetched input dist]
        local_dim = sum(r.shard.num_cols for r in self.layout.local)
        self._arrival = Arrival(
            [*self._recv_dims, local_dim],
            self.layout.output_columns(),
            self.layout.output_dim,
            device,
        )
        self._mean_columns, self._mean_features = self._mean_column_maps()

        self.embedding_bags = nn.ModuleDict(  # collective: fills the shards, makes the weights
            self._shards.build_tables(ebc, global_rank=self._global_rank, tensor_type=tensor_type)
        )

    @classmethod
    def unsharded(
        cls, ebc: EmbeddingBagCollection, *, module: str, fused: Optional[FusedConfig] = None
    ) -> ShardedEmbeddingBagCollection:
        """A single-process stand-in for `ebc` (every table local, no communication), with
        `ebc`'s weights: what `fuse_optimizer` makes of a materialised EBC, which `modular.shard`
        accepts."""
        device = next(iter(ebc.parameters())).device
        at = RankLayout.one_process(table_infos(ebc, module), module=module, device=device)
        return cls(ebc, at, fused=fused)

    @property
    def is_local(self) -> bool:
        return self._local_only

    @property
    def fused(self) -> Optional[FusedConfig]:
        """The fused optimizer's config, or None (Note [fused tables])."""
        return None if self.fused_tables is None else self.fused_tables.config

    # -- construction -----------------------------------------------------------------------

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
        if torch._dynamo.config.compiled_autograd:  # Note [compiling a sharded model]
            raise ShardingError(
                f"module {self._module_fqn!r}: compiled autograd (torch._dynamo.config."
                "compiled_autograd) is not supported over a sharded EBC: traced, its backward "
                "drifted from eager's; compile with it off (docs/compiling.md)"
            )
        received = self._prefetcher.take(features) if self._prefetcher is not None else None
        if received is None:
            received = self.input_dist(features)
        remote, local = self.lookup(received)
        return self.output_dist(remote, local, received)

    @torch.compiler.disable(reason=EAGER_REASON)
    def prefetch(self, features: KeyedJaggedTensor) -> None:
        """Prefetches `features` for a later `forward(features)`: its input dist runs in the
        background from this module's next wait on (Note [prefetched input dist] in
        modular/routing/prefetcher.py); call it on every rank, in the same order."""
        if self._prefetcher is None:
            self._prefetcher = Prefetcher(self._input_dist, self.make_exchange, at=self._at)
        self._prefetcher.start(features)

    def input_dist(self, features: KeyedJaggedTensor) -> Received:
        """Checks the batch, then sends each id to the rank that owns its row (Note [routes])."""
        return self._input_dist(features)

    def make_exchange(self, group: Optional[ProcessGroup]) -> IdsExchange:
        """The input dist's exchange of ids on `group`: the module's, or the prefetch thread's
        (each keeps its own slots, Note [ids with their header])."""
        return IdsExchange(group, self._rank, self._router, self._device, self._is_weighted)

    def _input_dist(
        self, features: KeyedJaggedTensor, exchange: Optional[IdsExchange] = None
    ) -> Received:
        exchange = exchange or self._exchange
        rejection, kjt, routed = self._router.accept(features, alone=self._alone)
        batch = features.stride()
        world = self._world
        if self._alone:
            return self._received(kjt, routed.lengths, routed.values, routed.weights, batch)
        # Every rank hears how much is coming and whether anyone failed (so a bad batch raises
        # on every rank instead of hanging the others) in the header of the ids' own all-to-all
        # (Note [ids with their header] in modular/routing/exchange.py).
        # Whether this rank needs its ids sent as int64 this step (Note [ids on the wire]).
        wide = routed is not None and routed.values.numel() > INT32_MAX
        got = exchange.exchange(routed, rejection, batch, wide, self._agreement_name(exchange.group))
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

    def _agreement_name(self, group: Optional[ProcessGroup]) -> str:
        """The input dist's first all-to-all on `group`, as its error names it (Note [a failed
        peer]); with a hint at prefetch where the module prefetches."""
        what = f"the input-dist agreement of module {self._module_fqn!r}"
        return what if self._prefetcher is None else self._prefetcher.describe(what, group)

    def _received(self, kjt, lengths, values, weights, batch) -> Received:
        local = None
        if self.layout.local:
            local = permute(kjt, self._local_features)
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
                kjt.weights().float() if self._is_weighted else None,  # FP32, as routed ones
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
                wire=self.comm_dtype,
            )
        if local is not None:  # this rank's data-parallel columns come last
            local = local.reshape(-1)
            arrived = torch.cat([arrived, local]) if arrived.numel() else local
        out = self._arrival.arrange(arrived, batch)  # Note [arrival blocks]
        if self._mean_columns is not None:
            counts = received.local_lengths.index_select(0, self._mean_features).t()
            means = out.index_select(1, self._mean_columns) / counts.clamp(min=1).to(out.dtype)
            out = out.index_copy(1, self._mean_columns, means)
        if self.fused_tables is not None and self.fused_tables.end_of_backward is not None:
            self.fused_tables.end_of_backward.arm(out)  # the deferred updates (Note [fused tables])
        if self.output_dtype is not out.dtype:
            out = out.to(self.output_dtype)
        torch._dynamo.maybe_mark_dynamic(out, 0)  # the batch size (Note [compiling a sharded model])
        return KeyedTensor(
            keys=[o.key for o in self.layout.outputs],
            length_per_key=[o.dim for o in self.layout.outputs],
            values=out,
        )

    # -- the fused optimizer's state (modular/fused/state.py) -------------------------------

    def table_weights(self) -> dict[str, torch.Tensor]:
        """Each table's registered weight (ShardedTensor or replica), by table name."""
        return {n: holder._parameters["weight"] for n, holder in self.embedding_bags.items()}

    def local_shard_views(self) -> dict[tuple[str, int], torch.Tensor]:
        """This rank's shards by (table, shard index in the layout), aliasing the kernels'
        weights: writing into one changes what the next lookup reads (`modular.unshard`)."""
        return self._shards.views()

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
