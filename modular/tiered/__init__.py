"""Tables larger than the memory that holds them: a cache of hot rows over a slower tier (issue 47).

# Note [tiered tables]
A tiered shard keeps all its rows and their fused optimizer state in a backing store (`RowStore`,
modular/tiered/store.py: on CPU a float32 file, one record per row, the row's weights then its
state, so that a row and its state move together), and a cache of `cache_rows` slots in the
memory the kernel uses: fbgemm's fused TBE sized (cache_rows, cols) (`TieredKernel`,
modular/tiered/kernel.py). Before each lookup the step's unique ids of each table are given slots
(`SlotMap`, modular/tiered/slots.py, LRU or LFU replacement among the slots the step does not
use): evicted rows that the kernel may have updated are written back first, missing rows are
read in, and the kernel runs on the cache with ids renumbered to slots. The fused update then
touches the slots' rows and state exactly as the resident kernel touches the rows': fbgemm's
per-row update reads only the row, its state and its gradient, and the gradient of a row sums
its positions in the batch in the same order whatever the row's number (tests/modular/tiered
checks this bit for bit against the resident kernel, caches of 1% to 100%). A step needs all
its unique ids in the cache at once: a step with more unique ids of a table than its cache has
slots raises InputError naming the table (raise `cache_load_factor`). Not done yet: the Adam
family and emulated kernels under a tier, checkpoints streaming from the store, the planner's
pricing of misses, CUDA (host-memory store); docs/tiered_tables.md lists them.
"""

from modular.tiered.kernel import TieredKernel, TierStats
from modular.tiered.slots import SlotMap
from modular.tiered.store import RowStore

__all__ = ["RowStore", "SlotMap", "TierStats", "TieredKernel"]
