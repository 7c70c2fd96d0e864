"""2D sparse parallelism in the planner (issue 36): one shard group planned, replicated across
replica groups, and what keeping the replicas in step costs.

Note [pricing replica groups]
`modular.shard(model, plan, mesh=mesh)` with a ("replicate", "shard") mesh of R x G ranks shards
every table within each shard group of G ranks and keeps one copy per replica group; rank
`r * G + s` is rank `s` of replica group `r`. So `plan(..., replicas=R)` plans one group: a
topology of G = W / R ranks (hosts as the world's, or one group of G inside a host), the
per-rank batch as given (the global batch is W x B), and every shard priced as the 1D cost
model prices it in a world of G, plus its cross-replica part, `replica_sync`:

  * "exact" (Note [exact replicas] in modular/kernels/exact_replicas.py): before the update, every copy
    of a shard gathers the other R - 1 replica groups' lookup batches, their ids (wire bytes, a
    weight with each id of a weighted table), one bag length per bag in the ids' dtype (`l`: 4
    bytes, 8 for a data-parallel table's int64 batch or a table past 2**31 rows) and the
    pooled gradients (4 bytes per output value), and replays them through its backward. Per
    shard:

        replica_sync = (ids_in * i_w + bags_out * l + bags_out * c_out * 4) * beta
        lookup      += (R - 1) * bwd / mem_bw              (the replayed backward)
        memory      += (R - 1) * (ids_in * i_w + bags_out * l + bags_out * c_out * 4)

    with `beta` the seconds to receive one byte from each of the R - 1 other replica groups,
    as the cost model's `alpha` is for the ranks of the world: a peer in the same host over
    NVLink, the others over the NIC (a rank's replica peers are G ranks apart). A
    data-parallel table gathers its own batch's ids and gradients likewise (its replay is the
    dense gradient's share, `ids_in * 2 c e` and its bags, per peer). Column pieces exchange
    row statistics for the merged batch, R times a group's ids (`stat_exchange` x R). Not
    priced: the replicas' counts gathered first (3 int64 per kernel and peer), nor any
    collective's latency (none is priced; the replay is two all-gathers per fused module and
    step, two per unfused kernel: Note [exact replicas]).
    These are the bytes modular sends: tests/planners/test_replicas.py pins them against those
    benchmarks/step_2d.py counts on gloo ranks (table-wise, column-wise, data-parallel and
    mixed plans; row-wise shards' gathers pad to the replica with most ids).
    Why exact costs more than 1D: each of the R copies of a shard must apply the global batch's
    update, so the copy receives (R - 1) groups' pooled gradients for it, and a rank holds 1/G
    of the tables, R times its 1D share. Its cross-replica bytes are about (R - 1) x (P i_w +
    4 F + 4 F c) / (P i_w + 8 F c) times what its 1D all-to-all receives (about (R - 1) / 2
    for wide pooled tables), and its backward is R times as large. All-reducing the touched
    rows' summed gradients instead receives 2 (R - 1) / R x 4 u c for the u rows the global
    batch touches, more than the replay unless u < R b / 2 for b bags a group (Note [exact
    replicas]; not at pooling 1 with uniform ids, nor at pooling 4 or more). Exact 2D wins
    only where 1D's all-to-all has grown past that: many more ranks than tables, whose pieces
    then each receive every rank's ids and send partial sums or column pieces to every rank.
  * "periodic": no per-step traffic across replica groups (each trains as a 1D job on its own
    G ranks' batches). `modular.sync_replicas` every N steps is no per-step cost and the search
    leaves it out; `Replicas.sync_seconds(synced_bytes(...))` prices one call (a ring
    all-reduce of every shard and its optimizer state, fp32, over the R replica peers), so
    that N can be chosen against the per-step prices (benchmarks/step_2d.py --priced).

A shard group must be a whole number of hosts or a whole fraction of one (G % H == 0 or
H % G == 0), so that every group sits on the hosts alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from planners.assumptions import ReplicaSync
from planners.inputs import Optimizer, Table, Topology
from planners.types import PlanError, ShardingPlan

__all__ = ["ReplicaSync", "Replicas", "group_topology", "synced_bytes"]


@dataclass(frozen=True)
class Replicas:
    """R replica groups of G ranks each, on hosts of `ranks_per_host` (the world's), and the
    sync mode: what `CostModel` needs to price a shard's cross-replica part."""

    count: int
    group_size: int
    ranks_per_host: int
    sync: ReplicaSync = ReplicaSync.EXACT

    @property
    def per_step(self) -> bool:
        """Whether the replicas exchange anything every step ("exact" with R > 1)."""
        return self.count > 1 and self.sync is ReplicaSync.EXACT

    def beta(self, intra_host_bandwidth: float, cross_host_bandwidth: float) -> float:
        """Seconds to receive one byte from each of the other R - 1 replica groups: the peers
        `G` ranks apart that share this rank's host over NVLink, the rest over the NIC."""
        same_host = 0
        if self.group_size < self.ranks_per_host:
            same_host = min(self.count, self.ranks_per_host // self.group_size) - 1
        others = self.count - 1 - same_host
        return same_host / intra_host_bandwidth + others / cross_host_bandwidth

    def sync_seconds(self, synced: float, intra_host_bandwidth: float,
                     cross_host_bandwidth: float) -> float:  # fmt: skip
        """Seconds one `modular.sync_replicas` call takes on a rank whose shards and optimizer
        state are `synced` bytes (`synced_bytes`): a ring all-reduce over its R replica peers,
        receiving 2 (R - 1) / R x `synced`, over NVLink where all R share a host, else at the
        NIC's pace."""
        if self.count == 1:
            return 0.0
        one_host = self.count * self.group_size <= self.ranks_per_host
        bandwidth = intra_host_bandwidth if one_host else cross_host_bandwidth
        return 2 * (self.count - 1) / self.count * synced / bandwidth


def synced_bytes(plan: ShardingPlan, tables: Sequence[Table], *, module_fqn: str = "",
                 optimizer: Optimizer | str = Optimizer.ROWWISE_ADAGRAD) -> list[float]:  # fmt: skip
    """Bytes each rank of `plan`'s shard group all-reduces in `modular.sync_replicas(model,
    optimizer_state=True)`: its shards of the tables of `module_fqn` and their optimizer state,
    as fp32 (the average is taken in fp32 whatever the table's dtype)."""
    optimizer = Optimizer.parse(optimizer)
    per_rank = [0.0] * plan.world_size
    placements = plan.modules[module_fqn]
    for table in tables:
        for shard in placements[table.name].shards(
            num_embeddings=table.num_embeddings, embedding_dim=table.embedding_dim,
            world_size=plan.world_size, table=table.name,
        ):  # fmt: skip
            state = optimizer.state_bytes_per_row(shard.num_cols)
            per_rank[shard.rank] += shard.num_rows * (4 * shard.num_cols + state)
    return per_rank


def group_topology(topology: Topology, replicas: int, replica_sync: ReplicaSync | str
                   ) -> tuple[Topology, Replicas]:  # fmt: skip
    """The topology of one shard group of `topology.world_size / replicas` ranks, and the
    replica layout; refuses a world size that the replica count does not divide, or a group that
    would sit on the hosts unevenly (Note [pricing replica groups])."""
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise PlanError(f"replicas must be a positive integer (replica groups), got {replicas!r}")
    sync = ReplicaSync.parse(replica_sync)
    world, host = topology.world_size, int(topology.ranks_per_host or 1)
    if world % replicas:
        near = [r for r in range(1, world + 1) if world % r == 0]
        raise PlanError(
            f"world_size {world} is not divisible by replicas {replicas}: each of the replica "
            f"groups needs the same number of ranks; use replicas in {near}"
        )
    group = world // replicas
    if group % host and host % group:
        raise PlanError(
            f"replica groups of {world} // {replicas} = {group} ranks would sit unevenly on hosts "
            f"of {host} ranks; choose replicas so that the group size is a multiple or a divisor "
            f"of {host}"
        )
    sub = Topology(group, ranks_per_host=min(host, group), device_memory=topology.device_memory,
                   host_memory=topology.host_memory,
                   device_memory_bandwidth=topology.device_memory_bandwidth,
                   intra_host_bandwidth=topology.intra_host_bandwidth,
                   cross_host_bandwidth=topology.cross_host_bandwidth,
                   reserved_fraction=topology.reserved_fraction,
                   calibration=topology.calibration)  # fmt: skip
    return sub, Replicas(replicas, group, host, sync)
