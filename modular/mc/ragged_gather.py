"""Gathers of small int64 rows whose count differs by rank (the collision remap's collectives)."""

from __future__ import annotations

from typing import Optional

import torch
from torch.distributed import ProcessGroup

from modular.comm import all_gather

__all__ = ["gather_rows"]


def gather_rows(rows: torch.Tensor, *, group: Optional[ProcessGroup], world: int, what: str) -> list[torch.Tensor]:
    """Every rank's (n_r, width) int64 `rows`, in rank order: two collectives (counts, then the
    rows padded to the longest)."""
    width = rows.shape[1]
    counts = all_gather(torch.tensor([rows.shape[0]], dtype=torch.int64), group=group, world=world,
                        what=f"{what} (counts)").view(-1).tolist()  # fmt: skip
    longest = max(max(counts), 1)  # gloo wants a non-empty piece
    padded = torch.zeros(longest, width, dtype=torch.int64)
    padded[: rows.shape[0]] = rows
    out = all_gather(padded, group=group, world=world, what=what)
    return [out[r, : counts[r]] for r in range(world)]
