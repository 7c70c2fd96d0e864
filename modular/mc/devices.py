"""The devices of the split collision state and of its collectives (Note [collision state on a
GPU rank]).

Note [collision state on a GPU rank]
A model on a CUDA device feeds its managed-collision collection a KeyedJaggedTensor whose ids
live on that device; torchrec's unsharded MCH module keeps its state in buffers on the model's
device and remaps there. The split state (Note [sharded managed collisions] in
modular/mc/sharded_mch.py) stays on the CPU on every rank, CUDA or not: its work per call is
many small steps whose sizes are read on the host (`int(...)`, `tolist()`: the history's cut,
the bounds of every gather, the shard's merges), each a device sync on a GPU, over int64 rows of
a few slots per rank; on the host they cost what they cost on a CPU rank, and the state takes no
GPU memory (4 int64 per slot). What crosses to the host per call is the batch's ids of the MC
tables (one copy to the CPU where they enter: the check's fold, the history, the remap) and the
remapped ids back (one copy, on the input's device and dtype, as torchrec's remap returns them).

The collectives run where the group runs them: `collective_device(group)` (modular/comm.py),
the current CUDA device under NCCL, else the CPU (gloo; gloo also takes CUDA tensors, but the
state's tensors are on the CPU already). `all_gather` / `all_reduce` here move a tensor there
and the result back to the CPU only when the two differ: on a gloo group (CPU ranks, or CUDA
ranks sharing a GPU under gloo) they are modular.comm's, the same collectives and bytes. The
replicated path (Note [managed collisions over the global batch] in modular/managed_collisions.py)
gathers with them too and hands torchrec's remap the global batch on the input's device.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from modular import comm
from modular.comm import collective_device

__all__ = ["STATE_DEVICE", "all_gather", "all_reduce", "to_state"]

STATE_DEVICE = torch.device("cpu")  # where the split collision state lives, on every rank


def to_state(tensor: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """`tensor` on the state's device (a copy only when it is elsewhere), as `dtype` if given."""
    return tensor.to(STATE_DEVICE, dtype if dtype is not None else tensor.dtype)


def all_gather(tensor: torch.Tensor, *, group: Optional[ProcessGroup], world: int, what: str) -> torch.Tensor:
    """modular.comm's all_gather on the group's collective device; the result on the state's
    device. On a gloo group with a CPU tensor: modular.comm's, no copy."""
    device = collective_device(group)
    out = comm.all_gather(tensor.to(device), group=group, world=world, what=what)
    return out.to(STATE_DEVICE)


def all_reduce(tensor: torch.Tensor, *, group: Optional[ProcessGroup], what: str,
               op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:  # fmt: skip
    """modular.comm's all_reduce of `tensor` in place, through the group's collective device
    when `tensor` is elsewhere (one copy there and one back)."""
    device = collective_device(group)
    if tensor.device == device:
        comm.all_reduce(tensor, group=group, what=what, op=op)
        return
    moved = tensor.to(device)
    comm.all_reduce(moved, group=group, what=what, op=op)
    tensor.copy_(moved)
