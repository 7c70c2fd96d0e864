"""The reshard's collectives: its blocks packed per dtype and sent with one all_to_all_single each
(gloo has no uneven all_to_all), and the agreements that make a failure on one rank raise on
every rank (Note [resharding in memory] in modular/resharding/__init__.py)."""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from modular.comm import all_gather_bytes, all_to_all
from modular.errors import ShardingError
from modular.resharding.moves import Item

__all__ = ["Traffic", "agree", "exchange", "plan_traffic"]


@dataclasses.dataclass(frozen=True)
class Traffic:
    """What one dtype's all-to-all carries on this rank: the items it sends (by destination
    rank, in item order) and receives (by source rank, in item order), as indices into the
    reshard's items, and the element splits."""

    dtype: torch.dtype
    sends: tuple[int, ...]
    receives: tuple[int, ...]
    input_splits: tuple[int, ...]
    output_splits: tuple[int, ...]

    @property
    def bytes_sent(self) -> int:
        return sum(self.input_splits) * _itemsize(self.dtype)

    @property
    def bytes_received(self) -> int:
        return sum(self.output_splits) * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def plan_traffic(items: list[Item], rank: int, world: int) -> list[Traffic]:
    """One `Traffic` per dtype that any rank sends (the same dtypes on every rank, in the order
    they first appear in `items`, which every rank lists alike); blocks a rank keeps are not in
    it: they are copied on the rank."""
    dtypes: list[torch.dtype] = []
    for item in items:
        if item.block.moves and item.dtype not in dtypes:
            dtypes.append(item.dtype)
    out = []
    for dtype in dtypes:
        sends = [i for i, it in enumerate(items) if it.dtype == dtype and it.block.moves and it.block.src == rank]
        receives = [i for i, it in enumerate(items) if it.dtype == dtype and it.block.moves and it.block.dst == rank]
        sends.sort(key=lambda i: items[i].block.dst)  # stable: item order within a peer
        receives.sort(key=lambda i: items[i].block.src)
        input_splits, output_splits = [0] * world, [0] * world
        for i in sends:
            input_splits[items[i].block.dst] += items[i].block.numel
        for i in receives:
            output_splits[items[i].block.src] += items[i].block.numel
        out.append(Traffic(dtype, tuple(sends), tuple(receives), tuple(input_splits), tuple(output_splits)))
    return out


def pack(
    traffic: Traffic, items: list[Item], read: Callable[[Item], torch.Tensor], device: torch.device
) -> torch.Tensor:
    """The send buffer of one dtype: each block this rank sends, copied once, back to back."""
    buffer = torch.empty(sum(traffic.input_splits), dtype=traffic.dtype, device=device)
    at = 0
    for i in traffic.sends:
        block = items[i].block
        buffer[at : at + block.numel].view(block.shape).copy_(read(items[i]))
        at += block.numel
    return buffer


def exchange(
    traffic: Traffic, items: list[Item], send: torch.Tensor, group: Optional[ProcessGroup]
) -> dict[int, torch.Tensor]:
    """Sends one dtype's blocks (`send`, from `pack`); returns each received item's block, by
    item index, as a view of one receive buffer."""
    received = all_to_all(
        send, input_splits=list(traffic.input_splits), output_splits=list(traffic.output_splits),
        group=group, what=f"the reshard's all-to-all of {traffic.dtype} blocks",
    )  # fmt: skip
    out, at = {}, 0
    for i in traffic.receives:
        block = items[i].block
        out[i] = received[at : at + block.numel].view(block.shape)
        at += block.numel
    return out


def agree(failure: Optional[BaseException], what: str, group: Optional[ProcessGroup]) -> None:
    """One small all-gather that every rank joins after a step that may fail on some ranks only:
    if any failed, every rank raises ShardingError naming the first failing rank and its error,
    before the next collective could leave a peer waiting (the model still holds its old
    shards). The failing rank's error is the ShardingError's cause."""
    flag = b"\x00" if failure is None else b"\x01"
    flags = all_gather_bytes(flag, width=1, group=group)
    failed = [r for r, f in enumerate(flags) if f == b"\x01"]
    if not failed:
        return
    messages: list = [None] * dist.get_world_size(group)
    mine = None if failure is None else f"{type(failure).__name__}: {failure}"
    dist.all_gather_object(messages, mine, group=group)
    error = ShardingError(
        f"modular.reshard failed {what} on rank {failed[0]}: {messages[failed[0]]} (ranks "
        f"{failed} failed; every rank stops, and the model keeps its old shards on every rank)"
    )
    raise error from failure
