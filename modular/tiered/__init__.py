"""Tables larger than the memory that holds them: a cache of hot rows over a slower tier (issue 47).

# Note [tiered tables]
A table whose placement has a `cache_load_factor` has each of its shards on a tier. The shard's
rows and their fused optimizer state live in a backing store (`RowStore`,
modular/tiered/store.py: on CPU, float32 files under `shard(..., tier_dir=)`, mapped into
memory), and a cache of `cache_rows` slots lives in the memory the kernels use: the kernel the
group would have had, sized (cache_rows, cols) (`TieredKernel`, modular/tiered/kernel.py;
fbgemm's fused TBE, or the Adam family's emulation). Tiered shards get kernel groups of their
own (`Route.tiered`). Before each lookup a step's unique ids of each table are given slots
(`SlotMap`, modular/tiered/slots.py, LRU or LFU replacement among the slots the step does not
use): evicted rows that an update touched are written back first, missing rows are read in,
and the kernel runs on the cache with ids renumbered to slots. The update then touches the
slots' rows and state exactly as the resident kernel touches the rows': a fused update of a row
reads only that row, its state and its gradient, and the gradient of a row sums its positions
in the batch in the same order whatever the row's number. So a tiered model trains bit for bit
as the resident one (tests/modular/tiered: every sharding type that holds rows, worlds 1-3,
SGD, both Adagrads and the Adam family, caches of 1% to 100%).

A step needs all its distinct rows of a table in the cache at once. One that needs more slots
than the cache has grows that cache (a warning names the table) rather than fail on the one
rank that saw it, which would leave its peers waiting in a collective.

The module's table weights and the fused optimizer's state are the stores' tensors, so
`named_parameters()`, `state_dict()` and the optimizer's state name the unsharded tables as
always. They are current only after `TieredKernel.sync` (dirty rows written back, caches
emptied), which every reader and writer of them runs first: `state_dict()` and
`load_state_dict()` (hooks, modular/tiered/module_hooks.py, so DCP and `modular.checkpoint`
too), `local_shard_views()` (export, unshard, reshard) and the fused optimizer's state. A value
read from a table's weight directly between steps may be stale for rows still in a cache.

`modular.prefetch` brings a batch's rows into the caches ahead of its step (Note [tiered
prefetch] in modular/tiered/module_hooks.py). What `shard` cannot build yet it refuses on every
rank, naming the table (modular/tiered/tier_plan.py). docs/tiered_tables.md has the costs.
"""

from modular.tiered.kernel import TieredKernel, TierStats
from modular.tiered.slots import SlotMap
from modular.tiered.store import RowStore

__all__ = ["RowStore", "SlotMap", "TierStats", "TieredKernel"]
