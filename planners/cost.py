"""The cost model: seconds and bytes that one shard of one table adds to the rank holding it.

Every formula here is written out, with its symbols, in docs/planner.md ("The cost model"); the
names below follow it. The functions take numpy arrays (one entry per table or per shard) so
that the search can price every candidate placement of thousands of tables at once.

Note [what a rank's cost is]
A training step moves data one way: input dist (ids to the shard that owns their rows) ->
lookup (pooling rows into bags) -> output dist (pooled bags back to the rank that owns the
sample), and the reverse in backward. The cost of a rank is the sum, over the shards it holds,
of the time its memory and links spend on that shard's part of the three steps, forward and
backward, plus the gradient all-reduce of data-parallel tables. The sending half of each
all-to-all (every rank sends its own batch's ids and receives its own batch's bags) is the same
on every rank to first order, so it is left out: it would add one constant to every rank.
Links are charged one after the other (intra-host bytes / intra-host bandwidth + cross-host
bytes / cross-host bandwidth), which keeps a rank's cost a plain sum over its shards.

Note [what a rank holds]
A rank's memory is priced as what modular allocates for it, part by part (`ShardCost` and
`planners.RankStats` name them; docs/planner.md, "Memory"):
- weights: each shard's rows x cols x e (a data-parallel copy is the whole table);
- optimizer state: fused, fp32 whatever the table's dtype (`Optimizer.state_bytes_per_row`);
  unfused, what torch's optimizer makes with `zeros_like` of each shard, in its dtype: SGD
  (no momentum) none, Adagrad one value per element, Adam two (their scalar step counts are
  left out);
- gradients: unfused only, the dense kernel's buffer as large as its weights, kept across steps
  (Note [dense gradient buffer] in modular/kernels/dense.py), for every sharding kind. A fused
  table holds no dense gradient, data-parallel copies included (Note [fused data-parallel
  copies] in modular/fused/deferred.py);
- buffers, kept by kernels across steps: a fused data-parallel copy that takes the torch
  emulation (the Adam family; a width that is not a multiple of 4) gathers every rank's touched
  rows and their gradients into kept buffers (Note [kept receive buffers] in modular/comm.py):
  its own packed rows (int64) and gradients (fp32), the W ranks' gathered, and the global
  batch's summed gradients, each 1/8 larger than asked; touched rows are estimated as from
  uniform ids, T = N (1 - exp(-n / N)) of n ids. Under exact row-wise Adagrad a kernel group of
  column pieces of mixed widths keeps a scratch statistic, one fp32 per row of its pieces
  (`column_scratch_bytes`; groups of one width take a pooling kernel and keep none); it depends
  on what else the rank holds, so the search reserves it for every such piece (`shard`) and
  `plan_stats` prices, per rank, what is kept: never more than the search reserved;
- the rest is the step's batch: ids, pooled outputs and their gradients, wire copies.
Weight decay on CPU also sends fused tables to the emulation, and a non-CPU device never keeps
gather buffers (its caching allocator reuses memory): neither is visible to the planner.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import numpy as np

# The column pieces' statistics live in planners/column_pieces.py; re-exported here.
from planners.column_pieces import STAT_BYTES, column_scratch_bytes, column_stat_floats
from planners.inputs import ColumnWiseStatistic, DataType, Optimizer, Table, Topology
from planners.replicas import Replicas
from planners.tier_cost import TierSpec, tier_arrays, tier_cost
from planners.types import PlanError, ShardingType

__all__ = [
    "COMPONENTS", "CostModel", "ShardCost", "TableArrays", "OUTPUT_BYTES", "ID_BYTES", "WIRE_ID_BYTES",
    "WEIGHT_BYTES", "STAT_BYTES", "column_scratch_bytes", "column_stat_floats",
]  # fmt: skip

OUTPUT_BYTES = 4  # pooled outputs and their gradients are fp32 (also for FP16/BF16 tables)
ID_BYTES = 8  # a batch's ids are int64
# Routed ids travel as int32 while the table has fewer than 2**31 rows (modular's Note [ids on
# the wire]); a taller table's ids stay int64.
WIRE_ID_BYTES = 4
INT32_ROWS = 2**31 - 1
WEIGHT_BYTES = 4  # per-id weights of weighted features are fp32
ROW_ID_BYTES = 8  # the touched rows an emulated data-parallel copy gathers are int64
KEPT_SLACK = 1.125  # a kept buffer has room for 1/8 more (modular.comm.KeptBuffers)
_ADAM_FAMILY = frozenset({Optimizer.ADAM, Optimizer.PARTIAL_ROWWISE_ADAM, Optimizer.LAMB,
                          Optimizer.PARTIAL_ROWWISE_LAMB})  # fmt: skip


class TableArrays(NamedTuple):
    """The numbers of each table that the cost model needs, as parallel numpy arrays."""

    rows: np.ndarray  # N, rows
    dim: np.ndarray  # d, columns
    elem: np.ndarray  # e, bytes per weight element
    ids: np.ndarray  # P, ids per sample (sum of the features' pooling factors x batch fractions)
    bags: np.ndarray  # F, bags per sample (the features' batch fractions: their number, mostly)
    id_bytes: np.ndarray  # bytes of the batch per id (8, plus 4 for a weight)
    wire_id_bytes: np.ndarray  # bytes per routed id (4, or 8 past 2**31 rows; plus 4 for a weight)
    sequence: np.ndarray  # 1 for a sequence table (one output row per id), else 0
    # Tiered tables (Note [pricing tiered tables] in planners/tier_cost.py): the cache load
    # factor (0: resident), the given hit rate (-1: from Zipf) and the Zipf exponent.
    cache: np.ndarray
    hit_rate: np.ndarray
    zipf_alpha: np.ndarray

    @classmethod
    def of(cls, tables: Sequence[Table], tiers: Sequence[TierSpec | None] | None = None) -> TableArrays:
        """`tiers`: each table's tier, None (or no list) for a resident one."""
        return cls(
            rows=np.array([t.num_embeddings for t in tables], dtype=np.float64),
            dim=np.array([t.embedding_dim for t in tables], dtype=np.float64),
            elem=np.array([t.dtype.num_bytes for t in tables], dtype=np.float64),
            # A feature's bags per sample (`batch_fraction`, a deduplicated feature's < 1) scale
            # its ids and its bags: lookups and both all-to-alls move only those.
            ids=np.array(
                [sum(p * f for p, f in zip(t.pooling_factors, t.batch_fractions)) for t in tables],
                dtype=np.float64,
            ),
            bags=np.array([sum(t.batch_fractions) for t in tables], dtype=np.float64),
            id_bytes=np.array(
                [ID_BYTES + (WEIGHT_BYTES if t.weighted else 0) for t in tables], dtype=np.float64
            ),
            wire_id_bytes=np.array(
                [
                    (WIRE_ID_BYTES if t.num_embeddings <= INT32_ROWS else ID_BYTES)
                    + (WEIGHT_BYTES if t.weighted else 0)
                    for t in tables
                ],
                dtype=np.float64,
            ),
            sequence=np.array([float(t.sequence) for t in tables], dtype=np.float64),
            **dict(zip(("cache", "hit_rate", "zipf_alpha"),
                       tier_arrays([None] * len(tables) if tiers is None else tiers))),
        )

    @property
    def outputs(self) -> np.ndarray:
        """Output rows per sample: one per feature (pooled), one per id (sequence)."""
        return np.where(self.sequence > 0, self.ids, self.bags)

    def take(self, index: np.ndarray) -> TableArrays:
        return TableArrays(*(a[index] for a in self))


# The parts of a shard's (and a rank's) cost, in pipeline order, as named in reports, the plot
# and docs/planner.md: (attribute, short column header, what it is).
COMPONENTS = (
    ("lookup", "lookup", "lookup: pooling rows into bags, forward and fused backward"),
    ("input_dist", "in-dist", "input dist: ids arriving from the other ranks"),
    ("output_dist", "out-dist", "output dist: pooled bags out, their gradients back"),
    ("grad_sync", "dp-grad", "data-parallel gradient all-reduce"),
    ("stat_exchange", "cw-stat", "column-piece row-statistic exchange (exact row-wise Adagrad, "
                                 "partial_rowwise, LAMB)"),
    ("replica_sync", "rep-sync", "cross-replica sync: other replica groups' ids and pooled "
                                 "gradients (2D, exact)"),
    ("tier", "tier", "tiered tables: cache bookkeeping, and misses read from and dirty rows "
                     "written back to the tier unless prefetched"),
)


class ShardCost(NamedTuple):
    """Seconds per training step (forward + backward) and bytes, per shard.

    `grad_sync` is the all-reduce of a data-parallel table's gradient; `stat_exchange` the
    row statistics a column piece sends to the table's other pieces under exact row-wise
    Adagrad, the partial_rowwise kinds and LAMB (`column_stat_floats`; zero for every
    other shard)."""

    lookup: np.ndarray
    input_dist: np.ndarray
    output_dist: np.ndarray
    grad_sync: np.ndarray
    stat_exchange: np.ndarray
    memory: np.ndarray
    replica_sync: np.ndarray | float = 0.0  # 2D, exact (Note [pricing replica groups])
    # The parts of `memory` that the model keeps across steps (Note [what a rank holds]); the
    # rest of `memory` is the step's batch (ids, pooled outputs, their wire copies).
    weights: np.ndarray | float = 0.0
    state: np.ndarray | float = 0.0  # optimizer state
    gradients: np.ndarray | float = 0.0  # unfused: the dense kernel's gradient buffer
    buffers: np.ndarray | float = 0.0  # kept by kernels: emulated data-parallel gather buffers
    # Tiered shards (Note [pricing tiered tables]): seconds in the step, the cache's bytes in
    # `memory` (its weights and state not in `weights`, `state`), the store's on the tier, and
    # the tier traffic's seconds (hidden by prefetch or not), hit rate and cache rows.
    tier: np.ndarray | float = 0.0
    cache: np.ndarray | float = 0.0
    tier_bytes: np.ndarray | float = 0.0
    tier_io: np.ndarray | float = 0.0
    hit_rate: np.ndarray | float = 0.0
    cache_rows: np.ndarray | float = 0.0

    @property
    def total(self) -> np.ndarray:
        return (self.lookup + self.input_dist + self.output_dist + self.grad_sync
                + self.stat_exchange + self.replica_sync + self.tier)  # fmt: skip


@dataclass(frozen=True)
class CostModel:
    """Prices shards for one cluster, per-rank batch size and embedding optimizer.

        model = CostModel(topology, batch_size=512)
        cost = model.shard(ShardingType.TABLE_WISE, TableArrays.of(tables), rows, cols, shards)

    `column_wise_statistic` (keyword-only; "exact" or "per_shard", as given to
    `modular.fuse_optimizer`) decides what a column piece costs under row-wise Adagrad (see
    `shard`); under the other optimizers it changes nothing.
    """

    topology: Topology
    batch_size: int
    optimizer: Optimizer = Optimizer.ROWWISE_ADAGRAD
    column_wise_statistic: ColumnWiseStatistic = field(
        default=ColumnWiseStatistic.EXACT, kw_only=True
    )
    # The dtype pooled embeddings and their gradients travel in (`modular.shard(comm_dtype=)`,
    # modular's Note [low-precision comms]): FP16/BF16 halve the output dist's bytes.
    comm_dtype: DataType = field(default=DataType.FP32, kw_only=True)
    # 2D: `topology` is one shard group's, replicated this way (Note [pricing replica groups]
    # in planners/replicas.py); None is 1D.
    replicas: Replicas | None = field(default=None, kw_only=True)
    # The loop calls `modular.prefetch`: tiered tables' reads run beside the step (Note [pricing
    # tiered tables]).
    prefetch: bool = field(default=False, kw_only=True)

    def __post_init__(self) -> None:
        b = self.batch_size
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise PlanError(f"batch_size must be a positive integer (per rank), got {b!r}")
        object.__setattr__(self, "optimizer", Optimizer.parse(self.optimizer))
        statistic = ColumnWiseStatistic.parse(self.column_wise_statistic)
        object.__setattr__(self, "column_wise_statistic", statistic)
        object.__setattr__(self, "comm_dtype", DataType.parse(self.comm_dtype))

    @property
    def exact_column_statistic(self) -> bool:
        """Whether column pieces pay for the exact row statistic (Note [row statistics across
        column shards] in modular/fused/deferred.py): row-wise Adagrad under "exact"."""
        return (
            self.optimizer is Optimizer.ROWWISE_ADAGRAD
            and self.column_wise_statistic is ColumnWiseStatistic.EXACT
        )

    @property
    def alpha(self) -> float:
        """Seconds to move one byte from each of the other ranks to one rank, over both links.

        alpha = (H - 1) / intra_bw + (W - H) / cross_bw
        """
        topo = self.topology
        world, host = topo.world_size, int(topo.ranks_per_host or 1)
        if topo.calibration is not None:  # measured per peer (Note [calibrated prices])
            return (world - 1) / topo.calibration.all_to_all_bandwidth
        return (host - 1) / topo.intra_host_bandwidth + (world - host) / topo.cross_host_bandwidth

    @property
    def wire_bytes(self) -> int:
        """Bytes per pooled value of the output dist's low-precision copies: 2 under FP16/BF16
        comms, 0 under FP32 comms (which send the pooled outputs themselves, no copy)."""
        return 0 if self.comm_dtype is DataType.FP32 else self.comm_dtype.num_bytes

    def batch_buffer_bytes(self, t: TableArrays, *, wire: bool = True) -> float:
        """Bytes every rank holds for its own batch, whatever the plan: its ids and pooled bags.

        sum over tables of B*P*id_bytes + 2*B*F*d*4 (bags and their gradients; a sequence
        table's outputs are rows of ids, P instead of F), plus, under low-precision comms, the
        copies of one pooled table's worth arriving and its gradient leaving (Note [wire copies]):
        2*B*F*d*w per pooled table, `arrival_wire_bytes` as if each table were one piece
        (`wire=False` leaves them out).
        """
        b = self.batch_size
        w = self.wire_bytes if wire else 0
        pooled = np.where(t.sequence > 0, 0.0, 2 * b * t.bags * t.dim * w)
        return float(np.sum(b * t.ids * t.id_bytes + 2 * b * t.outputs * t.dim * OUTPUT_BYTES + pooled))

    def arrival_wire_bytes(
        self, kind: ShardingType, t: TableArrays, cols: np.ndarray | float
    ) -> np.ndarray:
        """Bytes that one shard's pooled outputs take on *every* rank under low-precision comms:
        the copy of its columns of the rank's batch arriving and of their gradient leaving.

        Note [wire copies]
        Under `comm_dtype` FP16/BF16, `modular.comm.pooled_all_to_all` sends a copy of the
        pooled outputs in that dtype and receives into a buffer of it, each way: the rank
        holding a shard makes 2*W*B*F*c*w bytes for it (its pooled outputs for every rank's batch
        leaving, their gradients arriving; in `shard`'s memory), and every rank 2*B*F*c*w for it
        (its batch's columns arriving, their gradients leaving; here), with c the columns the
        shard sends: its own (table-wise, column-wise) or the table's d (row-wise partial sums).
        Data-parallel and sequence tables send nothing through it. `batch_buffer_bytes` counts
        one table's worth per pooled table (plan-independent); `plan_stats` replaces it by the
        sum of this over the plan's shards (more for the partial sums of row-wise pieces, less
        for data-parallel tables), and the search charges that difference with each placement
        (`everywhere_bytes`), so both price the same bytes.
        """
        cols = np.asarray(cols, dtype=np.float64)
        if kind is ShardingType.DATA_PARALLEL:
            return np.zeros(np.broadcast(cols, t.rows).shape)
        out_cols = cols if kind in (ShardingType.TABLE_WISE, ShardingType.COLUMN_WISE) else t.dim
        pooled = np.where(t.sequence > 0, 0.0, 1.0)
        return pooled * 2 * self.batch_size * t.bags * out_cols * self.wire_bytes + 0 * cols

    def everywhere_bytes(
        self, kind: ShardingType, t: TableArrays, num_shards: np.ndarray | float
    ) -> np.ndarray:
        """Bytes that a table placed as `kind` in `num_shards` shards adds to *every* rank beyond
        `batch_buffer_bytes`'s reserve of one table's worth of low-precision copies (Note [wire
        copies]): 0 for table- and column-wise (their pieces' columns add up to the table's
        width), (k - 1) copies for k row-wise pieces (each sends partial sums of every column),
        minus the reserve for a data-parallel table (it sends nothing). 0 under FP32 comms.
        The search charges this with the placement, so that it prices what `plan_stats` does."""
        k = np.asarray(num_shards, dtype=np.float64)
        placed = k * self.arrival_wire_bytes(kind, t, t.dim / k)
        return placed - self.arrival_wire_bytes(ShardingType.TABLE_WISE, t, t.dim)

    def shard(
        self,
        kind: ShardingType,
        t: TableArrays,
        rows: np.ndarray | float,
        cols: np.ndarray | float,
        num_shards: np.ndarray | float,
    ) -> ShardCost:
        """The cost of one shard of `rows` x `cols` of each table in `t` placed as `kind`.

        `num_shards` matters only for TABLE_ROW_WISE (the size of its intra-host reduce-scatter).
        Arguments broadcast like numpy arrays.
        """
        topo = self.topology
        world, host = float(topo.world_size), float(topo.ranks_per_host or 1)
        b, alpha = float(self.batch_size), self.alpha
        rows = np.asarray(rows, dtype=np.float64)
        cols = np.asarray(cols, dtype=np.float64)
        k = np.asarray(num_shards, dtype=np.float64)
        zero = np.zeros(np.broadcast(rows, cols, t.rows).shape)
        state = self.optimizer.state_bytes_per_row(cols, t.elem)  # s(c), bytes per row
        frac = rows / t.rows  # phi, the share of the table's ids that this shard looks up
        if kind is ShardingType.DATA_PARALLEL:
            ids_in, bags_out = b * t.ids, b * t.bags
        elif kind in (ShardingType.TABLE_WISE, ShardingType.COLUMN_WISE):
            ids_in, bags_out = world * b * t.ids, world * b * t.bags
        else:
            ids_in, bags_out = world * b * t.ids * frac, world * b * t.bags
        # A sequence table outputs one row per id it looks up, never a partial sum.
        seq = t.sequence > 0
        bags_out = np.where(seq, ids_in, bags_out)
        # Lookup, forward: read each id's row, write each bag. Backward (fused optimizer): read
        # each bag's gradient, then read and write each id's row and its optimizer state.
        out_cols = cols if kind in (ShardingType.TABLE_WISE, ShardingType.COLUMN_WISE,
                                    ShardingType.DATA_PARALLEL) else t.dim  # fmt: skip
        fwd = ids_in * cols * t.elem + bags_out * out_cols * OUTPUT_BYTES
        bwd = bags_out * out_cols * OUTPUT_BYTES + ids_in * (2 * cols * t.elem + 2 * state)
        base_bytes = fwd + bwd  # the kernel's own work, before what the kinds below add
        weights, states = rows * cols * t.elem + zero, rows * state + zero
        # Note [what a rank holds]: unfused, the dense kernel's gradient buffer (every kind).
        gradients = weights if not self.optimizer.fused else zero
        buffers = zero
        memory = weights + states + gradients
        # Received ids: routed (wire) ids, or a data-parallel table's own batch.
        held_id_bytes = t.id_bytes if kind is ShardingType.DATA_PARALLEL else t.wire_id_bytes
        memory = memory + ids_in * held_id_bytes + 2 * bags_out * out_cols * OUTPUT_BYTES
        if kind is not ShardingType.DATA_PARALLEL:  # the low-precision copies (Note [wire copies])
            memory = memory + np.where(seq, 0.0, 2 * bags_out * out_cols * self.wire_bytes)
        input_dist, output_dist, grad_sync, stat_exchange = zero, zero, zero, zero
        # Under exact replicas a copy's update runs on every group's batch (Note [pricing replica
        # groups]), the column pieces' statistics exchange included.
        merged = self.replicas.count if self.replicas is not None and self.replicas.per_step else 1
        if kind is ShardingType.COLUMN_WISE and self.exact_column_statistic:
            # Column pieces of one table (k > 1) under row-wise Adagrad, exact: the row's
            # statistic is the mean of g**2 over all its columns, so each piece runs its backward
            # a second time (pass 1 finds its share, into a scratch statistic per row) and sends
            # one float per id to the table's other pieces (modular's Note [row statistics
            # across column shards]); priced as one peer's worth. One piece (table-wise) does
            # neither, nor does a piece under "per_shard", which keeps its own columns'
            # statistic (already in `state`) and runs one plain pass.
            # Its scratch statistic (one fp32 per row) exists only where a kernel group mixes
            # piece widths: reserved here, where the rank's other pieces are not known;
            # `plan_stats` prices what is kept (`column_scratch_bytes`).
            piece = (k > 1).astype(np.float64)
            bwd = bwd + piece * bwd
            buffers = buffers + piece * rows * STAT_BYTES
            memory = memory + piece * rows * STAT_BYTES
            bw = self._piece_bandwidth
            stat_exchange = piece * merged * ids_in * STAT_BYTES / bw + zero
        floats = column_stat_floats(self.optimizer, self.column_wise_statistic)
        if kind is ShardingType.COLUMN_WISE and floats and not self.exact_column_statistic:
            # Column pieces (k > 1) under partial_rowwise_adam, lamb or partial_rowwise_lamb
            # (Note [fused Adam and LAMB]): one pass, and at the end of backward `floats` fp32
            # per touched row to the table's other pieces, one all-to-all per statistic; priced
            # as one peer's worth, as above. Touched rows: the distinct rows of the step's ids
            # drawn uniformly from the table's N, N * (1 - exp(-ids / N)) (fewer under skew;
            # never more than the ids).
            piece = (k > 1).astype(np.float64)
            touched = t.rows * -np.expm1(-merged * ids_in / t.rows)
            bw = self._piece_bandwidth
            stat_exchange = piece * touched * floats * STAT_BYTES / bw + zero
        if kind is ShardingType.DATA_PARALLEL:
            # Dense gradient: each id writes a gradient row; after the all-reduce the optimizer
            # steps over the whole table (read gradient, read and write weights and state).
            bwd = bwd - ids_in * 2 * state + rows * cols * 3 * t.elem + rows * 2 * state
            # Its dense gradient is in `gradients` when unfused; fused copies hold none (Note
            # [fused data-parallel copies] in modular/fused/deferred.py) but the emulated ones
            # keep gather buffers (Note [what a rank holds]).
            buffers = self.gather_buffer_bytes(t, cols) + zero
            memory = memory + buffers
            cal = topo.calibration
            if world > 1 and cal is not None:  # as modular runs it (Note [calibrated prices])
                grad_sync = cal.data_parallel_sync(self.optimizer.fused, world, rows, cols, t.elem,
                                                   ids_in, bags_out) + zero  # fmt: skip
            elif world > 1:
                ring_bw = topo.cross_host_bandwidth if world > host else topo.intra_host_bandwidth
                grad_sync = 2 * (world - 1) / world * rows * cols * t.elem / ring_bw + zero
        else:
            # Input dist: ids from the other ranks arrive (no backward: ids have no gradient).
            ids_from_each = b * t.ids if kind in (
                ShardingType.TABLE_WISE, ShardingType.COLUMN_WISE) else b * t.ids * frac
            input_dist = ids_from_each * t.wire_id_bytes * alpha + zero
            # Output dist: bags (or partial sums) leave in forward, their gradients come back.
            bag_bytes = b * t.bags * out_cols * self.comm_dtype.num_bytes  # to each rank
            if kind is ShardingType.TABLE_ROW_WISE:
                intra = world * bag_bytes * (k - 1) / k / topo.intra_host_bandwidth
                output_dist = 2 * (intra + bag_bytes * alpha / k) + zero
            else:
                output_dist = 2 * bag_bytes * alpha + zero
            # A sequence table sends each id's row back (its shard's columns), bytes per id.
            row_bytes = ids_from_each * out_cols * OUTPUT_BYTES
            output_dist = np.where(seq, 2 * row_bytes * alpha + zero, output_dist)
        replica_sync = zero
        if self.replicas is not None and self.replicas.per_step:
            # Note [pricing replica groups]: the other groups' lookup batches gathered and
            # replayed through this copy's backward.
            peers = self.replicas.count - 1
            length_bytes = ID_BYTES if kind is ShardingType.DATA_PARALLEL else np.where(
                t.rows <= INT32_ROWS, WIRE_ID_BYTES, ID_BYTES)  # bag lengths in the ids' dtype
            held = (ids_in * held_id_bytes + bags_out * length_bytes
                    + bags_out * out_cols * OUTPUT_BYTES)  # fmt: skip
            beta = self.replicas.beta(topo.intra_host_bandwidth, topo.cross_host_bandwidth)
            replica_sync = held * beta + zero  # beta: one byte from each of the peers
            memory = memory + peers * held
            if kind is ShardingType.DATA_PARALLEL:
                bwd = bwd + peers * (bags_out * out_cols * OUTPUT_BYTES + ids_in * 2 * cols * t.elem)
            else:
                bwd = bwd + peers * bwd
        if topo.calibration is None:
            lookup = (fwd + bwd) / topo.device_memory_bandwidth + zero
        else:
            lookup = topo.calibration.lookup_seconds(  # Note [calibrated prices]
                self.family(cols), kind is ShardingType.DATA_PARALLEL, self.optimizer.fused, rows,
                cols * t.elem, ids_in, bags_out * out_cols, fwd + bwd, base_bytes, world) + zero
        # Note [pricing tiered tables]: a tiered shard holds a cache, not its rows (never a
        # data-parallel copy, which modular refuses to tier)
        factor = t.cache if kind is not ShardingType.DATA_PARALLEL else 0.0 * t.cache
        tc = tier_cost(factor=factor + zero, hit_rate=t.hit_rate, alpha=t.zipf_alpha, rows=rows + zero,
                       row_bytes=cols * t.elem + state, ids=ids_in + zero,
                       tier_bandwidth=topo.tier_bandwidth, memory_bandwidth=self._stream_bandwidth,
                       prefetch=self.prefetch)  # fmt: skip
        tiered = factor > 0
        memory = memory + np.where(tiered, tc.cache - weights - states, 0.0)
        weights, states = np.where(tiered, 0.0, weights), np.where(tiered, 0.0, states)
        return ShardCost(lookup, input_dist, output_dist, grad_sync, stat_exchange, memory + zero,
                         replica_sync, weights, states, gradients, buffers, tc.seconds, tc.cache,
                         tc.store, tc.io, tc.hit_rate, tc.slots)  # fmt: skip

    @property
    def _stream_bandwidth(self) -> float:
        cal = self.topology.calibration
        return self.topology.device_memory_bandwidth if cal is None else cal.stream_bandwidth

    @property
    def _piece_bandwidth(self) -> float:
        """Bytes/s between a table's column pieces (the row-statistic exchange)."""
        topo = self.topology
        if topo.calibration is not None:
            return topo.calibration.all_to_all_bandwidth
        multi_host = topo.world_size > int(topo.ranks_per_host or 1)
        return topo.cross_host_bandwidth if multi_host else topo.intra_host_bandwidth

    def family(self, cols: np.ndarray) -> np.ndarray:
        """The kernel family each width takes (`planners.calibration.FAMILIES` index): fbgemm's
        fused kernels 0, the torch emulation 1 (the Adam family; widths not a multiple of 4),
        the dense kernel 2 (unfused)."""
        cols = np.asarray(cols)
        if not self.optimizer.fused:
            return np.full(np.shape(cols), 2)
        return self.emulated_copies(cols).astype(np.int64)

    def emulated_copies(self, cols: np.ndarray) -> np.ndarray:
        """Whether a fused data-parallel copy of this width takes the torch emulation, which
        keeps gather buffers (Note [what a rank holds]): the Adam family always, the others at a
        width fbgemm's fused kernels cannot take (not a multiple of 4). 0/1 per entry."""
        if not self.optimizer.fused:
            return np.zeros(np.shape(cols))
        adam = self.optimizer in _ADAM_FAMILY
        return np.where(adam | (np.asarray(cols) % 4 != 0), 1.0, 0.0)

    def gather_buffer_bytes(self, t: TableArrays, cols: np.ndarray | float) -> np.ndarray:
        """Bytes an emulated fused data-parallel copy of `cols` columns keeps on every rank for
        gathering every rank's touched rows and their gradients (Note [what a rank holds]);
        0 for the other copies."""
        cols = np.asarray(cols, dtype=np.float64)
        world = float(self.topology.world_size)
        ids = self.batch_size * t.ids  # this rank's ids of the table per step
        mine = t.rows * -np.expm1(-ids / t.rows)  # touched rows, ids drawn uniformly
        every = t.rows * -np.expm1(-world * ids / t.rows)  # the global batch's touched rows
        packed = mine * (ROW_ID_BYTES + cols * OUTPUT_BYTES)
        kept = KEPT_SLACK * ((1 + world) * packed + every * cols * OUTPUT_BYTES)
        return self.emulated_copies(cols) * kept
