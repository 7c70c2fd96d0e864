"""Where every lookup of one sharded EmbeddingBagCollection happens: pure data, no collectives.

# Note [routes]
A *route* is one (output embedding, shard) pair: the ids of one feature that fall in one shard's
rows, looked up on the shard's rank and pooled over the shard's columns. Every sharding type is a
set of routes:

    TABLE_WISE      1 route per output, the whole table on one rank
    COLUMN_WISE     k routes per output, each over all rows and dim/k columns
    ROW_WISE        k routes per output, each over rows/k rows (partial sums, added on arrival)
    TABLE_ROW_WISE  ROW_WISE over the ranks of one host
    DATA_PARALLEL   no route: every rank looks the table up locally (see `Layout.local`)

One all-to-all moves the ids of all routes (ordered by destination rank), the kernels look them up
for the whole global batch, and one all-to-all moves the pooled columns back. The columns a rank
receives, in global route order, are added into the output at `Layout.output_columns` (adding is
what makes row-wise partial sums whole; for the other types each column is written once).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from modular.tables.replicas import Replicas
from planners.types import ShardingType, ShardSpec, TablePlacement

ROW_SPLIT = (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE)


class Pooling(enum.Enum):
    SUM = "sum"
    MEAN = "mean"
    # An EmbeddingCollection's tables: each id's row, no pooling (Note [sequence lookups] in
    # modular/sequence/lookup.py says which kernels take it as fbgemm's PoolingMode.NONE).
    NONE = "none"


@dataclass(frozen=True)
class TableInfo:
    """The facts about one table that sharding needs (read from a torchrec EmbeddingBagConfig)."""

    name: str
    num_embeddings: int
    embedding_dim: int
    features: tuple[str, ...]
    pooling: Pooling
    # The weights' dtype (torchrec's data_type): FP32, FP16 or BF16 (Note [low-precision tables]
    # in modular/kernels/table_dtypes.py).
    dtype: torch.dtype = torch.float32


@dataclass(frozen=True)
class Output:
    """One pooled embedding of the EBC's output KeyedTensor."""

    key: str
    feature: str
    table: str
    dim: int
    col: int  # first column in the output


@dataclass(frozen=True)
class Route:
    """One (output, shard) lookup; see Note [routes]."""

    output: int
    feature: int  # index into Layout.features
    table: str
    shard: ShardSpec
    shard_index: int  # index among the table's shards
    pooling: Pooling  # the kernel's pooling (SUM for row-split MEAN tables, divided on arrival)
    column_piece: bool = False  # one of several column-wise shards of its table
    dtype: torch.dtype = torch.float32  # its table's weights' dtype: one kernel holds one dtype
    tiered: bool = False  # on a tier: kernel groups of its own (Note [tiered tables])


@dataclass(frozen=True)
class Layout:
    world_size: int
    rank: int
    tables: tuple[TableInfo, ...]
    placements: tuple[TablePlacement, ...]  # aligned with tables
    shards: tuple[tuple[ShardSpec, ...], ...]  # aligned with tables
    features: tuple[str, ...]  # the KJT keys the EBC consumes, in first-use order
    outputs: tuple[Output, ...]
    # global, ordered by (destination rank, pooling, dtype, odd width, column piece, sequence
    # width, tier, table, shard, output): see build_layout and kernel_groups
    routes: tuple[Route, ...]
    local: tuple[Route, ...]  # data-parallel lookups, done on every rank from its own batch

    @property
    def output_dim(self) -> int:
        return sum(o.dim for o in self.outputs)

    def table(self, name: str) -> TableInfo:
        return self.tables[self.table_index(name)]

    def table_index(self, name: str) -> int:
        for i, t in enumerate(self.tables):
            if t.name == name:
                return i
        raise KeyError(name)

    def routes_to(self, rank: int) -> tuple[Route, ...]:
        return tuple(r for r in self.routes if r.shard.rank == rank)

    def routes_per_rank(self) -> list[int]:
        counts = [0] * self.world_size
        for r in self.routes:
            counts[r.shard.rank] += 1
        return counts

    def dims_per_rank(self) -> list[int]:
        dims = [0] * self.world_size
        for r in self.routes:
            dims[r.shard.rank] += r.shard.num_cols
        return dims

    def output_columns(self) -> list[int]:
        """For each column that arrives (all ranks' routes in order, then local ones), its output column."""
        cols: list[int] = []
        for r in (*self.routes, *self.local):
            start = self.outputs[r.output].col + r.shard.col_offset
            cols.extend(range(start, start + r.shard.num_cols))
        return cols

    def mean_outputs(self) -> tuple[int, ...]:
        """Outputs whose kernel sums partial rows and whose mean is taken after arrival."""
        out = []
        for i, o in enumerate(self.outputs):
            t = self.table_index(o.table)
            if self.tables[t].pooling is Pooling.MEAN and self.placements[t].sharding_type in ROW_SPLIT:
                out.append(i)
        return tuple(out)


def output_keys(tables: tuple[TableInfo, ...]) -> list[tuple[str, str, str]]:
    """(key, feature, table) of each output, in torchrec's order and naming (feature@table if shared)."""
    uses: dict[str, int] = {}
    for t in tables:
        for f in t.features:
            uses[f] = uses.get(f, 0) + 1
    out = []
    for t in tables:
        for f in t.features:
            out.append((f if uses[f] == 1 else f"{f}@{t.name}", f, t.name))
    return out


def build_layout(
    tables: tuple[TableInfo, ...],
    placements: tuple[TablePlacement, ...],
    shards: tuple[tuple[ShardSpec, ...], ...],
    *,
    world_size: int,
    rank: int,
) -> Layout:
    """Derives the routes of one EBC from its tables and their (already validated) shards."""
    features: list[str] = []
    for t in tables:
        for f in t.features:
            if f not in features:
                features.append(f)
    outputs, col = [], 0
    by_name = {t.name: i for i, t in enumerate(tables)}
    for key, feature, table in output_keys(tables):
        dim = tables[by_name[table]].embedding_dim
        outputs.append(Output(key=key, feature=feature, table=table, dim=dim, col=col))
        col += dim
    routes, local = [], []
    for i, o in enumerate(outputs):
        t = by_name[o.table]
        kind = placements[t].sharding_type
        pooling = tables[t].pooling
        if kind in ROW_SPLIT:
            pooling = Pooling.SUM
        column_piece = kind is ShardingType.COLUMN_WISE and len(shards[t]) > 1
        for j, spec in enumerate(shards[t]):
            route = Route(
                output=i,
                feature=features.index(o.feature),
                table=o.table,
                shard=spec,
                shard_index=j,
                pooling=pooling,
                column_piece=column_piece,
                dtype=tables[t].dtype,
                tiered=getattr(placements[t], "cache_load_factor", None) is not None,
            )
            if kind is ShardingType.DATA_PARALLEL:
                if spec.rank == rank:
                    local.append(route)
            else:
                routes.append(route)
    pooling_order = {p: k for k, p in enumerate(Pooling)}
    # A table's outputs are consecutive (`output_keys`), so ordering by the table's first output,
    # then shard, then output keeps each kernel table's routes together, also for a rank holding
    # two column pieces of a table read by two features: fbgemm's CPU backward takes a kernel
    # table's rows as the step of `hash_size_cumsum` between consecutive routes, which interleaved
    # routes (tables 0, 1, 0, 1) make negative (rows skipped, or a wrong update).
    first_output = {}
    for r in routes:
        first_output.setdefault(r.table, r.output)
    routes.sort(
        key=lambda r: (
            r.shard.rank, pooling_order[r.pooling], _dtype_order(r), _odd_width(r),
            r.column_piece, _nobag_width(r), r.tiered, first_output[r.table], r.shard_index,
            r.output,
        )
    )  # fmt: skip
    local.sort(
        key=lambda r: (pooling_order[r.pooling], _dtype_order(r), _odd_width(r), _nobag_width(r), r.output)
    )
    return Layout(
        world_size=world_size,
        rank=rank,
        tables=tables,
        placements=placements,
        shards=shards,
        features=tuple(features),
        outputs=tuple(outputs),
        routes=tuple(routes),
        local=tuple(local),
    )


@dataclass(frozen=True)
class KernelGroup:
    """Consecutive routes of one rank that one table-batched kernel looks up together."""

    pooling: Pooling
    routes: tuple[Route, ...]
    shards: tuple[tuple[str, int], ...]  # (table, shard_index) of each kernel table, first-use order
    feature_table_map: tuple[int, ...]  # for each route, its kernel table
    dtype: torch.dtype = torch.float32  # the weights' dtype of every table in the group

    @property
    def dim(self) -> int:
        return sum(r.shard.num_cols for r in self.routes)

    tiered = property(lambda self: self.routes[0].tiered, doc="Note [tiered tables]")


def _dtype_order(route: Route) -> int:
    """FP32 first, so that the order of an all-FP32 layout's routes is what it always was."""
    return _DTYPE_ORDER.get(route.dtype, len(_DTYPE_ORDER))


_DTYPE_ORDER = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def odd_width(cols: int) -> bool:
    """A shard width fbgemm's fused kernels cannot take (not a multiple of 4)."""
    return cols % 4 != 0


def _odd_width(route: Route) -> bool:
    return odd_width(route.shard.num_cols)


def _nobag_width(route: Route) -> int:
    """The width that splits kernel groups of sequence routes (fbgemm's PoolingMode.NONE kernels
    take one width, Note [sequence lookups]); 0 for pooled routes, which mix widths."""
    return route.shard.num_cols if route.pooling is Pooling.NONE else 0


def kernel_groups(routes: tuple[Route, ...]) -> tuple[KernelGroup, ...]:
    """Splits a rank's routes (already ordered by pooling, dtype, odd width, column piece, then
    sequence width) into one group per pooling mode, weights' dtype (one fbgemm TBE has one
    weights precision), width class, column piece or not, and, for sequences, width:
    - fbgemm's sequence (PoolingMode.NONE) kernels take tables of one width (fbgemm-gpu 1.8.0
      asserts it), so sequence routes of different widths (column pieces of unequal widths:
      torchrec's EmbeddingCollection gives every table one dim) get a group per width;
    - a shard whose width fbgemm's fused kernels cannot take is emulated with the rest of its
      group (Note [fused tables] in modular/fused/choice.py), so it gets a group of its own instead of
      taking every table of its pooling mode with it;
    - under row-wise Adagrad a group with a column piece runs fbgemm's backward twice (Note [row
      statistics across column shards] in modular/fused/deferred.py), so column pieces get a group
      of their own instead of doubling the backward of the whole tables beside them (planned
      plans mix them on one rank). Otherwise the split costs one more kernel call."""
    groups = []
    start = 0
    while start < len(routes):
        end = start
        head = routes[start]
        while (
            end < len(routes)
            and routes[end].pooling is head.pooling
            and routes[end].dtype == head.dtype
            and _odd_width(routes[end]) == _odd_width(head)
            and routes[end].column_piece == head.column_piece
            and _nobag_width(routes[end]) == _nobag_width(head)
            and routes[end].tiered == head.tiered
        ):
            end += 1
        members = routes[start:end]
        shards: list[tuple[str, int]] = []
        ftm = []
        for r in members:
            key = (r.table, r.shard_index)
            if key not in shards:
                shards.append(key)
            ftm.append(shards.index(key))
        if ftm != sorted(ftm):  # see build_layout: fbgemm's CPU backward would skip rows
            raise AssertionError(f"kernel group interleaves its tables' routes: {ftm}")
        groups.append(
            KernelGroup(
                pooling=routes[start].pooling,
                dtype=routes[start].dtype,
                routes=members,
                shards=tuple(shards),
                feature_table_map=tuple(ftm),
            )
        )
        start = end
    return tuple(groups)


@dataclass(frozen=True)
class RankLayout:
    """One rank's view of a sharded module: the layout, and where this rank sits in it.

    What every part of a sharded module (its kernels' fused machinery, its state, its end of
    backward) receives explicitly, instead of reading the module's attributes."""

    layout: Layout
    module: str  # the module's FQN in the model, for messages
    rank: int
    world: int
    group: Optional[ProcessGroup]
    device: torch.device
    local: bool  # a one-process module that never communicates (`unsharded`)
    # The replica axis of a 2D layout (modular/tables/replicas.py); None in 1D.
    replicas: Optional[Replicas] = None
    tier_dir: Optional[str] = None  # where tiered shards' files go (Note [tiered tables])

    @classmethod
    def build(
        cls,
        tables: tuple[TableInfo, ...],
        placements: dict[str, TablePlacement],
        shards: dict[str, tuple[ShardSpec, ...]],
        *,
        module: str,
        group: Optional[ProcessGroup],
        device: torch.device,
        local: bool,
        replicas: Optional[Replicas] = None,
        tier_dir: Optional[str] = None,
    ) -> RankLayout:
        """The layout of `tables` under `placements` / `shards`, seen from this rank of `group`
        (a `local` module is a world of one that never communicates)."""
        world = 1 if local else dist.get_world_size(group)
        rank = 0 if local else dist.get_rank(group)
        layout = build_layout(
            tables,
            tuple(placements[t.name] for t in tables),
            tuple(shards[t.name] for t in tables),
            world_size=world,
            rank=rank,
        )
        return cls(
            layout=layout, module=module, rank=rank, world=world, group=group, device=device,
            local=local, replicas=replicas, tier_dir=tier_dir,
        )  # fmt: skip

    @classmethod
    def one_process(
        cls, tables: tuple[TableInfo, ...], *, module: str, device: torch.device
    ) -> RankLayout:
        """Every table whole on a world of one that never communicates: a one-process module
        (`unsharded`, what `fuse_optimizer` makes of a materialised collection)."""
        placements = {t.name: TablePlacement(ShardingType.DATA_PARALLEL) for t in tables}
        shards = {t.name: (ShardSpec(0, 0, t.num_embeddings, 0, t.embedding_dim),) for t in tables}
        return cls.build(
            tables, placements, shards, module=module, group=None, device=device, local=True
        )

    @property
    def global_rank(self) -> int:
        """This rank in the default group: ShardedTensor placements name global ranks, also when
        sharding over a subgroup."""
        if self.local or self.group is None:
            return self.rank
        return dist.get_global_rank(self.group, self.rank)

    def shard_of_rank(self, t: int) -> int:
        """The index of this rank's shard of table `t` (a data-parallel table's copy)."""
        for j, s in enumerate(self.layout.shards[t]):
            if s.rank == self.rank:
                return j
        raise KeyError(f"rank {self.rank} holds no shard of table {self.layout.tables[t].name!r}")
