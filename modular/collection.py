"""The one path of every sharded collection: input dist -> lookup -> output dist.

`ShardedCollection` is the step both sharded modules run (the pooled EBC's and the sequence EC's),
composed into each of them: the batch's checks and routing, the ids' exchange and its arrival
permutation, prefetch, the output all-to-all (with `comm_dtype`), the fused optimizer's arm, the
output dtype, the shards and the tables' weights. It owns that state; what differs by kind is a
`KindPart` it is given (modular/parts.py, Note [collection kinds] in modular/kinds.py): how the
kernels look the ids up, what goes on the wire, and where what arrives lands in the output; and,
for a kind that takes them, a second part for variable-batch steps, which the input dist picks
once per step (`Received.part`).

`ShardedCollectionModule` is the `nn.Module` face both sharded modules share: it holds one
`ShardedCollection`, registers the tables under the unsharded module's names, and is where the
compile boundary sits (Note [compiling a sharded model] in modular/compose/compile.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Optional

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from modular.comm import KeptBuffers, pooled_all_to_all
from modular.errors import InputError, ShardingError
from modular.fused.config import FusedConfig
from modular.kernels.lookups import INT32_MAX
from modular.kernels.table_dtypes import check_table_dtypes
from modular.kinds import CollectionKind
from modular.local_shards import LocalShards, ShardFill
from modular.parts import KindPart
from modular.profiling import INPUT_DIST, LOOKUP, OUTPUT_DIST, labelled
from modular.routing.exchange import IdsExchange
from modular.routing.learned_weights import LearnedWeights, positions_like, returned
from modular.routing.permute import Permutation, permute
from modular.routing.prefetcher import Prefetcher
from modular.routing.received import Received
from modular.routing.router import Router
from modular.routing.variable_batch import (
    VariableBatch, permute_segments, select_features, strides_of,
)  # fmt: skip
from modular.tables.forms import TensorType
from modular.tables.layout import RankLayout
from modular.tables.weights import check_widths_off_cpu
from modular.tiered.module_hooks import watch_tiers, with_row_prefetch

__all__ = ["CollectionOptions", "EAGER_REASON", "ShardedCollection", "ShardedCollectionModule"]

# Why a compiled model runs a sharded collection's forward eagerly; dynamo shows it with the break.
EAGER_REASON = (
    "a modular sharded collection (EmbeddingBagCollection or EmbeddingCollection) runs its "
    "forward (input dist -> lookup -> output dist: host reads of the batch, collectives, fbgemm "
    "kernels) eagerly, one deliberate graph break per call (Note [compiling a sharded model] in "
    "modular/compose/compile.py); under fullgraph=True compile the dense modules instead "
    "(modular.apply_compile)"
)


@dataclasses.dataclass(frozen=True)
class CollectionOptions:
    """`modular.shard`'s options for one collection, whatever its kind.

    Note [low-precision tables] (modular/kernels/table_dtypes.py) and Note [low-precision comms]
    (modular/comm.py): outputs are FP32 unless `output_dtype` says otherwise; `comm_dtype` is the
    output dist's wire dtype (None: the outputs' own, FP32). `tensor_type`: Note [table tensor
    types] in modular/tables/forms.py."""

    output_dtype: torch.dtype = torch.float32
    comm_dtype: Optional[torch.dtype] = None
    tensor_type: TensorType = TensorType.SHARDED_TENSOR

    def __post_init__(self) -> None:
        if self.comm_dtype is torch.float32:  # FP32 on the wire is the default, spelled out
            object.__setattr__(self, "comm_dtype", None)


class ShardedCollection:
    """The step of one sharded collection on this rank (module docstring)."""

    def __init__(
        self,
        at: RankLayout,
        part: KindPart,
        *,
        variable_part: Optional[KindPart] = None,
        fused: Optional[FusedConfig],
        options: CollectionOptions,
        is_weighted: bool,
        fill: Optional[ShardFill] = None,
    ) -> None:
        module, device = at.module, at.device
        check_table_dtypes(at.layout.tables, module, device)
        if device.type != "cpu":  # every rank raises alike, before any collective
            check_widths_off_cpu(at.layout, module, device)
        self.at, self.layout, self.part, self.options = at, at.layout, part, options
        # The part of a step whose features have their own bag counts (Note [variable batch per
        # feature]); None: the kind takes no such batch, and the router refuses one.
        self.variable_part = variable_part
        self.is_weighted = is_weighted
        # A world of one sends nothing: each all-to-all would copy a tensor onto itself (four a
        # step; on a GPU each costs a NCCL launch), and no peer needs the agreement.
        self.alone = at.world == 1
        self.router = Router(
            self.layout, module=module, is_weighted=is_weighted, device=device,
            variable_batch=variable_part is not None,
        )  # fmt: skip
        self.my_route_features = torch.tensor(
            [r.feature for r in self.layout.routes_to(at.rank)], dtype=torch.int64
        )
        self.shards = LocalShards(at=at, fused=fused, fill=fill)
        for p in (part, variable_part):
            if p is not None:
                p.attach(self.shards)
        self.local_features = Permutation([r.feature for r in self.layout.local])
        self.recv_buffers = KeptBuffers()  # Note [kept receive buffers]
        self.exchange = None if self.alone else self.make_exchange(at.group)
        self.prefetcher: Optional[Prefetcher] = None  # Note [prefetched input dist]

    def build_tables(self, source: nn.Module) -> dict[str, nn.Module]:
        """Fills the shards from `source` (collective) and makes each table's weight holder."""
        return self.shards.build_tables(
            source, global_rank=self.at.global_rank, tensor_type=self.options.tensor_type
        )

    # -- the three steps --------------------------------------------------------------------

    def prefetched(self, features: KeyedJaggedTensor) -> Optional[Received]:
        """The start of a forward: `features`' prefetched input dist, or None."""
        if torch._dynamo.config.compiled_autograd:  # Note [compiling a sharded model]
            raise ShardingError(
                f"module {self.at.module!r}: compiled autograd (torch._dynamo.config."
                "compiled_autograd) is not supported over a sharded collection: traced, its "
                "backward drifted from eager's; compile with it off (docs/compiling.md)"
            )
        return self.prefetcher.take(features) if self.prefetcher is not None else None

    def prefetch(self, features: KeyedJaggedTensor) -> None:
        if self.prefetcher is None:
            dist = with_row_prefetch(self.input_dist, self.shards.kernels)  # Note [tiered prefetch]
            self.prefetcher = Prefetcher(dist, self.make_exchange, at=self.at)
        self.prefetcher.start(features)

    def make_exchange(self, group: Optional[ProcessGroup]) -> IdsExchange:
        """The input dist's exchange of ids on `group`: the module's, or the prefetch thread's
        (each keeps its own slots, Note [ids with their header])."""
        return IdsExchange(group, self.at.rank, self.router, self.at.device, self.is_weighted)

    @labelled(INPUT_DIST)  # Note [profiler labels] in modular/profiling.py
    def input_dist(
        self, features: KeyedJaggedTensor, exchange: Optional[IdsExchange] = None
    ) -> Received:
        """Checks the batch, then sends each id to the rank that owns its row (Note [routes])."""
        # Weights that require grad: positions travel in their place, the weights beside them
        # (Note [learned per-sample weights] in modular/routing/learned_weights.py)
        learned = LearnedWeights.of(features) if self.is_weighted else None
        if learned is None:
            rejection, kjt, routed = self.router.accept(features, alone=self.alone)
        else:
            rejection, kjt, routed = self.router.accept(
                learned.checked, alone=self.alone, positions=learned.positions
            )
            if routed is not None:
                sent = learned.at(routed.weights)
                routed = routed._replace(weights=sent.detach())
        variable = kjt is not None and kjt.variable_stride_per_key()
        if self.alone:
            lengths, values, weights = routed.lengths, routed.values, routed.weights
            if learned is not None:
                weights = sent
            bags = variable or kjt.stride() == 0  # Note [a batch size per rank]
            strides = torch.tensor([strides_of(kjt)], dtype=torch.int64) if bags else None
        else:
            # Every rank hears how much is coming and whether anyone failed (so a bad batch
            # raises on every rank instead of hanging the others) in the header of the ids' own
            # all-to-all (Note [ids with their header] in modular/routing/exchange.py), and
            # whether this rank needs its ids sent as int64 this step (Note [ids on the wire]).
            exchange = exchange or self.exchange
            wide = routed is not None and routed.values.numel() > INT32_MAX
            got = exchange.exchange(
                routed, rejection, features.stride(), wide, self._agreement(exchange),
                strides_of(kjt) if variable else None, learned is not None,
            )  # fmt: skip
            if rejection is not None:  # unreachable: the exchange raised it
                raise InputError(rejection.message)
            lengths, values, weights, strides = got.lengths, got.values, got.weights, got.strides
            if learned is not None and self.layout.routes:
                weights = returned(sent, weights, (got.sent, got.received), self.at.group, self.at.world)
        if learned is not None:  # the permutations below move positions in `weights`
            arrived, weights = weights, positions_like(weights)
        # Some rank's batch has its own bags per feature, or its own batch size: the step's part
        if strides is not None:
            inverse = kjt.inverse_indices()[1] if variable else _uniform_inverse(kjt)
            vbe = VariableBatch(strides, inverse)
            received = self._received_bags(kjt, lengths, values, weights, vbe)
        else:
            received = self._received_uniform(kjt, lengths, values, weights)
        return received if learned is None else learned.resolve(received, arrived)

    def _received_uniform(self, kjt, lengths, values, weights) -> Received:
        """`input_dist`'s result where every feature has one bag per sample: the arrivals,
        (source rank, route) by samples, put route by route."""
        batch, world = kjt.stride(), self.at.world
        mine = self.router.routes_per_rank[self.at.rank]
        if not self.alone and mine > 0:  # arrivals are (source, route); kernels want (route, source)
            perm = torch.arange(world * mine, device=self.at.device, dtype=torch.int32)
            perm = perm.view(world, mine).t().reshape(-1)
            lengths, values, weights = torch.ops.fbgemm.permute_2D_sparse_data(
                perm, lengths.view(world * mine, batch), values, weights, values.numel()
            )
        lengths = lengths.reshape(-1, world * batch)
        local = permute(kjt, self.local_features) if self.layout.local else None
        extra = self.part.prepare(kjt, lengths, None)
        return Received(batch, kjt, lengths, values, weights, local, extra, self.part)

    def _received_bags(self, kjt, lengths, values, weights, vbe: VariableBatch) -> Received:
        """`input_dist`'s result where features have their own bags (Note [variable batch per
        feature]), or ranks their own batch sizes (Note [a batch size per rank]): the arrivals,
        (source rank, route) by bags, put route by route."""
        mine = self.my_route_features
        if mine.numel() and self.at.world > 1:
            per_source = vbe.strides[:, mine]  # (ranks, my routes): the bags each rank sent
            order = torch.arange(per_source.numel()).view_as(per_source).t().reshape(-1)
            lengths, values, weights, _ = permute_segments(
                order, per_source.reshape(-1), lengths, values, weights
            )
        local = None
        if self.layout.local:
            features = [r.feature for r in self.layout.local]
            local = select_features(kjt, features, [self.layout.features[f] for f in features])
        # A kind that takes no VBE batch runs its own part on a step whose ranks differ in batch
        # size (Note [a batch size per rank]): every feature's stride is the rank's batch size.
        part = self.variable_part or self.part
        extra = part.prepare(kjt, lengths, vbe)
        return Received(kjt.stride(), kjt, lengths, values, weights, local, extra, part, vbe)

    def _agreement(self, exchange: IdsExchange) -> str:
        """The input dist's first all-to-all on the exchange's group, as its error names it
        (Note [a failed peer]); with a hint at prefetch where the module prefetches."""
        what = f"the input-dist agreement of module {self.at.module!r}"
        return what if self.prefetcher is None else self.prefetcher.describe(what, exchange.group)

    @labelled(LOOKUP)
    def lookup(self, received: Received) -> Any:
        fused = self.shards.fused_tables
        if fused is not None and torch.is_grad_enabled():  # a forward whose backward updates
            fused.steps.advance()  # the Adam family's t (Note [fused Adam and LAMB])
        return received.part.lookup(self.shards, received)

    @labelled(OUTPUT_DIST)
    def output_dist(self, looked: Any, received: Received) -> Any:
        """Sends each rank its samples' results and places them in the output."""
        if self.prefetcher is not None:  # this thread waits next: the prefetched batch may go
            self.prefetcher.release()
        wire = received.part.send(looked, received)
        parts = []
        if wire.send is not None:
            arrived = wire.send
            if not self.alone:
                arrived = pooled_all_to_all(
                    wire.send,
                    input_splits=wire.input_splits,
                    output_splits=wire.output_splits,
                    group=self.at.group,
                    grad_scale=1.0 / self.at.world,
                    buffers=self.recv_buffers,
                    wire=self.options.comm_dtype,
                )
            parts.append(arrived.reshape(-1))
        if wire.local is not None:  # this rank's data-parallel results come last
            parts.append(wire.local.reshape(-1))
        arrived = parts[0] if len(parts) == 1 else torch.cat(parts) if parts else torch.zeros(0)
        out = received.part.place(arrived, received)
        fused = self.shards.fused_tables
        if fused is not None and fused.end_of_backward is not None:
            fused.end_of_backward.arm(out)  # the deferred updates (Note [fused tables])
        if self.options.output_dtype is not out.dtype:
            out = out.to(self.options.output_dtype)
        return received.part.wrap(out, received)


class ShardedCollectionModule(nn.Module):
    """The `nn.Module` face of a sharded collection: one `ShardedCollection` and the tables under
    the unsharded module's names. Built by `modular.shard`; `forward(kjt)` returns what the
    unsharded module returns on this rank's batch; gradients follow Note [grad scaling across
    ranks]."""

    kind: ClassVar[CollectionKind]

    def _attach(self, sharded: ShardedCollection, source: nn.Module) -> None:
        """Holds `sharded` and registers its tables, filled from `source` (collective)."""
        self._sharded = sharded
        tables = nn.ModuleDict(sharded.build_tables(self.kind.weights_source(source)))
        setattr(self, self.kind.tables_attr, tables)
        if any(k.group.tiered for k in sharded.shards.kernels):  # Note [tiered tables]
            watch_tiers(self, sharded.shards.sync_tiers)

    @classmethod
    def unsharded(
        cls, source: nn.Module, *, module: str, fused: Optional[FusedConfig] = None
    ) -> ShardedCollectionModule:
        """A single-process stand-in for the torchrec collection `source` (every table local, no
        communication), with its weights: what a materialised collection marked by
        `fuse_optimizer` becomes when used before any `shard` (Note [fusing at shard]), which
        `modular.shard` accepts."""
        device = next(iter(source.parameters())).device
        tables = cls.kind.read_tables(source, module)
        return cls(source, RankLayout.one_process(tables, module=module, device=device), fused=fused)

    @torch.compiler.disable(reason=EAGER_REASON)  # Note [compiling a sharded model]
    def forward(self, features: KeyedJaggedTensor) -> Any:
        """The three steps below, in order (a prefetched batch's input dist already ran)."""
        received = self._sharded.prefetched(features)
        if received is None:
            received = self.input_dist(features)
        return self.output_dist(self.lookup(received), received)

    @torch.compiler.disable(reason=EAGER_REASON)
    def prefetch(self, features: KeyedJaggedTensor) -> None:
        """Prefetches `features` for a later `forward(features)`: its input dist runs in the
        background from this module's next wait on (Note [prefetched input dist] in
        modular/routing/prefetcher.py); call it on every rank, in the same order."""
        self._sharded.prefetch(features)

    def input_dist(self, features: KeyedJaggedTensor) -> Received:
        """Checks the batch, then sends each id to the rank that owns its row (Note [routes])."""
        return self._sharded.input_dist(features)

    def lookup(self, received: Received) -> Any:
        """The kernels' results for the received ids (every rank's) and the local ones."""
        return self._sharded.lookup(received)

    def output_dist(self, looked: Any, received: Received) -> Any:
        """Sends each rank its samples' results and places them in the output."""
        return self._sharded.output_dist(looked, received)

    # -- the tables and the fused optimizer's state (modular/fused/state.py) ----------------

    def table_weights(self) -> dict[str, torch.Tensor]:
        """Each table's registered weight (ShardedTensor, DTensor or data-parallel copy), by table
        name."""
        tables = getattr(self, self.kind.tables_attr)
        return {n: holder._parameters["weight"] for n, holder in tables.items()}

    def local_shard_views(self) -> dict[tuple[str, int], torch.Tensor]:
        """This rank's shards by (table, shard index in the layout), aliasing the kernels'
        weights: writing into one changes what the next lookup reads (`modular.unshard`)."""
        return self._sharded.shards.views()

    @property
    def fused_tables(self):
        """The fused optimizer's part, or None (Note [fused tables])."""
        return self._sharded.shards.fused_tables

    @property
    def fused(self) -> Optional[FusedConfig]:
        """The fused optimizer's config, or None (Note [fused tables])."""
        fused = self._sharded.shards.fused_tables
        return None if fused is None else fused.config

    # -- where it lives and how it was sharded ----------------------------------------------

    layout = property(lambda self: self._sharded.layout, doc="The tables' layout (`Layout`).")
    is_local = property(lambda self: self._sharded.at.local, doc="A one-process module.")
    device = property(lambda self: self._sharded.at.device, doc="Where this rank's shards live.")
    process_group = property(lambda self: self._sharded.at.group, doc="The group of the tables.")
    replicas = property(lambda self: self._sharded.at.replicas, doc="The 2D replica axis, or None.")
    module_fqn = property(lambda self: self._sharded.at.module, doc="Its FQN in the model.")
    output_dtype = property(lambda self: self._sharded.options.output_dtype)
    comm_dtype = property(lambda self: self._sharded.options.comm_dtype)
    tensor_type = property(lambda self: self._sharded.options.tensor_type)
    tier_dir = property(lambda self: self._sharded.at.tier_dir, doc="Note [tiered tables]")

    # What tests and benchmarks inspect: this rank's kernels and its prefetcher.
    _kernels = property(lambda self: self._sharded.shards.kernels)
    _local_kernels = property(lambda self: self._sharded.shards.local_kernels)
    _prefetcher = property(lambda self: self._sharded.prefetcher)
    _exchange = property(lambda self: self._sharded.exchange)
    _router = property(lambda self: self._sharded.router)


def _uniform_inverse(kjt: KeyedJaggedTensor) -> torch.Tensor:
    """The inverse indices of a batch with one bag per sample, for a step in which some rank's
    batch has its own bags per feature or its own batch size (every rank then takes the
    variable-batch path)."""
    batch, device = kjt.stride(), kjt.lengths().device
    return torch.arange(batch, device=device).expand(len(kjt.keys()), batch)
