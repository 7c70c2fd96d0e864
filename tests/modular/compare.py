"""Comparing a sharded model with its unsharded reference: tensors, optimizer state, tables.

Every comparison names what it compares (`what`) in its message. Tolerances are `ATOL` (fp32);
a sharded model's tables are compared piece by piece (`local_blocks`: this rank's shards, or its
whole data-parallel copy), gathered to one rank (`gather_table`), or assembled on every rank (`full_value`,
a collective). Gradients follow Note [grad scaling across ranks]: the reference's loss is the
mean over ranks of the per-rank losses, so its gradients equal the sharded model's.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor

ATOL = 1e-5


def close(actual: torch.Tensor | None, expected: torch.Tensor, what: str) -> float:
    """assert_close at ATOL (fp32), with `what` in the message; returns the max abs difference."""
    if actual is None:
        raise AssertionError(f"{what}: got None, expected a tensor of shape {tuple(expected.shape)}")
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0, msg=lambda m: f"{what}: {m}")
    return float((actual - expected).detach().abs().max()) if expected.numel() else 0.0


def state_error(got: torch.Tensor, want: torch.Tensor, what: str, compare: Callable[..., float] = close) -> float:
    """`compare`s one optimizer state entry (a ShardedTensor's local shards, or a plain tensor)
    with the unsharded model's state `want`; returns the largest difference."""
    if not isinstance(got, ShardedTensor):
        return compare(got, want, what)
    worst = 0.0
    for s in got.local_shards():
        where = tuple(slice(o, o + n) for o, n in zip(s.metadata.shard_offsets, s.metadata.shard_sizes))
        worst = max(worst, compare(s.tensor, want[where], what))
    return worst


def local_blocks(param: torch.Tensor) -> list[tuple[torch.Tensor, slice, slice]]:
    """(tensor, rows, cols) of each piece of a table this rank holds: shards, or a full
    data-parallel copy."""
    if isinstance(param, ShardedTensor):
        out = []
        for s in param.local_shards():
            (r0, c0), (nr, nc) = s.metadata.shard_offsets, s.metadata.shard_sizes
            out.append((s.tensor, slice(r0, r0 + nr), slice(c0, c0 + nc)))
        return out
    rows, cols = param.shape
    return [(param, slice(0, rows), slice(0, cols))]


def gather_table(param: torch.Tensor, dst: int) -> torch.Tensor | None:
    """The full table on rank `dst` (None elsewhere); a data-parallel copy is returned as it is."""
    if not isinstance(param, ShardedTensor):
        return param.detach().clone() if dist.get_rank() == dst else None
    full = torch.empty(tuple(param.size())) if dist.get_rank() == dst else None
    param.gather(dst, full)
    return full



def full_value(p: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank: gathers ShardedTensors and DTensors (collective)."""
    if isinstance(p, DTensor):
        return p.full_tensor()
    if isinstance(p, ShardedTensor):
        full = torch.zeros(p.size())
        for t, rows, cols in local_blocks(p):
            full[rows, cols] = t.detach()
        dist.all_reduce(full)  # shards are disjoint: the sum assembles the table
        return full
    return p.detach()


def assert_weights_match(model: nn.Module, ref: nn.Module, what: str) -> None:
    refs = dict(ref.named_parameters())
    names = [n for n, _ in model.named_parameters()]
    assert names == list(refs), f"{what}: parameter names {names} != reference {list(refs)}"
    for name, p in model.named_parameters():
        torch.testing.assert_close(
            full_value(p), refs[name].detach(), atol=ATOL, rtol=0, msg=lambda m: f"{what}: {name}: {m}"
        )


def assert_grads_match(model: nn.Module, ref: nn.Module, what: str) -> None:
    """Each rank's gradients against the matching slice of the reference's (collective for DTensors)."""
    refs = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        expected = refs[name].grad
        if isinstance(p, ShardedTensor):
            for t, rows, cols in local_blocks(p):
                torch.testing.assert_close(t.grad, expected[rows, cols], atol=ATOL, rtol=0,
                                           msg=lambda m: f"{what}: grad of {name} at ({rows.start}, {cols.start}): {m}")
        else:
            got = p.grad.full_tensor() if isinstance(p, DTensor) else p.grad
            torch.testing.assert_close(got, expected, atol=ATOL, rtol=0, msg=lambda m: f"{what}: grad of {name}: {m}")



def backward_and_step(losses: tuple[torch.Tensor, ...], optimizers: tuple) -> None:
    """Backward of each loss, then each optimizer's step and zero_grad (None: a rank holding no
    table, or fused tables that step in backward)."""
    for loss in losses:
        loss.backward()
    for o in optimizers:
        if o is not None:
            o.step()
            o.zero_grad()
