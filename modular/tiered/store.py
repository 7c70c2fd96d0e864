"""The backing store of one tiered shard (Note [tiered tables] in modular/tiered/__init__.py)."""

from __future__ import annotations

import os

import numpy as np
import torch

__all__ = ["RowStore"]

_CHUNK_ROWS = 65536  # rows per chunk when a store is filled: never the whole shard in memory


class RowStore:
    """All rows of one shard and their optimizer state, in a float32 file `path`: one record of
    `cols + state_width` floats per row (the row's weights, then its state)."""

    def __init__(self, path: str, rows: int, cols: int, state_width: int) -> None:
        self.path, self.rows, self.cols, self.state_width = path, rows, cols, state_width
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.records = np.lib.format.open_memmap(
            path, mode="w+", dtype=np.float32, shape=(rows, cols + state_width)
        )

    def fill(self, weights: torch.Tensor, state: torch.Tensor | None) -> None:
        """Writes initial rows (and state, (rows, state_width)) chunk by chunk."""
        for lo in range(0, self.rows, _CHUNK_ROWS):
            hi = min(lo + _CHUNK_ROWS, self.rows)
            self.records[lo:hi, : self.cols] = weights[lo:hi].detach().float().cpu().numpy()
            if self.state_width:
                self.records[lo:hi, self.cols :] = state[lo:hi].float().cpu().numpy()

    def read(self, ids: torch.Tensor) -> torch.Tensor:
        """The records of `ids` (sorted reads: the file is read in order)."""
        return torch.from_numpy(np.ascontiguousarray(self.records[ids.numpy()]))

    def write(self, ids: torch.Tensor, records: torch.Tensor) -> None:
        self.records[ids.numpy()] = records.numpy()

    def chunks(self, chunk_rows: int = _CHUNK_ROWS):
        """(first row, records) in bounded chunks, for saving without the whole shard."""
        for lo in range(0, self.rows, chunk_rows):
            yield lo, torch.from_numpy(np.array(self.records[lo : min(lo + chunk_rows, self.rows)]))
