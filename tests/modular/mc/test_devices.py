"""The split collision state's collectives on a gloo group (Note [collision state on a GPU rank]
in modular/mc/devices.py): the CPU path is modular.comm's, with no copy; the results land on
the state's device. The NCCL path (a copy to the current CUDA device and back) runs in
tests/gpu/test_cuda_mc.py."""

from __future__ import annotations

import torch
import torch.distributed as dist

from modular.comm import collective_device
from modular.mc.devices import STATE_DEVICE, all_gather, all_reduce, to_state
from tests.dist import run_on_ranks


def _gloo_collectives() -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    assert collective_device(None) == torch.device("cpu") == STATE_DEVICE
    mine = torch.arange(3, dtype=torch.int64) + 10 * rank
    assert to_state(mine) is mine, "a CPU tensor is not copied onto the CPU state"
    assert to_state(mine, torch.int32).dtype == torch.int32
    got = all_gather(mine, group=None, world=world, what="a test gather")
    assert got.device == STATE_DEVICE
    assert torch.equal(got, torch.stack([torch.arange(3) + 10 * r for r in range(world)]))
    slots = torch.tensor([rank, -1, 5 - rank], dtype=torch.int64)
    pointer = slots.data_ptr()
    all_reduce(slots, group=None, what="a test reduce", op=dist.ReduceOp.MAX)
    assert slots.data_ptr() == pointer, "the CPU reduce is not in place"
    assert slots.tolist() == [world - 1, -1, 5]


def test_the_collision_collectives_on_a_gloo_group_are_modular_comms_in_place_without_copies() -> None:
    run_on_ranks(2, _gloo_collectives)
