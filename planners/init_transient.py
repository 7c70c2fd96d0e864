"""What `modular.shard` holds for a moment beyond the plan when the model is on meta (pure
Python: the planner never imports modular).

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
"""

from __future__ import annotations

from planners.model_tables import TableSet
from planners.types import ShardingPlan, ShardingType

__all__ = ["WHOLE_TABLE_INIT_BYTES", "meta_init_bytes"]

WHOLE_TABLE_INIT_BYTES = 1 << 30  # modular/tables/meta_init.py's


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
