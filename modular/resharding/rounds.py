"""The reshard's collectives: its blocks cut into rounds, packed per dtype and round and sent with
one all_to_all_single each (gloo has no uneven all_to_all), and the agreements that make a
failure on one rank raise on every rank (Note [resharding in memory] in
modular/resharding/__init__.py)."""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from modular.comm import all_gather_bytes, all_to_all
from modular.errors import ShardingError
from modular.resharding.memory import scratch
from modular.resharding.moves import Item

__all__ = ["Traffic", "agree", "exchange", "plan_traffic", "rounds"]

# Bytes one rank sends another in one round: half its largest moved block over its peers (so that a
# round's send and receive buffers together hold at most that block), within these bounds.
ROUND_MIN_BYTES = 1 << 20
ROUND_MAX_BYTES = 64 << 20


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


def rounds(items: list[Item], world: int) -> list[list[Item]]:
    """The blocks that change rank, cut by rows into rounds of one dtype each, the same list on
    every rank. Between two ranks a round carries at most a budget of bytes: the smaller of the
    two ranks' largest moved blocks over 2 x (world - 1), within [ROUND_MIN_BYTES,
    ROUND_MAX_BYTES] (and at least one row), so a rank's send and receive buffers of one round
    hold at most its largest moved block together (Note [reshard memory] in memory.py). Blocks
    a rank keeps are not in any round: they are copied on the rank."""
    moving = [it for it in items if it.block.moves]
    largest = [0] * world
    for it in moving:
        size = it.block.numel * _itemsize(it.dtype)
        for rank in (it.block.src, it.block.dst):
            largest[rank] = max(largest[rank], size)
    dtypes: list[torch.dtype] = []
    for it in moving:
        if it.dtype not in dtypes:
            dtypes.append(it.dtype)
    out: list[list[Item]] = []
    for dtype in dtypes:
        placed: dict[tuple[int, int], tuple[int, int]] = {}  # (src, dst) -> (round, bytes in it)
        per_round: list[list[Item]] = []
        for it in (it for it in moving if it.dtype == dtype):
            pair = (it.block.src, it.block.dst)
            share = min(largest[pair[0]], largest[pair[1]]) // (2 * max(1, world - 1))
            budget = min(ROUND_MAX_BYTES, max(ROUND_MIN_BYTES, share))
            row = it.block.numel // (it.block.rows[1] - it.block.rows[0]) * _itemsize(dtype)
            step = max(1, budget // row)
            for r0 in range(it.block.rows[0], it.block.rows[1], step):
                r1 = min(r0 + step, it.block.rows[1])
                at, used = placed.get(pair, (0, 0))
                if used and used + (r1 - r0) * row > budget:
                    at, used = at + 1, 0
                placed[pair] = (at, used + (r1 - r0) * row)
                while len(per_round) <= at:
                    per_round.append([])
                block = dataclasses.replace(it.block, rows=(r0, r1))
                per_round[at].append(dataclasses.replace(it, block=block))
        out.extend(per_round)
    return out


def pack(
    traffic: Traffic, items: list[Item], read: Callable[[Item], torch.Tensor], device: torch.device
) -> torch.Tensor:
    """The send buffer of one dtype: each block this rank sends, copied once, back to back."""
    buffer = scratch(sum(traffic.input_splits), traffic.dtype, device)
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
        out=scratch(sum(traffic.output_splits), traffic.dtype, send.device),
    )  # fmt: skip
    out, at = {}, 0
    for i in traffic.receives:
        block = items[i].block
        out[i] = received[at : at + block.numel].view(block.shape)
        at += block.numel
    return out


def agree(failure: Optional[BaseException], what: str, group: Optional[ProcessGroup]) -> None:
    """One small all-gather that every rank joins after a step that may fail on some ranks only:
    if any failed, every rank raises ShardingError naming the first failing rank, what it was
    doing (`what`, this rank's words: "while filling the new shards of module 'ebc'") and its
    error, before the next collective could leave a peer waiting (the model still holds its old
    shards). The failing rank's error is the ShardingError's cause."""
    flag = b"\x00" if failure is None else b"\x01"
    flags = all_gather_bytes(flag, width=1, group=group)
    failed = [r for r, f in enumerate(flags) if f == b"\x01"]
    if not failed:
        return
    messages: list = [None] * dist.get_world_size(group)
    mine = None if failure is None else f"{what}: {type(failure).__name__}: {failure}"
    dist.all_gather_object(messages, mine, group=group)
    error = ShardingError(
        f"modular.reshard failed on rank {failed[0]} {messages[failed[0]]} (ranks {failed} "
        "failed; every rank stops, and the model keeps its old shards on every rank)"
    )
    raise error from failure
