"""`modular.clip_grad_norm_`: gradient clipping by the global norm of a model sharded every way.

# Note [one global grad norm]
The norm must be that of the unsharded model's gradients, so every element is counted exactly
once over all ranks. The gradients fall into disjoint parts, each reduced over the ranks that
hold different pieces of it and no others:
- sharded tables (row/column/table-wise, table-row-wise): each rank holds distinct blocks, so the
  local sums are all-reduced over the module's process group;
- FSDP2 DTensor gradients: the local sums are all-reduced over each mesh dimension on which the
  parameter is sharded (the shard dimension only under HSDP: the replicate dimension holds copies);
- data-parallel tables' copies and plain parameters (e.g. under DDP): every rank holds the same
  full gradient after its all-reduce, so each rank counts its own copy once, with no collective.
For a p-norm the parts are sums of |g|^p; for inf they are maxima. Adding the parts gives the same
total on every rank, with one small all-reduce per process group or mesh dimension.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor, Shard
from torch.nn.utils import get_total_norm

from modular.comm import all_reduce
from modular.sharded_types import SHARDED_COLLECTIONS
from modular.tables.forms import is_sharded, local_pieces

__all__ = ["clip_grad_norm_"]

LOW_PRECISION = (torch.float16, torch.bfloat16)


@torch.no_grad()
def clip_grad_norm_(
    model: nn.Module, max_norm: float, norm_type: Union[float, int, str] = 2.0
) -> torch.Tensor:
    """Clips every gradient of `model` by their global norm, like `torch.nn.utils.clip_grad_norm_`
    on the unsharded model; returns that total norm (a 0-dim tensor, the same on every rank).

    Call it on every rank (it runs collectives) between `backward()` and `optimizer.step()`:

        loss.backward()
        modular.clip_grad_norm_(model, max_norm=1.0)
        opt.step()

    It covers the local shards of sharded tables (each element counted once across ranks), the
    data-parallel tables' copies (counted once, not once per rank), FSDP2's DTensor gradients and
    plain parameters, which must hold the same gradient on every rank, as DDP leaves them; see
    Note [one global grad norm]. `norm_type` is a positive p or `inf`. Tables fused with their
    optimizer (`modular.fuse_optimizer`) are updated inside backward and have no gradients: they
    are neither counted in the norm nor clipped, so the norm is that of the other gradients.
    Gradients scale by `max_norm / (total + 1e-6)` when that is below 1, as in torch.
    """
    p = float(norm_type)
    if not p > 0:
        raise ValueError(f"norm_type must be a positive number or inf, got {norm_type!r}")
    is_inf = math.isinf(p)
    reduce_op = dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM

    table_ids: set[int] = set()
    by_group: dict[Optional[ProcessGroup], tuple[torch.device, list[torch.Tensor]]] = {}
    same_everywhere: list[torch.Tensor] = []
    for _, m in model.named_modules():
        if not isinstance(m, SHARDED_COLLECTIONS):
            continue
        for w in m.parameters():
            table_ids.add(id(w))
            if is_sharded(w):
                # Keyed by the table, not by its gradients, which a rank may lack: every rank must
                # run the same collectives. A module with no ShardedTensor (all data-parallel, or
                # a single-process fused EBC) runs none.
                _, shard_grads = by_group.setdefault(m.process_group, (m.device, []))
                shard_grads.extend(_grads(piece.tensor for piece in local_pieces(w)))
            else:
                same_everywhere.extend(_grads([w]))

    by_mesh: dict[tuple, tuple[torch.device, list[torch.Tensor]]] = {}
    for name, w in model.named_parameters():
        if id(w) in table_ids:
            continue
        if isinstance(w, DTensor):
            dims = tuple(d for d, pl in enumerate(w.placements) if isinstance(pl, Shard))
            mesh = w.device_mesh
            _, local = by_mesh.setdefault((mesh, dims), (torch.device(mesh.device_type), []))
            g = w.grad
            if g is not None:
                if any(pl.is_partial() for pl in g.placements):
                    raise ValueError(
                        f"the gradient of {name!r} is a partial DTensor {g.placements}; "
                        "reduce it before clipping"
                    )
                local.append(g.to_local())
        else:
            same_everywhere.extend(_grads([w]))

    parts = []
    for group, (device, grads) in by_group.items():
        part = _part(grads, p, device)
        all_reduce(part, op=reduce_op, group=group, what="clip_grad_norm_'s all-reduce of table norms")
        parts.append(part)
    for (mesh, dims), (device, grads) in by_mesh.items():
        part = _part(grads, p, device)
        for d in dims:
            all_reduce(part, op=reduce_op, group=mesh.get_group(d),
                       what="clip_grad_norm_'s all-reduce of dense norms")  # fmt: skip
        parts.append(part)
    device = parts[0].device if parts else _device_of(same_everywhere)
    parts.append(_part(same_everywhere, p, device))

    stacked = torch.stack([part.to(device) for part in parts])
    total = stacked.max() if is_inf else stacked.sum() ** (1.0 / p)

    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grads in (
        *(g for _, g in by_group.values()),
        *(g for _, g in by_mesh.values()),
        same_everywhere,
    ):
        for g in grads:
            g.mul_(coef.to(g.device))
    return total


def _grads(params) -> list[torch.Tensor]:
    return [w.grad for w in params if w.grad is not None]


def _part(grads: list[torch.Tensor], p: float, device: torch.device) -> torch.Tensor:
    """The p-th power sum (the maximum for inf) of the absolute values in `grads`, as fp32."""
    # FSDP gives a rank an empty shard of a small parameter; inf norms have no identity for it.
    grads = [g for g in grads if g.numel()]
    if not grads:
        return torch.zeros((), device=device)
    # FP16/BF16 gradients (of FP16 tables: Note [low-precision tables]) are normed in FP32, as
    # their norm easily exceeds FP16's range (65504) where no element does.
    full = [g for g in grads if g.dtype not in LOW_PRECISION]
    low = [torch.linalg.vector_norm(g, p, dtype=torch.float32) for g in grads if g.dtype in LOW_PRECISION]
    norms = [get_total_norm(full, p).to(device=device, dtype=torch.float32)] if full else []
    norms += [n.to(device) for n in low]
    norm = torch.linalg.vector_norm(torch.stack(norms), p)
    return norm if math.isinf(p) else norm**p


def _device_of(grads: list[torch.Tensor]) -> torch.device:
    return grads[0].device if grads else torch.device("cpu")
