"""Gathers of small int64 rows whose count differs by rank (the collision remap's collectives)."""

from __future__ import annotations

from typing import Optional

import torch
from torch.distributed import ProcessGroup

from modular.mc.devices import all_gather

__all__ = ["gather_rows"]


def gather_rows(rows: torch.Tensor, *, bound: int, group: Optional[ProcessGroup], world: int, what: str) -> torch.Tensor:
    """Every rank's (n_r, width) int64 `rows`, concatenated in rank order: one all_gather, each
    rank's rows padded to `bound` (at least every n_r, known on every rank) with rows whose first
    column is -1, dropped on arrival (a real row's first column is never negative)."""
    padded = torch.full((max(bound, 1), rows.shape[1]), -1, dtype=torch.int64)  # gloo: a non-empty piece
    padded[: rows.shape[0]] = rows
    out = all_gather(padded, group=group, world=world, what=what).view(-1, rows.shape[1])
    return out[out[:, 0] >= 0]
