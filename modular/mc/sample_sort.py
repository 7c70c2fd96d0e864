"""A collision table's entries moved between ranks for a checkpoint (Note [a collision table in a
checkpoint] in modular/mc/table_state.py): sorted together by (raw id, slot) into contiguous
ranges, sent to the ranks whose slots hold them, and made 1-D ShardedTensors.

Rows are int64 (entries, columns): column 0 the raw id (int64-max for an empty slot), column 1
the slot, the policy's metadata after them. Raw ids are held once each, so entries tie on the
raw id only where it is int64-max, and those are in slot order.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

from modular import comm
from modular.mc.devices import STATE_DEVICE, all_gather
from modular.mc.eviction import key_order
from modular.mc.ragged_gather import gather_rows
from modular.tables.deprecation import quiet_sharded_tensor

__all__ = ["by_key", "even_range", "sharded_column", "sort_across", "to_owners"]

# Keys each rank samples to cut the sorted entries into ranges. A sampled key stands for 1/SAMPLES
# of its rank's entries, so a cut lands within 1/SAMPLES of the whole table of its exact place,
# and a range holds its share within 2 world/SAMPLES of a share at worst (0.4% at 2 ranks, 25%
# at 128: the ranges are a save's transient buffers, not the state the ranks keep).
SAMPLES = 1024


def by_key(rows: torch.Tensor) -> torch.Tensor:
    """`rows` sorted by (raw id, slot), as torchrec sorts its table."""
    return rows[key_order(rows[:, 0], rows[:, 1])]


def _cut(rows: torch.Tensor, raw: int, slot: int) -> int:
    """How many of the sorted `rows` come before the key (raw, slot)."""
    ids = rows[:, 0].contiguous()
    key = torch.tensor([raw], dtype=torch.int64)
    lo = int(torch.searchsorted(ids, key))
    hi = int(torch.searchsorted(ids, key, right=True))
    if hi == lo:
        return lo
    return lo + int(torch.searchsorted(rows[lo:hi, 1].contiguous(), torch.tensor([slot], dtype=torch.int64)))


def _exchange(rows: torch.Tensor, sends: list[int], *, group: Optional[ProcessGroup], world: int,
              what: str) -> torch.Tensor:  # fmt: skip
    """Each rank's rows sent to the ranks by `sends` (rows per destination, in rank order); the
    rows received, in source rank order."""
    width = rows.shape[1]
    counts = all_gather(torch.tensor(sends, dtype=torch.int64), group=group, world=world, what=what)
    me = dist.get_rank(group)
    recvs = counts[:, me].tolist()
    device = comm.collective_device(group)
    out = comm.all_to_all(rows.to(device).reshape(-1), input_splits=[n * width for n in sends],
                          output_splits=[n * width for n in recvs], group=group, what=what)  # fmt: skip
    return out.to(STATE_DEVICE).view(-1, width)


def sort_across(rows: torch.Tensor, *, group: Optional[ProcessGroup], world: int, what: str) -> torch.Tensor:
    """This rank's range of every rank's entries sorted together: each rank passes its entries
    sorted by key (`by_key`); rank r gets those between the (r)th and (r+1)th of `world - 1`
    keys cut from a sample of every rank's, in sorted order (a sample sort)."""
    n = rows.shape[0]
    take = min(n, SAMPLES)
    at = ((torch.arange(take, dtype=torch.float64) + 0.5) * n / max(take, 1)).long()
    sample = by_key(gather_rows(rows[at, :2], bound=SAMPLES, group=group, world=world, what=what))
    cuts = [0]
    for j in range(1, world):
        if sample.shape[0] == 0:
            cuts.append(n)
            continue
        raw, slot = sample[min(sample.shape[0] * j // world, sample.shape[0] - 1)].tolist()
        cuts.append(_cut(rows, raw, slot))
    cuts.append(n)
    sends = [cuts[j + 1] - cuts[j] for j in range(world)]
    return by_key(_exchange(rows, sends, group=group, world=world, what=what))


def to_owners(rows: torch.Tensor, owners: torch.Tensor, *, group: Optional[ProcessGroup], world: int,
              what: str) -> torch.Tensor:  # fmt: skip
    """The rows each rank sent this one: row i goes to rank `owners[i]` (none where it is `world`)."""
    sends = torch.bincount(owners, minlength=world + 1)[:world].tolist()
    order = torch.argsort(owners, stable=True)[: sum(sends)]
    return _exchange(rows[order], sends, group=group, world=world, what=what)


def even_range(total: int, rank: int, world: int) -> tuple[int, int]:
    """(offset, length) of rank's even share of `total` positions."""
    lo, hi = total * rank // world, total * (rank + 1) // world
    return lo, hi - lo


def sharded_column(column: torch.Tensor, lengths: list[int], *, group: Optional[ProcessGroup]) -> ShardedTensor:
    """A 1-D ShardedTensor of `sum(lengths)` int64 entries whose rank r holds the `lengths[r]`
    after those of the ranks before it; `column` is this rank's. No collective: every rank
    passes the same `lengths`."""
    me = dist.get_rank(group)
    shards, local, offset = [], [], 0
    for r, length in enumerate(lengths):
        if length:  # a rank without entries offers DCP no chunk
            placement = f"rank:{dist.get_global_rank(group, r) if group is not None else r}/{STATE_DEVICE}"
            meta = ShardMetadata(shard_offsets=[offset], shard_sizes=[length], placement=placement)
            shards.append(meta)
            if r == me:
                local.append(Shard(tensor=column, metadata=meta))
        offset += length
    properties = TensorProperties(dtype=column.dtype, layout=torch.strided, requires_grad=False,
                                  memory_format=torch.contiguous_format, pin_memory=False)  # fmt: skip
    metadata = ShardedTensorMetadata(shards_metadata=shards, size=torch.Size([offset]), tensor_properties=properties)
    with quiet_sharded_tensor():
        return ShardedTensor._init_from_local_shards_and_global_metadata(local, metadata, process_group=group)
