"""What a rank holds for a moment beyond the plan: `modular.shard` on a meta model, and an
unfused torch optimizer's step (pure Python: the planner never imports modular).

Note [pricing meta init]
A meta table of at most `WHOLE_TABLE_INIT_BYTES` runs its `init_fn` once on the whole table on
every rank that holds a piece of it, so that the pieces hold the unsharded module's values, and
copies the rank's pieces out of it (Note [shard init] in modular/tables/meta_init.py; the
constant is the same). Tables are filled one after the other, so a rank holds at most its
largest such table beside its shards: `RankStats.meta_init`. Not for a piece that is the whole
table (table-wise, data-parallel copies: filled in place), nor a larger table (its init_fn runs
per shard), nor a materialised model (its pieces are copied from the weights it already holds).
It is reported, not reserved: the search plans the steady state; a job that shards a meta
model on a rank with less room than `memory + meta_init` may fail at `shard`.

Note [pricing step transients]
An unfused table's torch optimizer steps each local piece (`modular.local_parameters`: one
tensor per shard, a data-parallel copy whole) one after the other on CPU (torch's default
there is not `foreach`), with temporaries as large as the piece, in its dtype:
- Adam: `denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)`: the square root and
  the quotient, both alive for a moment, 2 pieces;
- Adagrad: `std = state_sum.sqrt().add_(eps)`, 1 piece;
- SGD (no momentum): `param.add_(grad, alpha=-lr)`, none.
The step runs after backward has freed the batch's buffers (ids, pooled outputs and their
gradients), so a rank's peak is its held bytes plus the larger of its batch and the step's
transient (`RankStats.peak`), not their sum. `RankStats.step_transient` is the transient;
like `meta_init` it is reported, not reserved by the search. Measured (benchmarks/rss_growth.py,
unfused_adam, rows x100): the peak grew 60 MiB beyond the planned memory, whose largest piece
is a 36.6 MiB data-parallel copy.

Note [pricing a step's runtime]
A rank's first step allocates memory that belongs to no table and no batch and stays: torch's
autograd engine and thread pools, the process group's buffers, fbgemm's and torchrec's
workspaces. `RankStats.runtime` is that, a constant (`STEP_RUNTIME_BYTES`), in `peak` and not
in `memory` (the topology's `reserved_fraction` keeps room for the runtime, the dense model and,
on CUDA, the context). Measured on the 2-core CPU VM with gloo, torch 2.13 (benchmarks/rss_growth.py
--meta, 2 ranks, 2026-11-28): the peak RSS growth over `shard` + one step less what a rank holds
and its batch was 10.3-10.8 MiB on the configurations whose step is the peak (no meta init), and
10.5-12.9 MiB with tables a hundredth the size, so it does not scale with the tables. On a meta
model the shard's own transient (`meta_init`) is freed before the step, and what `shard` leaves
a rank is its weights and fused state (a torch optimizer makes its state when it is built, after
`shard`, and the unfused gradient buffers come with the first backward), its collision state and
caches: `RankStats.shard_peak` is that plus `meta_init` and the part of the runtime that
`shard` has allocated by then (its collectives' buffers, 5-7 MiB measured: `SHARD_RUNTIME_BYTES`
is 6), and a meta model's rank peaks at the larger of `shard_peak` and `peak`. Measured (rss_growth.py --meta --random 12 --world-size 3):
an unfused SGD rank grew 239 MiB against 332 for `held + meta_init` and 237 for `shard_peak`.
"""

from __future__ import annotations

from planners.assumptions import Optimizer
from planners.model_tables import TableSet
from planners.types import ShardingPlan, ShardingType

__all__ = ["SHARD_RUNTIME_BYTES", "STEP_RUNTIME_BYTES", "STEP_TEMPORARIES", "WHOLE_TABLE_INIT_BYTES", "meta_init_bytes",
           "step_transient_bytes"]

WHOLE_TABLE_INIT_BYTES = 1 << 30  # modular/tables/meta_init.py's
# Temporaries as large as the piece a torch optimizer's step holds at once (Note [pricing step
# transients]); fused optimizers step inside backward, on rows, and are not here.
STEP_TEMPORARIES = {Optimizer.UNFUSED_ADAM: 2, Optimizer.UNFUSED_ADAGRAD: 1}
STEP_RUNTIME_BYTES = 10 * 2**20  # what a rank's first step allocates beside its tables (Note [pricing a step's runtime])
SHARD_RUNTIME_BYTES = 6 * 2**20  # of which `shard` has allocated as it ends (the same Note)


def meta_init_bytes(plan: ShardingPlan, table_set: TableSet, world: int) -> list[float]:
    """Per rank, the largest table whose init_fn `shard` runs whole there on a meta model."""
    out = [0.0] * world
    for fqn, table in table_set:
        placement = plan.placement(fqn, table.name)
        size = float(table.weight_bytes)
        if placement.sharding_type is ShardingType.DATA_PARALLEL or size > WHOLE_TABLE_INIT_BYTES:
            continue
        for s in placement.shards(num_embeddings=table.num_embeddings, embedding_dim=table.embedding_dim,
                                  world_size=world, table=table.name):  # fmt: skip
            if (s.num_rows, s.num_cols) != (table.num_embeddings, table.embedding_dim):
                out[s.rank] = max(out[s.rank], size)
    return out


def step_transient_bytes(plan: ShardingPlan, table_set: TableSet, world: int,
                         optimizer: Optimizer) -> list[float]:  # fmt: skip
    """Per rank, what an unfused optimizer's step holds for a moment: its temporaries for the
    rank's largest local piece (Note [pricing step transients])."""
    out = [0.0] * world
    count = STEP_TEMPORARIES.get(optimizer, 0)
    if not count:
        return out
    for fqn, table in table_set:
        placement = plan.placement(fqn, table.name)
        if placement.sharding_type is ShardingType.DATA_PARALLEL:
            for r in range(world):
                out[r] = max(out[r], count * float(table.weight_bytes))
            continue
        for s in placement.shards(num_embeddings=table.num_embeddings, embedding_dim=table.embedding_dim,
                                  world_size=world, table=table.name):  # fmt: skip
            piece = float(s.num_rows * s.num_cols * table.dtype.num_bytes)
            out[s.rank] = max(out[s.rank], count * piece)
    return out
