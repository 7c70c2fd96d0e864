"""Resharding in memory: `modular.reshard(model, plan)` moves sharded collections to a new plan
at the same world size, a change of the step's layout between two steps (docs/design.md,
docs/resharding.md). `blocks.py` says which blocks of which shards move (pure), `moves.py` reads
and writes them for one module, `adopt.py` says which kernels stay as they are, `rounds.py`
holds the collectives, `call.py` the public call.

# Note [resharding in memory]
A new plan changes where some tables live. Through a checkpoint, every table makes a round trip
through storage; `reshard` moves only what changes rank, in one step per module:

  * Agree. The plan is checked against the sharded modules and its digest agreed on every rank
    (Note [agreeing on the plan]), so a plan for another world size, another module or other
    tables raises ShardingError everywhere before anything moves. Modules whose placements do
    not change are left alone (their tensors, and optimizers over them, stay valid).
  * Cut. For each changed module, every table's new shards are cut into blocks (rows x
    columns), each the intersection of a new shard with an old one (`blocks.py`): an old
    plan's shards cover the table once, and data-parallel copies are one rectangle that
    every rank holds. A block is read from the new shard's own rank where that rank holds it
    (a data-parallel copy, a shard that stays, a row range it keeps), so it is copied there, never
    sent. A fused optimizer's state follows its rows: per-element state (Adagrad's `sum`, Adam's
    moments) in the weights' blocks; per-row state (row-wise Adagrad's `row_sum`,
    partial_rowwise's `exp_avg_sq`) in row blocks, one per row range for all of a rank's column
    pieces (each keeps the whole row's statistic, Note [row statistics across column shards]);
    column_wise_statistic="per_shard" pieces keep their own, which only the same columns take
    (another cut is refused naming the table). The Adam family's step count is the module's.
  * Build. Each new module is built by the class `shard` uses, on the new `RankLayout`, with
    the old module's options; in place of shard init (which would copy or re-initialise every
    shard and broadcast the data-parallel copies) its shards are left to the blocks
    (the `fill` the sharded class passes to `LocalShards`), and their buffers take memory only as
    blocks are written into them (Note [reshard memory] in memory.py). A local kernel whose
    shards stay as they are on this rank is adopted instead, buffers, optimizer state and step
    count with it (`adopt.py`): nothing of it is built, copied or given back. The tables'
    ShardedTensors are made collectively here, before anything moves.
  * Move. The blocks that change rank are cut by rows into rounds (`rounds.rounds`), one dtype
    each (the table dtypes, and FP32 for the state): per round every rank packs what it sends,
    joins one small agreement (a rank that failed to pack, e.g. out of memory, or to write an
    earlier round, raises on every rank before the next collective), then one
    `all_to_all_single` with element splits (gloo has no uneven all_to_all) moves them and each
    rank writes what it received into its new shards. Between two ranks a round carries at most
    the smaller of their largest moved blocks over 2 x (world - 1) bytes (within 1-64 MiB, and
    at least one row), so one round's send and receive buffers together hold at most a rank's
    largest moved block. The Adam family's step count is copied.
  * Commit. A last agreement says that every rank has written every block it receives (and
    found the old tensor of every block it keeps, `moves.kept_blocks`). Until here the old
    modules were only read: a failure raises on every rank (ShardingError naming the rank and
    what it was doing, or CollectiveError for a peer that died: Note [a failed peer]) and
    leaves every old module as it was.
  * Swap. The old modules are replaced, at every name they are registered under, and their
    tensors retired (Note [lifecycle state]), but for those adopted fused kernels still hold
    (an adopted dense kernel has new parameter objects): an optimizer over the old
    `local_parameters` raises at its next step on every rank, naming reshard. The mover then
    drops the old modules: it holds their shards only through tensors of its own (`Kept`), so
    that what else still holds them shows (Note [reshard memory]).
  * Keep. Each rank copies the blocks it keeps (outside adopted kernels) into the new ones, in row
    chunks, giving each chunk of an old shard back to the OS once copied, and old shards that
    were sent away whole; an old shard that something outside the mover still holds (a
    `state_dict()`, a view, the old parameters, an optimizer over them, the last loss's graph)
    is kept whole instead, so that it reads what it read, and one warning per reshard names its
    tables and the bytes over the bound (Note [reshard memory]). Only local copies are left,
    which nothing but a bug or the process dying can fail; if one does, that rank raises
    ShardingError saying its new shards are partly filled and its old ones partly given back,
    and that the last checkpoint must be loaded (every rank holds the new plan).

2D (`shard(..., mesh=mesh)`): the plan is for the shard group, and every replica group makes the
same moves inside its own shard group (the all-to-alls run over `module.process_group`, the shard
group), into new modules whose `RankLayout`s keep the old `replicas` (so their sync, and DTensor
tables' Replicate() on "replicate"); nothing crosses the replica axis, whose copies stay
bit-identical under exact sync and each group's own under periodic sync. The plan's agreement and
every `agree` above run over every rank of the world, so a failure in any replica group raises
everywhere before the commit.

Memory: beside its old shards a rank holds at most the bytes it receives plus the larger of one
round's buffers (at most its largest moved block, unless the 1 MiB floor is more) and one kept
chunk (1 MiB; none where every kernel it keeps is adopted), on CPU under Linux, where nothing
outside the model holds the old shards (Note [reshard memory]); off CPU, the old shards of the
kernels a rank rebuilds can pass through host memory instead, freed on the device before the new
ones are built (`host_staging.py`; off until a GPU session has run it); no full table is ever made. docs/benchmarks.md measures it against
checkpoint save and load. Optimizer state of torch optimizers (unfused tables) does not move:
they are rebuilt. A prefetched batch of a rebuilt module is dropped with the old module's
prefetcher (Note [prefetched input dist]). Gradients of unfused tables are not moved either: reshard between a
step's `optimizer.step()` and the next forward.
"""

from modular.resharding.call import reshard

__all__ = ["reshard"]
