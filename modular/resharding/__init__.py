"""Resharding in memory: `modular.reshard(model, plan)` moves sharded collections to a new plan
at the same world size, a change of the step's layout between two steps (docs/design.md,
docs/resharding.md). `blocks.py` says which blocks of which shards move (pure), `moves.py` reads
and writes them for one module, `exchange.py` holds the collectives, `call.py` the public call.

# Note [resharding in memory]
A new plan changes where some tables live. Through a checkpoint, every table makes a round trip
through storage; `reshard` moves only what changes rank, in one step per module:

  * Agree. The plan is checked against the sharded modules and its digest agreed on every rank
    (Note [agreeing on the plan]), so a plan for another world size, another module or other
    tables raises ShardingError everywhere before anything moves. Modules whose placements do
    not change are left alone (their tensors, and optimizers over them, stay valid).
  * Cut. For each changed module, every table's new shards are cut into blocks (rows x
    columns), each the intersection of a new shard with an old one (`blocks.py`): an old
    plan's shards cover the table once, and data-parallel replicas are one rectangle that
    every rank holds. A block is read from the new shard's own rank where that rank holds it
    (a replica, a shard that stays, a row range it keeps), so it is copied there and never
    sent. A fused optimizer's state follows its rows: per-element state (Adagrad's `sum`, Adam's
    moments) in the weights' blocks; per-row state (row-wise Adagrad's `row_sum`,
    partial_rowwise's `exp_avg_sq`) in row blocks, one per row range for all of a rank's column
    pieces (each keeps the whole row's statistic, Note [row statistics across column shards]);
    column_wise_statistic="per_shard" pieces keep their own, which only the same columns take
    (another cut is refused naming the table). The Adam family's step count is the module's.
  * Move. Every rank packs the blocks it sends into one buffer per dtype (the table dtypes, and
    FP32 for the state), joins one small agreement (a rank that failed to pack, e.g. out of
    memory, raises on every rank before the exchange), then one `all_to_all_single` per dtype
    with element splits (gloo has no uneven all_to_all) moves them; the send buffers are freed
    before anything is built.
  * Build. Each new module is built by the class `shard` uses, on the new `RankLayout`, with
    the old module's options; in place of shard init (which would copy or re-initialise every
    shard and broadcast the replicas) its shards are filled from the received and kept blocks
    (`lifecycle.set_shard_fill`, taken by `init_shards`), followed by an agreement, since the
    tables' ShardedTensors are made collectively next. The optimizer state is written once the
    module is built, and a last agreement says every rank has built every module.
  * Swap. Only then are the old modules replaced, at every name they are registered under, and
    their tensors retired (Note [lifecycle state]): an optimizer over the old `local_parameters`
    raises at its next step, naming reshard. A failure before the swap raises on every rank
    (ShardingError naming the rank, or CollectiveError for a peer that died: Note [a failed
    peer]) and leaves every old module as it was; the old modules are only read.

Memory: each rank holds, beside the old modules, its send and receive buffers (the bytes it
sends and receives) and the new modules' shards, which are new kernels' buffers (fbgemm's kernels
own their flat buffers, so a shard that stays is copied once into the new kernel rather than
shared); no full table is ever made. docs/benchmarks.md measures it against checkpoint save and
load. Optimizer state of torch optimizers (unfused tables) does not move: they are rebuilt. A
prefetched batch of a rebuilt module is dropped with the old module's prefetcher (Note
[prefetched input dist]). Gradients of unfused tables are not moved either: reshard between a
step's `optimizer.step()` and the next forward.
"""

from modular.resharding.call import reshard

__all__ = ["reshard"]
